"""What ``inferprof.configure()`` settles on: :class:`Config`, and how it is resolved.

Each setting flows keyword argument -> environment variable
(``inferprof.environment_variables``) -> a ``DEFAULT_*`` constant here, through the
parsers of ``inferprof._settings``.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from inferprof import _settings, semconv
from inferprof import environment_variables as ev

_logger = logging.getLogger("inferprof._config")

DEFAULT_MODE = semconv.MODE_FULL
DEFAULT_SAMPLE_RATE = 0.05
DEFAULT_TAIL_QUANTILE = 0.9
#: Requests per second, per route (HTTP path) and process, that production mode times;
#: above it a random share is timed (sampling.TimingBudget). 0: every request.
DEFAULT_MAX_TIMED_RATE = 100.0
#: The same, on a route whose untimed requests are summarised with their stage times
#: (``untimed_stages``): the summaries hold every request of it, so its timed requests
#: only feed traces, and fewer are timed (docs/overhead.md). 0: ``max_timed_rate``'s.
DEFAULT_MAX_TIMED_RATE_SUMMARISED = 10.0
#: Share of the process's CPU that production mode's timing may cost (sampling.TimingBudget's
#: CPU guard); 0: no such cap.
DEFAULT_MAX_TIMING_CPU = 0.0
#: Production mode: every timed request counted through summaries (contract §15).
DEFAULT_SUMMARIES = True
#: Seconds between two summary exports.
DEFAULT_SUMMARY_INTERVAL_S = 5.0
#: Production mode with summaries: requests the timing budget leaves untimed are
#: summarised with their stage times (records.SummaryRecord), not only counted.
DEFAULT_UNTIMED_STAGES = True
DEFAULT_BATCH_ENCODING = semconv.BATCH_ENCODING_CHILDREN
DEFAULT_CONTENT_MAX_BYTES = 1024
#: Health checks, scrapes and FastAPI's interactive documentation: not model requests.
DEFAULT_EXCLUDED_PATHS = (
    "/healthz", "/health", "/livez", "/readyz", "/metrics", "/favicon.ico",
    "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json",
)
PROTOCOL_GRPC = "grpc"
PROTOCOL_HTTP = "http/protobuf"
PROTOCOLS = (PROTOCOL_GRPC, PROTOCOL_HTTP)
DEFAULT_PROTOCOL = PROTOCOL_GRPC


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
    max_timed_rate: float = DEFAULT_MAX_TIMED_RATE
    #: production mode: the same on a route whose untimed requests are summarised with
    #: their stages (0: ``max_timed_rate``'s); at most ``max_timed_rate``
    max_timed_rate_summarised: float = DEFAULT_MAX_TIMED_RATE_SUMMARISED
    #: production mode: share of the process's CPU that timing may cost (0: no cap)
    max_timing_cpu: float = DEFAULT_MAX_TIMING_CPU
    #: production mode: export summaries of every timed request (ignored in other modes)
    summaries: bool = DEFAULT_SUMMARIES
    #: seconds between two summary exports
    summary_interval_s: float = DEFAULT_SUMMARY_INTERVAL_S
    #: production mode: summarise untimed requests with their stage times (False: only
    #: count them)
    untimed_stages: bool = DEFAULT_UNTIMED_STAGES

    @property
    def enabled(self) -> bool:
        return self.mode != semconv.MODE_OFF


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
    raw = os.environ.get(ev.INFERPROF_EXCLUDED_PATHS)
    if raw is None:  # set but empty: no path excluded
        return DEFAULT_EXCLUDED_PATHS
    paths = [p.strip() for p in raw.split(",") if p.strip()]
    relative = [p for p in paths if not _matchable_path(p)]
    if relative:
        _logger.warning(
            "ignoring %s entries that do not start with '/' (they would never match): %s",
            ev.INFERPROF_EXCLUDED_PATHS, ", ".join(relative))
    return tuple(p for p in paths if _matchable_path(p))


def _matchable_path(entry: str) -> bool:
    """Whether an excluded-paths entry can match an ASGI path (which starts with "/"):
    a path or prefix from the root, or ``*`` (a prefix of every path)."""
    return entry.startswith("/") or entry == "*"


def batch_encoding_setting(arg: Any) -> str:
    return _settings.choice(
        arg, ev.INFERPROF_BATCH_ENCODING, semconv.BATCH_ENCODINGS, DEFAULT_BATCH_ENCODING,
        "batch_encoding",
    )


def resolve(
    *,
    mode: Any = None,
    service_name: Any = None,
    endpoint: Any = None,
    protocol: Any = None,
    sample_rate: Any = None,
    tail_quantile: Any = None,
    max_timed_rate: Any = None,
    max_timed_rate_summarised: Any = None,
    max_timing_cpu: Any = None,
    batch_encoding: Any = None,
    record_content: Any = None,
    content_max_bytes: Any = None,
    excluded_paths: Any = None,
    summaries: Any = None,
    summary_interval_s: Any = None,
    untimed_stages: Any = None,
    owns: bool,
) -> Config:
    """Settings from arguments, then ``INFERPROF_*``/``OTEL_*`` variables, then defaults
    (``None`` means "not given")."""
    _check_service_and_endpoint(service_name, endpoint)
    # configure(endpoint=...) names one endpoint for both signals; otherwise a signal's
    # own variable wins over OTEL_EXPORTER_OTLP_ENDPOINT (OpenTelemetry's rule).
    own_urls = endpoint is None
    return Config(
        mode=_mode(mode),
        service_name=service_name or _settings.env(ev.OTEL_SERVICE_NAME),
        endpoint=endpoint or _settings.url(ev.OTEL_EXPORTER_OTLP_ENDPOINT),
        protocol=_traces_protocol(protocol),
        sample_rate=_settings.fraction(
            sample_rate, ev.INFERPROF_SAMPLE_RATE, DEFAULT_SAMPLE_RATE, "sample_rate",
            open_low=True,
        ),
        tail_quantile=_settings.fraction(
            tail_quantile, ev.INFERPROF_TAIL_QUANTILE, DEFAULT_TAIL_QUANTILE, "tail_quantile",
            open_low=True,
        ),
        batch_encoding=batch_encoding_setting(batch_encoding),
        record_content=_settings.flag(record_content, ev.INFERPROF_RECORD_CONTENT, False),
        content_max_bytes=_settings.positive_int(
            content_max_bytes, ev.INFERPROF_CONTENT_MAX_BYTES, DEFAULT_CONTENT_MAX_BYTES,
            "content_max_bytes",
        ),
        excluded_paths=excluded_paths_setting(excluded_paths),
        owns_providers=owns,
        traces_endpoint=_settings.url(ev.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) if own_urls else None,
        metrics_endpoint=(
            _settings.url(ev.OTEL_EXPORTER_OTLP_METRICS_ENDPOINT) if own_urls else None
        ),
        metrics_protocol=_metrics_protocol(protocol),
        max_timed_rate=_settings.rate(
            max_timed_rate, ev.INFERPROF_MAX_TIMED_RATE, DEFAULT_MAX_TIMED_RATE, "max_timed_rate"
        ),
        max_timed_rate_summarised=_settings.rate(
            max_timed_rate_summarised, ev.INFERPROF_MAX_TIMED_RATE_SUMMARISED,
            DEFAULT_MAX_TIMED_RATE_SUMMARISED, "max_timed_rate_summarised",
            zero="max_timed_rate's",
        ),
        max_timing_cpu=_settings.fraction(
            max_timing_cpu, ev.INFERPROF_MAX_TIMING_CPU, DEFAULT_MAX_TIMING_CPU,
            "max_timing_cpu", open_low=False,
        ),
        summaries=_summaries(summaries),
        summary_interval_s=_settings.positive_seconds(
            summary_interval_s, ev.INFERPROF_SUMMARY_INTERVAL, DEFAULT_SUMMARY_INTERVAL_S,
            "summary_interval_s",
        ),
        untimed_stages=_untimed_stages(untimed_stages),
    )


def _summaries(arg: Any) -> bool:
    if arg is not None and not isinstance(arg, bool):
        raise ValueError(f"summaries must be a bool, got {arg!r}")
    return _settings.flag(arg, ev.INFERPROF_SUMMARIES, DEFAULT_SUMMARIES)


def _untimed_stages(arg: Any) -> bool:
    if arg is not None and not isinstance(arg, bool):
        raise ValueError(f"untimed_stages must be a bool, got {arg!r}")
    return _settings.flag(arg, ev.INFERPROF_UNTIMED_STAGES, DEFAULT_UNTIMED_STAGES)


def mode_setting(arg: Any = None) -> str:
    """The mode: argument -> ``INFERPROF_MODE`` (``OTEL_SDK_DISABLED=true``: off) -> full."""
    return _mode(arg)


def _mode(arg: Any) -> str:
    mode = _settings.choice(arg, ev.INFERPROF_MODE, semconv.MODES, DEFAULT_MODE, "mode")
    if arg is None and _settings.flag(None, ev.OTEL_SDK_DISABLED, False):
        return semconv.MODE_OFF
    return mode


def _check_service_and_endpoint(service_name: Any, endpoint: Any) -> None:
    if service_name is not None and (not isinstance(service_name, str) or not service_name):
        raise ValueError(f"service_name must be a non-empty string, got {service_name!r}")
    if endpoint is not None and (not isinstance(endpoint, str) or "://" not in endpoint):
        raise ValueError(
            f"endpoint must be a URL such as 'http://127.0.0.1:4317', got {endpoint!r}"
        )


def _traces_protocol(arg: Any) -> str:
    name = (
        ev.OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
        if _settings.env(ev.OTEL_EXPORTER_OTLP_TRACES_PROTOCOL)
        else ev.OTEL_EXPORTER_OTLP_PROTOCOL
    )
    return _settings.choice(arg, name, PROTOCOLS, DEFAULT_PROTOCOL, "protocol")


def _metrics_protocol(arg: Any) -> str | None:
    if arg is not None or not _settings.env(ev.OTEL_EXPORTER_OTLP_METRICS_PROTOCOL):
        return None
    return _settings.choice(
        None, ev.OTEL_EXPORTER_OTLP_METRICS_PROTOCOL, PROTOCOLS, DEFAULT_PROTOCOL, "protocol"
    )


#: The ``service.instance.id`` values :func:`resource` generated (not set by the user):
#: those a forked child replaces (:func:`fresh_instance`). One per configure() call.
_generated_instance_ids: set[str] = set()


def _new_instance_id() -> str:
    instance = str(uuid.uuid4())
    _generated_instance_ids.add(instance)
    return instance


def resource(service_name: str | None, extra: Mapping[str, Any] | None) -> Any:
    """The SDK ``Resource`` of inferprof's providers: a generated instance id and the host
    name, under ``OTEL_RESOURCE_ATTRIBUTES``/``OTEL_SERVICE_NAME``, under the arguments."""
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
    res = base.merge(Resource.create(attrs))
    if not _user_instance_id(extra):
        # Ours, or the one the SDK's Resource.create() generates (recent SDKs do): a
        # random id either way, the process's to replace in a forked child.
        _generated_instance_ids.add(str(res.attributes.get(semconv.RESOURCE_SERVICE_INSTANCE_ID)))
    return res


def _user_instance_id(extra: Mapping[str, Any] | None) -> bool:
    """Whether the user named the instance: in the arguments or OTEL_RESOURCE_ATTRIBUTES."""
    if extra and semconv.RESOURCE_SERVICE_INSTANCE_ID in extra:
        return True
    env = os.environ.get(ev.OTEL_RESOURCE_ATTRIBUTES, "")
    return any(part.partition("=")[0].strip() == semconv.RESOURCE_SERVICE_INSTANCE_ID
               for part in env.split(","))


def fresh_instance(res: Any) -> Any | None:
    """``res`` with a new ``service.instance.id``, for a process forked after configure()
    (a pre-forking server's worker): each worker is an instance of its own to the
    collector (its engine steps' timeline, its fleet series). None when the id is not
    one :func:`resource` generated: an id the user set is theirs to keep."""
    from opentelemetry.sdk.resources import Resource

    if str(res.attributes.get(semconv.RESOURCE_SERVICE_INSTANCE_ID)) not in _generated_instance_ids:
        return None
    return res.merge(Resource({semconv.RESOURCE_SERVICE_INSTANCE_ID: _new_instance_id()}))


#: The well-known OTLP ports (the OpenTelemetry Collector's and `inferprof collect`'s).
_OTLP_PORTS = {4317: PROTOCOL_GRPC, 4318: PROTOCOL_HTTP}


def protocol_port_mismatch(endpoint: str | None, protocol: str) -> str | None:
    """Why ``endpoint`` looks wrong for ``protocol`` (OTLP/HTTP to 4317, gRPC to 4318), or None."""
    if not endpoint:
        return None
    try:
        port = urlsplit(endpoint).port
    except ValueError:
        return None
    expected = _OTLP_PORTS.get(port) if port is not None else None
    if expected is None or expected == protocol:
        return None
    return (f"OTLP endpoint {endpoint} is on port {port}, the {expected} port, but the "
            f"protocol is {protocol}: exports will fail unless that receiver speaks "
            f"{protocol}. Set protocol= (or OTEL_EXPORTER_OTLP_PROTOCOL) to {expected}, or "
            f"use port {4318 if protocol == PROTOCOL_HTTP else 4317}")


def _http_signal_endpoint(endpoint: str | None, path: str) -> str | None:
    """OTLP/HTTP wants the signal's path on a base endpoint (``/v1/traces``...)."""
    if endpoint and not endpoint.rstrip("/").endswith(path):
        return endpoint.rstrip("/") + path
    return endpoint


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


def metric_exporter(config: Config) -> Any:
    """The SDK's OTLP metric exporter for ``config``'s protocol and URL."""
    protocol, endpoint = metrics_endpoint(config)
    if protocol == PROTOCOL_HTTP:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
            OTLPMetricExporter as HTTPExporter,
        )

        return HTTPExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

    return OTLPMetricExporter(endpoint=endpoint)


__all__ = [
    "PROTOCOLS",
    "PROTOCOL_GRPC",
    "PROTOCOL_HTTP",
    "Config",
    "batch_encoding_setting",
    "excluded_paths_setting",
    "metric_exporter",
    "metrics_endpoint",
    "mode_setting",
    "protocol_port_mismatch",
    "resolve",
    "resource",
    "traces_endpoint",
]
