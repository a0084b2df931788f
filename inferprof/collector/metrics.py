"""Prometheus exposition of the engine (contract §5), computed at scrape time.

``EngineCollector`` is a ``prometheus_client`` custom collector: register it on a
``CollectorRegistry`` (the transport's ``/metrics`` does) and every scrape reads the
engine's current state. Families:

* ``inferprof_stage_duration_seconds{service,model,stage}`` and
  ``inferprof_request_duration_seconds{service,model}`` — cumulative histograms since
  the collector started, weighted by sampling weight (buckets ``engine.HISTOGRAM_BOUNDS``);
* ``inferprof_stage_quantile_seconds{service,model,stage,quantile}`` — p50/p95/p99 over
  the sliding window (``window_s``, at most the engine's retention), including the
  ``unattributed`` pseudo-stage;
* ``inferprof_request_errors_total{service,model}`` — requests whose request span has
  status ERROR (HTTP 5xx, exceptions), weighted, since the collector started: with the
  request histogram's ``_count``, the error ratio;
* ``inferprof_request_quantile_seconds{service,model,quantile}`` — end-to-end p50/p95/p99
  over the same window (the breakdown's ``latency``: exact to the sketch's accuracy, where
  the histogram's buckets are 2-2.5x apart);
* ``inferprof_stage_share_of_p95{service,model,stage}`` — contract §6 over the window;
* ``inferprof_bottleneck{service,model,verdict}`` — 1 for the current verdict, 0 for the
  others (every verdict is present while the window holds requests of the series, so alert
  rules need no ``absent()``; gone, like the other windowed series, once it holds none);
* ``inferprof_queue_behind_batches{service,model}`` — share of queue time spent behind
  earlier batches over the window (absent for a series without queue spans or batches);
* generation (contract §7, §14): ``inferprof_ttft_seconds``, ``inferprof_itl_seconds``,
  ``inferprof_tpot_seconds`` and the GenAI server metrics
  ``gen_ai_server_time_to_first_token_seconds``,
  ``gen_ai_server_time_per_output_token_seconds``,
  ``gen_ai_server_request_duration_seconds`` (histograms since start, labels
  ``service``, ``model``); ``inferprof_ttft_share_of_p95{stage}`` and
  ``inferprof_itl_share_of_p95{cause}`` over the window;
* ``inferprof_stage_gpu_seconds_per_request{service,model,stage}``,
  ``inferprof_stage_energy_joules_per_request{service,model,stage}`` and
  ``inferprof_stage_cost_per_request{service,model,stage}`` — the breakdown's ``cost``
  over the window (``cost.py``; energy for compute stages with power samples, cost with a
  ``--gpu-hour-price``);
* ``inferprof_padding_waste_ratio{service,model}``,
  ``inferprof_gpu_utilization_during_compute{service,model}`` (the mean) and
  ``inferprof_gpu_power_watts_during_compute{service,model}`` (the mean) — the breakdown's
  padding and GPU figures over the window, absent where it has none;
* ``inferprof_spans_received_total``, ``inferprof_spans_dropped_total{reason}``,
  ``inferprof_traces_incomplete_total``;
* ``inferprof_gpu_samples_dropped_total{reason}``, ``inferprof_gpu_samples`` (retained
  now) and ``inferprof_labels_truncated_total{label}`` (service and model names cut to
  ``semconv.MAX_LABEL_BYTES``).

At most ``max_series`` (service, model) pairs are rendered per scrape (the engine's own
cap folds the rest into ``service="__overflow__"`` already).

A scrape never raises: a failure computing one series is logged and that series is
left out of that scrape.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from inferprof import semconv as sc
from inferprof._optional import require
from inferprof.collector import generation as gen
from inferprof.collector.engine import HISTOGRAM_BOUNDS, Engine
from inferprof.collector.exemplars import TRACE_ID_LABEL

_log = logging.getLogger(__name__)
_QUANTILE_KEYS = (("0.5", "p50"), ("0.95", "p95"), ("0.99", "p99"))


def _le(bound: float) -> str:
    return repr(float(bound))


def _buckets(bounds, counts) -> list[tuple[str, float]]:
    cumulative = 0.0
    out = []
    for bound, c in zip((*bounds, float("inf")), counts.tolist(), strict=False):
        cumulative += c
        out.append(("+Inf" if bound == float("inf") else _le(bound), cumulative))
    return out


#: Generation histograms: engine histogram id -> (metric, help).
_GEN_HISTOGRAMS = {
    gen.H_TTFT: (sc.PROM_TTFT, "Time to first token per generating request (weighted)."),
    gen.H_ITL: (sc.PROM_ITL, "Inter-token latency: every gap between output tokens (weighted)."),
    gen.H_TPOT: (sc.PROM_TPOT, "Time per output token after the first, per request (weighted)."),
    gen.H_GENAI_TTFT: (
        sc.PROM_GEN_AI_TTFT,
        "OpenTelemetry GenAI gen_ai.server.time_to_first_token, from the spans (weighted).",
    ),
    gen.H_GENAI_TPOT: (
        sc.PROM_GEN_AI_TPOT,
        "OpenTelemetry GenAI gen_ai.server.time_per_output_token, from the spans (weighted).",
    ),
    gen.H_GENAI_DURATION: (
        sc.PROM_GEN_AI_REQUEST_DURATION,
        "OpenTelemetry GenAI gen_ai.server.request.duration of generating requests (weighted).",
    ),
}


#: the engine's span-drop reasons (contract names in inferprof.semconv)
_ENGINE_DROP_REASONS = (
    sc.DROP_INVALID_ID, sc.DROP_NEGATIVE_DURATION, sc.DROP_ABSURD_DURATION, sc.DROP_DUPLICATE,
    sc.DROP_INVALID_STAGE, sc.DROP_TRACE_TOO_LARGE, sc.DROP_TOO_MANY_STAGES, sc.DROP_LATE,
    sc.DROP_ORPHAN_STAGE, sc.DROP_INCOMPLETE_TRACE, sc.DROP_OUTSIDE_REQUEST, sc.DROP_SHUTDOWN,
    sc.DROP_TOO_MANY_LINKS, sc.DROP_INVALID_STEPS,
)


#: single-value engine counters: (metric, help, EngineStats field)
_ENGINE_COUNTERS = (
    (
        sc.PROM_SERIES_OVERFLOW,
        (
            "Requests folded into service=\"__overflow__\": their (service, model) came "
            "after --max-series others."
        ),
        "series_overflow",
    ),
    (
        sc.PROM_SERIES_RECLAIMED,
        (
            "(service, model) slots freed for a new pair at --max-series: the series idle "
            "longest, once none of it was left in the retained window."
        ),
        "series_reclaimed",
    ),
    (
        sc.PROM_GPU_SAMPLES_RECEIVED,
        "GPU samples (contract section 4 data points) accepted, joined to spans or not.",
        "gpu_samples_received",
    ),
    (
        sc.PROM_SUMMARISED_REQUESTS,
        (
            "Requests counted from summaries (contract section 15), unweighted: every "
            "request a production-mode process timed, whether its trace was kept or not."
        ),
        "summary_requests",
    ),
    (
        sc.PROM_SUMMARISED_UNTIMED,
        (
            "Requests a production-mode process served but did not time, counted by "
            "summaries (contract section 15) at their end-to-end latency."
        ),
        "summary_untimed_requests",
    ),
    (
        sc.PROM_SUMMARIES_REJECTED,
        (
            "Summary data points (contract section 15) rejected as malformed; each is named "
            "in its OTLP answer's partial success."
        ),
        "summary_points_rejected",
    ),
    (
        sc.PROM_ENGINE_STEPS_RECEIVED,
        (
            "Engine step spans (contract section 14) received, joined to generating "
            "requests or not."
        ),
        "engine_steps_received",
    ),
    (
        sc.PROM_TRITON_REQUESTS_PARTIAL,
        (
            "Triton requests counted with fewer than queue, h2d, compute and d2h derived "
            "from their span events."
        ),
        "triton_requests_partial",
    ),
    (
        sc.PROM_TRACES_INCOMPLETE,
        "Traces evicted with stage spans but no request span (never completed).",
        "traces_incomplete",
    ),
)


class EngineCollector:
    def __init__(self, engine: Engine, *, window_s: float = 300.0, max_series: int = 1000) -> None:
        if not isinstance(window_s, (int, float)) or not window_s > 0:
            raise ValueError(f"window_s must be a positive number, got {window_s!r}")
        if not isinstance(max_series, int) or max_series < 1:
            raise ValueError(f"max_series must be a positive integer, got {max_series!r}")
        self._core = require("prometheus_client.core", "collector")
        self._samples = require("prometheus_client.samples", "collector")
        self.engine = engine
        self.window_s = float(window_s)
        self.max_series = max_series

    @staticmethod
    def _resource_families(core, svc: str, mdl: str, stg: str, window_s: float) -> dict:
        """The cost, padding and GPU gauges (filled by ``_add_resources``)."""
        per_stage = [svc, mdl, stg]
        return {
            "gpu_seconds": core.GaugeMetricFamily(
                sc.PROM_STAGE_GPU_SECONDS,
                f"GPU-seconds per request in each stage over the last {window_s:g} s: a "
                "batch's device time split among its members (by tokens where known).",
                labels=per_stage),
            "energy": core.GaugeMetricFamily(
                sc.PROM_STAGE_ENERGY,
                f"Joules per request in each compute stage over the last {window_s:g} s: "
                "GPU-seconds times the mean power drawn during compute.",
                labels=per_stage),
            "money": core.GaugeMetricFamily(
                sc.PROM_STAGE_COST,
                f"Cost per request in each stage over the last {window_s:g} s, in the unit "
                "of --gpu-hour-price: GPU-seconds times the price per GPU-hour / 3600.",
                labels=per_stage),
            "padding": core.GaugeMetricFamily(
                sc.PROM_PADDING_WASTE,
                f"Share of padded tokens that are padding over the last {window_s:g} s.",
                labels=[svc, mdl]),
            "utilization": core.GaugeMetricFamily(
                sc.PROM_GPU_UTILIZATION_DURING_COMPUTE,
                f"Mean GPU utilisation during compute spans over the last {window_s:g} s.",
                labels=[svc, mdl]),
            "power": core.GaugeMetricFamily(
                sc.PROM_GPU_POWER_DURING_COMPUTE,
                f"Mean GPU power draw (W) during compute spans over the last {window_s:g} s.",
                labels=[svc, mdl]),
        }

    def describe(self) -> list:
        # Empty: the families are dynamic; registering must not trigger a collect().
        return []

    def collect(self) -> Iterator:
        self.engine.advance()  # fold what is due, so histograms and gauges agree
        series = self.engine.series()
        # The engine's own cap folds the pairs past it into __overflow__, which comes after
        # them: it is always rendered, so what was folded stays visible.
        overflow = (sc.OVERFLOW_SERIES, "")
        series = series[: self.max_series] + (
            [overflow] if overflow in series[self.max_series:] else [])
        allowed = set(series)
        yield from self._histograms(allowed)
        yield from self._generation_and_errors(allowed)
        yield from self._windowed(series)
        yield from self._engine_counters()

    def _histograms(self, allowed: set) -> Iterator:
        """The duration histograms, with their exemplars on OpenMetrics scrapes."""
        core = self._core
        svc, mdl, stg = sc.PROM_LABEL_SERVICE, sc.PROM_LABEL_MODEL, sc.PROM_LABEL_STAGE
        stage_hist = core.HistogramMetricFamily(
            sc.PROM_STAGE_DURATION,
            "Time per request spent in each stage (weighted by sampling weight).",
            labels=[svc, mdl, stg],
        )
        req_hist = core.HistogramMetricFamily(
            sc.PROM_REQUEST_DURATION,
            "End-to-end request latency (weighted by sampling weight).",
            labels=[svc, mdl],
        )
        exemplar_of = self._samples.Exemplar
        for service, model, stage, counts, total in self.engine.histograms():
            if (service, model) not in allowed:
                continue
            cumulative = 0.0
            buckets: list[tuple] = []
            exemplars = self.engine.histogram_exemplars(service, model, stage)
            bounds = (*HISTOGRAM_BOUNDS, float("inf"))
            for bound, c, ex in zip(bounds, counts.tolist(), exemplars, strict=True):
                cumulative += c
                le = "+Inf" if bound == float("inf") else _le(bound)
                if ex is None:
                    buckets.append((le, cumulative))
                else:  # on OpenMetrics scrapes only: the text format has no exemplars
                    exemplar = exemplar_of({TRACE_ID_LABEL: ex[0]}, ex[1], ex[2])
                    buckets.append((le, cumulative, exemplar))
            if stage is None:
                req_hist.add_metric([service, model], buckets, total)
            else:
                stage_hist.add_metric([service, model, stage], buckets, total)
        yield stage_hist
        yield req_hist

    def _generation_and_errors(self, allowed: set) -> Iterator:
        core = self._core
        svc, mdl = sc.PROM_LABEL_SERVICE, sc.PROM_LABEL_MODEL
        gen_hist = {
            h: core.HistogramMetricFamily(name, text, labels=[svc, mdl])
            for h, (name, text) in _GEN_HISTOGRAMS.items()
        }
        for service, model, h, bounds, counts, total in self.engine.generation_histograms():
            if (service, model) in allowed:
                gen_hist[h].add_metric([service, model], _buckets(bounds, counts), total)
        yield from gen_hist.values()
        errors = core.CounterMetricFamily(
            sc.PROM_REQUEST_ERRORS,
            "Requests whose request span has status ERROR (weighted by sampling weight).",
            labels=[svc, mdl],
        )
        for service, model, total in self.engine.request_errors():
            if (service, model) in allowed:
                errors.add_metric([service, model], total)
        yield errors

    def _windowed(self, series: list) -> Iterator:
        """The gauges of each series' breakdown over the metrics window."""
        core = self._core
        svc, mdl, stg = sc.PROM_LABEL_SERVICE, sc.PROM_LABEL_MODEL, sc.PROM_LABEL_STAGE
        # The engine answers for what it retains: a longer window is read as that.
        window_s = min(self.window_s, self.engine.retention_s)
        quantile = core.GaugeMetricFamily(
            sc.PROM_STAGE_QUANTILE,
            f"Per-stage latency quantile over the last {window_s:g} s.",
            labels=[svc, mdl, stg, sc.PROM_LABEL_QUANTILE],
        )
        latency = core.GaugeMetricFamily(
            sc.PROM_REQUEST_QUANTILE,
            f"End-to-end request latency quantile over the last {window_s:g} s.",
            labels=[svc, mdl, sc.PROM_LABEL_QUANTILE],
        )
        share = core.GaugeMetricFamily(
            sc.PROM_STAGE_SHARE_OF_P95,
            "Share of p95-and-slower requests' latency spent in each stage (sums to 1).",
            labels=[svc, mdl, stg],
        )
        verdict = core.GaugeMetricFamily(
            sc.PROM_BOTTLENECK,
            "1 for the current bottleneck verdict, 0 for the others.",
            labels=[svc, mdl, sc.PROM_LABEL_VERDICT],
        )
        behind = core.GaugeMetricFamily(
            sc.PROM_QUEUE_BEHIND_BATCHES,
            "Share of queue time spent while earlier batches of the same service instance "
            "and model were processed: at 0.5 or more requests wait for the model, not for "
            "the batcher.",
            labels=[svc, mdl],
        )
        ttft_share = core.GaugeMetricFamily(
            sc.PROM_TTFT_SHARE_OF_P95,
            "Share of p95-and-slower time to first token spent in each stage (sums to 1).",
            labels=[svc, mdl, stg],
        )
        itl_share = core.GaugeMetricFamily(
            sc.PROM_ITL_SHARE_OF_P95,
            "Share of p95-and-slower inter-token gaps spent on each cause (sums to 1).",
            labels=[svc, mdl, sc.PROM_LABEL_CAUSE],
        )
        resources = self._resource_families(core, svc, mdl, stg, window_s)
        families = (quantile, latency, share, verdict, behind, ttft_share, itl_share)
        for service, model in series:
            try:
                doc = self.engine.breakdown(service, model, window_s)
            except Exception:
                _log.exception("inferprof: breakdown of %s/%s failed", service, model)
                continue
            if doc is None:
                continue
            _add_breakdown(families, service, model, doc)
            _add_resources(resources, service, model, doc)
        yield from families
        yield from resources.values()

    def _engine_counters(self) -> Iterator:
        core = self._core
        stats = self.engine.stats
        yield core.CounterMetricFamily(
            sc.PROM_SPANS_RECEIVED,
            "Spans received by the collector engine.",
            value=stats.spans_received,
        )
        dropped = core.CounterMetricFamily(
            sc.PROM_SPANS_DROPPED,
            "Spans dropped by the collector engine, by reason.",
            labels=[sc.PROM_LABEL_REASON],
        )
        # Every reason from the start, at 0: the first drop is then an increase that
        # rate() and the `> 0` alert rules see (a series born at 1 shows none).
        counts = dict.fromkeys(_ENGINE_DROP_REASONS, 0)
        counts.update(stats.spans_dropped)
        for reason, n in sorted(counts.items()):
            dropped.add_metric([reason], n)
        yield dropped
        for name, help_text, field in _ENGINE_COUNTERS:
            yield core.CounterMetricFamily(name, help_text, value=getattr(stats, field))
        yield from _bounds_families(core, stats)


def _add_breakdown(families: tuple, service: str, model: str, doc: dict) -> None:
    """One series' breakdown into the windowed gauges."""
    quantile, latency, share, verdict, behind, ttft_share, itl_share = families
    for st in doc["stages"]:
        for label, key in _QUANTILE_KEYS:
            if st[key] is not None:
                quantile.add_metric([service, model, st["stage"], label], st[key])
        share.add_metric([service, model, st["stage"]], st["share_of_p95"])
    for label, key in _QUANTILE_KEYS:
        if doc["latency"].get(key) is not None:
            latency.add_metric([service, model, label], doc["latency"][key])
    if doc["requests"] or doc["traced_requests"]:
        # A series with nothing in the window has no verdict to state: it leaves
        # with the other windowed series (not an everlasting "unknown").
        current = doc["verdict"]["bottleneck"]
        for name in sc.VERDICTS:
            verdict.add_metric([service, model, name], 1.0 if name == current else 0.0)
    if doc.get("queue"):
        behind.add_metric([service, model], doc["queue"]["behind_batches"])
    generation = doc.get("generation")
    if generation:
        for st in generation["ttft"]["stages"]:
            ttft_share.add_metric([service, model, st["stage"]], st["share_of_p95"])
        for c in generation["itl"]["causes"]:
            itl_share.add_metric([service, model, c["cause"]], c["share_of_p95"])


def _bounds_families(core, stats) -> Iterator:
    """What the engine's caps on GPU samples and names kept out."""
    gpu_dropped = core.CounterMetricFamily(
        sc.PROM_GPU_SAMPLES_DROPPED,
        "GPU samples not kept (rejected, or the oldest of a full series), by reason.",
        labels=[sc.PROM_LABEL_REASON],
    )
    for reason, n in sorted(stats.gpu_samples_dropped.items()):
        gpu_dropped.add_metric([reason], n)
    yield gpu_dropped
    yield core.GaugeMetricFamily(
        sc.PROM_GPU_SAMPLES,
        "GPU samples retained now (compare with --max-gpu-samples).",
        value=stats.gpu_samples,
    )
    truncated = core.CounterMetricFamily(
        sc.PROM_LABELS_TRUNCATED,
        f"Requests whose service or model name was cut to {sc.MAX_LABEL_BYTES} bytes.",
        labels=[sc.PROM_LABEL_LABEL],
    )
    for label, n in sorted(stats.labels_truncated.items()):
        truncated.add_metric([label], n)
    yield truncated


def _add_resources(families: dict, service: str, model: str, doc: dict) -> None:
    cost = doc.get("cost")
    if cost:
        for st in cost["stages"]:
            labels = [service, model, st["stage"]]
            families["gpu_seconds"].add_metric(labels, st["gpu_seconds_per_request"])
            if st["energy_joules_per_request"] is not None:
                families["energy"].add_metric(labels, st["energy_joules_per_request"])
            if st["cost_per_request"] is not None:
                families["money"].add_metric(labels, st["cost_per_request"])
        power = cost.get("power_watts_during_compute")
        if power:
            families["power"].add_metric([service, model], power["mean"])
    waste = (doc.get("padding") or {}).get("waste_ratio")
    if waste is not None:
        families["padding"].add_metric([service, model], waste)
    util = (doc.get("gpu") or {}).get("utilization_during_compute")
    if util:
        families["utilization"].add_metric([service, model], util["mean"])


__all__ = ["EngineCollector"]
