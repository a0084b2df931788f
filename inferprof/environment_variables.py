"""Every environment variable inferprof reads, as a documented constant: the in-process
instrumentation's, the GPU sampler's, the collector's and the demo services'.

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

INFERPROF_MAX_TIMED_RATE_SUMMARISED = "INFERPROF_MAX_TIMED_RATE_SUMMARISED"
"""Production mode: requests timed per second, per route and process, on a route whose
untimed requests are summarised with their stage times (default 10; 0: the
``INFERPROF_MAX_TIMED_RATE``'s); at most ``INFERPROF_MAX_TIMED_RATE``."""

INFERPROF_MAX_TIMING_CPU = "INFERPROF_MAX_TIMING_CPU"
"""Production mode: share of the process's CPU that timing requests may cost, in [0, 1]
(0: no cap)."""

INFERPROF_SUMMARIES = "INFERPROF_SUMMARIES"
"""Production mode: export summaries of every timed request (contract §15); on by default."""

INFERPROF_UNTIMED_STAGES = "INFERPROF_UNTIMED_STAGES"
"""Production mode with summaries: summarise each request the timing budget leaves untimed
with its stage times (true, the default), or only count it (false)."""

INFERPROF_SUMMARY_INTERVAL = "INFERPROF_SUMMARY_INTERVAL"
"""Production mode: seconds between two summary exports (default 5)."""

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

OTEL_RESOURCE_ATTRIBUTES = "OTEL_RESOURCE_ATTRIBUTES"
"""The resource's attributes, ``key=value,...`` (read by the SDK). A ``service.instance.id``
named here is kept by a worker forked after configure(); without one, each such worker
gets an id of its own."""

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

# --- the collector (inferprof collect; docs/collector.md) ------------------------------------

INFERPROF_COLLECTOR_HOST = "INFERPROF_COLLECTOR_HOST"
"""``inferprof collect --host``."""

INFERPROF_COLLECTOR_GRPC_HOST = "INFERPROF_COLLECTOR_GRPC_HOST"
"""``inferprof collect --grpc-host``."""

INFERPROF_COLLECTOR_GRPC_PORT = "INFERPROF_COLLECTOR_GRPC_PORT"
"""``inferprof collect --grpc-port``."""

INFERPROF_COLLECTOR_HTTP_HOST = "INFERPROF_COLLECTOR_HTTP_HOST"
"""``inferprof collect --http-host``."""

INFERPROF_COLLECTOR_HTTP_PORT = "INFERPROF_COLLECTOR_HTTP_PORT"
"""``inferprof collect --http-port``."""

INFERPROF_COLLECTOR_API_HOST = "INFERPROF_COLLECTOR_API_HOST"
"""``inferprof collect --api-host``."""

INFERPROF_COLLECTOR_API_PORT = "INFERPROF_COLLECTOR_API_PORT"
"""``inferprof collect --api-port``."""

INFERPROF_COLLECTOR_MAX_BODY_BYTES = "INFERPROF_COLLECTOR_MAX_BODY_BYTES"
"""``inferprof collect --max-body-bytes``."""

INFERPROF_COLLECTOR_MAX_CONCURRENT_REQUESTS = "INFERPROF_COLLECTOR_MAX_CONCURRENT_REQUESTS"
"""``inferprof collect --max-concurrent-requests``."""

INFERPROF_COLLECTOR_GRPC_WORKERS = "INFERPROF_COLLECTOR_GRPC_WORKERS"
"""``inferprof collect --grpc-workers``."""

INFERPROF_COLLECTOR_RETRY_AFTER_S = "INFERPROF_COLLECTOR_RETRY_AFTER_S"
"""``inferprof collect --retry-after-s``."""

INFERPROF_AUTH_TOKEN = "INFERPROF_AUTH_TOKEN"
"""``inferprof collect --auth-token``."""

INFERPROF_AUTH_TOKEN_FILE = "INFERPROF_AUTH_TOKEN_FILE"
"""``inferprof collect --auth-token-file``."""

INFERPROF_TLS_CERT = "INFERPROF_TLS_CERT"
"""``inferprof collect --tls-cert``."""

INFERPROF_TLS_KEY = "INFERPROF_TLS_KEY"
"""``inferprof collect --tls-key``."""

INFERPROF_COLLECTOR_FORWARD = "INFERPROF_COLLECTOR_FORWARD"
"""``inferprof collect --forward`` (comma-separated URLs)."""

INFERPROF_COLLECTOR_FORWARD_HEADERS = "INFERPROF_COLLECTOR_FORWARD_HEADERS"
"""``inferprof collect --forward-header`` (comma-separated key=value)."""

INFERPROF_COLLECTOR_FORWARD_CA = "INFERPROF_COLLECTOR_FORWARD_CA"
"""``inferprof collect --forward-ca``."""

INFERPROF_COLLECTOR_FORWARD_QUEUE_SIZE = "INFERPROF_COLLECTOR_FORWARD_QUEUE_SIZE"
"""``inferprof collect --forward-queue-size``."""

INFERPROF_COLLECTOR_FORWARD_QUEUE_BYTES = "INFERPROF_COLLECTOR_FORWARD_QUEUE_BYTES"
"""``inferprof collect --forward-queue-bytes``."""

INFERPROF_COLLECTOR_BODY_TIMEOUT_S = "INFERPROF_COLLECTOR_BODY_TIMEOUT_S"
"""``inferprof collect --body-timeout-s``."""

INFERPROF_COLLECTOR_FORWARD_TIMEOUT_S = "INFERPROF_COLLECTOR_FORWARD_TIMEOUT_S"
"""``inferprof collect --forward-timeout-s``."""

INFERPROF_COLLECTOR_FORWARD_COMPRESSION = "INFERPROF_COLLECTOR_FORWARD_COMPRESSION"
"""``inferprof collect --forward-compression``."""

INFERPROF_COLLECTOR_SETTLE_S = "INFERPROF_COLLECTOR_SETTLE_S"
"""``inferprof collect --settle-s``."""

INFERPROF_COLLECTOR_TRACE_TIMEOUT_S = "INFERPROF_COLLECTOR_TRACE_TIMEOUT_S"
"""``inferprof collect --trace-timeout-s``."""

INFERPROF_COLLECTOR_WINDOWS_S = "INFERPROF_COLLECTOR_WINDOWS_S"
"""``inferprof collect --windows-s`` (comma-separated seconds)."""

INFERPROF_COLLECTOR_SLICE_S = "INFERPROF_COLLECTOR_SLICE_S"
"""``inferprof collect --slice-s``."""

INFERPROF_COLLECTOR_RELATIVE_ACCURACY = "INFERPROF_COLLECTOR_RELATIVE_ACCURACY"
"""``inferprof collect --relative-accuracy``."""

INFERPROF_COLLECTOR_MAX_SERIES = "INFERPROF_COLLECTOR_MAX_SERIES"
"""``inferprof collect --max-series``."""

INFERPROF_COLLECTOR_MAX_STAGES = "INFERPROF_COLLECTOR_MAX_STAGES"
"""``inferprof collect --max-stages``."""

INFERPROF_COLLECTOR_MAX_SPANS_PER_TRACE = "INFERPROF_COLLECTOR_MAX_SPANS_PER_TRACE"
"""``inferprof collect --max-spans-per-trace``."""

INFERPROF_COLLECTOR_MAX_LINKS_PER_SPAN = "INFERPROF_COLLECTOR_MAX_LINKS_PER_SPAN"
"""``inferprof collect --max-links-per-span``."""

INFERPROF_COLLECTOR_MAX_PENDING_SPANS = "INFERPROF_COLLECTOR_MAX_PENDING_SPANS"
"""``inferprof collect --max-pending-spans``."""

INFERPROF_COLLECTOR_MAX_GPU_SAMPLES = "INFERPROF_COLLECTOR_MAX_GPU_SAMPLES"
"""``inferprof collect --max-gpu-samples``."""

INFERPROF_COLLECTOR_MAX_GPUS_PER_HOST = "INFERPROF_COLLECTOR_MAX_GPUS_PER_HOST"
"""``inferprof collect --max-gpus-per-host``."""

INFERPROF_COLLECTOR_MAX_GPU_HOSTS = "INFERPROF_COLLECTOR_MAX_GPU_HOSTS"
"""``inferprof collect --max-gpu-hosts``."""

INFERPROF_COLLECTOR_METRICS_WINDOW_S = "INFERPROF_COLLECTOR_METRICS_WINDOW_S"
"""``inferprof collect --metrics-window-s``."""

INFERPROF_COLLECTOR_ADVANCE_INTERVAL_S = "INFERPROF_COLLECTOR_ADVANCE_INTERVAL_S"
"""``inferprof collect --advance-interval-s``."""

INFERPROF_COLLECTOR_TRITON_SPANS = "INFERPROF_COLLECTOR_TRITON_SPANS"
"""``inferprof collect --triton-spans`` (true/false, 1/0, yes/no, on/off)."""

INFERPROF_COLLECTOR_SHARE_PENDING_CAP = "INFERPROF_COLLECTOR_SHARE_PENDING_CAP"
"""``inferprof collect --share-pending-cap`` (true/false, like the above)."""

INFERPROF_COLLECTOR_TRACE_URL = "INFERPROF_COLLECTOR_TRACE_URL"
"""``inferprof collect --trace-url``."""

INFERPROF_COLLECTOR_GPU_HOUR_PRICES = "INFERPROF_COLLECTOR_GPU_HOUR_PRICES"
"""``inferprof collect --gpu-hour-prices`` (comma-separated [MODEL=]PRICE)."""

INFERPROF_COLLECTOR_CONFIG = "INFERPROF_COLLECTOR_CONFIG"
"""A TOML or YAML settings file (``inferprof collect --config``)."""

INFERPROF_COLLECTOR_FLEET_METRICS = "INFERPROF_COLLECTOR_FLEET_METRICS"
"""``inferprof collect --fleet-metrics`` (true/false, like the above)."""

# --- the demo service (inferprof demo; docs/demo.md) -----------------------------------------

INFERPROF_DEMO_INSTRUMENTATION = "INFERPROF_DEMO_INSTRUMENTATION"
"""The demo service's ``instrumentation`` setting."""

INFERPROF_DEMO_MODEL_SIZE = "INFERPROF_DEMO_MODEL_SIZE"
"""The demo service's ``model_size`` setting."""

INFERPROF_DEMO_MAX_BATCH_SIZE = "INFERPROF_DEMO_MAX_BATCH_SIZE"
"""The demo service's ``max_batch_size`` setting."""

INFERPROF_DEMO_MAX_DELAY_MS = "INFERPROF_DEMO_MAX_DELAY_MS"
"""The demo service's ``max_delay_ms`` setting."""

INFERPROF_DEMO_MAX_TOKENS = "INFERPROF_DEMO_MAX_TOKENS"
"""The demo service's ``max_tokens`` setting."""

INFERPROF_DEMO_SERVICE_NAME = "INFERPROF_DEMO_SERVICE_NAME"
"""The demo service's ``service_name`` setting."""

INFERPROF_DEMO_OTLP_ENDPOINT = "INFERPROF_DEMO_OTLP_ENDPOINT"
"""The demo service's ``endpoint`` setting."""

INFERPROF_DEMO_GC_FREEZE = "INFERPROF_DEMO_GC_FREEZE"
"""The demo service's ``gc_freeze`` setting."""

INFERPROF_DEMO_GC_THRESHOLD = "INFERPROF_DEMO_GC_THRESHOLD"
"""The demo service's ``gc_threshold`` setting."""

# --- the LLM demo service (inferprof demo --workload llm; docs/demo.md) ----------------------

INFERPROF_DEMO_LLM_MODEL_SIZE = "INFERPROF_DEMO_LLM_MODEL_SIZE"
"""The LLM demo service's ``model_size`` setting."""

INFERPROF_DEMO_LLM_KV_BLOCKS = "INFERPROF_DEMO_LLM_KV_BLOCKS"
"""The LLM demo service's ``kv_blocks`` setting."""

INFERPROF_DEMO_LLM_BLOCK_SIZE = "INFERPROF_DEMO_LLM_BLOCK_SIZE"
"""The LLM demo service's ``block_size`` setting."""

INFERPROF_DEMO_LLM_MAX_BATCHED_TOKENS = "INFERPROF_DEMO_LLM_MAX_BATCHED_TOKENS"
"""The LLM demo service's ``max_batched_tokens`` setting."""

INFERPROF_DEMO_LLM_MAX_RUNNING = "INFERPROF_DEMO_LLM_MAX_RUNNING"
"""The LLM demo service's ``max_running`` setting."""

INFERPROF_DEMO_LLM_MAX_IN_FLIGHT = "INFERPROF_DEMO_LLM_MAX_IN_FLIGHT"
"""The LLM demo service's ``max_in_flight`` setting."""
