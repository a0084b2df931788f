"""Synthetic generation traces (contract §7, inferprof's encoding §14, and vLLM-shaped
spans) with their exact truth, for collector tests.

``simulate`` runs a toy continuous-batching engine: one step after another on one engine,
each step's prefill and decode token counts given, its duration growing with the prefill
it carries. Requests arrive, queue, prefill in one step, then emit one token per step
(some steps emit two tokens in one chunk), may be evicted and re-admitted. Every figure the
collector reports is also computed here, directly, from the same request timelines:
``truth_*`` use plain loops and ``numpy`` (never the collector's code).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.trace.v1 import trace_pb2

from inferprof import semconv as sc
from inferprof.collector.decode import decode_request
from inferprof.collector.sketch import exact_weighted_quantile
from tests.collector.synth import SERVER, TraceBuilder, new_span_id, new_trace_id

_FLAG_HAS_IS_REMOTE = 0x100
_FLAG_IS_REMOTE = 0x200


@dataclass
class Step:
    start: float
    end: float
    prefill: int
    decode: int
    kv: float | None = None


@dataclass
class GenRequest:
    start: float
    end: float
    weight: float
    offsets: list[float]  # seconds from start
    tokens: list[int]  # per chunk
    stages: list[tuple[str, float, float]] = field(default_factory=list)  # absolute s
    preemptions: int = 0
    cancelled: bool = False
    prompt: int = 100

    @property
    def ttft(self) -> float:
        return self.offsets[0]

    @property
    def output(self) -> int:
        return sum(self.tokens)


@dataclass
class Scenario:
    steps: list[Step]
    requests: list[GenRequest]


def simulate(
    rng: np.random.Generator,
    *,
    n_requests: int = 300,
    n_steps: int = 4000,
    prefill_every: float = 0.1,
    prefill_tokens: int = 512,
    decode_s: float = 0.004,
    prefill_s_per_token: float = 0.00004,
    host_s: float = 0.0005,
    queue_s: float = 0.005,
    preempt_prob: float = 0.0,
    kv: float | None = None,
    weights: tuple[float, ...] = (1.0,),
    cancel_prob: float = 0.0,
    output_tokens: tuple[int, int] = (2, 60),
) -> Scenario:
    """Steps back to back with ``host_s`` between them; a share ``prefill_every`` of them
    carries a prefill chunk of ``prefill_tokens`` (other requests' prompts). Requests arrive
    spread over the run, wait about ``queue_s`` (exponential), prefill in the next step,
    then emit a token at the end of each later step (+ ``host_s``/2), sometimes two in one
    chunk; with ``preempt_prob`` a request is evicted for 20-60 steps once. Output lengths
    are uniform in ``output_tokens`` (high end excluded)."""
    steps: list[Step] = []
    t = 0.0
    for _ in range(n_steps):
        p = prefill_tokens if rng.random() < prefill_every else 0
        n = int(rng.integers(4, 32))
        d = decode_s * (1 + 0.1 * rng.random()) + p * prefill_s_per_token
        usage = None if kv is None else float(np.clip(kv + 0.04 * rng.standard_normal(), 0, 1))
        steps.append(Step(t, t + d, p, n, usage))
        t += d + host_s
    starts = [s.start for s in steps]
    horizon = steps[-200].start
    requests = []
    for _ in range(n_requests):
        start = float(rng.uniform(0.0, horizon * 0.8))
        wait = float(rng.exponential(queue_s))
        j = bisect.bisect_left(starts, start + wait)
        prefill_step = steps[j]
        stages = [("queue", start, prefill_step.start), ("prefill", prefill_step.start,
                                                           prefill_step.end)]
        out = int(rng.integers(*output_tokens))
        emits: list[float] = [prefill_step.end + host_s / 2]
        tokens = [1]
        j += 1
        preempted = False
        decode_start = emits[0]
        preemptions = 0
        while sum(tokens) < out and j < len(steps) - 1:
            if not preempted and rng.random() < preempt_prob / 10:
                # Evicted after step j-1: re-admitted (recompute prefill) later.
                preempted = True
                preemptions += 1
                back = j + int(rng.integers(20, 60))
                if back >= len(steps) - 1:
                    break
                stages.append(("decode", decode_start, emits[-1]))
                stages.append(("preempted", steps[j - 1].end, steps[back].start))
                stages.append(("prefill", steps[back].start, steps[back].end))
                j = back
                emits.append(steps[j].end + host_s / 2)
                tokens.append(1)
                decode_start = emits[-1]
                j += 1
                continue
            emit = steps[j].end + host_s / 2
            if rng.random() < 0.1 and sum(tokens) + 2 <= out and j + 1 < len(steps) - 1:
                j += 1  # two tokens leave in one chunk, at the later step
                emit = steps[j].end + host_s / 2
                tokens.append(2)
            else:
                tokens.append(1)
            emits.append(emit)
            j += 1
        stages.append(("decode", decode_start, emits[-1]))
        end = emits[-1] + host_s
        requests.append(
            GenRequest(
                start=start,
                end=end,
                weight=float(rng.choice(weights)),
                offsets=[e - start for e in emits],
                tokens=tokens,
                stages=stages,
                preemptions=preemptions,
                cancelled=bool(rng.random() < cancel_prob),
                prompt=int(rng.integers(10, 400)),
            )
        )
    return Scenario(steps, requests)


def any_value(value) -> AnyValue:
    if isinstance(value, (list, tuple)):
        return AnyValue(array_value=ArrayValue(values=[any_value(v) for v in value]))
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    return AnyValue(string_value=str(value))


def _attrs(mapping: dict) -> list[KeyValue]:
    return [KeyValue(key=k, value=any_value(v)) for k, v in mapping.items() if v is not None]


def inferprof_exports(
    sc_: Scenario, *, service: str = "llm", model: str = "m", engine_id: str | None = None,
    steps: bool = True, per_export: int = 200, compact: int = 0,
) -> list:
    """The scenario as inferprof's producer exports it (§14), in several OTLP exports:
    step spans first (they end first), then the requests. ``compact`` > 0: the steps as
    compact step spans of that many steps each (production mode's encoding)."""
    b = TraceBuilder(service)
    out = []
    if steps and compact:
        for i in range(0, len(sc_.steps), compact):
            group = sc_.steps[i:i + compact]
            ns = [(b.ns(s.start), b.ns(s.end)) for s in group]
            first = min(a for a, _ in ns)
            ref = b.span(sc.ENGINE_STEPS_SPAN_NAME, group[0].start,
                         max(s.end for s in group))
            pb = b.spans[-1]
            pb.start_time_unix_nano = first
            pb.end_time_unix_nano = max(e for _, e in ns)
            del pb.attributes[:]
            pb.attributes.extend(_attrs({
                sc.ATTR_ENGINE_ID: engine_id,
                sc.ATTR_STEPS_START_OFFSETS_S: [(a - first) / 1e9 for a, _ in ns],
                sc.ATTR_STEPS_DURATIONS_S: [(e - a) / 1e9 for a, e in ns],
                sc.ATTR_STEPS_PREFILL_TOKENS: [s.prefill for s in group],
                sc.ATTR_STEPS_DECODE_TOKENS: [s.decode for s in group],
                sc.ATTR_STEPS_REQUESTS: [s.decode + (1 if s.prefill else 0) for s in group],
                sc.ATTR_STEPS_KV_CACHE_USAGE: [s.kv if s.kv is not None else -1.0
                                               for s in group],
            }))
            del ref
            if len(b.spans) >= per_export:
                out.append(b.export())
    elif steps:
        for s in sc_.steps:
            _span(b, sc.ENGINE_STEP_SPAN_NAME, s.start, s.end, None, {
                sc.ATTR_ENGINE_ID: engine_id,
                sc.ATTR_STEP_PREFILL_TOKENS: s.prefill,
                sc.ATTR_STEP_DECODE_TOKENS: s.decode,
                sc.ATTR_STEP_REQUESTS: s.decode + (1 if s.prefill else 0),
                sc.ATTR_STEP_KV_CACHE_USAGE: s.kv,
            })
            if len(b.spans) >= per_export:
                out.append(b.export())
    for r in sc_.requests:
        attrs = {
            sc.ATTR_MODEL_NAME: model,
            sc.ATTR_SAMPLE_WEIGHT: r.weight if r.weight != 1.0 else None,
            sc.ATTR_TOKENS_PROMPT: r.prompt,
            sc.ATTR_TOKENS_OUTPUT: r.output,
            sc.ATTR_GEN_EMIT_OFFSETS_S: list(r.offsets),
            sc.ATTR_GEN_EMIT_TOKENS: list(r.tokens) if any(k != 1 for k in r.tokens) else None,
            sc.ATTR_ENGINE_ID: engine_id,
            sc.ATTR_GEN_PREEMPTIONS: r.preemptions or None,
            sc.ATTR_CANCELLED: True if r.cancelled else None,
        }
        req = _span(b, "POST /v1/completions", r.start, r.end, None, attrs, kind=SERVER)
        for name, s, e in r.stages:
            _span(b, sc.span_name(name), s, e, req, {sc.ATTR_STAGE: name})
        if len(b.spans) >= per_export:
            out.append(b.export())
    if b.spans:
        out.append(b.export())
    return out


def vllm_exports(sc_: Scenario, *, service: str = "vllm", model: str = "meta/llama",
                 flags: str = "remote") -> list:
    """Each request as vLLM's output processor builds its span (``do_tracing``): a SERVER
    span ``llm_request`` started at the arrival time, child of the caller's remote span
    (``flags``: "remote" marks the parent remote in the OTLP flags; "absent" leaves the
    flags unset and the parent span is never sent), with ``gen_ai.*`` latencies as
    doubles in seconds and token counts as ints, and no child span."""
    b = TraceBuilder(service, scope="vllm.llm_engine")
    for r in sc_.requests:
        queue = next(s for s in r.stages if s[0] == "queue")
        prefill = next(s for s in r.stages if s[0] == "prefill")
        first = r.start + r.ttft
        last = r.start + r.offsets[-1]
        attrs = {
            "gen_ai.response.model": model,
            "gen_ai.request.id": f"cmpl-{id(r)}",
            "gen_ai.request.temperature": 0.7,
            "gen_ai.request.max_tokens": 64,
            sc.ATTR_GEN_AI_USAGE_PROMPT_TOKENS: r.prompt,
            sc.ATTR_GEN_AI_USAGE_COMPLETION_TOKENS: r.output,
            sc.ATTR_GEN_AI_LATENCY_TIME_IN_QUEUE: float(queue[2] - queue[1]),
            sc.ATTR_GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: float(r.ttft),
            sc.ATTR_GEN_AI_LATENCY_E2E: float(r.end - r.start),
            sc.ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: float(first - prefill[1]),
            sc.ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: float(last - first),
            "gen_ai.latency.time_in_model_inference": float(last - prefill[1]),
        }
        caller = trace_pb2.Span(trace_id=new_trace_id(), span_id=new_span_id())
        span = _span(b, sc.GEN_AI_REQUEST_SPAN_NAME, r.start, r.end, None, attrs, kind=SERVER)
        pb = b.spans[-1]
        pb.trace_id = caller.trace_id
        pb.parent_span_id = caller.span_id
        if flags == "remote":
            pb.flags = 0x01 | _FLAG_HAS_IS_REMOTE | _FLAG_IS_REMOTE
        del span
    return [b.export()]


def _span(b: TraceBuilder, name, start, end, parent, attrs, kind=trace_pb2.Span.SPAN_KIND_INTERNAL):
    ref = b.span(name, start, end, parent=parent, kind=kind)
    pb = b.spans[-1]
    del pb.attributes[:]
    pb.attributes.extend(_attrs(attrs))
    return ref


def through_the_wire(export) -> object:
    """An export as the HTTP receiver decodes it (protobuf bytes in, message out)."""
    body = export.SerializeToString()
    msg, _ = decode_request(
        body, content_type="application/x-protobuf", content_encoding=None,
        signal=sc.SIGNAL_TRACES, max_bytes=1 << 30,
    )
    return msg


# --- truth ----------------------------------------------------------------------------------


def quantiles(values, weights) -> dict:
    return {name: exact_weighted_quantile(values, weights, q)
            for name, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))}


def truth_ttft(sc_: Scenario) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([r.ttft for r in sc_.requests]), np.array([r.weight for r in sc_.requests]))


def truth_tpot(sc_: Scenario) -> tuple[np.ndarray, np.ndarray]:
    rs = [r for r in sc_.requests if r.output >= 2]
    return (np.array([(r.end - r.start - r.ttft) / (r.output - 1) for r in rs]),
            np.array([r.weight for r in rs]))


def truth_itl(sc_: Scenario) -> tuple[np.ndarray, np.ndarray, list]:
    """Every itl value, its weight, and (request, gap index) of each."""
    vals, ws, where = [], [], []
    for i, r in enumerate(sc_.requests):
        for g in range(1, len(r.offsets)):
            k = r.tokens[g]
            gap = r.offsets[g] - r.offsets[g - 1]
            for _ in range(k):
                vals.append(gap / k)
                ws.append(r.weight)
                where.append((i, g))
    return np.array(vals), np.array(ws), where


def truth_ttft_shares(sc_: Scenario) -> dict[str, float]:
    v, w = truth_ttft(sc_)
    p95 = exact_weighted_quantile(v, w, 0.95)
    num: dict[str, float] = {}
    den = 0.0
    for r in sc_.requests:
        if r.ttft < p95:
            continue
        first = r.start + r.ttft
        covered = 0.0
        for name, s, e in r.stages:
            x = max(0.0, min(e, first) - max(s, r.start))
            num[name] = num.get(name, 0.0) + r.weight * x
            covered += x
        num["unattributed"] = num.get("unattributed", 0.0) + r.weight * (r.ttft - covered)
        den += r.weight * r.ttft
    return {k: x / den for k, x in num.items()}


def _overlap(a, b, s, e) -> float:
    return max(0.0, min(b, e) - max(a, s))


def truth_itl_shares(sc_: Scenario, *, with_steps: bool = True) -> dict[str, float]:
    """§14's gap attribution, one gap at a time with plain interval arithmetic."""
    vals, ws, _ = truth_itl(sc_)
    p95 = exact_weighted_quantile(vals, ws, 0.95)
    starts = [s.start for s in sc_.steps]
    num = dict.fromkeys(sc.ITL_CAUSES, 0.0)
    den = 0.0
    for r in sc_.requests:
        # an eviction's cost: the wait, and the recomputed prompt after the first token
        pre = [(s, e) for name, s, e in r.stages
               if name == "preempted" or (name == "prefill" and s >= r.start + r.ttft)]
        for g in range(1, len(r.offsets)):
            k = r.tokens[g]
            a, b = r.start + r.offsets[g - 1], r.start + r.offsets[g]
            if (b - a) / k < p95:
                continue
            gap = b - a
            in_pre = sum(_overlap(a, b, s, e) for s, e in pre)
            dec = pf = 0.0
            touched = False
            if with_steps:
                lo = max(0, bisect.bisect_left(starts, a) - 1)
                for st in sc_.steps[lo:bisect.bisect_right(starts, b) + 1]:
                    x = _overlap(a, b, st.start, st.end)
                    if st.start < b and st.end > a:
                        touched = True
                    if x <= 0:
                        continue
                    x -= sum(_overlap(max(a, st.start), min(b, st.end), s, e) for s, e in pre)
                    tot = st.prefill + st.decode
                    pf += x * st.prefill / tot if tot else 0.0
                    dec += x - (x * st.prefill / tot if tot else 0.0)
            other = gap - in_pre - dec - pf
            num["preempted"] += r.weight * in_pre
            num["decode"] += r.weight * dec
            num["prefill_interference"] += r.weight * pf
            num["host" if touched else "unattributed"] += r.weight * other
            den += r.weight * gap
    return {k: x / den for k, x in num.items()}


__all__ = [
    "GenRequest",
    "Scenario",
    "Step",
    "inferprof_exports",
    "quantiles",
    "simulate",
    "through_the_wire",
    "truth_itl",
    "truth_itl_shares",
    "truth_tpot",
    "truth_ttft",
    "truth_ttft_shares",
    "vllm_exports",
]
