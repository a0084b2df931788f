"""Reading generating requests off spans (contract §7, inferprof's encoding in §14).

What trace assembly needs to know about generation, and nothing more: which attribute keys
to keep, how to read the array attributes, which spans are engine steps, and the stages an
engine's own request span (vLLM's ``llm_request``, SGLang's) stands for. The folding into
ttft/itl/tpot figures is ``generation``'s.
"""

from __future__ import annotations

import math
from array import array
from typing import Any

import numpy as np

from inferprof import semconv as sc

#: Request-span attributes of generation (§14 and the engines' ``gen_ai.*``, §7).
REQUEST_KEYS = frozenset(
    {
        sc.ATTR_TOKENS_PROMPT,
        sc.ATTR_TOKENS_OUTPUT,
        sc.ATTR_GEN_EMIT_OFFSETS_S,
        sc.ATTR_GEN_EMIT_TOKENS,
        sc.ATTR_GEN_EMIT_MERGED,
        sc.ATTR_GEN_PREEMPTIONS,
        sc.ATTR_ENGINE_ID,
        sc.ATTR_CANCELLED,
        sc.ATTR_GEN_AI_LATENCY_TIME_IN_QUEUE,
        sc.ATTR_GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN,
        sc.ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL,
        sc.ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_DECODE,
        sc.ATTR_GEN_AI_LATENCY_E2E,
        sc.ATTR_GEN_AI_USAGE_PROMPT_TOKENS,
        sc.ATTR_GEN_AI_USAGE_COMPLETION_TOKENS,
        sc.ATTR_GEN_AI_RESPONSE_MODEL,
        sc.ATTR_GEN_AI_REQUEST_MODEL,
    }
)
#: Compact step-span arrays (§14).
STEPS_ARRAY_KEYS = frozenset(
    {
        sc.ATTR_STEPS_START_OFFSETS_S,
        sc.ATTR_STEPS_DURATIONS_S,
        sc.ATTR_STEPS_PREFILL_TOKENS,
        sc.ATTR_STEPS_DECODE_TOKENS,
        sc.ATTR_STEPS_REQUESTS,
        sc.ATTR_STEPS_KV_CACHE_USAGE,
    }
)
#: Engine step-span attributes (§14), per-step and compact.
STEP_KEYS = frozenset(
    {
        sc.ATTR_STEP_PREFILL_TOKENS,
        sc.ATTR_STEP_DECODE_TOKENS,
        sc.ATTR_STEP_REQUESTS,
        sc.ATTR_STEP_KV_CACHE_USAGE,
        *STEPS_ARRAY_KEYS,
    }
)
ARRAY_KEYS = frozenset({sc.ATTR_GEN_EMIT_OFFSETS_S, sc.ATTR_GEN_EMIT_TOKENS, *STEPS_ARRAY_KEYS})
#: Keys that name a model and nothing else: alone, they do not make a span a request.
_MODEL_KEYS = frozenset({sc.ATTR_GEN_AI_RESPONSE_MODEL, sc.ATTR_GEN_AI_REQUEST_MODEL})
#: Keys whose presence makes a request a generating one.
_GENERATING_KEYS = frozenset(
    {
        sc.ATTR_GEN_EMIT_OFFSETS_S,
        sc.ATTR_TOKENS_OUTPUT,
        sc.ATTR_GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN,
        sc.ATTR_GEN_AI_USAGE_COMPLETION_TOKENS,
    }
)
_ENGINE_LATENCY_KEYS = frozenset(
    {
        sc.ATTR_GEN_AI_LATENCY_TIME_IN_QUEUE,
        sc.ATTR_GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN,
        sc.ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL,
        sc.ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_DECODE,
        sc.ATTR_GEN_AI_LATENCY_E2E,
    }
)
_STEP_MARKS = (sc.ATTR_STEP_DECODE_TOKENS, sc.ATTR_STEP_PREFILL_TOKENS, sc.ATTR_STEP_REQUESTS,
               sc.ATTR_STEPS_START_OFFSETS_S, sc.ATTR_STEPS_DURATIONS_S)
_NS = 1e9
#: Longest duration read off an engine's span (s): its nanoseconds added to a span's start
#: stay within int64 (about 146 years); a larger value is malformed, not a latency.
MAX_SECONDS = 2.0**62 / _NS
#: One double-valued AnyValue inside an ArrayValue, serialized: field 1 (values), length
#: 9, field 4 (double_value, fixed64), the little-endian double.
_DOUBLE_RECORD = np.dtype([("head", "V3"), ("value", "<f8")])
_DOUBLE_HEAD = np.frombuffer(bytes([0x0A, 0x09, 0x21]), "V3")[0]
#: One int-valued AnyValue below 128: field 1, length 2, field 3 (int_value, varint), 1 byte.
_SMALL_INT_RECORD = np.dtype([("head", "V3"), ("value", "u1")])
_SMALL_INT_HEAD = np.frombuffer(bytes([0x0A, 0x02, 0x18]), "V3")[0]


_DOUBLES = frozenset({"double_value"})
_INTS = frozenset({"int_value"})
_NUMBERS = _DOUBLES | _INTS


def array_value(v: Any) -> array[float] | None:
    """An OTLP array attribute of numbers (ints, doubles or both) as ``array('d')``; None
    for anything else (a bool, a string, ... in it)."""
    if v.WhichOneof("value") != "array_value":
        return None
    arr = v.array_value
    # Fast path: an array of doubles only is, on the wire, one 11-byte record per value
    # (AnyValue field tag, length 9, double_value tag, 8 bytes): read it in one numpy call
    # instead of one protobuf object per value.
    raw = arr.SerializeToString()
    if raw and len(raw) % _DOUBLE_RECORD.itemsize == 0:
        rec = np.frombuffer(raw, _DOUBLE_RECORD)
        if (rec["head"] == _DOUBLE_HEAD).all():
            return array("d", rec["value"].tobytes())
    # Likewise small ints (0..127, tokens per chunk): 4 bytes each.
    if raw and len(raw) % _SMALL_INT_RECORD.itemsize == 0:
        rec = np.frombuffer(raw, _SMALL_INT_RECORD)
        if (rec["head"] == _SMALL_INT_HEAD).all() and (rec["value"] < 0x80).all():
            return array("d", rec["value"].astype(np.float64).tobytes())
    values = arr.values
    if not values:
        return array("d")
    # Every value's type: one read by the first's type gives 0 for a value of another.
    kinds = {x.WhichOneof("value") for x in values}
    if kinds == _DOUBLES:
        return array("d", [x.double_value for x in values])
    if kinds == _INTS:
        return array("d", [x.int_value for x in values])
    if kinds == _NUMBERS:
        return array("d", [x.double_value if x.WhichOneof("value") == "double_value"
                           else x.int_value for x in values])
    return None


def compact_steps(
    extra: dict[str, Any], start: int, end: int
) -> tuple[np.ndarray, ...] | str | None:
    """A compact step span's steps (§14): (start ns, end ns, prefill tokens, decode tokens,
    KV usage (NaN: no reading)), one entry per step; None for a per-step span; a reason
    (str) when the arrays are malformed (none of its steps is read)."""
    offsets = extra.get(sc.ATTR_STEPS_START_OFFSETS_S)
    durations = extra.get(sc.ATTR_STEPS_DURATIONS_S)
    if offsets is None and durations is None and sc.ATTR_STEPS_START_OFFSETS_S not in extra \
            and sc.ATTR_STEPS_DURATIONS_S not in extra:
        return None
    if offsets is None or durations is None:
        return (f"needs {sc.ATTR_STEPS_START_OFFSETS_S} and {sc.ATTR_STEPS_DURATIONS_S} "
                "as arrays of numbers")
    n = len(offsets)
    if not 0 < n <= sc.MAX_STEPS_PER_SPAN:
        return f"holds {n} steps (1 to {sc.MAX_STEPS_PER_SPAN})"
    cols = [np.frombuffer(offsets, np.float64), np.frombuffer(durations, np.float64)]
    for key in (sc.ATTR_STEPS_PREFILL_TOKENS, sc.ATTR_STEPS_DECODE_TOKENS,
                sc.ATTR_STEPS_KV_CACHE_USAGE):
        if key not in extra:
            cols.append(np.zeros(n) if key != sc.ATTR_STEPS_KV_CACHE_USAGE
                        else np.full(n, np.nan))
            continue
        v = extra[key]
        if v is None:
            return f"{key} is not an array of numbers"
        cols.append(np.frombuffer(v, np.float64))
    # the members' counts: checked as the others (§14), not read
    members = np.zeros(n)
    if sc.ATTR_STEPS_REQUESTS in extra:
        v = extra[sc.ATTR_STEPS_REQUESTS]
        if v is None:
            return f"{sc.ATTR_STEPS_REQUESTS} is not an array of numbers"
        members = np.frombuffer(v, np.float64)
    for key, col in zip((sc.ATTR_STEPS_DURATIONS_S, sc.ATTR_STEPS_PREFILL_TOKENS,
                         sc.ATTR_STEPS_DECODE_TOKENS, sc.ATTR_STEPS_KV_CACHE_USAGE,
                         sc.ATTR_STEPS_REQUESTS),
                        [*cols[1:], members], strict=True):
        if col.size != n:
            return f"{key} has {col.size} entries, {sc.ATTR_STEPS_START_OFFSETS_S} {n}"
    off, dur, p, d, kv = cols
    span_s = (end - start) / _NS
    with np.errstate(invalid="ignore"):
        # the last step ends at the span's end; a few ns of slack for the doubles' rounding
        if not (np.isfinite(off).all() and np.isfinite(dur).all() and (off >= 0).all()
                and (dur >= 0).all() and (off + dur <= span_s + 1e-6).all()):
            return "a step is negative, not finite, or outside the span"
        if not ((p >= 0).all() and (d >= 0).all() and (members >= 0).all()
                and np.isfinite(p).all() and np.isfinite(d).all()
                and np.isfinite(members).all() and (np.floor(p) == p).all()
                and (np.floor(d) == d).all() and (np.floor(members) == members).all()):
            return "a token or request count is negative, fractional or not finite"
    # a start in the slack past the span's end: at its end (a step never ends before it
    # starts)
    st = np.minimum(start + np.rint(off * _NS).astype(np.int64), end)
    en = np.minimum(st + np.rint(dur * _NS).astype(np.int64), end)
    kv = np.where((kv >= 0) & (kv <= 1), kv, np.nan)
    return st, en, p, d, kv


def is_step_span(extra: dict[str, Any], stage: Any, parent: bytes) -> bool:
    """An engine step span (a root span with step attributes), or a stage of one (a
    stage span with ``inferprof.engine.id`` and a parent: request stages never carry it)."""
    if stage is None:
        return not parent and any(k in extra for k in _STEP_MARKS)
    return bool(parent) and sc.ATTR_ENGINE_ID in extra


def marks_request(extra: dict[str, Any] | None) -> bool:
    """Whether a request span's attributes make it an inference request on their own."""
    if not extra:
        return False
    return not extra.keys() <= _MODEL_KEYS


def is_engine_request(extra: dict[str, Any]) -> bool:
    """An engine's own request span (vLLM, SGLang): it carries ``gen_ai.latency.*``
    seconds. A request-span candidate whatever its kind (§14)."""
    return not _ENGINE_LATENCY_KEYS.isdisjoint(extra)


def is_generating(extra: dict[str, Any]) -> bool:
    return not _GENERATING_KEYS.isdisjoint(extra)


def model_of(extra: dict[str, Any]) -> Any:
    """The model an engine's request span names, when ``inferprof.model.name`` is absent."""
    model = extra.get(sc.ATTR_GEN_AI_RESPONSE_MODEL)
    return model if model is not None else extra.get(sc.ATTR_GEN_AI_REQUEST_MODEL)


def seconds(extra: dict[str, Any], key: str) -> float | None:
    """A non-negative finite number of seconds (at most ``MAX_SECONDS``), or None."""
    v = extra.get(key)
    if isinstance(v, (float, int)) and not isinstance(v, bool) and math.isfinite(v) \
            and 0 <= v <= MAX_SECONDS:
        return float(v)
    return None


def count(extra: dict[str, Any], key: str) -> int | None:
    v = extra.get(key)
    if type(v) is int and v >= 0:
        return v
    if type(v) is float and v.is_integer() and v >= 0:
        return int(v)
    return None


def derived_stages(
    start: int, end: int, extra: dict[str, Any]
) -> list[tuple[str, int, int]] | None:
    """The ``queue``, ``prefill`` and ``decode`` of an engine's request span from its
    ``gen_ai.latency.*`` seconds (§14): anchored on the first token where the span gives
    the ttft, else one after the other from the span's start. None: no such attribute."""
    queue = seconds(extra, sc.ATTR_GEN_AI_LATENCY_TIME_IN_QUEUE)
    prefill = seconds(extra, sc.ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL)
    decode = seconds(extra, sc.ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_DECODE)
    if queue is None and prefill is None and decode is None:
        return None
    ttft = seconds(extra, sc.ATTR_GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN)
    if ttft is not None:
        first = start + round(ttft * _NS)
        prefill_start = first - round((prefill or 0.0) * _NS)
        queue_start = prefill_start - round((queue or 0.0) * _NS)
    else:
        queue_start = start
        prefill_start = queue_start + round((queue or 0.0) * _NS)
        first = prefill_start + round((prefill or 0.0) * _NS)
    out = []
    for name, s, d in (
        (sc.STAGE_QUEUE, queue_start, queue),
        (sc.STAGE_PREFILL, prefill_start, prefill),
        (sc.STAGE_DECODE, first, decode),
    ):
        if d is not None:
            e = min(s + round(d * _NS), end)
            s = max(s, start)
            if e >= s:
                out.append((name, s, e))
    return out


__all__ = [
    "ARRAY_KEYS",
    "REQUEST_KEYS",
    "STEP_KEYS",
    "array_value",
    "compact_steps",
    "count",
    "derived_stages",
    "is_generating",
    "is_step_span",
    "marks_request",
    "model_of",
    "seconds",
]
