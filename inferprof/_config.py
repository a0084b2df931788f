"""``inferprof.configure()``: the one place inferprof touches global state.

Settings flow keyword argument -> environment variable -> ``_DEFAULT_*`` constant, as in the
OpenTelemetry SDK: a bad argument raises ``ValueError``, a bad environment value is logged
and replaced by the default. Standard ``OTEL_*`` variables keep their OpenTelemetry meaning
(the SDK and the OTLP exporters read most of them themselves); ``INFERPROF_*`` variables
hold inferprof's own settings.

Nothing is installed at import time. Until ``configure()`` runs, every inferprof API is a
cheap no-op — unless the application has already installed an SDK ``TracerProvider`` as the
global provider, in which case inferprof uses it (mode ``full``) without installing anything.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import metrics as metrics_api
from opentelemetry import trace as trace_api

from inferprof import semconv

_logger = logging.getLogger(__name__)

# --- environment variables ------------------------------------------------------------

ENV_MODE = "INFERPROF_MODE"
ENV_SAMPLE_RATE = "INFERPROF_SAMPLE_RATE"
ENV_TAIL_QUANTILE = "INFERPROF_TAIL_QUANTILE"
ENV_MAX_TIMED_RATE = "INFERPROF_MAX_TIMED_RATE"
ENV_BATCH_ENCODING = "INFERPROF_BATCH_ENCODING"
ENV_RECORD_CONTENT = "INFERPROF_RECORD_CONTENT"
ENV_CONTENT_MAX_BYTES = "INFERPROF_CONTENT_MAX_BYTES"
ENV_EXCLUDED_PATHS = "INFERPROF_EXCLUDED_PATHS"
# Standard OpenTelemetry variables inferprof reads itself (the SDK reads the rest).
ENV_OTEL_SDK_DISABLED = "OTEL_SDK_DISABLED"
ENV_OTEL_SERVICE_NAME = "OTEL_SERVICE_NAME"
ENV_OTEL_EXPORTER_OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
ENV_OTEL_EXPORTER_OTLP_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
ENV_OTEL_EXPORTER_OTLP_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
ENV_OTEL_EXPORTER_OTLP_METRICS_PROTOCOL = "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"
ENV_OTEL_EXPORTER_OTLP_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENV_OTEL_EXPORTER_OTLP_METRICS_ENDPOINT = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"

# --- defaults -----------------------------------------------------------------------------

_DEFAULT_MODE = semconv.MODE_FULL
_DEFAULT_SAMPLE_RATE = 0.05
_DEFAULT_TAIL_QUANTILE = 0.9
#: Requests per second, per route (HTTP path) and process, that production mode times;
#: above it a random share is timed (sampling.TimingBudget). 0: every request.
_DEFAULT_MAX_TIMED_RATE = 100.0
_DEFAULT_BATCH_ENCODING = semconv.BATCH_ENCODING_CHILDREN
_DEFAULT_PROTOCOL = "grpc"
_DEFAULT_CONTENT_MAX_BYTES = 1024
#: Health checks, scrapes and FastAPI's interactive documentation: not model requests.
_DEFAULT_EXCLUDED_PATHS = (
    "/healthz", "/health", "/livez", "/readyz", "/metrics", "/favicon.ico",
    "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json",
)
_DEFAULT_METRIC_EXPORT_INTERVAL_MS = 15000
#: Span export every second (the SDK's default is 5 s) unless OTEL_BSP_SCHEDULE_DELAY says
#: otherwise: the export thread shares the service's CPU, and five seconds of kept traces
#: built and sent in one go held requests up long enough to show in the p99
#: (docs/instrumenting.md, "Export cadence").
_DEFAULT_SPAN_SCHEDULE_DELAY_MS = 1000
PROTOCOL_GRPC = "grpc"
PROTOCOL_HTTP = "http/protobuf"
PROTOCOLS = (PROTOCOL_GRPC, PROTOCOL_HTTP)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class Config:
    """What ``configure()`` settled on (after arguments, environment and defaults)."""

    mode: str
    service_name: str | None
    endpoint: str | None
    protocol: str
    sample_rate: float
    tail_quantile: float
    batch_encoding: str
    record_content: bool
    content_max_bytes: int
    excluded_paths: tuple[str, ...]
    #: True when inferprof created the providers (``shutdown()`` then shuts them down).
    owns_providers: bool
    #: OpenTelemetry's per-signal settings, which beat the generic ones (and ``endpoint``
    #: taken from the environment): ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` and
    #: ``..._METRICS_ENDPOINT``, full URLs used as given (no ``/v1/...`` appended); None
    #: when unset or when ``configure(endpoint=...)`` names one endpoint for both signals.
    traces_endpoint: str | None = None
    metrics_endpoint: str | None = None
    #: the metrics exporter's protocol (``OTEL_EXPORTER_OTLP_METRICS_PROTOCOL``); None:
    #: ``protocol``'s.
    metrics_protocol: str | None = None
    #: production mode: requests timed per second per route and process (0: every one)
    max_timed_rate: float = _DEFAULT_MAX_TIMED_RATE

    @property
    def enabled(self) -> bool:
        return self.mode != semconv.MODE_OFF


# --- parsing helpers -------------------------------------------------------------------------


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    if value is None:
        return None
    value = value.strip()
    return value or None


def _choice(arg: Any, env: str, allowed: tuple[str, ...], default: str, what: str) -> str:
    if arg is not None:
        if arg not in allowed:
            raise ValueError(f"{what} must be one of {allowed}, got {arg!r}")
        return arg
    raw = _env(env)
    if raw is None:
        return default
    if raw.lower() in allowed:
        return raw.lower()
    _logger.warning("ignoring %s=%r: expected one of %s; using %r", env, raw, allowed, default)
    return default


def _number(arg: Any, env: str, default: float, what: str, ok: Callable[[float], bool],
            expected: str) -> float:
    """A number setting: ``arg`` (``ValueError`` unless ``ok``), else the variable ``env``
    (ignored with a warning unless ``ok``), else ``default``."""
    if arg is not None:
        if isinstance(arg, bool) or not isinstance(arg, (int, float)) or not ok(float(arg)):
            raise ValueError(f"{what} must be {expected}, got {arg!r}")
        return float(arg)
    raw = _env(env)
    if raw is None:
        return default
    try:
        value = float(raw)
        if ok(value):
            return value
    except ValueError:
        pass
    _logger.warning("ignoring %s=%r: not %s; using %r", env, raw, expected, default)
    return default


def _fraction(arg: Any, env: str, default: float, what: str, *, open_low: bool) -> float:
    def ok(v: float) -> bool:
        return (0.0 < v if open_low else 0.0 <= v) and v <= 1.0

    interval = "(0, 1]" if open_low else "[0, 1]"
    return _number(arg, env, default, what, ok, f"a number in {interval}")


def _rate(arg: Any, env: str, default: float, what: str) -> float:
    """A non-negative number of requests per second (0: no limit)."""
    return _number(arg, env, default, what, lambda v: 0.0 <= v < float("inf"),
                   "a number >= 0 (requests per second; 0: no limit)")


def _flag(arg: Any, env: str, default: bool) -> bool:
    if arg is not None:
        if not isinstance(arg, bool):
            raise ValueError(f"expected a bool, got {arg!r}")
        return arg
    raw = os.environ.get(env)
    if raw is None:
        return default
    if raw.strip().lower() in _TRUE:
        return True
    if raw.strip().lower() in _FALSE:
        return False
    _logger.warning("ignoring %s=%r: not a boolean; using %r", env, raw, default)
    return default


def _positive_int(arg: Any, env: str, default: int, what: str) -> int:
    if arg is not None:
        if isinstance(arg, bool) or not isinstance(arg, int) or arg <= 0:
            raise ValueError(f"{what} must be a positive int, got {arg!r}")
        return arg
    raw = _env(env)
    if raw is None:
        return default
    try:
        value = int(raw)
        if value > 0:
            return value
    except ValueError:
        pass
    _logger.warning("ignoring %s=%r: not a positive integer; using %r", env, raw, default)
    return default


def excluded_paths_setting(arg: Any) -> tuple[str, ...]:
    """``excluded_paths`` argument -> ``INFERPROF_EXCLUDED_PATHS`` (comma separated) -> default."""
    if arg is not None:
        if isinstance(arg, str) or not all(isinstance(p, str) for p in arg):
            raise ValueError(f"excluded_paths must be a sequence of path strings, got {arg!r}")
        relative = [p for p in arg if not _matchable_path(p)]
        if relative:
            raise ValueError(
                "excluded_paths must start with '/' as request paths do (or be '*', every "
                f"path), got {relative!r}"
            )
        return tuple(arg)
    raw = os.environ.get(ENV_EXCLUDED_PATHS)
    if raw is None:
        return _DEFAULT_EXCLUDED_PATHS
    paths = [p.strip() for p in raw.split(",") if p.strip()]
    relative = [p for p in paths if not _matchable_path(p)]
    if relative:
        _logger.warning(
            "ignoring %s entries that do not start with '/' (they would never match): %s",
            ENV_EXCLUDED_PATHS, ", ".join(relative))
    return tuple(p for p in paths if _matchable_path(p))


def _matchable_path(entry: str) -> bool:
    """Whether an excluded-paths entry can match an ASGI path (which starts with "/"):
    a path or prefix from the root, or ``*`` (a prefix of every path)."""
    return entry.startswith("/") or entry == "*"


def batch_encoding_setting(arg: Any) -> str:
    return _choice(
        arg, ENV_BATCH_ENCODING, semconv.BATCH_ENCODINGS, _DEFAULT_BATCH_ENCODING, "batch_encoding"
    )


# --- global state ---------------------------------------------------------------------------

_lock = threading.Lock()
_runtime: Any = None  # inferprof.instrumentation.runtime.Runtime | None
_auto: tuple[Any, Any] | None = None  # (global SDK provider, Runtime built on it)
_installed_providers: set[int] = set()  # ids of providers inferprof itself created
#: the counters of the runtime ``shutdown()`` closed last: its final counts stay readable
_final_stats: Any = None  # inferprof.instrumentation.accounting.Stats | None


def active_runtime() -> Any:
    """The runtime stage/request/middleware record into, or None (no-op).

    Hot path: one global read when ``configure()`` ran. Otherwise checks whether the
    application installed an SDK TracerProvider globally, and if so builds (once) a full-mode
    runtime on it.
    """
    rt = _runtime
    if rt is not None:
        return rt if rt.enabled else None
    return _auto_runtime()


_MISSING = object()


def _auto_runtime() -> Any:
    global _auto
    # get_tracer_provider() reads os.environ on every call while no provider is set; this
    # runs once per request/stage when inferprof is not configured, so peek at the global
    # first (falling back to the public call if OpenTelemetry ever renames it).
    provider = getattr(trace_api, "_TRACER_PROVIDER", _MISSING)
    if provider is None:
        return None
    if provider is _MISSING:
        provider = trace_api.get_tracer_provider()
    auto = _auto
    if auto is not None and auto[0] is provider:
        return auto[1]
    from opentelemetry.sdk.trace import TracerProvider

    if not isinstance(provider, TracerProvider) or id(provider) in _installed_providers:
        return None
    from inferprof.instrumentation.runtime import Runtime

    config = _resolve(owns=False)
    if not config.enabled:
        return None
    rt = Runtime(config, provider, metrics_api.get_meter_provider())
    _auto = (provider, rt)
    return rt


def _resolve(
    *,
    mode=None,
    service_name=None,
    endpoint=None,
    protocol=None,
    sample_rate=None,
    tail_quantile=None,
    max_timed_rate=None,
    batch_encoding=None,
    record_content=None,
    content_max_bytes=None,
    excluded_paths=None,
    owns: bool,
) -> Config:
    """Settings from arguments, then ``INFERPROF_*``/``OTEL_*`` variables, then defaults
    (``None`` means "not given")."""
    resolved_mode = _choice(mode, ENV_MODE, semconv.MODES, _DEFAULT_MODE, "mode")
    if mode is None and _flag(None, ENV_OTEL_SDK_DISABLED, False):
        resolved_mode = semconv.MODE_OFF
    if service_name is not None and (not isinstance(service_name, str) or not service_name):
        raise ValueError(f"service_name must be a non-empty string, got {service_name!r}")
    if endpoint is not None and (not isinstance(endpoint, str) or "://" not in endpoint):
        raise ValueError(
            f"endpoint must be a URL such as 'http://127.0.0.1:4317', got {endpoint!r}"
        )
    proto_env = (
        ENV_OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
        if _env(ENV_OTEL_EXPORTER_OTLP_TRACES_PROTOCOL)
        else ENV_OTEL_EXPORTER_OTLP_PROTOCOL
    )
    metrics_protocol = None
    if protocol is None and _env(ENV_OTEL_EXPORTER_OTLP_METRICS_PROTOCOL):
        metrics_protocol = _choice(None, ENV_OTEL_EXPORTER_OTLP_METRICS_PROTOCOL, PROTOCOLS,
                                   _DEFAULT_PROTOCOL, "protocol")
    # configure(endpoint=...) names one endpoint for both signals; otherwise a signal's
    # own variable wins over OTEL_EXPORTER_OTLP_ENDPOINT (OpenTelemetry's rule).
    traces_url = metrics_url = None
    if endpoint is None:
        traces_url = _url_env(ENV_OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)
        metrics_url = _url_env(ENV_OTEL_EXPORTER_OTLP_METRICS_ENDPOINT)
    return Config(
        mode=resolved_mode,
        service_name=service_name or _env(ENV_OTEL_SERVICE_NAME),
        endpoint=endpoint or _url_env(ENV_OTEL_EXPORTER_OTLP_ENDPOINT),
        protocol=_choice(protocol, proto_env, PROTOCOLS, _DEFAULT_PROTOCOL, "protocol"),
        sample_rate=_fraction(
            sample_rate, ENV_SAMPLE_RATE, _DEFAULT_SAMPLE_RATE, "sample_rate", open_low=True
        ),
        tail_quantile=_fraction(
            tail_quantile, ENV_TAIL_QUANTILE, _DEFAULT_TAIL_QUANTILE, "tail_quantile", open_low=True
        ),
        batch_encoding=batch_encoding_setting(batch_encoding),
        record_content=_flag(record_content, ENV_RECORD_CONTENT, False),
        content_max_bytes=_positive_int(
            content_max_bytes,
            ENV_CONTENT_MAX_BYTES,
            _DEFAULT_CONTENT_MAX_BYTES,
            "content_max_bytes",
        ),
        excluded_paths=excluded_paths_setting(excluded_paths),
        owns_providers=owns,
        traces_endpoint=traces_url,
        metrics_endpoint=metrics_url,
        metrics_protocol=metrics_protocol,
        max_timed_rate=_rate(
            max_timed_rate, ENV_MAX_TIMED_RATE, _DEFAULT_MAX_TIMED_RATE, "max_timed_rate"
        ),
    )


def _url_env(name: str) -> str | None:
    """A URL-valued variable. One without a scheme is logged: OpenTelemetry's exporters
    read these variables themselves as well, so it cannot be ignored, only named."""
    value = _env(name)
    if value and "://" not in value:
        _logger.warning("%s=%r is not a URL such as http://127.0.0.1:4318: exports to it "
                        "will fail", name, value)
    return value or None


def _resource(service_name: str | None, extra: Mapping[str, Any] | None):
    from opentelemetry.sdk.resources import Resource

    base = Resource(
        {
            semconv.RESOURCE_SERVICE_INSTANCE_ID: str(uuid.uuid4()),
            semconv.RESOURCE_HOST_NAME: socket.gethostname(),
        }
    )
    attrs: dict[str, Any] = dict(extra or {})
    if service_name:
        attrs[semconv.RESOURCE_SERVICE_NAME] = service_name
    # Resource.create folds in OTEL_RESOURCE_ATTRIBUTES / OTEL_SERVICE_NAME; explicit
    # arguments win over those, and both win over the generated instance id / host name.
    return base.merge(Resource.create(attrs))


def _http_signal_endpoint(endpoint: str | None, path: str) -> str | None:
    """OTLP/HTTP wants the signal's path on a base endpoint (``/v1/traces``...)."""
    if endpoint and not endpoint.rstrip("/").endswith(path):
        return endpoint.rstrip("/") + path
    return endpoint


#: The well-known OTLP ports (the OpenTelemetry Collector's and `inferprof collect`'s).
_OTLP_PORTS = {4317: PROTOCOL_GRPC, 4318: PROTOCOL_HTTP}


def protocol_port_mismatch(endpoint: str | None, protocol: str) -> str | None:
    """Why ``endpoint`` looks wrong for ``protocol`` (OTLP/HTTP to 4317, gRPC to 4318), or None."""
    if not endpoint:
        return None
    from urllib.parse import urlsplit

    try:
        port = urlsplit(endpoint).port
    except ValueError:
        return None
    expected = _OTLP_PORTS.get(port)  # type: ignore[arg-type]
    if expected is None or expected == protocol:
        return None
    return (f"OTLP endpoint {endpoint} is on port {port}, the {expected} port, but the "
            f"protocol is {protocol}: exports will fail unless that receiver speaks "
            f"{protocol}. Set protocol= (or OTEL_EXPORTER_OTLP_PROTOCOL) to {expected}, or "
            f"use port {4318 if protocol == PROTOCOL_HTTP else 4317}")


def _signal_url(own: str | None, protocol: str, endpoint: str | None, path: str) -> str | None:
    """A signal's URL: its own variable as given, else the shared endpoint (plus the
    signal's path over OTLP/HTTP); None leaves it to the exporter's default."""
    if own:
        return own
    return _http_signal_endpoint(endpoint, path) if protocol == PROTOCOL_HTTP else endpoint


def traces_endpoint(config: Config) -> str | None:
    """The URL the span exporter sends to (None: the exporter's default)."""
    return _signal_url(config.traces_endpoint, config.protocol, config.endpoint, "/v1/traces")


def metrics_endpoint(config: Config) -> tuple[str, str | None]:
    """The metrics exporter's protocol and URL (None: the exporter's default)."""
    protocol = config.metrics_protocol or config.protocol
    return protocol, _signal_url(config.metrics_endpoint, protocol, config.endpoint,
                                 "/v1/metrics")


def _span_schedule_delay_ms() -> int | None:
    """inferprof's 1 s export delay unless ``OTEL_BSP_SCHEDULE_DELAY`` sets one (None: the
    SDK reads it); a value that is not a positive integer is logged like inferprof's own
    bad settings, and the default kept (the SDK would log a traceback and use 5 s, or, for
    0, refuse every ``OTEL_BSP_*`` setting with it)."""
    raw = _env("OTEL_BSP_SCHEDULE_DELAY")
    if not raw:
        return _DEFAULT_SPAN_SCHEDULE_DELAY_MS
    try:
        if int(raw) > 0:
            return None
    except ValueError:
        pass
    _logger.warning(
        "ignoring OTEL_BSP_SCHEDULE_DELAY=%r: not a positive integer (milliseconds); "
        "using %d", raw, _DEFAULT_SPAN_SCHEDULE_DELAY_MS)
    return _DEFAULT_SPAN_SCHEDULE_DELAY_MS


def _span_exporter(config: Config):
    # The SDK's exporters with inferprof's wire encoder (same bytes, a quarter of the CPU
    # per span; see inferprof/instrumentation/otlp_encode.py and docs/overhead.md).
    from inferprof.instrumentation.otlp_encode import grpc_span_exporter, http_span_exporter

    exporter = http_span_exporter if config.protocol == PROTOCOL_HTTP else grpc_span_exporter
    return exporter(endpoint=traces_endpoint(config))


def _metric_exporter(config: Config):
    protocol, endpoint = metrics_endpoint(config)
    if protocol == PROTOCOL_HTTP:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

    return OTLPMetricExporter(endpoint=endpoint)


def configure(
    *,
    service_name: str | None = None,
    endpoint: str | None = None,
    protocol: str | None = None,
    mode: str | None = None,
    sample_rate: float | None = None,
    tail_quantile: float | None = None,
    max_timed_rate: float | None = None,
    batch_encoding: str | None = None,
    record_content: bool | None = None,
    content_max_bytes: int | None = None,
    excluded_paths: Any = None,
    tracer_provider: Any = None,
    meter_provider: Any = None,
    resource_attributes: Mapping[str, Any] | None = None,
    span_exporter: Any = None,
    metric_readers: Any = None,
    set_global: bool = True,
) -> Config:
    """Set inferprof up; returns the settled :class:`Config`.

    Providers, in order: ``tracer_provider``/``meter_provider`` arguments; else the global
    ones if the application already installed SDK providers (inferprof installs nothing);
    else inferprof creates SDK providers exporting OTLP (``protocol`` ``grpc`` or
    ``http/protobuf``) to ``endpoint`` through a bounded ``BatchSpanProcessor``, and makes
    them global when ``set_global`` is true. ``span_exporter`` / ``metric_readers`` replace
    the OTLP exporters (tests, custom backends). Calling ``configure()`` again replaces the
    previous configuration (shutting down what the previous call created).
    """
    global _runtime
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    if resource_attributes is not None and not isinstance(resource_attributes, Mapping):
        raise ValueError(f"resource_attributes must be a mapping, got {resource_attributes!r}")
    if tracer_provider is not None and not hasattr(tracer_provider, "get_tracer"):
        raise ValueError(f"tracer_provider must be a TracerProvider, got {tracer_provider!r}")

    existing = trace_api.get_tracer_provider()
    adopt_global = (
        tracer_provider is None
        and isinstance(existing, TracerProvider)
        and id(existing) not in _installed_providers
    )
    owns = tracer_provider is None and not adopt_global
    config = _resolve(
        mode=mode,
        service_name=service_name,
        endpoint=endpoint,
        protocol=protocol,
        sample_rate=sample_rate,
        tail_quantile=tail_quantile,
        max_timed_rate=max_timed_rate,
        batch_encoding=batch_encoding,
        record_content=record_content,
        content_max_bytes=content_max_bytes,
        excluded_paths=excluded_paths,
        owns=owns,
    )

    from inferprof.instrumentation.accounting import (
        CountingBatchSpanProcessor,
        CountingSpanExporter,
    )
    from inferprof.instrumentation.runtime import Runtime

    shutdown()
    if not config.enabled:
        config = _replace_owns(config, False)
        with _lock:
            _runtime = Runtime(config, None, None)
        return config

    if not owns:
        # Settings only a provider inferprof builds would use: say they are not applied.
        unused = [name for name, value in (
            ("service_name", service_name), ("endpoint", endpoint), ("protocol", protocol),
            ("resource_attributes", resource_attributes), ("span_exporter", span_exporter),
            ("metric_readers", metric_readers)) if value is not None]
        if unused:
            _logger.warning(
                "inferprof uses %s tracer provider, so %s given to configure() %s not "
                "applied: set them on that provider", "the given" if tracer_provider is not None
                else "the application's global", ", ".join(unused),
                "is" if len(unused) == 1 else "are")
    if tracer_provider is not None:
        tp = tracer_provider
        mp = meter_provider if meter_provider is not None else metrics_api.get_meter_provider()
    elif adopt_global:
        tp = existing
        mp = meter_provider if meter_provider is not None else metrics_api.get_meter_provider()
    else:
        resource = _resource(config.service_name, resource_attributes)
        from inferprof.instrumentation.accounting import Stats

        stats = Stats()
        tp = TracerProvider(resource=resource)
        mismatch = span_exporter is None and protocol_port_mismatch(
            traces_endpoint(config), config.protocol)
        if mismatch:
            _logger.warning("%s", mismatch)
        exporter = span_exporter if span_exporter is not None else _span_exporter(config)
        counted = CountingSpanExporter(exporter, stats)
        delay = _span_schedule_delay_ms()
        try:
            processor = CountingBatchSpanProcessor(counted, stats, schedule_delay_millis=delay)
        except ValueError as exc:  # inconsistent OTEL_BSP_* values: log and default them
            _logger.warning("ignoring OTEL_BSP_* settings (%s); using the SDK defaults", exc)
            processor = CountingBatchSpanProcessor(
                counted,
                stats,
                max_queue_size=2048,
                schedule_delay_millis=_DEFAULT_SPAN_SCHEDULE_DELAY_MS,
                max_export_batch_size=512,
            )
        tp.add_span_processor(processor)
        if meter_provider is not None:
            mp = meter_provider
        else:
            if metric_readers is None:
                from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

                metric_readers = [
                    PeriodicExportingMetricReader(
                        _metric_exporter(config),
                        export_interval_millis=_DEFAULT_METRIC_EXPORT_INTERVAL_MS,
                    )
                ]
            mp = MeterProvider(resource=resource, metric_readers=list(metric_readers))
        _installed_providers.add(id(tp))
        if set_global:
            _set_global(tp, mp)
        with _lock:
            deferred = processor if processor._emit is not None else None
            _runtime = Runtime(config, tp, mp, stats=stats, deferred=deferred,
                               owned_processor=processor)
        return config

    with _lock:
        _runtime = Runtime(config, tp, mp)
    return config


def _replace_owns(config: Config, owns: bool) -> Config:
    from dataclasses import replace

    return replace(config, owns_providers=owns)


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


def current_config() -> Config | None:
    """The configuration in force, or None when ``configure()`` has not run."""
    rt = _runtime
    return rt.config if rt is not None else None


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
    global _runtime, _auto, _final_stats
    started = time.monotonic()
    samplers = sys.modules.get("inferprof.gpu.sampler")  # loaded only if one was used
    if samplers is not None:
        try:
            samplers._stop_all(timeout=timeout_millis / 5000)
        except Exception:  # telemetry never raises into the application
            _logger.exception("stopping the GPU samplers failed")
    with _lock:
        rt, _runtime = _runtime, None
        _auto = None
        if rt is not None:
            _final_stats = rt.stats
    if rt is None:
        return
    left_ms = max(0, int(timeout_millis - (time.monotonic() - started) * 1000))
    try:
        rt.close(timeout_millis=left_ms)
    except Exception:  # telemetry never raises into the application
        _logger.exception("inferprof shutdown failed")


__all__ = ["Config", "configure", "shutdown", "current_config"]
