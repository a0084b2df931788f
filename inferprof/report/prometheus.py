"""The fleet-wide breakdown from Prometheus: ``inferprof report --prometheus URL``.

Collectors started with ``--fleet-metrics`` export their sketch buckets and tail table
(``collector/fleet.py``); Prometheus scrapes every one of them. This module asks
Prometheus's HTTP API for those families summed across collectors (``sum by (model,
stage, le)``), over the last ``window_s`` seconds (``increase()``) or since the
collectors started (the counters as they stand), and reads the contract §5 document from
the sums with the engine's own quantile and share rules.

Over a window, ``increase()`` extrapolates each series to the window's edges and misses
the first scrape of a series born inside the window (a bucket first reached, a collector
started): the figures are those of the scraped increase, close to but not exactly the
requests of the window. Since start (no window), the sums are exact.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from typing import Any

from inferprof import semconv as sc

_TIMEOUT_S = 30.0


class PrometheusError(RuntimeError):
    """Prometheus could not be queried, or answered with an error."""


def _label_value(value: str) -> str:
    return json.dumps(value)  # a PromQL string literal: quotes and backslashes escaped


def _query(url: str, promql: str, at: float) -> list[dict[str, Any]]:
    params = urllib.parse.urlencode({"query": promql, "time": f"{at:.3f}"})
    endpoint = f"{url.rstrip('/')}/api/v1/query?{params}"
    try:
        with urllib.request.urlopen(endpoint, timeout=_TIMEOUT_S) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read()).get("error", "")
        except ValueError:
            detail = ""
        raise PrometheusError(f"{endpoint}: HTTP {exc.code} {detail}".strip()) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise PrometheusError(f"cannot query {url}: {exc}") from None
    if body.get("status") != "success":
        raise PrometheusError(f"{url}: {body.get('error', body)}")
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def fleet_documents(
    url: str,
    service: str,
    model: str | None = None,
    window_s: float | None = None,
    *,
    at: float | None = None,
) -> list[dict[str, Any]]:
    """Breakdown documents of ``service`` (one per model, or only ``model``) from the
    fleet families in Prometheus at ``url``; empty when it holds none of the service."""
    from inferprof.collector.fleet import E2E, Buckets, document, tables_from_sums
    from inferprof.collector.sketch import KeyMapping

    if window_s is not None and not window_s > 0:
        raise ValueError(f"window must be a positive number of seconds, got {window_s!r}")
    at = time.time() if at is None else at
    selector = f"{sc.PROM_LABEL_SERVICE}={_label_value(service)}"
    if model is not None:
        selector += f",{sc.PROM_LABEL_MODEL}={_label_value(model)}"

    def over(metric: str) -> str:
        series = f"{metric}{{{selector}}}"
        return series if window_s is None else f"increase({series}[{window_s:g}s])"

    accuracies = {
        float(r["value"][1]) for r in _query(url, sc.PROM_FLEET_RELATIVE_ACCURACY, at)
    }
    if not accuracies:
        raise PrometheusError(
            f"{url} holds no {sc.PROM_FLEET_RELATIVE_ACCURACY}: start the collectors with "
            "--fleet-metrics and let Prometheus scrape them"
        )
    if len(accuracies) > 1:
        raise PrometheusError(
            "the collectors scraped do not share one --relative-accuracy "
            f"({', '.join(sorted(map(str, accuracies)))}): their buckets do not sum"
        )
    buckets = Buckets(KeyMapping(accuracies.pop()))
    m, st, le = sc.PROM_LABEL_MODEL, sc.PROM_LABEL_STAGE, sc.PROM_LABEL_LE
    Table = dict[str, float]
    stage_cum: defaultdict[str, defaultdict[str, Table]] = defaultdict(lambda: defaultdict(dict))
    tail_stage: defaultdict[str, defaultdict[str, Table]] = defaultdict(lambda: defaultdict(dict))
    tail_e2e: defaultdict[str, Table] = defaultdict(dict)
    tail_traced: defaultdict[str, Table] = defaultdict(dict)
    errors: defaultdict[str, float] = defaultdict(float)

    def summed(by: str, metric: str) -> list[tuple[dict[str, str], float]]:
        return [
            (r["metric"], float(r["value"][1]))
            for r in _query(url, f"sum by ({by}) ({over(metric)})", at)
        ]

    # "{}_bucket".format: the import checker reads a "_bucket" literal as a private name
    stage_buckets = "{}_bucket".format(sc.PROM_FLEET_STAGE_DURATION)  # noqa: UP032
    request_buckets = "{}_bucket".format(sc.PROM_FLEET_REQUEST_DURATION)  # noqa: UP032
    for labels, v in summed(f"{m}, {st}, {le}", stage_buckets):
        stage_cum[labels.get(m, "")][labels[st]][labels[le]] = v
    for labels, v in summed(f"{m}, {le}", request_buckets):
        stage_cum[labels.get(m, "")][E2E][labels[le]] = v
    for labels, v in summed(f"{m}, {st}, {le}", sc.PROM_FLEET_TAIL_STAGE):
        tail_stage[labels.get(m, "")][labels[st]][labels[le]] = v
    for name, table in (
        (sc.PROM_FLEET_TAIL_REQUEST, tail_e2e), (sc.PROM_FLEET_TAIL_TRACED, tail_traced),
    ):
        for labels, v in summed(f"{m}, {le}", name):
            table[labels.get(m, "")][labels[le]] = v
    for labels, v in summed(m, sc.PROM_REQUEST_ERRORS):
        errors[labels.get(m, "")] = v
    docs = []
    for mdl in sorted(stage_cum):
        if E2E not in stage_cum[mdl]:
            continue
        tables = tables_from_sums(
            buckets, stage_cum[mdl], tail_stage[mdl], tail_e2e[mdl], tail_traced[mdl]
        )
        doc = document(service, mdl, window_s, tables, buckets.mapping, errors.get(mdl, 0.0))
        if doc["requests"] or window_s is None:
            docs.append(doc)
    return docs


__all__ = ["PrometheusError", "fleet_documents"]
