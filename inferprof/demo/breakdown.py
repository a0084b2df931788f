"""The collector's side of a demo run, for both workloads: its breakdown once it has
folded the run, and the lines the demo prints for it."""

from __future__ import annotations

import time
from typing import Any

from inferprof import semconv
from inferprof.demo.settings import INSTRUMENTATION_NONE, INSTRUMENTATION_OTEL

# How long to wait for the collector to have folded every request the client saw.
_DRAIN_TIMEOUT_S = 10.0


def collect_breakdown(collector: Any, expected: int, service_name: str,
                      trace_url: str | None = None) -> dict[str, Any] | None:
    """The collector's breakdown once it has folded every request it was sent.

    The service has exited (and flushed) by now, so every span has been received; a
    flush folds the traces still settling. In full mode the count reaches what the
    client saw; in production mode it is a weighted estimate, so stop when it is stable.
    With ``trace_url`` (a template with ``{trace_id}``, checked by the caller) each slow
    trace listed carries its URL, as the collector's API gives them with ``--trace-url``.
    """
    from inferprof.collector.examples import with_links

    deadline = time.monotonic() + _DRAIN_TIMEOUT_S
    doc = previous = None
    while time.monotonic() < deadline:
        collector.engine.flush()
        # model=None: every model of the service.
        doc = collector.engine.breakdown(service_name, None, window_s=None)
        count = None if doc is None else doc.get("requests")
        if count is not None and (count >= expected or count == previous):
            break
        previous = count
        time.sleep(0.25)
    return None if doc is None else with_links(doc, trace_url)


def breakdown_lines(doc: dict[str, Any] | None, mode: str) -> list[str]:
    """The breakdown as the demo prints it (report/render.py's table, which ends with the
    verdict and lists the slow traces), or why there is none for this instrumentation."""
    if doc is None:
        if mode == INSTRUMENTATION_OTEL:
            return ["(instrumentation 'otel' exports one server span per request and no "
                    "stages: there is nothing to attribute, which is what inferprof adds)"]
        if mode in (INSTRUMENTATION_NONE, semconv.MODE_OFF):
            return [f"(instrumentation '{mode}' emits no spans: no breakdown)"]
        return ["the collector received no complete request traces"]
    from inferprof.report.render import format_table

    return [format_table(doc)]
