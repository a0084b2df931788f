"""What one ``Assembler.advance`` call hands the engine: the requests it finalised, as
columns (:class:`Finalised`), and how a request span's row fields are read
(:func:`request_fields`: model, sample weight, error, counted, prompt tokens)."""

from __future__ import annotations

from array import array
from typing import Any

from inferprof import semconv as sc
from inferprof.collector import gen_spans as _gen
from inferprof.collector.traces import FLAG_ERROR

#: Stages whose spans carry a batch's padding figures.
PADDING_STAGES = frozenset({sc.STAGE_BATCH_ASSEMBLY, sc.STAGE_COMPUTE})
COMPUTE_STAGES = frozenset(sc.COMPUTE_STAGES)
#: A batch's work: what the worker is busy with while later requests queue behind it.
WORK_STAGES = frozenset(sc.COMPUTE_STAGES | sc.TRANSFER_STAGES)
_MAX_WEIGHT = sc.MAX_SAMPLE_WEIGHT
_PROMPT_TOKENS = sc.ATTR_TOKENS_PROMPT
_GEN_AI_PROMPT_TOKENS = sc.ATTR_GEN_AI_USAGE_PROMPT_TOKENS


def trace_state_weight(trace_state: str) -> float | None:
    """Adjusted count from an OpenTelemetry ``ot=th:<hex>`` tracestate, or None.

    The threshold T is the hex string padded right with zeros to 14 digits; the
    sampling probability is ``1 - T / 2**56`` and the adjusted count its inverse.
    """
    if not trace_state or "ot=" not in trace_state:
        return None
    for member in trace_state.split(","):
        key, _, value = member.strip().partition("=")
        if key != sc.TRACESTATE_OT_KEY:
            continue
        for sub in value.split(";"):
            sk, _, sv = sub.partition(":")
            if sk != sc.TRACESTATE_THRESHOLD_KEY:
                continue
            if not sv or len(sv) > 14:
                return None
            try:
                threshold = int(sv.ljust(14, "0"), 16)
            except ValueError:
                return None
            probability = 1.0 - threshold / float(1 << 56)
            return 1.0 / probability if probability > 0 else None
    return None


def request_fields(extra: dict | None, flags: int, trace_state: str | None) -> tuple:
    """A request row's (model, weight, error, counted, prompt tokens) from its request
    span's wanted attributes, flags (``FLAG_ERROR`` set: status ERROR) and trace state."""
    model = extra.get(sc.ATTR_MODEL_NAME) if extra else None
    if model is None and extra:
        model = _gen.model_of(extra)
    weight = None
    if extra:
        w = extra.get(sc.ATTR_SAMPLE_WEIGHT)
        if (
            isinstance(w, (int, float))
            and not isinstance(w, bool)
            and 1 <= w <= _MAX_WEIGHT
        ):
            weight = float(w)
    if weight is None:
        weight = (trace_state and trace_state_weight(trace_state)) or 1.0
    tokens = extra.get(_PROMPT_TOKENS) if extra else None
    if tokens is None and extra:
        tokens = extra.get(_GEN_AI_PROMPT_TOKENS)
    return (
        model,
        weight,
        1 if flags & FLAG_ERROR else 0,
        1 if extra and extra.get(sc.ATTR_SUMMARY_COUNTED) is True else 0,
        tokens if type(tokens) is int and tokens > 0 else 0,
    )


class Finalised:
    """Requests finalised by one ``Assembler.advance`` call, column by column.

    Columns rather than one object per request: the engine folds them with numpy, and a
    per-request record with per-request dicts cost more than the folding itself. Numeric
    columns are ``array.array`` (numpy reads them without a copy; times are unsigned
    64-bit like OTLP's).

    Per request ``i``: ``service[i]``, ``model[i]`` (the attribute's value as sent: the
    engine turns anything but a string into ""), ``weight[i]``, ``start[i]`` and
    ``end[i]`` (ns), ``error[i]`` (1: the request span's status is ERROR). Per stage span
    attributed to a request (a linked batch span once per member): ``span_key`` = request
    index << 32 | stage number (one append instead of two; the number indexes
    ``Assembler.stage_names``), ``span_start``, ``span_end`` (ns). ``batches``: (request index,
    effective, padded) of batches seen first here;
    ``compute``: (request index, (host, gpu id, start s, end s)) of compute-stage spans,
    deduplicated per batch. ``instance`` per request: its resource's (host.name,
    service.instance.id). ``work``: flat (request index, start s, end s) of work spans
    (``h2d``, compute stages, ``d2h``), once per batch id; ``work_share``: flat (request
    index, seconds) per member request of such a span with a batch id: its duration over
    ``inferprof.batch.size`` (the whole duration, once, when the size is missing), so
    that the weighted sum estimates the batch work of the requests not sampled too.
    ``queue_behind``: flat (span position, seconds) of ``queue`` spans whose batcher
    reported ``inferprof.queue.behind_batches_s``; the position indexes ``span_key``.
    ``trace_id`` per request: its trace's id (16 bytes), for the examples and exemplars
    that point at it. ``tokens`` per request: its request span's ``inferprof.tokens.prompt``
    (0: not given). ``device``: flat (request index, stage number, seconds, share) per work
    span (``h2d``, compute stages, ``d2h``) attributed to a request, every member of a batch
    included: the span's duration and the request's share of it (``cost.member_share``).
    ``counted`` per request: 1 when its request span says ``inferprof.summary.counted``
    (contract §15): its process's summaries count it, so its trace only adds what
    summaries do not carry.
    """

    __slots__ = (
        "batches",
        "compute",
        "counted",
        "device",
        "end",
        "error",
        "gen",
        "instance",
        "model",
        "queue_behind",
        "service",
        "span_end",
        "span_key",
        "span_start",
        "start",
        "tokens",
        "trace_id",
        "weight",
        "work",
        "work_share",
    )

    def __init__(self) -> None:
        self.service: list[str] = []
        self.model: list[Any] = []
        self.weight = array("d")
        self.start = array("Q")
        self.end = array("Q")
        self.error = array("B")
        self.counted = array("B")
        self.span_key = array("q")
        self.span_start = array("Q")
        self.span_end = array("Q")
        self.batches: list[tuple[int, int, int]] = []
        self.compute: list[tuple[int, tuple[str, str, float, float]]] = []
        self.instance: list[tuple[str, str]] = []
        self.work = array("d")  # flat (request index, start s, end s) triples
        self.work_share = array("d")  # flat (request index, seconds) pairs
        self.queue_behind = array("d")  # flat (span position, seconds) pairs
        self.trace_id: list[bytes] = []
        #: (request index, its wanted attributes) of generating requests (gen_spans).
        self.gen: list[tuple[int, dict]] = []
        self.tokens = array("q")
        self.device = array("d")  # flat (request index, stage number, seconds, share)

    def __len__(self) -> int:
        return len(self.start)


__all__ = [
    "COMPUTE_STAGES",
    "PADDING_STAGES",
    "WORK_STAGES",
    "Finalised",
    "request_fields",
    "trace_state_weight",
]
