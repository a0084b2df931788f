"""Settings of ``inferprof collect``: one frozen record, resolved flag -> env -> file -> default.

Every setting has a keyword (and a CLI flag of the same name with dashes; ``forward_headers``
is ``--forward-header``, repeated), an
``INFERPROF_*`` environment variable and a ``_DEFAULT_*`` constant. A bad keyword
argument raises ``ValueError``; a bad environment or config-file value is logged
and replaced by the default, so a typo in a deployment manifest degrades to
defaults instead of taking the collector down.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import pathlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from inferprof import _settings
from inferprof import environment_variables as ev
from inferprof.collector.attribution import DEFAULT_MAX_STAGES, MAX_MAX_STAGES, MIN_MAX_STAGES
from inferprof.collector.cost import parse_prices, valid_price
from inferprof.collector.examples import check_template
from inferprof.collector.sketch import RELATIVE_ACCURACY_MAX, RELATIVE_ACCURACY_MIN

_log = logging.getLogger(__name__)

# --- defaults ------------------------------------------------------------------------
_DEFAULT_HOST = "127.0.0.1"  # security by default: only this machine can reach the listeners
_DEFAULT_GRPC_PORT = 4317  # OTLP/gRPC well-known port
_DEFAULT_HTTP_PORT = 4318  # OTLP/HTTP well-known port
_DEFAULT_API_PORT = 9464  # Prometheus exporter port convention used by OpenTelemetry
_DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
_DEFAULT_MAX_CONCURRENT_REQUESTS = 64
_DEFAULT_GRPC_WORKERS = 8
_DEFAULT_RETRY_AFTER_S = 1.0
_DEFAULT_FORWARD_QUEUE_SIZE = 1000
#: Bytes queued per destination: with --max-body-bytes of 16 MiB, 1000 queued exports
#: could otherwise hold 16 GiB for a hung downstream.
_DEFAULT_FORWARD_QUEUE_BYTES = 64 * 1024 * 1024
#: Longest an OTLP/HTTP body may take to arrive. The OpenTelemetry exporters give up on
#: an export after 10 s (OTEL_EXPORTER_OTLP_TIMEOUT): a body still arriving after that is
#: answered to nobody, and a connection trickling one holds a reader meanwhile.
_DEFAULT_BODY_TIMEOUT_S = 10.0
_DEFAULT_FORWARD_TIMEOUT_S = 5.0
_DEFAULT_FORWARD_COMPRESSION = "gzip"  # what the OpenTelemetry Collector's exporters default to
_DEFAULT_SETTLE_S = 2.0
_DEFAULT_TRACE_TIMEOUT_S = 60.0
_DEFAULT_WINDOWS_S = (60.0, 300.0, 900.0)
_DEFAULT_SLICE_S = 10.0
_DEFAULT_RELATIVE_ACCURACY = 0.005
_DEFAULT_MAX_SERIES = 1000
_DEFAULT_MAX_STAGES = DEFAULT_MAX_STAGES
_DEFAULT_MAX_SPANS_PER_TRACE = 10_000
#: Links read per batch stage span (batch encoding links): one per member request.
_DEFAULT_MAX_LINKS_PER_SPAN = 1024
_DEFAULT_MAX_PENDING_SPANS = 1_000_000
#: GPU samples (contract section 4 data points) retained, all GPUs together.
_DEFAULT_MAX_GPU_SAMPLES = 1_000_000
#: Distinct GPUs (hw.id) per host, and hosts, that GPU samples are kept for: 8 GPUs of 7
#: MIG instances each fit a host; a fleet of 1024 GPU hosts fits one collector's samples.
_DEFAULT_MAX_GPUS_PER_HOST = 64
_DEFAULT_MAX_GPU_HOSTS = 1024
_DEFAULT_METRICS_WINDOW_S = 300.0
_DEFAULT_ADVANCE_INTERVAL_S = 0.5
_DEFAULT_TRITON_SPANS = True  # Triton's own spans become stages of the Triton service
_DEFAULT_SHARE_PENDING_CAP = True  # near the cap, a starved sender's room is kept for it
_DEFAULT_FLEET_METRICS = False  # about 1,400 series per (series, stage): opt in (fleet.py)

# --- environment variables (one per setting) --------------------------------------------
ENV_HOST = ev.INFERPROF_COLLECTOR_HOST
ENV_GRPC_HOST = ev.INFERPROF_COLLECTOR_GRPC_HOST
ENV_GRPC_PORT = ev.INFERPROF_COLLECTOR_GRPC_PORT
ENV_HTTP_HOST = ev.INFERPROF_COLLECTOR_HTTP_HOST
ENV_HTTP_PORT = ev.INFERPROF_COLLECTOR_HTTP_PORT
ENV_API_HOST = ev.INFERPROF_COLLECTOR_API_HOST
ENV_API_PORT = ev.INFERPROF_COLLECTOR_API_PORT
ENV_MAX_BODY_BYTES = ev.INFERPROF_COLLECTOR_MAX_BODY_BYTES
ENV_MAX_CONCURRENT_REQUESTS = ev.INFERPROF_COLLECTOR_MAX_CONCURRENT_REQUESTS
ENV_GRPC_WORKERS = ev.INFERPROF_COLLECTOR_GRPC_WORKERS
ENV_RETRY_AFTER_S = ev.INFERPROF_COLLECTOR_RETRY_AFTER_S
ENV_AUTH_TOKEN = ev.INFERPROF_AUTH_TOKEN
ENV_AUTH_TOKEN_FILE = ev.INFERPROF_AUTH_TOKEN_FILE
ENV_TLS_CERT = ev.INFERPROF_TLS_CERT
ENV_TLS_KEY = ev.INFERPROF_TLS_KEY
ENV_FORWARD = ev.INFERPROF_COLLECTOR_FORWARD
ENV_FORWARD_HEADERS = ev.INFERPROF_COLLECTOR_FORWARD_HEADERS
ENV_FORWARD_CA = ev.INFERPROF_COLLECTOR_FORWARD_CA
ENV_FORWARD_QUEUE_SIZE = ev.INFERPROF_COLLECTOR_FORWARD_QUEUE_SIZE
ENV_FORWARD_QUEUE_BYTES = ev.INFERPROF_COLLECTOR_FORWARD_QUEUE_BYTES
ENV_BODY_TIMEOUT_S = ev.INFERPROF_COLLECTOR_BODY_TIMEOUT_S
ENV_FORWARD_TIMEOUT_S = ev.INFERPROF_COLLECTOR_FORWARD_TIMEOUT_S
ENV_FORWARD_COMPRESSION = ev.INFERPROF_COLLECTOR_FORWARD_COMPRESSION
ENV_SETTLE_S = ev.INFERPROF_COLLECTOR_SETTLE_S
ENV_TRACE_TIMEOUT_S = ev.INFERPROF_COLLECTOR_TRACE_TIMEOUT_S
ENV_WINDOWS_S = ev.INFERPROF_COLLECTOR_WINDOWS_S
ENV_SLICE_S = ev.INFERPROF_COLLECTOR_SLICE_S
ENV_RELATIVE_ACCURACY = ev.INFERPROF_COLLECTOR_RELATIVE_ACCURACY
ENV_MAX_SERIES = ev.INFERPROF_COLLECTOR_MAX_SERIES
ENV_MAX_STAGES = ev.INFERPROF_COLLECTOR_MAX_STAGES
ENV_MAX_SPANS_PER_TRACE = ev.INFERPROF_COLLECTOR_MAX_SPANS_PER_TRACE
ENV_MAX_LINKS_PER_SPAN = ev.INFERPROF_COLLECTOR_MAX_LINKS_PER_SPAN
ENV_MAX_PENDING_SPANS = ev.INFERPROF_COLLECTOR_MAX_PENDING_SPANS
ENV_MAX_GPU_SAMPLES = ev.INFERPROF_COLLECTOR_MAX_GPU_SAMPLES
ENV_MAX_GPUS_PER_HOST = ev.INFERPROF_COLLECTOR_MAX_GPUS_PER_HOST
ENV_MAX_GPU_HOSTS = ev.INFERPROF_COLLECTOR_MAX_GPU_HOSTS
ENV_METRICS_WINDOW_S = ev.INFERPROF_COLLECTOR_METRICS_WINDOW_S
ENV_ADVANCE_INTERVAL_S = ev.INFERPROF_COLLECTOR_ADVANCE_INTERVAL_S
ENV_TRITON_SPANS = ev.INFERPROF_COLLECTOR_TRITON_SPANS
ENV_SHARE_PENDING_CAP = ev.INFERPROF_COLLECTOR_SHARE_PENDING_CAP
ENV_FLEET_METRICS = ev.INFERPROF_COLLECTOR_FLEET_METRICS
ENV_TRACE_URL = ev.INFERPROF_COLLECTOR_TRACE_URL
ENV_GPU_HOUR_PRICES = ev.INFERPROF_COLLECTOR_GPU_HOUR_PRICES
ENV_CONFIG = ev.INFERPROF_COLLECTOR_CONFIG

# file:///path appends to an inferprof protobuf dump that `inferprof report` reads.
FORWARD_SCHEMES = ("otlp-grpc", "otlp-grpcs", "http", "https", "file")
FORWARD_COMPRESSIONS = ("gzip", "none")


# The string parsers are the settings toolkit's (inferprof._settings), shared with the
# instrumentation, the GPU sampler and the demos; the collector adds its config file.
_parse_str = _settings.parse_str
_parse_int = _settings.parse_int
_parse_float = _settings.parse_float
_parse_bool = _settings.parse_flag
_parse_list = _settings.parse_list
_parse_floats = _settings.parse_floats
_parse_headers = _settings.parse_headers
_split_header = _settings.parse_header


# field name -> (environment variable, parser of its string value)
_ENV: dict[str, tuple[str, Callable[[str], Any]]] = {
    "host": (ENV_HOST, _parse_str),
    "grpc_host": (ENV_GRPC_HOST, _parse_str),
    "grpc_port": (ENV_GRPC_PORT, _parse_int),
    "http_host": (ENV_HTTP_HOST, _parse_str),
    "http_port": (ENV_HTTP_PORT, _parse_int),
    "api_host": (ENV_API_HOST, _parse_str),
    "api_port": (ENV_API_PORT, _parse_int),
    "max_body_bytes": (ENV_MAX_BODY_BYTES, _parse_int),
    "max_concurrent_requests": (ENV_MAX_CONCURRENT_REQUESTS, _parse_int),
    "grpc_workers": (ENV_GRPC_WORKERS, _parse_int),
    "retry_after_s": (ENV_RETRY_AFTER_S, _parse_float),
    "auth_token": (ENV_AUTH_TOKEN, _parse_str),
    "auth_token_file": (ENV_AUTH_TOKEN_FILE, _parse_str),
    "tls_cert": (ENV_TLS_CERT, _parse_str),
    "tls_key": (ENV_TLS_KEY, _parse_str),
    "forward": (ENV_FORWARD, _parse_list),
    "forward_headers": (ENV_FORWARD_HEADERS, _parse_headers),
    "forward_ca": (ENV_FORWARD_CA, _parse_str),
    "forward_queue_size": (ENV_FORWARD_QUEUE_SIZE, _parse_int),
    "forward_queue_bytes": (ENV_FORWARD_QUEUE_BYTES, _parse_int),
    "body_timeout_s": (ENV_BODY_TIMEOUT_S, _parse_float),
    "forward_timeout_s": (ENV_FORWARD_TIMEOUT_S, _parse_float),
    "forward_compression": (ENV_FORWARD_COMPRESSION, _parse_str),
    "settle_s": (ENV_SETTLE_S, _parse_float),
    "trace_timeout_s": (ENV_TRACE_TIMEOUT_S, _parse_float),
    "windows_s": (ENV_WINDOWS_S, _parse_floats),
    "slice_s": (ENV_SLICE_S, _parse_float),
    "relative_accuracy": (ENV_RELATIVE_ACCURACY, _parse_float),
    "max_series": (ENV_MAX_SERIES, _parse_int),
    "max_stages": (ENV_MAX_STAGES, _parse_int),
    "max_spans_per_trace": (ENV_MAX_SPANS_PER_TRACE, _parse_int),
    "max_links_per_span": (ENV_MAX_LINKS_PER_SPAN, _parse_int),
    "max_pending_spans": (ENV_MAX_PENDING_SPANS, _parse_int),
    "max_gpu_samples": (ENV_MAX_GPU_SAMPLES, _parse_int),
    "max_gpus_per_host": (ENV_MAX_GPUS_PER_HOST, _parse_int),
    "max_gpu_hosts": (ENV_MAX_GPU_HOSTS, _parse_int),
    "metrics_window_s": (ENV_METRICS_WINDOW_S, _parse_float),
    "advance_interval_s": (ENV_ADVANCE_INTERVAL_S, _parse_float),
    "triton_spans": (ENV_TRITON_SPANS, _parse_bool),
    "share_pending_cap": (ENV_SHARE_PENDING_CAP, _parse_bool),
    "fleet_metrics": (ENV_FLEET_METRICS, _parse_bool),
    "trace_url": (ENV_TRACE_URL, _parse_str),
    "gpu_hour_prices": (ENV_GPU_HOUR_PRICES, lambda v: parse_prices(_parse_list(v))),
}


@dataclass(frozen=True)
class CollectorSettings:
    """Everything ``inferprof collect`` can be told. Construct directly (validated) or
    through :meth:`from_env`. Ports may be 0 for an ephemeral port (tests, demos)."""

    host: str = _DEFAULT_HOST
    grpc_host: str | None = None  # None: use ``host``
    grpc_port: int = _DEFAULT_GRPC_PORT
    http_host: str | None = None
    http_port: int = _DEFAULT_HTTP_PORT
    api_host: str | None = None
    api_port: int = _DEFAULT_API_PORT
    max_body_bytes: int = _DEFAULT_MAX_BODY_BYTES
    max_concurrent_requests: int = _DEFAULT_MAX_CONCURRENT_REQUESTS
    grpc_workers: int = _DEFAULT_GRPC_WORKERS
    retry_after_s: float = _DEFAULT_RETRY_AFTER_S
    auth_token: str | None = field(default=None, repr=False)
    auth_token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    forward: tuple[str, ...] = ()
    forward_headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    forward_ca: str | None = None
    forward_queue_size: int = _DEFAULT_FORWARD_QUEUE_SIZE
    forward_queue_bytes: int = _DEFAULT_FORWARD_QUEUE_BYTES
    body_timeout_s: float = _DEFAULT_BODY_TIMEOUT_S
    forward_timeout_s: float = _DEFAULT_FORWARD_TIMEOUT_S
    forward_compression: str = _DEFAULT_FORWARD_COMPRESSION
    settle_s: float = _DEFAULT_SETTLE_S
    trace_timeout_s: float = _DEFAULT_TRACE_TIMEOUT_S
    windows_s: tuple[float, ...] = _DEFAULT_WINDOWS_S
    slice_s: float = _DEFAULT_SLICE_S
    relative_accuracy: float = _DEFAULT_RELATIVE_ACCURACY
    max_series: int = _DEFAULT_MAX_SERIES
    max_stages: int = _DEFAULT_MAX_STAGES
    max_spans_per_trace: int = _DEFAULT_MAX_SPANS_PER_TRACE
    max_links_per_span: int = _DEFAULT_MAX_LINKS_PER_SPAN
    max_pending_spans: int = _DEFAULT_MAX_PENDING_SPANS
    max_gpu_samples: int = _DEFAULT_MAX_GPU_SAMPLES
    max_gpus_per_host: int = _DEFAULT_MAX_GPUS_PER_HOST
    max_gpu_hosts: int = _DEFAULT_MAX_GPU_HOSTS
    metrics_window_s: float = _DEFAULT_METRICS_WINDOW_S
    advance_interval_s: float = _DEFAULT_ADVANCE_INTERVAL_S
    triton_spans: bool = _DEFAULT_TRITON_SPANS
    share_pending_cap: bool = _DEFAULT_SHARE_PENDING_CAP
    #: expose the fleet histograms and tail table on /metrics (collector/fleet.py)
    fleet_metrics: bool = _DEFAULT_FLEET_METRICS
    #: URL template of one trace ({trace_id}): the breakdown's examples link to it
    trace_url: str | None = None
    #: price per GPU-hour by GPU model (hw.model; "": every other GPU), for the cost figures
    gpu_hour_prices: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        # Normalise sequences given as lists so the record stays hashable.
        object.__setattr__(self, "forward", tuple(self.forward))
        object.__setattr__(self, "windows_s", tuple(float(w) for w in self.windows_s))
        object.__setattr__(
            self,
            "forward_headers",
            tuple((str(k).lower(), str(v)) for k, v in self.forward_headers),
        )
        _validate(self)

    # --- derived ---------------------------------------------------------------------
    @property
    def grpc_bind_host(self) -> str:
        return self.grpc_host or self.host

    @property
    def http_bind_host(self) -> str:
        return self.http_host or self.host

    @property
    def api_bind_host(self) -> str:
        return self.api_host or self.host

    @property
    def tls_enabled(self) -> bool:
        return self.tls_cert is not None

    def resolved_auth_token(self) -> str | None:
        """The bearer token, read from ``auth_token_file`` when that is how it was given."""
        if self.auth_token:
            return self.auth_token
        if self.auth_token_file:
            try:
                token = pathlib.Path(self.auth_token_file).read_text().strip()
            except (OSError, UnicodeDecodeError) as exc:
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                raise ValueError(
                    f"cannot read the auth token file {self.auth_token_file!r} "
                    f"(--auth-token-file / {ENV_AUTH_TOKEN_FILE}): {why}"
                ) from None
            if not token:
                raise ValueError(f"auth token file {self.auth_token_file!r} is empty")
            return token
        return None

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :class:`inferprof.collector.engine.Engine`."""
        return {
            "settle_s": self.settle_s,
            "trace_timeout_s": self.trace_timeout_s,
            "windows_s": self.windows_s,
            "slice_s": self.slice_s,
            "relative_accuracy": self.relative_accuracy,
            "max_series": self.max_series,
            "max_stages": self.max_stages,
            "max_spans_per_trace": self.max_spans_per_trace,
            "max_links_per_span": self.max_links_per_span,
            "max_pending_spans": self.max_pending_spans,
            "max_gpu_samples": self.max_gpu_samples,
            "max_gpus_per_host": self.max_gpus_per_host,
            "max_gpu_hosts": self.max_gpu_hosts,
            "triton_spans": self.triton_spans,
            "share_pending_cap": self.share_pending_cap,
            "gpu_hour_prices": self.gpu_hour_prices,
        }

    # --- resolution ---------------------------------------------------------------------
    @classmethod
    def from_env(
        cls,
        *,
        config: str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> CollectorSettings:
        """Resolve each setting: keyword (not None) -> environment -> config file -> default.

        ``config`` (or ``INFERPROF_COLLECTOR_CONFIG``) names a TOML or YAML file whose
        top-level keys are setting names (dashes or underscores).
        """
        env = os.environ if environ is None else environ
        unknown = set(overrides) - set(_ENV)
        if unknown:
            raise ValueError(f"unknown collector setting(s): {', '.join(sorted(unknown))}")
        if config is None and env.get(ENV_CONFIG):
            config = env[ENV_CONFIG]
        file_values = load_config_file(config) if config is not None else {}
        values: dict[str, Any] = {}
        for name, (var, parse) in _ENV.items():
            if overrides.get(name) is not None:
                values[name] = overrides[name]
                continue
            raw = env.get(var)
            if raw is not None and raw != "":
                # an invalid variable falls back to what is below it: the file, the default
                fallback = "the config file's value" if name in file_values else "the default"
                candidate = _try(lambda p=parse, r=raw: p(r),
                                 f"environment variable {var}={raw!r}", fallback)
                if candidate is not _INVALID and _field_ok(name, candidate):
                    values[name] = candidate
                    continue
                if candidate is not _INVALID:
                    _log.warning("ignoring invalid %s=%r; using %s", var, raw, fallback)
            if name in file_values:
                values[name] = file_values[name]
        if values.get("auth_token") is not None and overrides.get("auth_token_file") is None:
            values.pop("auth_token_file", None)  # a literal token beats a configured token file
        return cls(**values)


_INVALID = object()


def _try(fn: Callable[[], Any], what: str, fallback: str = "the default") -> Any:
    try:
        return fn()
    except (ValueError, TypeError) as exc:
        _log.warning("ignoring invalid %s (%s); using %s", what, exc, fallback)
        return _INVALID


def _field_ok(name: str, value: Any) -> bool:
    """Whether ``value`` would pass validation for ``name`` (checked alone)."""
    try:
        _check_field(name, value)
    except (ValueError, TypeError):
        return False
    return True


def load_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a TOML (``.toml``) or YAML (``.yaml``/``.yml``) settings file.

    Unknown keys and values that fail validation are logged and skipped, like bad
    environment values. A file that cannot be read or parsed raises ``ValueError``:
    the operator asked for it explicitly.
    """
    p = pathlib.Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read collector config {str(p)!r}: {exc}") from exc
    suffix = p.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml"):
        raise ValueError(f"collector config {str(p)!r} must end in .toml, .yaml or .yml")
    from inferprof._optional import require

    if suffix in (".yaml", ".yml"):
        yaml = require("yaml", "collector")
    elif sys.version_info >= (3, 11):
        import tomllib as toml
    else:  # tomli: the parser that became tomllib, for Python 3.10
        toml = require("tomli", "collector")
    try:
        data = toml.loads(text) if suffix == ".toml" else yaml.safe_load(text) or {}
    except Exception as exc:  # parse errors of either format
        raise ValueError(f"cannot parse collector config {str(p)!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"collector config {str(p)!r} must be a mapping of settings")
    # A [collector] table lets the file hold other sections too.
    if isinstance(data.get("collector"), dict):
        data = data["collector"]
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in _ENV:
            _log.warning("ignoring unknown key %r in collector config %s", key, p)
            continue
        if name == "forward_headers" and isinstance(value, dict):
            value = tuple((str(k), str(v)) for k, v in value.items())
        elif name == "gpu_hour_prices":
            # {model: price}, a list of [MODEL=]PRICE items, or one comma-separated string
            items = (
                [f"{k}={v}" if k else str(v) for k, v in value.items()]
                if isinstance(value, dict)
                else _parse_list(value) if isinstance(value, str)
                else [str(v) for v in value] if isinstance(value, list)
                else [str(value)]
            )
            value = _try(lambda i=items: parse_prices(i), f"config key {key}={value!r}")
        elif isinstance(value, list):
            value = tuple(value)
        elif isinstance(value, str) and name in (
            "forward",
            "windows_s",
            "forward_headers",
            "triton_spans",
            "share_pending_cap",
            "fleet_metrics",
        ):
            value = _try(lambda v=value, n=name: _ENV[n][1](v), f"config key {key}={value!r}")
        if value is not _INVALID and _field_ok(name, value):
            out[name] = value
        elif value is not _INVALID:
            _log.warning("ignoring invalid %s=%r in collector config %s", key, value, p)
    return out


_PORTS = ("grpc_port", "http_port", "api_port")
_HOSTS = ("host", "grpc_host", "http_host", "api_host")
_POSITIVE_INTS = (
    "max_body_bytes",
    "max_concurrent_requests",
    "grpc_workers",
    "forward_queue_size",
    "forward_queue_bytes",
    "max_series",
    "max_stages",
    "max_spans_per_trace",
    "max_links_per_span",
    "max_pending_spans",
    "max_gpu_samples",
    "max_gpus_per_host",
    "max_gpu_hosts",
)
_POSITIVE_SECONDS = (
    "retry_after_s",
    "forward_timeout_s",
    "body_timeout_s",
    "settle_s",
    "trace_timeout_s",
    "slice_s",
    "metrics_window_s",
    "advance_interval_s",
)
_OPTIONAL_PATHS = ("auth_token_file", "tls_cert", "tls_key", "forward_ca")


def _check_field(name: str, value: Any) -> None:
    """Raise ``ValueError`` if ``value`` is not acceptable for setting ``name`` on its own."""
    if name in _PORTS:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 65535:
            raise ValueError(f"{name} must be an integer in 0..65535 (0: ephemeral), got {value!r}")
    elif name in _HOSTS:
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ValueError(f"{name} must be a non-empty host name or address, got {value!r}")
    elif name in _POSITIVE_INTS:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    elif name in _POSITIVE_SECONDS:
        if not _positive(value):
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    elif name in _OPTIONAL_PATHS:
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{name} must be a file path, got {value!r}")
    elif name == "windows_s":
        if not value or not all(_positive(w) for w in value):
            raise ValueError(f"windows_s must be one or more positive numbers, got {value!r}")
    elif name == "relative_accuracy":
        # The sketch's own range: a value it refuses must be refused here, where a bad
        # setting is a usage error (or, from the environment, replaced by the default).
        if not (_positive(value) and RELATIVE_ACCURACY_MIN <= value <= RELATIVE_ACCURACY_MAX):
            raise ValueError(
                f"relative_accuracy must be in [{RELATIVE_ACCURACY_MIN}, "
                f"{RELATIVE_ACCURACY_MAX}], got {value!r}"
            )
    elif name == "auth_token":
        if value is not None and (
            not isinstance(value, str) or not value.strip() or value != value.strip()
        ):
            raise ValueError("auth_token must be a non-empty string without surrounding spaces")
    elif name == "forward_compression":
        if value not in FORWARD_COMPRESSIONS:
            raise ValueError(
                f"forward_compression must be one of {FORWARD_COMPRESSIONS}, got {value!r}"
            )
    elif name == "forward":
        for url in value:
            validate_forward_url(url)
    elif name in ("triton_spans", "share_pending_cap", "fleet_metrics"):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
    elif name == "trace_url":
        check_template(value)
    elif name == "gpu_hour_prices":
        if not all(
            isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
            and valid_price(pair[1]) for pair in value
        ):
            raise ValueError(
                f"gpu_hour_prices must be (GPU model or '', price >= 0) pairs, got {value!r}"
            )
    elif name == "forward_headers":
        for key, _ in value:
            if not key or any(c in key for c in " \r\n:"):
                raise ValueError(f"invalid forward header name {key!r}")


def _validate(s: CollectorSettings) -> None:
    for f in dataclasses.fields(s):
        _check_field(f.name, getattr(s, f.name))
    if (s.tls_cert is None) != (s.tls_key is None):
        raise ValueError("tls_cert and tls_key must be given together")
    if s.auth_token is not None and s.auth_token_file is not None:
        raise ValueError("give auth_token or auth_token_file, not both")
    if not MIN_MAX_STAGES <= s.max_stages <= MAX_MAX_STAGES:
        raise ValueError(
            f"max_stages must be from {MIN_MAX_STAGES} (the contract's stages and "
            f"unattributed) to {MAX_MAX_STAGES}, got {s.max_stages}"
        )


def validate_forward_url(url: str) -> str:
    """Return ``url`` if it is a forwarding destination inferprof can send to."""
    if not isinstance(url, str):
        raise ValueError(f"forward URL must be a string, got {url!r}")
    scheme, sep, rest = url.partition("://")
    target = rest if scheme == "file" else rest.split("/", 1)[0]
    if not sep or scheme not in FORWARD_SCHEMES or not target:
        raise ValueError(
            f"invalid forward URL {url!r}: use otlp-grpc://host:port, otlp-grpcs://host:port, "
            "http://host:port[/prefix], https://host:port[/prefix] or file:///path/to/dump"
        )
    return url


def _positive(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def replace(settings: CollectorSettings, **changes: Any) -> CollectorSettings:
    """A copy of ``settings`` with ``changes`` applied (validated)."""
    return dataclasses.replace(settings, **changes)


__all__ = ["FORWARD_SCHEMES", "CollectorSettings", "load_config_file", "validate_forward_url"]
