"""``inferprof.configure()`` and ``inferprof.shutdown()``: the one place inferprof touches
global state.

Settings flow keyword argument -> environment variable -> default, as in the OpenTelemetry
SDK (``inferprof.instrumentation.config``, ``inferprof.environment_variables``): a bad
argument raises ``ValueError``, a bad environment value is logged and replaced by the
default.

Nothing is installed at import time. Until ``configure()`` runs, every inferprof API is a
cheap no-op — unless the application has already installed an SDK ``TracerProvider`` as the
global provider, in which case inferprof uses it (mode ``full``) without installing anything
(``inferprof.instrumentation.active``).

``configure()`` reads as ``_providers()`` -> ``_own_providers()`` -> ``_span_processor()``
/ ``_meter_provider()``, one function per decision.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from opentelemetry import metrics as metrics_api
from opentelemetry import trace as trace_api

from inferprof import environment_variables as ev
from inferprof.instrumentation import active
from inferprof.instrumentation.accounting import CountingSpanExporter, Stats
from inferprof.instrumentation.active import active_runtime, configured_runtime, current_config
from inferprof.instrumentation.config import (
    DEFAULT_BATCH_ENCODING,
    DEFAULT_MAX_TIMED_RATE,
    DEFAULT_MAX_TIMED_RATE_SUMMARISED,
    DEFAULT_MAX_TIMING_CPU,
    DEFAULT_MODE,
    DEFAULT_SAMPLE_RATE,
    DEFAULT_TAIL_QUANTILE,
    PROTOCOL_GRPC,
    PROTOCOL_HTTP,
    PROTOCOLS,
    Config,
    batch_encoding_setting,
    excluded_paths_setting,
    metric_exporter,
    metrics_endpoint,
    protocol_port_mismatch,
    resolve,
    resource,
    traces_endpoint,
)
from inferprof.instrumentation.exporters import (
    grpc_span_exporter,
    http_span_exporter,
    settle_exporter_environment,
)
from inferprof.instrumentation.processor import BatchSpanProcessor
from inferprof.instrumentation.runtime import Runtime
from inferprof.semconv import MODE_PRODUCTION

_logger = logging.getLogger(__name__)

# The variables' names under the names this module has always given them.
ENV_MODE = ev.INFERPROF_MODE
ENV_SAMPLE_RATE = ev.INFERPROF_SAMPLE_RATE
ENV_TAIL_QUANTILE = ev.INFERPROF_TAIL_QUANTILE
ENV_MAX_TIMED_RATE = ev.INFERPROF_MAX_TIMED_RATE
ENV_BATCH_ENCODING = ev.INFERPROF_BATCH_ENCODING
ENV_RECORD_CONTENT = ev.INFERPROF_RECORD_CONTENT
ENV_CONTENT_MAX_BYTES = ev.INFERPROF_CONTENT_MAX_BYTES
ENV_EXCLUDED_PATHS = ev.INFERPROF_EXCLUDED_PATHS
ENV_OTEL_SDK_DISABLED = ev.OTEL_SDK_DISABLED
ENV_OTEL_SERVICE_NAME = ev.OTEL_SERVICE_NAME

_DEFAULT_METRIC_EXPORT_INTERVAL_MS = 15000
#: The SDK's batch processor defaults, used when the ``OTEL_BSP_*`` values contradict
#: each other (a batch larger than the queue).
_FALLBACK_QUEUE = {"max_queue_size": 2048, "schedule_delay_millis": 1000,
                   "max_export_batch_size": 512}

_shutdown_hooks: list[Callable[[float], None]] = []
_lock = threading.Lock()


def add_shutdown_hook(hook: Callable[[float], None]) -> None:
    """Call ``hook(timeout_s)`` first thing in :func:`shutdown` (the GPU samplers register
    theirs), with a fifth of the shutdown's timeout; its failures are logged."""
    with _lock:
        if hook not in _shutdown_hooks:
            _shutdown_hooks.append(hook)


def configure(
    *,
    service_name: str | None = None,
    endpoint: str | None = None,
    protocol: str | None = None,
    mode: str | None = None,
    sample_rate: float | None = None,
    tail_quantile: float | None = None,
    max_timed_rate: float | None = None,
    max_timed_rate_summarised: float | None = None,
    max_timing_cpu: float | None = None,
    batch_encoding: str | None = None,
    record_content: bool | None = None,
    content_max_bytes: int | None = None,
    excluded_paths: Any = None,
    summaries: bool | None = None,
    summary_interval_s: float | None = None,
    untimed_stages: bool | None = None,
    tracer_provider: Any = None,
    meter_provider: Any = None,
    resource_attributes: Mapping[str, Any] | None = None,
    span_exporter: Any = None,
    metric_readers: Any = None,
    summary_exporter: Any = None,
    set_global: bool = True,
) -> Config:
    """Set inferprof up; returns the settled :class:`Config`.

    Providers, in order: ``tracer_provider``/``meter_provider`` arguments; else the global
    ones if the application already installed SDK providers (inferprof installs nothing);
    else inferprof creates SDK providers exporting OTLP (``protocol`` ``grpc`` or
    ``http/protobuf``) to ``endpoint`` through a bounded batch span processor, and makes
    them global when ``set_global`` is true. ``span_exporter`` / ``metric_readers`` replace
    the OTLP exporters (tests, custom backends). Calling ``configure()`` again replaces the
    previous configuration (shutting down what the previous call created).

    In ``production`` mode, ``summaries`` (default on) exports every timed request's
    figures as OTLP metrics every ``summary_interval_s`` (contract §15), through
    ``summary_exporter`` (an SDK ``MetricExporter``) or, when inferprof builds the OTLP
    pipeline (no ``span_exporter``, no providers of the application's), an OTLP metric
    exporter to the metrics endpoint. Otherwise only a ``summary_exporter`` given here
    sends them. Requests a timing budget leaves untimed are summarised too, with their
    stage times (``untimed_stages``, default on: contract §15's extension "Untimed
    requests summarised"), or, with ``untimed_stages=False``, only counted.

    ``max_timed_rate`` caps the requests ``production`` mode times, per second, route and
    process (0: every request is timed). On a route whose untimed requests are summarised
    with their stages, every request is in the summaries whichever are timed, and timed
    ones only feed traces: ``max_timed_rate_summarised`` (default 10; 0: the same as
    ``max_timed_rate``) caps them there instead, at most ``max_timed_rate``.
    """
    _check_arguments(resource_attributes, tracer_provider)
    adopted = _adoptable_global() if tracer_provider is None else None
    owns = tracer_provider is None and adopted is None
    config = resolve(
        mode=mode, service_name=service_name, endpoint=endpoint, protocol=protocol,
        sample_rate=sample_rate, tail_quantile=tail_quantile, max_timed_rate=max_timed_rate,
        max_timed_rate_summarised=max_timed_rate_summarised, max_timing_cpu=max_timing_cpu,
        batch_encoding=batch_encoding, record_content=record_content,
        content_max_bytes=content_max_bytes, excluded_paths=excluded_paths,
        summaries=summaries, summary_interval_s=summary_interval_s,
        untimed_stages=untimed_stages, owns=owns,
    )
    shutdown()
    if not config.enabled:
        config = replace(config, owns_providers=False)
        active.install(Runtime(config, None, None))
        return config
    if not owns:
        _warn_unused(tracer_provider is not None, service_name=service_name, endpoint=endpoint,
                     protocol=protocol, resource_attributes=resource_attributes,
                     span_exporter=span_exporter, metric_readers=metric_readers)
        tp = tracer_provider if tracer_provider is not None else adopted
        mp = meter_provider if meter_provider is not None else metrics_api.get_meter_provider()
        active.install(Runtime(config, tp, mp, summary_exporter=summary_exporter))
        return config
    active.install(_own_runtime(config, resource_attributes, span_exporter, meter_provider,
                                metric_readers, summary_exporter, set_global))
    return config


def _check_arguments(resource_attributes: Any, tracer_provider: Any) -> None:
    if resource_attributes is not None and not isinstance(resource_attributes, Mapping):
        raise ValueError(f"resource_attributes must be a mapping, got {resource_attributes!r}")
    if tracer_provider is not None and not hasattr(tracer_provider, "get_tracer"):
        raise ValueError(f"tracer_provider must be a TracerProvider, got {tracer_provider!r}")


def _adoptable_global() -> Any:
    """The application's global SDK tracer provider (not one inferprof made), or None."""
    from opentelemetry.sdk.trace import TracerProvider

    existing = trace_api.get_tracer_provider()
    if isinstance(existing, TracerProvider) and not active.is_installed(existing):
        return existing
    return None


def _warn_unused(given: bool, **settings: Any) -> None:
    """Settings only a provider inferprof builds would use: say they are not applied."""
    unused = [name for name, value in settings.items() if value is not None]
    if unused:
        _logger.warning(
            "inferprof uses %s tracer provider, so %s given to configure() %s not "
            "applied: set them on that provider",
            "the given" if given else "the application's global", ", ".join(unused),
            "is" if len(unused) == 1 else "are")


def _own_runtime(config: Config, resource_attributes: Mapping[str, Any] | None,
                 span_exporter: Any, meter_provider: Any, metric_readers: Any,
                 summary_exporter: Any, set_global: bool) -> Runtime:
    """Providers of inferprof's own, exporting to ``config``'s endpoint, and their runtime."""
    from opentelemetry.sdk.trace import TracerProvider

    res = resource(config.service_name, resource_attributes)
    stats = Stats()
    tp = TracerProvider(resource=res)
    processor = _span_processor(config, span_exporter, stats)
    tp.add_span_processor(processor)
    mp = (meter_provider if meter_provider is not None
          else _meter_provider(config, res, metric_readers))
    active.mark_installed(tp)
    if set_global:
        _set_global(tp, mp)
    # The OTLP pipeline: summaries go where the traces go. A span_exporter of the
    # caller's (a test, a custom backend) takes traces only, unless summary_exporter is
    # given too: kept traces then count as before (no summary mark).
    if (summary_exporter is None and span_exporter is None and config.summaries
            and config.mode == MODE_PRODUCTION):
        summary_exporter = _summary_exporter(config)
    return Runtime(config, tp, mp, stats=stats, deferred=processor, owned_processor=processor,
                   summary_exporter=summary_exporter)


def _summary_exporter(config: Config) -> Any:
    """The OTLP metric exporter the summaries go through; None (logged) if it cannot be
    built: the service then runs with traces only."""
    try:
        exporter = metric_exporter(config)
    except Exception:
        _logger.exception("inferprof could not build its summary exporter; traces only")
        return None
    settle_exporter_environment(exporter)
    return exporter


def _span_processor(config: Config, span_exporter: Any, stats: Stats) -> BatchSpanProcessor:
    """The bounded batch processor, counting, around ``span_exporter`` or an OTLP one."""
    if span_exporter is None:
        mismatch = protocol_port_mismatch(traces_endpoint(config), config.protocol)
        if mismatch:
            _logger.warning("%s", mismatch)
        span_exporter = _otlp_span_exporter(config)
    counted = CountingSpanExporter(span_exporter, stats)
    try:
        return BatchSpanProcessor(counted, stats)
    except ValueError as exc:  # inconsistent OTEL_BSP_* values: log and default them
        _logger.warning("ignoring OTEL_BSP_* settings (%s); using the SDK defaults", exc)
        return BatchSpanProcessor(counted, stats, **_FALLBACK_QUEUE)


def _otlp_span_exporter(config: Config) -> Any:
    # The SDK's exporters with inferprof's wire encoder (same bytes, a quarter of the CPU
    # per span; see inferprof/instrumentation/otlp_encode.py and docs/overhead.md).
    exporter = http_span_exporter if config.protocol == PROTOCOL_HTTP else grpc_span_exporter
    return exporter(endpoint=traces_endpoint(config))


def _meter_provider(config: Config, res: Any, metric_readers: Any) -> Any:
    from opentelemetry.sdk.metrics import MeterProvider

    if metric_readers is None:
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        exporter = metric_exporter(config)
        settle_exporter_environment(exporter)
        metric_readers = [PeriodicExportingMetricReader(
            exporter, export_interval_millis=_DEFAULT_METRIC_EXPORT_INTERVAL_MS,
        )]
    return MeterProvider(resource=res, metric_readers=list(metric_readers))


def _set_global(tp: Any, mp: Any) -> None:
    # OpenTelemetry allows the global providers to be set once per process; a second
    # configure() keeps working through its own providers even when this is refused.
    if not isinstance(trace_api.get_tracer_provider(), trace_api.ProxyTracerProvider):
        _logger.info("a global TracerProvider is already set; inferprof uses its own directly")
    else:
        trace_api.set_tracer_provider(tp)
    from opentelemetry.sdk.metrics import MeterProvider

    # The API's placeholder class is private; "not an SDK provider yet" is the public test.
    if not isinstance(metrics_api.get_meter_provider(), MeterProvider):
        metrics_api.set_meter_provider(mp)


def shutdown(timeout_millis: int = 5000) -> None:
    """Flush and shut down what ``configure()`` created; inferprof becomes a no-op again.

    At most ``timeout_millis`` for spans and metrics together: with a healthy exporter
    the flush takes milliseconds; against one that is down, the SDK's exporters retry
    each export for up to 10 s, and a service being stopped (Kubernetes allows 30 s
    before SIGKILL) must not spend that. What is not exported in time is dropped, and
    counted: ``inferprof.instrumentation.stats()`` keeps returning the final counts.

    Providers inferprof did not create (passed in, or the application's globals) are
    flushed but left running: they belong to the application (their processors may not
    keep to the bound: the SDK's batch processor ignores a flush's timeout).

    GPU samplers started in this process (``inferprof.gpu``) are stopped first, their
    buffered readings exported, within a fifth of the timeout.
    """
    started = time.monotonic()
    for hook in list(_shutdown_hooks):
        try:
            hook(timeout_millis / 5000)
        except Exception:  # telemetry never raises into the application
            _logger.exception("an inferprof shutdown hook failed")
    rt = active.uninstall()
    if rt is None:
        return
    left_ms = max(0, int(timeout_millis - (time.monotonic() - started) * 1000))
    try:
        rt.close(timeout_millis=left_ms)
    except Exception:  # telemetry never raises into the application
        _logger.exception("inferprof shutdown failed")


__all__ = [
    "DEFAULT_BATCH_ENCODING",
    "DEFAULT_MAX_TIMED_RATE",
    "DEFAULT_MAX_TIMED_RATE_SUMMARISED",
    "DEFAULT_MAX_TIMING_CPU",
    "DEFAULT_MODE",
    "DEFAULT_SAMPLE_RATE",
    "DEFAULT_TAIL_QUANTILE",
    "PROTOCOLS",
    "PROTOCOL_GRPC",
    "PROTOCOL_HTTP",
    "Config",
    "active_runtime",
    "add_shutdown_hook",
    "batch_encoding_setting",
    "configure",
    "configured_runtime",
    "current_config",
    "excluded_paths_setting",
    "metrics_endpoint",
    "protocol_port_mismatch",
    "shutdown",
    "traces_endpoint",
]
