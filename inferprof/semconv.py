"""Every name on the wire, defined once.

This module mirrors ``docs/span-contract.md`` (the wire contract between the
instrumentation, the GPU samplers and the collector). Code anywhere in inferprof
refers to these constants rather than to string literals, so a rename is a
one-line change and a typo is an ``AttributeError`` instead of a silent miss.
"""

from __future__ import annotations

import re
from typing import Final

# --- §1 Stages -------------------------------------------------------------

STAGE_RECEIVE: Final = "receive"
STAGE_TOKENIZE: Final = "tokenize"
STAGE_QUEUE: Final = "queue"
STAGE_BATCH_ASSEMBLY: Final = "batch_assembly"
STAGE_H2D: Final = "h2d"
STAGE_COMPUTE: Final = "compute"
STAGE_PREFILL: Final = "prefill"
STAGE_DECODE: Final = "decode"
STAGE_D2H: Final = "d2h"
STAGE_POSTPROCESS: Final = "postprocess"
STAGE_SERIALIZE: Final = "serialize"
STAGE_NETWORK: Final = "network"
#: §7: evicted from the KV cache, waiting to be re-admitted (a queueing stage).
STAGE_PREEMPTED: Final = "preempted"
#: Pseudo-stage: the part of a request's end-to-end time no stage span covers.
STAGE_UNATTRIBUTED: Final = "unattributed"

#: Canonical stages in serving-path order.
CANONICAL_STAGES: Final = (
    STAGE_RECEIVE,
    STAGE_TOKENIZE,
    STAGE_QUEUE,
    STAGE_BATCH_ASSEMBLY,
    STAGE_H2D,
    STAGE_COMPUTE,
    STAGE_PREFILL,
    STAGE_DECODE,
    STAGE_D2H,
    STAGE_POSTPROCESS,
    STAGE_SERIALIZE,
    STAGE_NETWORK,
    STAGE_PREEMPTED,
)

#: Stages that run once per batch and carry ``inferprof.batch.*`` (§2).
BATCH_STAGES: Final = frozenset(
    {STAGE_BATCH_ASSEMBLY, STAGE_H2D, STAGE_COMPUTE, STAGE_PREFILL, STAGE_DECODE, STAGE_D2H}
)
#: Stages that run once per request (§2).
REQUEST_STAGES: Final = frozenset(
    {
        STAGE_RECEIVE,
        STAGE_TOKENIZE,
        STAGE_QUEUE,
        STAGE_POSTPROCESS,
        STAGE_SERIALIZE,
        STAGE_NETWORK,
        STAGE_PREEMPTED,
    }
)

# Stage groups the verdict reads (§6).
#: ``preempted`` queues like ``queue`` (§7: "a queueing stage, not a compute stage", §14).
BATCHING_STAGES: Final = frozenset({STAGE_QUEUE, STAGE_BATCH_ASSEMBLY, STAGE_PREEMPTED})
HOST_STAGES: Final = frozenset({STAGE_RECEIVE, STAGE_TOKENIZE, STAGE_POSTPROCESS, STAGE_SERIALIZE})
TRANSFER_STAGES: Final = frozenset({STAGE_H2D, STAGE_D2H})
NETWORK_STAGES: Final = frozenset({STAGE_NETWORK})
COMPUTE_STAGES: Final = frozenset({STAGE_COMPUTE, STAGE_PREFILL, STAGE_DECODE})

#: Longest string, in UTF-8 bytes, the collector keeps as a service or model name (cut,
#: with a marker, past it) or as a GPU's host name, id or metric name (rejected past it):
#: one long name must not make every scrape long (contract §9).
MAX_LABEL_BYTES: Final = 256
#: Longest stage name: a stage name is repeated on every series' stage rows of /metrics.
MAX_STAGE_NAME_LENGTH: Final = 64
# \Z, not $: "$" also matches before a trailing newline ("queue\n" would be a stage).
STAGE_NAME_PATTERN: Final = re.compile(r"^[a-z0-9_]{1,64}\Z")
SPAN_NAME_PREFIX: Final = "inferprof."


def span_name(stage: str) -> str:
    """Span name for a stage: ``inferprof.<stage>``."""
    return SPAN_NAME_PREFIX + stage


def validate_stage(stage: str) -> str:
    """Return ``stage`` if it is a valid stage value, else raise ``ValueError``."""
    if not isinstance(stage, str) or not STAGE_NAME_PATTERN.match(stage):
        raise ValueError(
            f"invalid inferprof stage name {str(stage)[:100]!r}: stage names are lower-case "
            f"letters, digits and underscores, at most {MAX_STAGE_NAME_LENGTH} of them "
            "([a-z0-9_]+)"
        )
    if stage == STAGE_UNATTRIBUTED:
        raise ValueError(f"{STAGE_UNATTRIBUTED!r} is reserved for the collector's pseudo-stage")
    return stage


# --- §3 Attributes -----------------------------------------------------------

ATTR_STAGE: Final = "inferprof.stage"
ATTR_REQUEST: Final = "inferprof.request"
ATTR_SAMPLE_WEIGHT: Final = "inferprof.sample.weight"
#: Extension (§13): the largest weight read; 1 / OpenTelemetry's smallest sampling
#: probability (``ot=th`` thresholds have 56 bits).
MAX_SAMPLE_WEIGHT: Final = float(2**56)
ATTR_MODEL_NAME: Final = "inferprof.model.name"
ATTR_MODEL_VERSION: Final = "inferprof.model.version"
ATTR_BATCH_ID: Final = "inferprof.batch.id"
ATTR_BATCH_SIZE: Final = "inferprof.batch.size"
ATTR_BATCH_MAX_SIZE: Final = "inferprof.batch.max_size"
ATTR_QUEUE_DEPTH: Final = "inferprof.queue.depth"
#: Extension (§8): seconds of a ``queue`` span during which every batch slot of its batcher
#: was running a batch: the request waited behind batches, not for the batcher.
ATTR_QUEUE_BEHIND_BATCHES_S: Final = "inferprof.queue.behind_batches_s"
ATTR_TOKENS_EFFECTIVE: Final = "inferprof.tokens.effective"
ATTR_TOKENS_PADDED: Final = "inferprof.tokens.padded"
ATTR_BYTES: Final = "inferprof.bytes"
ATTR_GPU_ID: Final = "inferprof.gpu.id"

# Resource attributes.
RESOURCE_SERVICE_NAME: Final = "service.name"
RESOURCE_SERVICE_INSTANCE_ID: Final = "service.instance.id"
RESOURCE_HOST_NAME: Final = "host.name"

#: tracestate key and sub-key of OpenTelemetry probability sampling (``ot=th:...``).
TRACESTATE_OT_KEY: Final = "ot"
TRACESTATE_THRESHOLD_KEY: Final = "th"

# --- §4 GPU samples -----------------------------------------------------------

METRIC_GPU_UTILIZATION: Final = "hw.gpu.utilization"
METRIC_GPU_MEMORY_UTILIZATION: Final = "hw.gpu.memory.utilization"
METRIC_GPU_MEMORY_USAGE: Final = "hw.gpu.memory.usage"
METRIC_GPU_MEMORY_LIMIT: Final = "hw.gpu.memory.limit"
METRIC_GPU_POWER_DRAW: Final = "hw.gpu.power.draw"
METRIC_GPU_CLOCK_GRAPHICS: Final = "hw.gpu.clock.graphics"
METRIC_GPU_TEMPERATURE: Final = "hw.gpu.temperature"
METRIC_DCGM_PREFIX: Final = "inferprof.gpu.dcgm."
METRIC_DCGM_SM_ACTIVE: Final = "inferprof.gpu.dcgm.sm_active"
METRIC_DCGM_SM_OCCUPANCY: Final = "inferprof.gpu.dcgm.sm_occupancy"
METRIC_DCGM_TENSOR_ACTIVE: Final = "inferprof.gpu.dcgm.tensor_active"
METRIC_DCGM_DRAM_ACTIVE: Final = "inferprof.gpu.dcgm.dram_active"
ATTR_HW_ID: Final = "hw.id"
#: GPU model name on GPU samples (OpenTelemetry hardware conventions), e.g.
#: "NVIDIA H100 80GB HBM3": the collector prices GPU time by it (--gpu-hour-price).
ATTR_HW_MODEL: Final = "hw.model"
#: Share of time the memory controller was busy (NVML ``utilization.memory``, DCGM
#: ``DCGM_FI_DEV_MEM_COPY_UTIL``), ratio 0..1. Not ``hw.gpu.memory.utilization``: the
#: OpenTelemetry convention defines that one as memory *used* over memory size (§10).
METRIC_DCGM_MEM_COPY_UTIL: Final = "inferprof.gpu.dcgm.mem_copy_util"
#: Resource attribute of GPU samples naming what produced them (§10): live sources
#: ``nvml`` and ``dcgm-exporter``; ``replay`` and ``synthetic`` are not live GPU data.
RESOURCE_GPU_SOURCE: Final = "inferprof.gpu.source"
GPU_SOURCE_NVML: Final = "nvml"
GPU_SOURCE_DCGM_EXPORTER: Final = "dcgm-exporter"
GPU_SOURCE_REPLAY: Final = "replay"
GPU_SOURCE_SYNTHETIC: Final = "synthetic"
GPU_SOURCES: Final = (
    GPU_SOURCE_NVML, GPU_SOURCE_DCGM_EXPORTER, GPU_SOURCE_REPLAY, GPU_SOURCE_SYNTHETIC
)

# --- §5 Collector outputs -------------------------------------------------------

PROM_STAGE_DURATION: Final = "inferprof_stage_duration_seconds"
PROM_REQUEST_DURATION: Final = "inferprof_request_duration_seconds"
PROM_STAGE_QUANTILE: Final = "inferprof_stage_quantile_seconds"
#: Extension: the breakdown's ``latency`` (end-to-end p50/p95/p99) over the window.
PROM_REQUEST_QUANTILE: Final = "inferprof_request_quantile_seconds"
#: Extension: requests whose request span has status ERROR, weighted, since start.
PROM_REQUEST_ERRORS: Final = "inferprof_request_errors_total"
PROM_STAGE_SHARE_OF_P95: Final = "inferprof_stage_share_of_p95"
PROM_BOTTLENECK: Final = "inferprof_bottleneck"
#: Extension: ``queue.behind_batches`` of the breakdown (collector/queueing.py).
PROM_QUEUE_BEHIND_BATCHES: Final = "inferprof_queue_behind_batches"
PROM_STAGE_GPU_SECONDS: Final = "inferprof_stage_gpu_seconds_per_request"
PROM_STAGE_ENERGY: Final = "inferprof_stage_energy_joules_per_request"
PROM_STAGE_COST: Final = "inferprof_stage_cost_per_request"
PROM_PADDING_WASTE: Final = "inferprof_padding_waste_ratio"
PROM_GPU_UTILIZATION_DURING_COMPUTE: Final = "inferprof_gpu_utilization_during_compute"
PROM_GPU_POWER_DURING_COMPUTE: Final = "inferprof_gpu_power_watts_during_compute"
PROM_SPANS_RECEIVED: Final = "inferprof_spans_received_total"
PROM_SPANS_DROPPED: Final = "inferprof_spans_dropped_total"
PROM_TRACES_INCOMPLETE: Final = "inferprof_traces_incomplete_total"
PROM_SERIES_OVERFLOW: Final = "inferprof_series_overflow_total"
PROM_SERIES_RECLAIMED: Final = "inferprof_series_reclaimed_total"
PROM_GPU_SAMPLES_RECEIVED: Final = "inferprof_gpu_samples_received_total"
PROM_GPU_SAMPLES_DROPPED: Final = "inferprof_gpu_samples_dropped_total"
PROM_GPU_SAMPLES: Final = "inferprof_gpu_samples"
#: Requests counted from summaries (contract §15), unweighted; summary data points rejected.
PROM_SUMMARISED_REQUESTS: Final = "inferprof_summarised_requests_total"
#: Requests a timing budget left untimed, counted by summaries (contract §15).
PROM_SUMMARISED_UNTIMED: Final = "inferprof_summarised_untimed_requests_total"
PROM_SUMMARIES_REJECTED: Final = "inferprof_summaries_rejected_total"
PROM_LABELS_TRUNCATED: Final = "inferprof_labels_truncated_total"
PROM_LABEL_LABEL: Final = "label"
PROM_TRITON_REQUESTS_PARTIAL: Final = "inferprof_triton_requests_partial_total"
#: Extension (collector/fleet.py): the sketch's buckets and tail table as cumulative
#: counters, summed across collectors in Prometheus for the fleet-wide breakdown.
PROM_FLEET_STAGE_DURATION: Final = "inferprof_fleet_stage_duration_seconds"
PROM_FLEET_REQUEST_DURATION: Final = "inferprof_fleet_request_duration_seconds"
PROM_FLEET_TAIL_STAGE: Final = "inferprof_fleet_tail_stage_seconds_total"
PROM_FLEET_TAIL_REQUEST: Final = "inferprof_fleet_tail_request_seconds_total"
PROM_FLEET_TAIL_TRACED: Final = "inferprof_fleet_tail_traced_requests_total"
PROM_FLEET_RELATIVE_ACCURACY: Final = "inferprof_fleet_relative_accuracy"
PROM_LABEL_SERVICE: Final = "service"
PROM_LABEL_MODEL: Final = "model"
PROM_LABEL_STAGE: Final = "stage"
PROM_LABEL_QUANTILE: Final = "quantile"
PROM_LABEL_VERDICT: Final = "verdict"
PROM_LABEL_REASON: Final = "reason"
#: the bucket bound of a histogram bucket, and of the fleet tail table's counters
PROM_LABEL_LE: Final = "le"

# Collector self-metrics of the transport (receivers, forwarding); not in the v1
# contract's list but named under the same prefix.
PROM_OTLP_REQUESTS: Final = "inferprof_otlp_requests_total"
PROM_OTLP_REQUEST_BYTES: Final = "inferprof_otlp_request_body_bytes"
PROM_OTLP_DECODE_ERRORS: Final = "inferprof_otlp_decode_errors_total"
PROM_OTLP_IN_FLIGHT: Final = "inferprof_otlp_requests_in_flight"
PROM_FORWARD_SENT: Final = "inferprof_forward_sent_total"
PROM_FORWARD_DROPPED: Final = "inferprof_forward_dropped_total"
PROM_FORWARD_QUEUE_LENGTH: Final = "inferprof_forward_queue_length"
PROM_FORWARD_QUEUE_BYTES: Final = "inferprof_forward_queue_bytes"
PROM_LABEL_TRANSPORT: Final = "transport"
PROM_LABEL_SIGNAL: Final = "signal"
PROM_LABEL_OUTCOME: Final = "outcome"
PROM_LABEL_DESTINATION: Final = "destination"
# Label values of the transport self-metrics.
TRANSPORT_GRPC: Final = "grpc"
TRANSPORT_HTTP: Final = "http"
SIGNAL_TRACES: Final = "traces"
SIGNAL_METRICS: Final = "metrics"
SIGNAL_LOGS: Final = "logs"  # received and forwarded only
OUTCOME_OK: Final = "ok"
OUTCOME_PARTIAL: Final = "partial"
OUTCOME_BAD_REQUEST: Final = "bad_request"
OUTCOME_UNSUPPORTED: Final = "unsupported_media_type"
OUTCOME_TOO_LARGE: Final = "too_large"
OUTCOME_OVERLOADED: Final = "overloaded"
OUTCOME_UNAUTHENTICATED: Final = "unauthenticated"
OUTCOME_ERROR: Final = "error"
OUTCOME_BODY_TIMEOUT: Final = "body_timeout"

# Reasons of ``inferprof_spans_dropped_total{reason}`` (collector engine).
DROP_INVALID_ID: Final = "invalid_id"
DROP_NEGATIVE_DURATION: Final = "negative_duration"
DROP_ABSURD_DURATION: Final = "absurd_duration"
DROP_DUPLICATE: Final = "duplicate_span"
DROP_INVALID_STAGE: Final = "invalid_stage"
DROP_TRACE_TOO_LARGE: Final = "trace_too_large"
DROP_TOO_MANY_STAGES: Final = "too_many_stages"
DROP_LATE: Final = "late"
DROP_ORPHAN_STAGE: Final = "orphan_stage"
DROP_INCOMPLETE_TRACE: Final = "incomplete_trace"
#: a stage span lying wholly outside its request's time (clock skew between processes, a
#: stage recorded after the request ended): the stage is absent from that request (§6)
DROP_OUTSIDE_REQUEST: Final = "outside_request"
#: links of a batch stage span beyond the collector's ``max_links_per_span``, counted once
#: per link: the members they name lack that stage (the span itself is kept)
DROP_TOO_MANY_LINKS: Final = "too_many_links"
#: spans still held when the collector stopped and its flush ran out of time
DROP_SHUTDOWN: Final = "shutdown"
#: a compact step span (§14) whose arrays are missing, of unequal lengths, or hold values
#: no step can have (negative, not finite, outside the span): none of its steps is read
DROP_INVALID_STEPS: Final = "invalid_steps"
#: Service label of the series that (service, model) pairs beyond the cardinality cap fold into.
OVERFLOW_SERIES: Final = "__overflow__"

QUANTILES: Final = (0.5, 0.95, 0.99)

# --- §6 Verdicts -------------------------------------------------------------------

VERDICT_BATCHING: Final = "batching"
VERDICT_HOST: Final = "host"
VERDICT_TRANSFER: Final = "transfer"
VERDICT_RUNTIME: Final = "runtime"
VERDICT_KERNEL: Final = "kernel"
VERDICT_HARDWARE: Final = "hardware"
VERDICT_NETWORK: Final = "network"
VERDICT_UNKNOWN: Final = "unknown"
VERDICTS: Final = (
    VERDICT_BATCHING,
    VERDICT_HOST,
    VERDICT_TRANSFER,
    VERDICT_RUNTIME,
    VERDICT_KERNEL,
    VERDICT_HARDWARE,
    VERDICT_NETWORK,
    VERDICT_UNKNOWN,
)

# --- §7 Generation, and inferprof's encoding of it (§14) ---------------------------------

#: Token counts on a generating request span (§7).
ATTR_TOKENS_PROMPT: Final = "inferprof.tokens.prompt"
ATTR_TOKENS_OUTPUT: Final = "inferprof.tokens.output"
#: Request span (§14): for each output chunk that left the service, its time in seconds
#: since the request span's start (double[]); the first one is the ttft.
ATTR_GEN_EMIT_OFFSETS_S: Final = "inferprof.gen.emit_offsets_s"
#: Request span (§14): tokens carried by each chunk (int[], same length); absent: 1 each.
ATTR_GEN_EMIT_TOKENS: Final = "inferprof.gen.emit_tokens"
#: Request span (§14): consecutive chunk pairs merged to stay within GEN_MAX_EMIT_ENTRIES.
ATTR_GEN_EMIT_MERGED: Final = "inferprof.gen.emit_merged"
#: Most entries ``inferprof.gen.emit_offsets_s`` carries (§14).
GEN_MAX_EMIT_ENTRIES: Final = 16384
#: Request span (§14): times the request was evicted from the KV cache (0: absent).
ATTR_GEN_PREEMPTIONS: Final = "inferprof.gen.preemptions"
#: Request span and engine step spans (§14): the engine instance within the service
#: instance; joins a request to its engine's steps. Absent: "0".
ATTR_ENGINE_ID: Final = "inferprof.engine.id"
DEFAULT_ENGINE_ID: Final = "0"
#: ``prefill`` stage spans (§14).
ATTR_PREFILL_TOKENS: Final = "inferprof.prefill.tokens"
ATTR_PREFILL_CHUNKS: Final = "inferprof.prefill.chunks"
ATTR_PREFILL_RECOMPUTE: Final = "inferprof.prefill.recompute"
#: Engine step spans (§14): one root span per engine step, a trace of its own.
ENGINE_STEP_SPAN_NAME: Final = "inferprof.engine_step"
ATTR_STEP_PREFILL_TOKENS: Final = "inferprof.step.prefill_tokens"
ATTR_STEP_DECODE_TOKENS: Final = "inferprof.step.decode_tokens"
ATTR_STEP_REQUESTS: Final = "inferprof.step.requests"
ATTR_STEP_KV_CACHE_USAGE: Final = "inferprof.step.kv_cache.usage"
#: Compact step spans (§14): one root span carrying many steps of one engine as arrays
#: (production mode's encoding), entry i of each array is step i.
ENGINE_STEPS_SPAN_NAME: Final = "inferprof.engine_steps"
#: Step starts, in seconds since the span's start (double[]).
ATTR_STEPS_START_OFFSETS_S: Final = "inferprof.steps.start_offsets_s"
#: Step durations in seconds (double[]).
ATTR_STEPS_DURATIONS_S: Final = "inferprof.steps.durations_s"
ATTR_STEPS_PREFILL_TOKENS: Final = "inferprof.steps.prefill_tokens"
ATTR_STEPS_DECODE_TOKENS: Final = "inferprof.steps.decode_tokens"
ATTR_STEPS_REQUESTS: Final = "inferprof.steps.requests"
#: KV-cache usage at each step's start (double[], 0..1; an entry outside 0..1: no reading).
ATTR_STEPS_KV_CACHE_USAGE: Final = "inferprof.steps.kv_cache.usage"
#: Most steps one compact step span may carry (§14); the collector rejects a longer one.
MAX_STEPS_PER_SPAN: Final = 65536
#: KV-cache gauge (§14): blocks in use over blocks in total, 0..1, attribute
#: ``inferprof.engine.id``, joined by time like the GPU samples.
METRIC_ENGINE_KV_CACHE_USAGE: Final = "inferprof.engine.kv_cache.usage"

#: Engines' own request spans (§7): vLLM's ``llm_request``, SGLang's request span.
GEN_AI_REQUEST_SPAN_NAME: Final = "llm_request"
ATTR_GEN_AI_LATENCY_TIME_IN_QUEUE: Final = "gen_ai.latency.time_in_queue"
ATTR_GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: Final = "gen_ai.latency.time_to_first_token"
ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: Final = "gen_ai.latency.time_in_model_prefill"
ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: Final = "gen_ai.latency.time_in_model_decode"
ATTR_GEN_AI_LATENCY_E2E: Final = "gen_ai.latency.e2e"
ATTR_GEN_AI_USAGE_PROMPT_TOKENS: Final = "gen_ai.usage.prompt_tokens"
ATTR_GEN_AI_USAGE_COMPLETION_TOKENS: Final = "gen_ai.usage.completion_tokens"
#: The model an engine's request span names (read when ``inferprof.model.name`` is absent).
ATTR_GEN_AI_RESPONSE_MODEL: Final = "gen_ai.response.model"
ATTR_GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"

#: Causes of ``itl.share_of_p95`` (§7), in the breakdown's order.
ITL_CAUSE_DECODE: Final = "decode"
ITL_CAUSE_PREFILL_INTERFERENCE: Final = "prefill_interference"
ITL_CAUSE_PREEMPTED: Final = "preempted"
ITL_CAUSE_HOST: Final = "host"
ITL_CAUSE_UNATTRIBUTED: Final = "unattributed"
ITL_CAUSES: Final = (
    ITL_CAUSE_DECODE,
    ITL_CAUSE_PREFILL_INTERFERENCE,
    ITL_CAUSE_PREEMPTED,
    ITL_CAUSE_HOST,
    ITL_CAUSE_UNATTRIBUTED,
)

#: Generation outputs (§7).
PROM_TTFT: Final = "inferprof_ttft_seconds"
PROM_ITL: Final = "inferprof_itl_seconds"
PROM_TPOT: Final = "inferprof_tpot_seconds"
PROM_TTFT_SHARE_OF_P95: Final = "inferprof_ttft_share_of_p95"
PROM_ITL_SHARE_OF_P95: Final = "inferprof_itl_share_of_p95"
PROM_GEN_AI_TTFT: Final = "gen_ai_server_time_to_first_token_seconds"
PROM_GEN_AI_TPOT: Final = "gen_ai_server_time_per_output_token_seconds"
PROM_GEN_AI_REQUEST_DURATION: Final = "gen_ai_server_request_duration_seconds"
PROM_LABEL_CAUSE: Final = "cause"
#: Engine step spans (§14) received, joined to requests or not.
PROM_ENGINE_STEPS_RECEIVED: Final = "inferprof_engine_steps_received_total"

#: Generation verdict classes (§7), besides §6's.
VERDICT_KV_CACHE: Final = "kv_cache"
VERDICT_SCHEDULING: Final = "scheduling"
GENERATION_VERDICTS: Final = (VERDICT_KV_CACHE, VERDICT_SCHEDULING)

# --- In-process instrumentation (extensions beyond the v1 contract) -----------

#: Name of the request span opened by ``inferprof.request()`` when none is given.
REQUEST_SPAN_NAME: Final = "inferprof.request"
#: Instrumentation scope of every span inferprof's in-process half emits.
INSTRUMENTATION_SCOPE: Final = "inferprof"
#: Opt-in only (``record_content=True``): a prefix of the request / response body.
ATTR_REQUEST_BODY: Final = "inferprof.request.body"
ATTR_RESPONSE_BODY: Final = "inferprof.response.body"
#: Stages past the per-request (per-batch) cap that were timed but not recorded.
ATTR_STAGES_DROPPED: Final = "inferprof.stages.dropped"
#: Set on a request span whose request was cancelled (client went away, task cancelled).
ATTR_CANCELLED: Final = "inferprof.cancelled"
#: Batch-stage encodings (§2): a copy under every member, or one span with links.
BATCH_ENCODING_CHILDREN: Final = "children"
BATCH_ENCODING_LINKS: Final = "links"
BATCH_ENCODINGS: Final = (BATCH_ENCODING_CHILDREN, BATCH_ENCODING_LINKS)
#: Instrumentation modes.
MODE_FULL: Final = "full"
MODE_PRODUCTION: Final = "production"
MODE_OFF: Final = "off"
MODES: Final = (MODE_FULL, MODE_PRODUCTION, MODE_OFF)
#: Self-metrics of the in-process half (OTel instruments).
METRIC_SPANS_DROPPED: Final = "inferprof.spans.dropped"
METRIC_SPANS_EMITTED: Final = "inferprof.spans.emitted"
ATTR_DROP_REASON: Final = "reason"
DROP_REASON_QUEUE_FULL: Final = "queue_full"
DROP_REASON_EXPORT_FAILED: Final = "export_failed"
DROP_REASON_SHUTDOWN: Final = "shutdown"

# --- In-process summaries (contract §15; extensions beyond the v1 contract) -------------

#: Summaries of every timed request, OTLP exponential histograms with DELTA temporality.
METRIC_SUMMARY_REQUEST_DURATION: Final = "inferprof.summary.request.duration"
METRIC_SUMMARY_STAGE_DURATION: Final = "inferprof.summary.stage.duration"
METRIC_SUMMARY_STAGE_TAIL: Final = "inferprof.summary.stage.tail"
#: Requests a timing budget left untimed, counted at their end-to-end latency (§15).
METRIC_SUMMARY_REQUEST_UNTIMED: Final = "inferprof.summary.request.untimed"
SUMMARY_METRICS: Final = (
    METRIC_SUMMARY_REQUEST_DURATION,
    METRIC_SUMMARY_STAGE_DURATION,
    METRIC_SUMMARY_STAGE_TAIL,
    METRIC_SUMMARY_REQUEST_UNTIMED,
)
#: Data points of requests that ended in error (on the request-duration metric).
ATTR_REQUEST_ERROR: Final = "inferprof.request.error"
#: On a kept request span: the request is counted by the summaries, not by its trace.
ATTR_SUMMARY_COUNTED: Final = "inferprof.summary.counted"
#: On a request-duration data point: its requests count once in request-level figures
#: (their untimed siblings are counted in METRIC_SUMMARY_REQUEST_UNTIMED).
ATTR_SUMMARY_UNTIMED_COUNTED: Final = "inferprof.summary.untimed_counted"

# --- Triton client wrapper (inferprof.triton; extensions beyond the v1 contract) --------

#: Model name and version a Triton call's ``network`` stage asked Triton for (the request
#: span's own ``inferprof.model.name`` stays the application's to set).
ATTR_TRITON_MODEL_NAME: Final = "inferprof.triton.model.name"
ATTR_TRITON_MODEL_VERSION: Final = "inferprof.triton.model.version"
#: The client's protocol: ``http`` or ``grpc``.
ATTR_TRITON_PROTOCOL: Final = "inferprof.triton.protocol"
#: Binary tensor data the call sent / received (``inferprof.bytes`` holds their sum).
ATTR_TRITON_REQUEST_BYTES: Final = "inferprof.triton.request.bytes"
ATTR_TRITON_RESPONSE_BYTES: Final = "inferprof.triton.response.bytes"
#: Streams: inference requests sent and responses received on the stream.
ATTR_TRITON_STREAM_REQUESTS: Final = "inferprof.triton.stream.requests"
ATTR_TRITON_STREAM_RESPONSES: Final = "inferprof.triton.stream.responses"
TRITON_PROTOCOL_HTTP: Final = "http"
TRITON_PROTOCOL_GRPC: Final = "grpc"

__all__ = [name for name in dir() if name.isupper()] + ["span_name", "validate_stage"]
