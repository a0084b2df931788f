"""The ``generation`` section of a breakdown (contract §7) as text and HTML.

``format_generation`` gives the lines ``render.format_table`` appends; ``generation_html``
the HTML block of ``render.write_html``, with the TTFT attribution (share of the p95-and-
slower TTFT by stage) and ITL attribution (share of the p95-and-slower gaps by cause) as
stacked bars drawn like the stage charts.
"""

from __future__ import annotations

import html
import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from inferprof import semconv as sc
from inferprof._optional import require

_QS = ("p50", "p95", "p99")
CAUSE_COLORS = {
    sc.ITL_CAUSE_DECODE: "#006d2c",
    sc.ITL_CAUSE_PREFILL_INTERFERENCE: "#74c476",
    sc.ITL_CAUSE_PREEMPTED: "#d62728",
    sc.ITL_CAUSE_HOST: "#4292c6",
    sc.ITL_CAUSE_UNATTRIBUTED: "#bdbdbd",
}


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    ms = value * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _shares(items: Sequence[Mapping[str, Any]], key: str) -> str:
    return ", ".join(f"{it[key]} {_pct(it['share_of_p95'])}" for it in items
                     if it["share_of_p95"] > 0) or "-"


def format_generation(gen: Mapping[str, Any]) -> list[str]:
    """Text lines of the generation section."""
    header = f"{'generation':<16}{'p50':>10}{'p95':>10}{'p99':>10}"
    lines = [f"generation: {gen['requests']} generating requests", header, "-" * len(header)]
    for name, unit in (("ttft", "ms"), ("itl", "ms"), ("tpot", "ms")):
        q = gen[name]
        lines.append(f"{name + ' ' + unit:<16}" + "".join(f"{_ms(q[k]):>10}" for k in _QS))
    tokens = gen["output_tokens"]
    lines.append(f"{'output tokens':<16}" + "".join(
        f"{'-' if tokens[k] is None else tokens[k]:>10}" for k in _QS))
    lines.append(f"TTFT p95 tail by stage: {_shares(gen['ttft']['stages'], 'stage')}")
    if gen["itl"]["causes"]:
        lines.append(f"ITL p95 tail by cause: {_shares(gen['itl']['causes'], 'cause')}")
    extra = [f"preempted requests: {gen['preempted_requests']}"]
    if gen.get("cancelled_requests"):
        extra.append(f"cancelled: {gen['cancelled_requests']}")
    kv = (gen.get("kv_cache") or {}).get("usage_p95")
    if kv is not None:
        extra.append(f"KV-cache usage p95: {_pct(kv)}")
    lines.append("; ".join(extra))
    verdict = gen["verdict"]
    lines.append(
        f"generation verdict: {verdict['bottleneck']} (confidence {verdict['confidence']:.2f})"
    )
    lines.extend(f"  - {item}" for item in verdict["evidence"])
    return lines


def _svg(fig: Any) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _bar(
    items: Sequence[Mapping[str, Any]], key: str, color: Callable[[str], str], xlabel: str
) -> str:
    require("matplotlib", "collector")
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    fig = Figure(figsize=(9, 1.6))
    ax = fig.subplots()
    left = 0.0
    for it in items:
        value = it["share_of_p95"] or 0.0
        if value <= 0:
            continue
        ax.barh(0, value, left=left, color=color(it[key]), edgecolor="white", label=it[key])
        if value >= 0.06:
            ax.text(left + value / 2, 0, f"{it[key]}\n{100 * value:.0f}%", ha="center",
                    va="center", fontsize=7)
        left += value
    ax.set_yticks([0], ["≥ p95"])
    ax.set_xlim(0, 1)
    ax.set_xlabel(xlabel)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.6), ncol=6, fontsize=8, frameon=False)
    return _svg(fig)


def generation_html(gen: Mapping[str, Any], stage_color: Callable[[str], str]) -> str:
    """The HTML block: figures table, TTFT and ITL attribution charts, verdict."""
    e = html.escape
    rows = "".join(
        f"<tr><td>{name}</td>" + "".join(f"<td>{_ms(gen[name][k])}</td>" for k in _QS) + "</tr>"
        for name in ("ttft", "itl", "tpot")
    )
    tokens = gen["output_tokens"]
    rows += "<tr><td>output tokens</td>" + "".join(
        f"<td>{'-' if tokens[k] is None else tokens[k]}</td>" for k in _QS) + "</tr>"
    ttft_svg = _bar(gen["ttft"]["stages"], "stage", stage_color,
                    "share of the TTFT of requests at or above TTFT p95, by stage")
    itl_svg = (
        _bar(gen["itl"]["causes"], "cause", lambda c: CAUSE_COLORS.get(c, "#e7969c"),
             "share of the inter-token gaps at or above ITL p95, by cause")
        if gen["itl"]["causes"] else "<p>No inter-token gaps in these traces.</p>"
    )
    verdict = gen["verdict"]
    evidence = "".join(f"<li>{e(item)}</li>" for item in verdict["evidence"])
    kv = (gen.get("kv_cache") or {}).get("usage_p95")
    facts = f"{gen['requests']} generating requests, {gen['preempted_requests']} preempted"
    if kv is not None:
        facts += f", KV-cache usage p95 {_pct(kv)}"
    return f"""
<h3>Generation</h3>
<div class="verdict"><b>Generation bottleneck: {e(verdict["bottleneck"])}</b>
 (confidence {verdict["confidence"]:.2f})<ul>{evidence}</ul></div>
<p>{e(facts)}</p>
<table><tr><th></th><th>p50 ms</th><th>p95 ms</th><th>p99 ms</th></tr>{rows}</table>
<h3>TTFT attribution</h3>
{ttft_svg}
<h3>ITL attribution</h3>
{itl_svg}"""


__all__ = ["CAUSE_COLORS", "format_generation", "generation_html"]
