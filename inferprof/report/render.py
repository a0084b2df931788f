"""Human-readable renderings of a breakdown document (contract §5).

``format_table(doc)`` is the text the ``report`` and ``demo`` commands print;
``write_html(docs, path)`` writes one self-contained page (inline SVG charts drawn with
matplotlib's non-interactive Agg/SVG backend, no external assets, no JavaScript).
"""

from __future__ import annotations

import html
import io
import os
from collections.abc import Sequence

from inferprof import semconv as sc
from inferprof._optional import require
from inferprof.report.generation import format_generation, generation_html

_QS = ("p50", "p95", "p99")


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    ms = value * 1e3
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    return f"{ms:.2f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def title(doc: dict) -> str:
    model = doc.get("model")
    window = doc.get("window_s")
    scope = "all data" if window is None else f"last {window:g} s"
    model_part = f" / model {model!r}" if model else (" / all models" if model is None else "")
    return f"service {doc['service']!r}{model_part} — {scope}"


def _cost_lines(cost: dict | None) -> list[str]:
    """GPU time, energy and money per request, per stage (the document's ``cost``)."""
    if not cost:
        return []
    parts = ", ".join(
        f"{st['stage']} {_ms(st['gpu_seconds_per_request'])}" for st in cost["stages"]
    )
    line = f"cost per request: GPU {_ms(cost['gpu_seconds_per_request'])} ms ({parts})"
    if cost.get("energy_joules_per_request") is not None:
        watts = cost["power_watts_during_compute"]
        line += (
            f", energy {cost['energy_joules_per_request']:.3g} J "
            f"(mean {watts['mean']:.0f} W during compute, {watts['samples']} samples)"
        )
    if cost.get("cost_per_request") is not None:
        line += (
            f", {cost['cost_per_request']:.3g} per request "
            f"(at {cost['gpu_hour_price']:g} per GPU-hour)"
        )
    return [line]


def _notes(doc: dict) -> list[str]:
    """Errors, padding, queue and GPU lines (empty when the document has none of them)."""
    lines = []
    failed, n = doc.get("errors") or 0, doc.get("requests") or 0
    if failed and n:
        lines.append(
            f"errors: {failed} of {n} requests failed ({_pct(failed / n)}; status ERROR, e.g. "
            "HTTP 5xx): their times are in every figure here"
        )
    pad = doc.get("padding") or {}
    if pad.get("padded_tokens"):
        lines.append(
            f"padding: {_pct(pad['waste_ratio'])} of padded tokens are padding "
            f"({pad['effective_tokens']} effective / {pad['padded_tokens']} padded"
            + (f", {pad['batches']} batches)" if pad.get("batches") else ")")
        )
    queue = doc.get("queue")
    if queue:
        seen = queue["batch_coverage"]
        reported = queue.get("reported_by_batcher") or 0.0
        if reported >= 0.995:
            how = " (measured by the batcher)"
        elif seen < 1.0:
            how = f" (estimated: the traces show {_pct(seen)} of the batch work)"
        else:
            how = ""
        if 0.005 <= reported < 0.995:
            how += f" ({_pct(reported)} of the queue time measured by the batcher)"
        lines.append(
            f"queue: {_pct(queue['behind_batches'])} of queue time passed while earlier batches "
            "were being processed" + how
        )
    lines.extend(_cost_lines(doc.get("cost")))
    gpu = doc.get("gpu") or {}
    util = gpu.get("utilization_during_compute")
    if util:
        lines.append(
            f"GPU utilisation during compute: median {_pct(util['p50'])}, "
            f"mean {_pct(util['mean'])} "
            f"({gpu.get('samples', 0)} samples)"
        )
    return lines


def _split(example: dict) -> str:
    parts = [f"{name} {_ms(t)}" for name, t in example["stages"].items() if t > 0]
    return ", ".join(parts)


#: The text table lists this many slowest requests end to end, and the slowest request of
#: the stages holding the largest shares of p95 (at most this many, each 5% or more); the
#: JSON and the HTML page list every example.
_TEXT_SLOWEST = 3
_TEXT_STAGES = 2
_TEXT_MIN_SHARE = 0.05


def _example_lines(doc: dict) -> list[str]:
    """The slowest traced requests, compactly: the slowest end to end with the stages that
    took a tenth or more of their time, then the slowest request of the stages that hold
    the tail; each with where its trace is (URL with --trace-url, else the trace id)."""
    examples = doc.get("examples") or []
    if not examples:
        return []
    lines = ["slowest traces (ms):"]
    for ex in [e for e in examples if e["slowest"] == "latency"][:_TEXT_SLOWEST]:
        big = [f"{name} {_ms(t)}" for name, t in ex["stages"].items()
               if t >= 0.1 * ex["latency"]]
        gpu = ex.get("gpu_seconds")
        gpu_part = f"; GPU {_ms(sum(gpu.values()))}" if gpu else ""
        lines.append(f"  {_ms(ex['latency']):>8} end-to-end  {_where(ex)}  "
                     f"({', '.join(big)}{gpu_part})")
    tail = sorted((st for st in doc.get("stages", ()) if st["share_of_p95"] >= _TEXT_MIN_SHARE),
                  key=lambda st: -st["share_of_p95"])[:_TEXT_STAGES]
    by_stage = {e["slowest"]: e for e in examples if e["slowest"] != "latency"}
    for st in tail:
        ex = by_stage.get(st["stage"])
        if ex is not None:
            lines.append(f"  {_ms(ex['seconds']):>8} in {ex['slowest']}  {_where(ex)}  "
                         f"(end-to-end {_ms(ex['latency'])})")
    return lines


def _where(example: dict) -> str:
    return example.get("url") or f"trace {example['trace_id']}"


def format_table(doc: dict) -> str:
    """The breakdown as a fixed-width text table followed by padding, GPU and verdict."""
    lines = [title(doc)]
    traced = doc.get("traced_requests")
    traced_part = f" ({traced} traced)" if traced is not None and traced != doc["requests"] else ""
    n = doc["requests"]
    lines.append(f"{n} request{'' if n == 1 else 's'}{traced_part}")
    lines.append("")
    header = (
        f"{'stage':<16}{'count':>9}{'p50 ms':>10}{'p95 ms':>10}{'p99 ms':>10}{'share of p95':>14}"
    )
    lines.append(header)
    lines.append("-" * len(header))
    for st in doc["stages"]:
        lines.append(
            f"{st['stage']:<16}{st['count']:>9}{_ms(st['p50']):>10}{_ms(st['p95']):>10}"
            f"{_ms(st['p99']):>10}{_pct(st['share_of_p95']):>14}"
        )
    lines.append("-" * len(header))
    lat = doc["latency"]
    total = sum(st["share_of_p95"] for st in doc["stages"]) if doc["stages"] else None
    lines.append(
        f"{'end-to-end':<16}{doc['requests']:>9}{_ms(lat['p50']):>10}{_ms(lat['p95']):>10}"
        f"{_ms(lat['p99']):>10}{_pct(total):>14}"
    )
    lines.append("")
    lines.extend(_notes(doc))
    verdict = doc["verdict"]
    lines.append(f"verdict: {verdict['bottleneck']} (confidence {verdict['confidence']:.2f})")
    for item in verdict["evidence"]:
        lines.append(f"  - {item}")
    examples = _example_lines(doc)
    if examples:
        lines.append("")
        lines.extend(examples)
    if doc.get("generation"):
        lines.append("")
        lines.extend(format_generation(doc["generation"]))
    return "\n".join(lines)


_COLORS = {
    sc.STAGE_RECEIVE: "#9ecae1",
    sc.STAGE_TOKENIZE: "#6baed6",
    sc.STAGE_QUEUE: "#fd8d3c",
    sc.STAGE_BATCH_ASSEMBLY: "#fdae6b",
    sc.STAGE_H2D: "#a1d99b",
    sc.STAGE_COMPUTE: "#31a354",
    sc.STAGE_PREFILL: "#74c476",
    sc.STAGE_DECODE: "#006d2c",
    sc.STAGE_D2H: "#c7e9c0",
    sc.STAGE_POSTPROCESS: "#4292c6",
    sc.STAGE_SERIALIZE: "#2171b5",
    sc.STAGE_NETWORK: "#756bb1",
    sc.STAGE_PREEMPTED: "#d62728",
    sc.STAGE_UNATTRIBUTED: "#bdbdbd",
}


def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    text = buf.getvalue()
    # Drop the XML prolog and DOCTYPE so the SVG can sit inline in HTML.
    return text[text.index("<svg") :]


def _charts(doc: dict) -> tuple[str, str]:
    require("matplotlib", "collector")
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    stages = doc["stages"]
    names = [s["stage"] for s in stages]

    fig = Figure(figsize=(9, 2.8))
    ax = fig.subplots()
    rows = [("≥ p50", "share_of_p50"), ("≥ p95", "share_of_p95"), ("≥ p99", "share_of_p99")]
    for y, (_label, key) in enumerate(rows):
        left = 0.0
        for st in stages:
            value = st.get(key, 0.0) or 0.0
            if value <= 0:
                continue
            ax.barh(
                y,
                value,
                left=left,
                color=_COLORS.get(st["stage"], "#e7969c"),
                edgecolor="white",
                label=st["stage"] if y == 1 else None,
            )
            if value >= 0.06:
                ax.text(
                    left + value / 2,
                    y,
                    f"{st['stage']}\n{100 * value:.0f}%",
                    ha="center",
                    va="center",
                    fontsize=7,
                )
            left += value
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of the latency of requests at or above the quantile")
    ax.invert_yaxis()
    ax.legend(
        loc="upper center",
        bbox_to_anchor=(0.5, -0.3),
        ncol=min(7, max(1, len(names))),
        fontsize=8,
        frameon=False,
    )
    shares_svg = _svg(fig)

    fig = Figure(figsize=(9, 3.6))
    ax = fig.subplots()
    width = 0.27
    xs = range(len(names))
    for i, (q, color) in enumerate(zip(_QS, ("#9ecae1", "#3182bd", "#08519c"), strict=False)):
        values = [(s[q] or 0.0) * 1e3 for s in stages]
        ax.bar([x + (i - 1) * width for x in xs], values, width, label=q, color=color)
    ax.set_xticks(list(xs), names, rotation=30, ha="right")
    ax.set_ylabel("ms per request")
    positive = [(s[q] or 0) for s in stages for q in _QS if (s[q] or 0) > 0]
    if positive and max(positive) / min(positive) > 50:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    quantiles_svg = _svg(fig)
    return shares_svg, quantiles_svg


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1100px; }
h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { padding: .25em .8em; text-align: right; border-bottom: 1px solid #eee; }
th:first-child, td:first-child { text-align: left; }
.verdict { background: #f6f6f6; padding: .6em 1em; border-left: 4px solid #fd8d3c; }
svg { max-width: 100%; height: auto; }
"""


def _section(doc: dict) -> str:
    e = html.escape
    shares_svg, quantiles_svg = _charts(doc) if doc["stages"] else ("", "")
    rows = "".join(
        f"<tr><td>{e(s['stage'])}</td><td>{s['count']}</td><td>{_ms(s['p50'])}</td>"
        f"<td>{_ms(s['p95'])}</td><td>{_ms(s['p99'])}</td><td>{_pct(s['share_of_p95'])}</td></tr>"
        for s in doc["stages"]
    )
    lat = doc["latency"]
    rows += (
        f"<tr><th>end-to-end</th><th>{doc['requests']}</th><th>{_ms(lat['p50'])}</th>"
        f"<th>{_ms(lat['p95'])}</th><th>{_ms(lat['p99'])}</th><th></th></tr>"
    )
    verdict = doc["verdict"]
    evidence = "".join(f"<li>{e(item)}</li>" for item in verdict["evidence"])
    notes = "".join(f"<p>{e(line)}</p>" for line in _notes(doc))
    examples = _examples_html(doc)
    generation = (
        generation_html(doc["generation"], lambda st: _COLORS.get(st, "#e7969c"))
        if doc.get("generation") else ""
    )
    return f"""
<section>
<h2>{e(title(doc))}</h2>
<div class="verdict"><b>Bottleneck: {e(verdict["bottleneck"])}</b>
 (confidence {verdict["confidence"]:.2f})<ul>{evidence}</ul></div>
{notes}<table><tr><th>stage</th><th>count</th><th>p50 ms</th><th>p95 ms</th><th>p99 ms</th>
<th>share of p95</th></tr>{rows}</table>
{examples}<h3>Where the time goes, by latency quantile</h3>
{shares_svg}
<h3>Per-stage latency quantiles</h3>
{quantiles_svg}
{generation}
<details><summary>full text</summary><pre>{e(format_table(doc))}</pre></details>
</section>"""


def _examples_html(doc: dict) -> str:
    e = html.escape
    examples = doc.get("examples") or []
    if not examples:
        return ""
    rows = []
    for ex in examples:
        trace = e(ex["trace_id"])
        if ex.get("url"):
            trace = f'<a href="{e(ex["url"], quote=True)}">{trace}</a>'
        rows.append(
            f"<tr><td>{e(ex['slowest'])}</td><td>{_ms(ex['seconds'])}</td>"
            f"<td>{_ms(ex['latency'])}</td><td>{trace}</td><td>{e(_split(ex))}</td></tr>"
        )
    return (
        "<h3>Slowest traces</h3><table><tr><th>slowest in</th><th>ms there</th>"
        "<th>end-to-end ms</th><th>trace</th><th>ms per stage</th></tr>"
        + "".join(rows) + "</table>\n"
    )


def html_page(docs: Sequence[dict]) -> str:
    """One self-contained HTML page with a section per breakdown document."""
    body = "".join(_section(doc) for doc in docs)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        "<title>inferprof report</title>"
        f"<style>{_CSS}</style></head><body><h1>inferprof report</h1>{body}</body></html>\n"
    )


def write_html(docs: Sequence[dict], path: str | os.PathLike) -> None:
    """Write ``html_page(docs)`` to ``path``."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(html_page(docs))


__all__ = ["format_table", "html_page", "write_html"]
