"""Per-request and per-batch records: what the hot path writes instead of spans.

A stage costs two ``time.time_ns()`` calls, one small object and one context-variable
set/reset; no OpenTelemetry span exists until the request ends, when the runtime turns the
record into spans in one go (or throws it away, in ``production`` mode, for a fast request
that was not sampled). The request's ids are fixed when it starts, so ``traceparent`` can be
propagated downstream while it runs.
"""

from __future__ import annotations

import asyncio
import random
import threading
from contextvars import ContextVar
from typing import Any

from opentelemetry import context as context_api
from opentelemetry import trace as trace_api

from inferprof import semconv
from inferprof.instrumentation._otel_compat import OTEL_CONTEXT as _OTEL_CONTEXT
from inferprof.instrumentation._otel_compat import SPAN_KEY as _SPAN_KEY

_SAMPLED = trace_api.TraceFlags(trace_api.TraceFlags.SAMPLED)
_NOT_SAMPLED = trace_api.TraceFlags(trace_api.TraceFlags.DEFAULT)


class StageRecord:
    """One timed stage. ``parent`` is the enclosing stage's record (None: the owner's root).

    ``span_id`` stays 0 until the stage's span is built (:func:`span_id_of`): the stages of
    a request that is not kept never draw a random id.
    """

    __slots__ = ("attrs", "device", "end", "error", "name", "parent", "span_id", "start")

    def __init__(self, name: str, parent: StageRecord | None, start: int, attrs: dict) -> None:
        self.name = name
        self.span_id = 0
        self.parent = parent
        self.start = start
        self.end: int | None = None
        self.attrs = attrs
        #: the exception (or message) it ended with; frozen to its span parts before a
        #: trace is queued (``spans.error_parts``)
        self.error: Any = None
        # Pending device timing (inferprof.instrumentation.device), resolved before emission.
        self.device: Any = None

    def set_attribute(self, key: str, value: Any) -> None:
        self.attrs[key] = value


_id_lock = threading.Lock()
#: ``RequestRecord.batches`` of a request never enqueued for a batch (no list allocated).
NO_BATCHES: Any = ()

#: Joining a ``links``-encoded batch (``inferprof.batch()``) and leaving one's batches when
#: a request ends (``Runtime._leave_batches``) are atomic against each other: a request that
#: ends while its batch forms either is a member and reports its end, or is not a member.
#: Taken once per batch that is ``links``-encoded, and once per request that was enqueued.
MEMBERSHIP_LOCK = threading.Lock()


def span_id_of(st: StageRecord) -> int:
    """The stage's span id, drawn on first use. A batch's stages are read by every member
    request, on whichever thread ends it: the lock makes them all see the same id."""
    sid = st.span_id
    if sid:
        return sid
    with _id_lock:
        sid = st.span_id
        if not sid:
            # getrandbits(64) is 0 with probability 2**-64; 0 is not a valid span id.
            sid = st.span_id = random.getrandbits(64) or 1
    return sid


class RequestRecord:
    """The handle of one request (what ``inferprof.current_request()`` returns).

    Public surface: ``trace_id``, ``span_id``, ``span_context``, ``model``,
    ``set_attribute()``, ``set_attributes()``. Everything else is internal.
    """

    __slots__ = (
        "attrs",
        "batches",
        "emit_request_span",
        "end",
        "error",
        "finished",
        "generation",
        "head",
        "kept",
        "kind",
        "live_span",
        "name",
        "parent",
        "runtime",
        "span_id",
        "stages",
        "stages_dropped",
        "start",
        "trace_id",
        "trace_state",
        "weight_hint",
    )

    def __init__(
        self,
        runtime: Any,
        name: str,
        kind: trace_api.SpanKind,
        trace_id: int,
        span_id: int,
        parent: trace_api.SpanContext | None,
        start: int,
        attrs: dict,
        head: bool,
        weight_hint: float = 1.0,
    ) -> None:
        self.runtime = runtime
        self.name = name
        self.kind = kind
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent = parent
        self.start = start
        self.end: int = 0  # set when the request ends, before the runtime reads it
        self.attrs = attrs
        self.stages: list[StageRecord] = []
        #: the batches it is a member of; NO_BATCHES (shared) until it is enqueued for one
        self.batches: list[BatchRecord] = NO_BATCHES
        self.error: Any = None  # an exception, a message, or its span parts (frozen)
        #: head sampling decision (full mode: the OTel sampler's; production: the coin flip).
        self.head = head
        #: weight implied by the OTel sampler in full mode (1/ratio), else 1.
        self.weight_hint = weight_hint
        #: an existing SDK span (opentelemetry-instrumentation-fastapi's) we enrich instead
        #: of emitting our own request span.
        self.live_span: Any = None
        self.emit_request_span = True
        self.finished = False
        self.kept = False
        self.stages_dropped = 0
        #: W3C tracestate inherited from the remote parent (propagated, put on every span)
        self.trace_state: trace_api.TraceState | None = None
        #: the engine's handle of a generating request (instrumentation.generation), or None
        self.generation: Any = None

    # --- public -----------------------------------------------------------------------
    @property
    def span_context(self) -> trace_api.SpanContext:
        flags = _SAMPLED if self.head else _NOT_SAMPLED
        return trace_api.SpanContext(self.trace_id, self.span_id, False, flags, self.trace_state)

    @property
    def model(self) -> str | None:
        return self.attrs.get(semconv.ATTR_MODEL_NAME)

    def set_attribute(self, key: str, value: Any) -> None:
        self.attrs[key] = value
        live = self.live_span
        if live is not None and live.is_recording():  # its owner may have ended it already
            live.set_attribute(key, value)

    def set_attributes(self, attributes: dict) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def __repr__(self) -> str:
        return f"<inferprof request {self.name!r} trace_id={self.trace_id:032x}>"

    def _summary_parts(self, flat: list) -> bool:
        """For the summaries (contract §15): add to ``flat`` the stage spans its trace
        would add at :meth:`_complete`, as ``stage, start_ns, end_ns`` each; return
        whether its request span would end in error. Called once, by the runtime, when
        the request ends."""
        return ends_in_error(self.error)

    def _summarised(self, model: str | None) -> bool | int:
        """For the summaries: the request is summarised under ``model``; return whether
        its untimed siblings are counted under that model too (contract §15, "The mark on
        timed requests"), or :data:`SUMMARISED_UNTIMED` when they are summarised with
        their stages (then it is summarised at weight 1, unmarked). Only a subclass that
        counts untimed requests says either. Called at most once, by the runtime, when
        the request ends."""
        return False

    def _complete(self) -> None:
        """The request is kept: add what only its trace needs (a subclass's deferred
        stages and attributes). Called once, by the runtime, before the spans are built."""
        if self.generation is not None:
            self.generation.complete(self)


def ends_in_error(error: Any) -> bool:
    """Whether a span that ended with ``error`` (a record's) gets the status ``ERROR``, as
    ``spans.error_parts`` makes it: a cancellation (``asyncio.CancelledError``) does not."""
    if isinstance(error, tuple):  # frozen already: (status, events, attributes)
        return error[0].status_code is trace_api.StatusCode.ERROR
    return error is not None and not isinstance(error, asyncio.CancelledError)


class RequestSpan(trace_api.NonRecordingSpan):
    """The request as OpenTelemetry's current span while it runs, so that downstream
    clients inject its ``traceparent`` and other instrumentations parent their spans on it.

    Its ``SpanContext`` is built on first use: most requests make no downstream call, and
    building one costs about 1 µs (the API validates both ids).
    """

    #: built on first use (an instance attribute from then on)
    _context: trace_api.SpanContext | None = None  # type: ignore[assignment]

    def __init__(self, rec: RequestRecord) -> None:  # no super().__init__: the context is lazy
        self._rec = rec

    def get_span_context(self) -> trace_api.SpanContext:
        ctx = self._context
        if ctx is None:
            ctx = self._context = self._rec.span_context
        return ctx

    def __repr__(self) -> str:
        return f"RequestSpan({self.get_span_context()!r})"


class BatchRecord:
    """One batch: its stages, attributes and member requests.

    Members hold a reference to it; in the ``children`` encoding each member copies the
    batch stages under its own request span when it ends. In the ``links`` encoding the
    batch emits its stages once, after it has closed and every member has ended (so the
    links name only members whose traces were kept).
    """

    __slots__ = (
        "attrs",
        "batch_id",
        "bodies",
        "closed",
        "emitted",
        "encoding",
        "finished",
        "kept_members",
        "lock",
        "members",
        "pending",
        "runtime",
        "stages",
        "stages_dropped",
        "summary_spans",
        "tokens",
        "trace_id",
    )

    def __init__(
        self,
        runtime: Any,
        batch_id: str,
        attrs: dict,
        members: list,
        encoding: str,
        trace_id: int = 0,
    ) -> None:
        self.runtime = runtime
        self.batch_id = batch_id
        self.attrs = attrs
        self.stages: list[StageRecord] = []
        self.members = members
        self.encoding = encoding
        self.closed = False
        self.pending = len(members)
        self.kept_members: list[trace_api.SpanContext] = []
        self.lock = threading.Lock()
        self.emitted = False
        #: token counts, put on batch_assembly and compute-type stages only (contract §3).
        self.tokens: dict[str, int] = {}
        #: the batch's own trace (``links`` encoding), fixed up front so member request
        #: spans can link back to the batch spans.
        self.trace_id = trace_id
        self.stages_dropped = 0
        #: encoded batch-stage spans minus their ids, by stage record, once the batch has
        #: closed (runtime's ``_batch_body``): shared by the copies of every kept member.
        self.bodies: dict[StageRecord, bytes] | None = None
        #: its stage spans as each member's summary holds them, flat, once the batch has
        #: closed with every stage ended (the runtime's ``_batch_summary_spans``)
        self.summary_spans: tuple | None = None
        #: never set: a batch records until its stages are done (Stage.__enter__ reads
        #: ``owner.finished`` of a request or a batch alike)
        self.finished = False

    def set_attribute(self, key: str, value: Any) -> None:
        self.attrs[key] = value

    def set_tokens(self, *, effective: int | None = None, padded: int | None = None) -> None:
        """Real and padded token counts of the batch (``inferprof.tokens.*``)."""
        set_batch_tokens(self, effective, padded)


def set_batch_tokens(
    record: BatchRecord | None, effective: int | None, padded: int | None
) -> None:
    """Check token counts (``ValueError``) and put them on ``record`` (None: check only)."""
    for name, value in (("effective", effective), ("padded", padded)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0
        ):
            raise ValueError(f"{name} tokens must be a non-negative int, got {value!r}")
    if effective is not None and padded is not None and padded < effective:
        raise ValueError(f"padded tokens ({padded}) must be >= effective tokens ({effective})")
    if record is None:
        return
    if effective is not None:
        record.tokens[semconv.ATTR_TOKENS_EFFECTIVE] = effective
    if padded is not None:
        record.tokens[semconv.ATTR_TOKENS_PADDED] = padded


# --- the OpenTelemetry context, without the API's layers ---------------------------------
# Once per request the request becomes OpenTelemetry's current span. The API does that in
# four Python calls (get_current, set_span_in_context, set_value, attach) and two more to
# detach; with the default runtime context (a ContextVar, fixed when
# ``opentelemetry.context`` is imported) the same takes one ``get``, one ``set`` and one
# ``reset`` of that variable (``_otel_compat.OTEL_CONTEXT``). Any other runtime context
# goes through the API.


def current_otel_context() -> Any:
    """``opentelemetry.context.get_current()``."""
    return _OTEL_CONTEXT.get() if _OTEL_CONTEXT is not None else context_api.get_current()


def attach_span(span: trace_api.Span, context: Any) -> Any:
    """Make ``span`` current in a copy of ``context`` (the current one); returns the token
    for :func:`detach_context`."""
    if _OTEL_CONTEXT is None:
        return context_api.attach(trace_api.set_span_in_context(span, context))
    if context:
        return _OTEL_CONTEXT.set(context_api.Context({**context, _SPAN_KEY: span}))
    return _OTEL_CONTEXT.set(context_api.Context({_SPAN_KEY: span}))


def detach_context(token: Any) -> None:
    """Undo :func:`attach_span`; never raises (a context left in another task)."""
    try:
        if _OTEL_CONTEXT is None:
            context_api.detach(token)
        else:
            _OTEL_CONTEXT.reset(token)
    except Exception:
        pass


#: The innermost open scope of this context: (owner, enclosing stage record or None). The
#: owner is a RequestRecord (request stages) or a BatchRecord (inside ``inferprof.batch``/the
#: batcher); or the scope is :data:`UNTIMED`.
SCOPE: ContextVar[tuple[Any, StageRecord | None] | None] = ContextVar(
    "inferprof_scope", default=None
)


class _QuietStep(threading.local):
    """This thread's production-mode engine step that holds no scope (:data:`QUIET`)."""

    #: the Step, or None
    step: Any = None


#: A ``production``-mode engine step entered with ``with`` in a thread running no event
#: loop, outside any scope, leaves :data:`SCOPE` unset while it runs, and is named here
#: instead. A set context variable makes every lookup of another one that misses search the
#: context (numpy makes two per array it creates: 42% of the engine thread's extra
#: instructions per token in ``benchmarks/llm_instructions.py``), and production mode sends
#: none of a step's stages anyway (contract §14). Meanwhile what reads SCOPE and finds None
#: asks :func:`in_quiet_step`: stages and Triton calls in such a step record nothing, as in
#: a request production mode does not time, instead of becoming spans of their own.
QUIET = _QuietStep()


def in_quiet_step() -> bool:
    """Whether this thread runs a production step that holds no scope (:data:`QUIET`); one
    that ended (exited in another thread, which cannot clear this one's) no more."""
    step = QUIET.step
    return step is not None and not step.finished


class _Untimed:
    """The owner in :data:`UNTIMED`: a request production mode left untimed."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<inferprof untimed request>"


#: The scope of a request that ``production`` mode's timing budget left untimed
#: (sampling.TimingBudget): its stages, queue handles and nested requests record nothing,
#: as with inferprof off, and are not mistaken for work outside any request.
UNTIMED: tuple[Any, None] = (_Untimed(), None)


#: ``RequestRecord._summarised``'s answer when the request's untimed siblings are
#: summarised with their stages (SummaryRecord), not only counted.
SUMMARISED_UNTIMED = 2


class SummaryRecord:
    """The owner of a request ``production`` mode's timing budget left untimed, recorded for
    the summaries alone (``configure(untimed_stages=True)``, contract §15 as extended in
    docs/span-contract.md, "Untimed requests summarised"): its stages' names and times and
    the batches it joined, nothing else. No span, no trace context, no attributes, no
    tail-sampling decision. Scope ``(record, None)``; what cannot be recorded this way
    (a device-timed stage, a Triton call, an engine generation) sets ``broken``, and the
    request is then only counted; past ``MAX_STAGES`` stages it records no more, as a
    timed request's record.
    """

    __slots__ = ("batches", "broken", "error", "stages")

    def __init__(self) -> None:
        # (the FastAPI middleware makes one without this call, once per untimed request:
        # a field added here is added there too)
        #: objects with ``name``, ``start`` (0: never entered) and ``end`` (None: open):
        #: its stages, and its queue handles
        self.stages: list[Any] = []
        #: BatchRecords it joined (NO_BATCHES until it is enqueued)
        self.batches: Any = NO_BATCHES
        self.broken = False
        #: None, or whether the exception of the first batch of it that failed is an error
        #: (what a timed member's ``error`` holds: ``ends_in_error``)
        self.error: bool | None = None

    def __repr__(self) -> str:
        return "<inferprof request summarised untimed>"


def current_owner() -> Any:
    scope = SCOPE.get()
    return scope[0] if scope is not None else None


__all__ = [
    "MEMBERSHIP_LOCK",
    "NO_BATCHES",
    "QUIET",
    "SCOPE",
    "SUMMARISED_UNTIMED",
    "UNTIMED",
    "BatchRecord",
    "RequestRecord",
    "RequestSpan",
    "StageRecord",
    "SummaryRecord",
    "attach_span",
    "current_otel_context",
    "current_owner",
    "detach_context",
    "ends_in_error",
    "in_quiet_step",
    "set_batch_tokens",
    "span_id_of",
]
