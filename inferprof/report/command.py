"""``inferprof report``: the per-stage breakdown of OTLP files, offline.

Feeds every export of the input files to a collector ``Engine`` (all data retained,
flushed at the end of input) and prints one breakdown per (service, model).
"""

from __future__ import annotations

import json
import math
import os
import sys

import click

from inferprof._optional import require
from inferprof.collector.command import gpu_hour_price_option, trace_url_option

#: Offline engine settings: traces are finalised only at the end of input unless the
#: pending-span cap forces an early flush (see ``_feed``).
_OFFLINE_SETTLE_S = 3600.0
_OFFLINE_MAX_PENDING = 5_000_000
#: A report reads a whole recording: its GPU samples are bounded by the files, not by
#: the collector's default cap.
_OFFLINE_MAX_GPU_SAMPLES = 1_000_000_000


def _feed(engine, files, progress: bool) -> int:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from inferprof.collector.engine import Overloaded
    from inferprof.collector.otlp_json import iter_otlp_file

    total = sum(os.path.getsize(f) for f in files)
    bar = None
    if progress:
        tqdm = require("tqdm", "collector").tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="reading", file=sys.stderr)
    done = 0
    exports = 0
    try:
        for path in files:

            def on_bytes(n: int, _base=done) -> None:
                if bar is not None:
                    bar.n = _base + n
                    bar.refresh()

            for request in iter_otlp_file(path, on_bytes=on_bytes):
                exports += 1
                if isinstance(request, ExportTraceServiceRequest):
                    try:
                        engine.ingest_traces(request)
                    except Overloaded:
                        # Input larger than memory allows: finalise what we have and go on.
                        engine.flush()
                        try:
                            engine.ingest_traces(request)
                        except Overloaded as exc:
                            raise ValueError(f"{path}: one export is too large: {exc}") from None
                else:
                    engine.ingest_metrics(request)
            done += os.path.getsize(path)
    finally:
        if bar is not None:
            bar.close()
    engine.flush()
    return exports


def build_documents(
    files,
    service: str | None = None,
    model: str | None = None,
    progress: bool = False,
    dropped: dict | None = None,
    gpu_hour_prices=(),
) -> list[dict]:
    """Breakdown documents (contract §5, ``window_s`` null) of ``files``, one per
    (service, model), filtered by ``service``/``model``; ``dropped``, when given, receives
    the spans dropped by reason (as the collector counts them); ``gpu_hour_prices``:
    (GPU model or "", price) pairs for the cost figures."""
    from inferprof.collector.attribution import MAX_MAX_STAGES
    from inferprof.collector.engine import Engine

    engine = Engine(
        settle_s=_OFFLINE_SETTLE_S,
        trace_timeout_s=_OFFLINE_SETTLE_S,
        retention_s=math.inf,
        max_pending_spans=_OFFLINE_MAX_PENDING,
        max_gpu_samples=_OFFLINE_MAX_GPU_SAMPLES,
        # No /metrics to keep small: every stage name the columns allow.
        max_stages=MAX_MAX_STAGES,
        gpu_hour_prices=gpu_hour_prices or (),
    )
    _feed(engine, files, progress)
    if dropped is not None:
        dropped.update((k, v) for k, v in engine.stats.spans_dropped.items() if v)
    docs = []
    for svc, mdl in sorted(engine.series()):
        if service is not None and svc != service:
            continue
        if model is not None and mdl != model:
            continue
        doc = engine.breakdown(svc, mdl, window_s=None)
        if doc is not None:
            docs.append(doc)
    return docs


@click.command("report")
@click.argument(
    "files", nargs=-1, type=click.Path(exists=True, dir_okay=False, readable=True)
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "text", "json", "html"]),
    default="table",
    show_default=True,
    help="Text tables ('text' is the same), the contract §5 JSON document(s), or the "
    "HTML page on stdout.",
)
@click.option(
    "--prometheus",
    "prometheus_url",
    metavar="URL",
    help="Instead of FILES: the fleet-wide breakdown of --service from the collectors' "
    "--fleet-metrics in this Prometheus (or anything with its HTTP API).",
)
@click.option(
    "--window",
    "window_s",
    type=float,
    metavar="SECONDS",
    help="With --prometheus: over the last SECONDS (default: since the collectors started).",
)
@click.option("--service", help="Only this service (service.name).")
@click.option("--model", help="Only this model (inferprof.model.name; '' for none).")
@click.option(
    "--html",
    "html_out",
    type=click.Path(dir_okay=False, writable=True),
    help="Also write a self-contained HTML report with charts to this file.",
)
@trace_url_option
@gpu_hour_price_option
@click.option(
    "--progress/--no-progress",
    default=None,
    help="Progress bar on stderr (default: when stderr is a terminal).",
)
def report(
    files, fmt, prometheus_url, window_s, service, model, html_out, trace_url, gpu_hour_prices,
    progress,
) -> None:
    """Per-stage latency breakdown of OTLP FILES: OpenTelemetry Collector file-exporter
    output (format json or proto, optionally gzipped) or inferprof protobuf dumps; or,
    with --prometheus, of a fleet of collectors."""
    if prometheus_url is not None:
        if files:
            raise click.UsageError("give FILES or --prometheus, not both")
        _fleet_report(prometheus_url, service, model, window_s, fmt, html_out)
        return
    if not files:
        raise click.UsageError("give FILES to read, or --prometheus URL")
    if window_s is not None:
        raise click.UsageError("--window goes with --prometheus (FILES are read whole)")
    from inferprof.collector.examples import with_links

    if progress is None:
        progress = sys.stderr.isatty()
    dropped: dict[str, int] = {}
    try:
        docs = build_documents(files, service, model, progress, dropped, gpu_hour_prices)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if dropped:
        # As the collector's inferprof_spans_dropped_total{reason}: what the figures lack.
        click.echo(
            "dropped spans, in all the files read whatever --service/--model select "
            "(docs/concepts.md, Bad input and limits): "
            + ", ".join(f"{reason} {n}" for reason, n in sorted(dropped.items())),
            err=True,
        )
    if not docs:
        what = "requests" if service is None else f"requests of service {service!r}"
        if model is not None:
            what += f" with model {model!r}"
        raise click.ClickException(f"no {what} found in {', '.join(files)}")
    docs = [with_links(doc, trace_url) for doc in docs]
    _print(docs, fmt)
    if html_out:
        from inferprof.report.render import write_html

        write_html(docs, html_out)
        click.echo(f"wrote {html_out}", err=True)


def _print(docs: list[dict], fmt: str) -> None:
    if fmt == "json":
        click.echo(json.dumps(docs[0] if len(docs) == 1 else docs, indent=2))
    elif fmt == "html":
        from inferprof.report.render import html_page

        click.echo(html_page(docs), nl=False)
    else:
        from inferprof.report.render import format_table

        click.echo("\n\n".join(format_table(doc) for doc in docs))


def _fleet_report(url, service, model, window_s, fmt, html_out) -> None:
    from inferprof.report.prometheus import PrometheusError, fleet_documents

    if service is None:
        raise click.UsageError("--prometheus needs --service")
    if window_s is not None and not window_s > 0:
        raise click.BadParameter("must be a positive number of seconds", param_hint="--window")
    try:
        docs = fleet_documents(url, service, model, window_s)
    except PrometheusError as exc:
        raise click.ClickException(str(exc)) from None
    if not docs:
        what = f"service {service!r}" + (f" with model {model!r}" if model is not None else "")
        raise click.ClickException(f"{url} holds no fleet figures of {what}")
    _print(docs, fmt)
    if html_out:
        from inferprof.report.render import write_html

        write_html(docs, html_out)
        click.echo(f"wrote {html_out}", err=True)


__all__ = ["build_documents", "report"]
