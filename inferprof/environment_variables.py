"""Every environment variable inferprof reads, as a documented constant.

Settings flow keyword argument -> environment variable -> default (``inferprof._settings``
holds the parsers). A bad argument raises ``ValueError``; a bad environment value is logged
and replaced by the default. Standard ``OTEL_*`` variables keep their OpenTelemetry meaning
(the SDK and the OTLP exporters read most of them themselves); listed here are those
inferprof reads itself. ``docs/instrumenting.md``, ``docs/gpu.md`` and ``docs/collector.md``
document each.
"""

# --- the in-process instrumentation (inferprof.configure) ---------------------------------

INFERPROF_MODE = "INFERPROF_MODE"
"""``full`` (default), ``production`` or ``off``."""

INFERPROF_SAMPLE_RATE = "INFERPROF_SAMPLE_RATE"
"""Production mode: share of requests kept whatever their latency, in (0, 1]."""

INFERPROF_TAIL_QUANTILE = "INFERPROF_TAIL_QUANTILE"
"""Production mode: requests slower than this running quantile are kept, in (0, 1]."""

INFERPROF_MAX_TIMED_RATE = "INFERPROF_MAX_TIMED_RATE"
"""Production mode: requests timed per second, per route and process (0: every one)."""

INFERPROF_BATCH_ENCODING = "INFERPROF_BATCH_ENCODING"
"""How batch stages are encoded: ``children`` (default) or ``links``."""

INFERPROF_RECORD_CONTENT = "INFERPROF_RECORD_CONTENT"
"""Record request and response bodies (truncated); off by default."""

INFERPROF_CONTENT_MAX_BYTES = "INFERPROF_CONTENT_MAX_BYTES"
"""Most bytes of a body recorded when ``INFERPROF_RECORD_CONTENT`` is on."""

INFERPROF_EXCLUDED_PATHS = "INFERPROF_EXCLUDED_PATHS"
"""Comma-separated request paths the HTTP middleware does not time (``/x*``: a prefix)."""

# --- standard OpenTelemetry variables inferprof reads itself --------------------------------

OTEL_SDK_DISABLED = "OTEL_SDK_DISABLED"
"""``true``: inferprof is off, as with ``INFERPROF_MODE=off``."""

OTEL_SERVICE_NAME = "OTEL_SERVICE_NAME"
"""``service.name`` of the resource."""

OTEL_EXPORTER_OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
"""Base URL of the OTLP receiver, for both signals."""

OTEL_EXPORTER_OTLP_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
"""``grpc`` (default) or ``http/protobuf``, for both signals."""

OTEL_EXPORTER_OTLP_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
"""The span exporter's protocol (beats ``OTEL_EXPORTER_OTLP_PROTOCOL``)."""

OTEL_EXPORTER_OTLP_METRICS_PROTOCOL = "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"
"""The metric exporter's protocol (beats ``OTEL_EXPORTER_OTLP_PROTOCOL``)."""

OTEL_EXPORTER_OTLP_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
"""Full URL of the span receiver, used as given."""

OTEL_EXPORTER_OTLP_METRICS_ENDPOINT = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
"""Full URL of the metric receiver, used as given."""

OTEL_BSP_SCHEDULE_DELAY = "OTEL_BSP_SCHEDULE_DELAY"
"""Milliseconds between two span exports (inferprof's default: 1000)."""

OTEL_BSP_MAX_QUEUE_SIZE = "OTEL_BSP_MAX_QUEUE_SIZE"
"""Most entries (a span or a kept trace) waiting for export (default 2048)."""

OTEL_BSP_MAX_EXPORT_BATCH_SIZE = "OTEL_BSP_MAX_EXPORT_BATCH_SIZE"
"""Most spans per export call (default 512; at most the queue size)."""

OTEL_BSP_EXPORT_TIMEOUT = "OTEL_BSP_EXPORT_TIMEOUT"
"""Milliseconds a flush waits for the exports before giving up (default 30000)."""

# --- the GPU sampler (inferprof.gpu) ---------------------------------------------------------

INFERPROF_GPU_SOURCE = "INFERPROF_GPU_SOURCE"
"""``nvml`` (default), ``dcgm-exporter``, ``replay`` or ``synthetic``."""

INFERPROF_GPU_INTERVAL = "INFERPROF_GPU_INTERVAL"
"""Seconds between two readings."""

INFERPROF_GPU_EXPORT_INTERVAL = "INFERPROF_GPU_EXPORT_INTERVAL"
"""Seconds between two exports of the readings."""

INFERPROF_GPU_DCGM_URL = "INFERPROF_GPU_DCGM_URL"
"""The dcgm-exporter metrics page (source ``dcgm-exporter``)."""

INFERPROF_GPU_REPLAY = "INFERPROF_GPU_REPLAY"
"""The recording to replay (source ``replay``)."""

INFERPROF_GPU_HOST_NAME = "INFERPROF_GPU_HOST_NAME"
"""``host.name`` of the readings (replaces the one a source reports)."""

INFERPROF_GPU_MAX_QUEUE_SIZE = "INFERPROF_GPU_MAX_QUEUE_SIZE"
"""Most readings buffered while the exporter is slow or down."""
