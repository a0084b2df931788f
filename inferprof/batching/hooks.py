"""Hooks for batchers applications already have: ``inferprof.enqueue()`` and ``inferprof.batch()``.

For a custom batching loop, Ray Serve's ``@serve.batch`` or a Triton Python backend::

    handle = inferprof.enqueue()                 # in the request's context: `queue` starts
    ...                                          # hand (item, handle) to the batching loop
    with inferprof.batch(handles, max_size=8) as b:   # the batch is formed: each `queue` ends
        with b.stage("batch_assembly"):
            x = pad_and_stack(items)
            b.set_tokens(effective=real, padded=total)
        with inferprof.stage("compute"):         # a batch stage (the batch is current)
            y = model(x)

``DynamicBatcher`` is built on these hooks, so both produce the same spans: per request a
``queue`` stage (``inferprof.queue.depth`` when given), per batch the stages recorded inside
``batch()``, carrying ``inferprof.batch.id/size/max_size`` and ``inferprof.model.name``,
encoded as ``children`` (a copy under every member request) or ``links`` (one span linked
to every member) — see ``docs/batching.md``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any, Literal

from inferprof import semconv
from inferprof.instrumentation.active import active_runtime
from inferprof.instrumentation.config import batch_encoding_setting
from inferprof.instrumentation.records import (
    MEMBERSHIP_LOCK,
    NO_BATCHES,
    SCOPE,
    BatchRecord,
    RequestRecord,
    StageRecord,
    SummaryRecord,
    ends_in_error,
    set_batch_tokens,
)
from inferprof.instrumentation.spans import new_trace_id
from inferprof.instrumentation.stage import NoopStage, Stage, check_stage

_logger = logging.getLogger(__name__)
_time_ns = time.time_ns
_warned: set[str] = set()


def _warn_once(kind: str, message: str) -> None:
    """A misuse of the hooks, logged once per kind per process (they run per batch)."""
    if kind not in _warned:
        _warned.add(kind)
        _logger.warning(message)


class QueueHandle(StageRecord):
    """A request waiting for a batch (what ``enqueue()`` returns). Pass it to ``batch()``.

    It is also the request's ``queue`` stage record (one object per request where a handle
    and a record made two): ``request`` is the waiting request, None for a handle that
    records nothing. ``batch()`` lets go of the request once the batch has formed, so the
    request's stage list, which holds this record, makes no reference cycle with it.
    """

    __slots__ = ("request",)

    def __init__(
        self, request: RequestRecord | None, parent: StageRecord | None, start: int, attrs: dict
    ) -> None:
        # StageRecord's fields, set here: one call per request instead of two
        self.name = _STAGE_QUEUE
        self.span_id = 0
        self.parent = parent
        self.start = start
        self.end = None
        self.attrs = attrs
        self.error = None
        self.device = None
        self.request = request

    @property
    def stage(self) -> StageRecord | None:
        """The ``queue`` stage's record (the handle itself), or None if it records nothing."""
        return self if self.request is not None or self.start else None

    def cancel(self) -> None:
        """The request left the queue without being batched (cancelled, timed out)."""
        if self.request is not None and self.end is None:
            self.end = _time_ns()
            self.attrs[semconv.ATTR_CANCELLED] = True
        self.request = None


_STAGE_QUEUE = semconv.STAGE_QUEUE
_ATTR_QUEUE_DEPTH = semconv.ATTR_QUEUE_DEPTH
#: The handle of a request that records nothing (outside a request, inferprof off): it
#: holds no state, so one is shared.
_NOTHING = QueueHandle(None, None, 0, {})
_new_handle = object.__new__


def enqueue(*, depth: int | None = None, **attributes: Any) -> QueueHandle:
    """Mark "this request was enqueued for batching": starts its ``queue`` stage.

    ``depth``: queue length at enqueue time (``inferprof.queue.depth``). Outside a request,
    or when inferprof is off, returns a handle that records nothing.
    """
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
        raise ValueError(f"depth must be a non-negative int, got {depth!r}")
    scope = SCOPE.get()
    if scope is None or not isinstance(scope[0], RequestRecord):
        if scope is not None and scope[0].__class__ is SummaryRecord:
            return _enqueue(0)  # (its queue stage's times only: no attribute recorded)
        return _NOTHING
    rec, parent = scope
    if depth is not None:
        attributes[semconv.ATTR_QUEUE_DEPTH] = depth
    handle = QueueHandle(rec, parent, _time_ns(), attributes)
    rec.stages.append(handle)
    if rec.batches is NO_BATCHES:
        rec.batches = []  # and it leaves its batches when it ends (Runtime._leave_batches)
    return handle


def _enqueue(depth: int) -> QueueHandle:
    """``enqueue(depth=depth)`` for DynamicBatcher, which passes a valid depth and nothing
    else: the same record, without the argument checks and keyword dict (once a request)."""
    scope = SCOPE.get()
    if scope is None:
        return _NOTHING
    rec, parent = scope
    if isinstance(rec, RequestRecord):
        attrs = {_ATTR_QUEUE_DEPTH: depth}
    elif rec.__class__ is SummaryRecord:
        # untimed, summarised: its ``queue`` stage's times alone (the batch that takes it
        # ends the stage and is added to ``rec.batches``; its parent is None)
        attrs = {}
    else:
        return _NOTHING
    # QueueHandle(rec, parent, now, attrs), without the class call (once a request)
    handle = _new_handle(QueueHandle)
    handle.name = _STAGE_QUEUE
    handle.span_id = 0
    handle.parent = parent
    handle.end = handle.error = handle.device = None
    handle.attrs = attrs
    handle.request = rec  # (a SummaryRecord too: Batch.__enter__ tells them apart)
    handle.start = _time_ns()
    rec.stages.append(handle)
    if rec.batches is NO_BATCHES:  # (here, in its context: batches form in any thread)
        rec.batches = []
    return handle


class _BoundStage(Stage):
    """A stage of a given batch, whatever the current context (``Batch.stage``)."""

    __slots__ = ("_outer", "_owner")
    _outer: Any

    def __init__(self, owner: BatchRecord, name: str, device: Any, attrs: dict) -> None:
        super().__init__(name, device, attrs)
        self._owner = owner
        # Never its own record (Stage.__enter__ records into a new one when ``start`` is
        # set): the record goes into the batch's stage list and this object holds the
        # batch, a cycle the garbage collector would otherwise break once per batch.
        self.start = -1

    def __enter__(self) -> Stage:
        self._outer = SCOPE.set((self._owner, None))
        return super().__enter__()

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        try:
            return super().__exit__(exc_type, exc, tb)
        finally:
            try:
                SCOPE.reset(self._outer)
            except ValueError:
                pass
            # The token holds the scope it replaced (the batch record, whose stage list
            # holds this stage): a cycle, left to the garbage collector once per batch.
            self._outer = None


class _ClosedBatchStage(NoopStage):
    """``b.stage()`` after the batch's block: records nothing, as a decorator too (a plain
    no-op stage defers a decorated function to a real stage at each call)."""

    __slots__ = ()

    def __call__(self, fn: Any) -> Any:
        return fn


class Batch:
    """A batch being processed (what ``with inferprof.batch(...)`` yields)."""

    __slots__ = (
        "_rt",
        "_token",
        "attrs",
        "encoding",
        "handles",
        "max_size",
        "model",
        "quiet",
        "record",
        "summarised",
    )
    _token: Any

    def __init__(
        self,
        handles: list,
        max_size: int | None,
        model: str | None,
        encoding: str | None,
        attrs: dict,
        quiet: bool = False,
    ) -> None:
        self.handles = handles
        #: DynamicBatcher's own batches: a request that ended between being taken for the
        #: batch and the batch forming (cancelled) is a race there, not a misuse to report.
        self.quiet = quiet
        self.max_size = max_size
        self.model = model
        self.encoding = encoding
        self.attrs = attrs
        self.record: BatchRecord | None = None
        self._token = None
        #: the SummaryRecords of its requests left untimed and summarised (no members)
        self.summarised: list[SummaryRecord] | None = None

    @property
    def id(self) -> str | None:
        """``inferprof.batch.id`` (None when inferprof is off)."""
        return self.record.batch_id if self.record is not None else None

    @property
    def size(self) -> int:
        return len(self.handles)

    def stage(self, name: str, *, device: Any = None, **attributes: Any) -> Stage:
        """A stage of this batch, usable from any thread or task."""
        check_stage(name)
        if self.record is None:
            return Stage(name, device, attributes)  # off: no batch scope, a no-op stage
        if self.record.closed:
            _warn_once(
                "closed",
                "inferprof: Batch.stage() after its `with inferprof.batch(...)` block ended "
                "records nothing; record the batch's stages inside the block",
            )
            return _ClosedBatchStage(name)  # type: ignore[return-value]
        return _BoundStage(self.record, name, device, attributes)

    def set_tokens(self, *, effective: int | None = None, padded: int | None = None) -> None:
        """Real and padded token counts of the batch (``inferprof.tokens.*``)."""
        set_batch_tokens(self.record, effective, padded)

    def set_attribute(self, key: str, value: Any) -> None:
        if self.record is not None:
            self.record.attrs[key] = value

    def __enter__(self) -> Batch:
        now = _time_ns()
        requests = []
        summarised = None
        for h in self.handles:
            request = h.request
            if request is not None:
                if h.end is None:
                    h.end = now
                h.request = None  # (class docstring: no cycle through the stage list)
                if request.__class__ is SummaryRecord:  # untimed, summarised: no member
                    if summarised is None:
                        summarised = []
                    summarised.append(request)
                    continue
                requests.append(request)
            elif h.start and not self.quiet:  # a recording handle, batched or cancelled before
                _warn_once(
                    "reused",
                    "inferprof.batch(): a handle already passed to an earlier batch() (or "
                    "cancelled) records nothing in this one; pass each enqueue() handle to "
                    "one batch. For continuous batching (a request in one engine step after "
                    "another), use inferprof.Engine (docs/generation.md)",
                )
        rt = requests[0].runtime if requests else active_runtime()
        if rt is None:  # inferprof off or not configured: nothing to record, nothing to say
            return self
        if not self.handles:
            _warn_once("empty", "inferprof.batch() got no handles: its stages belong to no request")
        try:
            encoding = self.encoding or rt.batch_encoding
            # The check that a request has not ended and its joining the batch are one step
            # against the request's leaving its batches (Runtime._leave_batches): a links
            # batch waits for every member to end, and a member that ended in between
            # would hold it back forever.
            with MEMBERSHIP_LOCK:
                record, late = self._open_record(rt, requests, encoding)
        except Exception:
            _logger.exception("inferprof could not open a batch")
            return self
        if late and not self.quiet:
            _warn_once(
                "finished",
                "inferprof.batch(): a handle's request had already ended; the batch is not "
                "recorded for it (form the batch before the request returns)",
            )
        self.record = record
        self._rt = rt
        self._token = SCOPE.set((record, None))
        if summarised is not None:  # its stages go into their summaries (Runtime)
            self.summarised = summarised
            for s in summarised:
                s.batches.append(record)
        return self

    def _open_record(self, rt: Any, requests: list, encoding: str) -> tuple[BatchRecord, int]:
        """The batch's record, its members joined to it; and how many requests had ended
        (their spans are built: the batch could add nothing to them)."""
        members = [r for r in requests if not r.finished]
        model = self.model
        if model is None and members:
            model = members[0].model
        attrs: dict[str, Any] = {
            semconv.ATTR_BATCH_SIZE: len(self.handles),
        }
        if self.max_size is not None:
            attrs[semconv.ATTR_BATCH_MAX_SIZE] = self.max_size
        if model is not None:
            attrs[semconv.ATTR_MODEL_NAME] = model
        attrs.update(self.attrs)
        record = BatchRecord(
            rt, rt.new_batch_id(), attrs, members, encoding, trace_id=new_trace_id()
        )
        attrs[semconv.ATTR_BATCH_ID] = record.batch_id
        for m in members:
            m.batches.append(record)
        return record, len(requests) - len(members)

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        record = self.record
        if record is None:
            return False
        try:
            SCOPE.reset(self._token)
        except ValueError:
            SCOPE.set(None)
        if exc is not None:
            for m in record.members:
                if m.error is None:
                    m.error = exc
            if self.summarised is not None:  # (as for a member: the first batch's)
                failed = ends_in_error(exc)
                for s in self.summarised:
                    if s.error is None:
                        s.error = failed
        self.summarised = None  # (a Batch kept by the app keeps no request)
        self._rt.close_batch(record)
        return False

    async def __aenter__(self) -> Batch:
        return self.__enter__()

    async def __aexit__(self, exc_type, exc, tb) -> Literal[False]:
        return self.__exit__(exc_type, exc, tb)


def batch(
    handles: Iterable[QueueHandle],
    *,
    max_size: int | None = None,
    model: str | None = None,
    batch_encoding: str | None = None,
    **attributes: Any,
) -> Batch:
    """Mark "a batch was formed from these requests" (``with`` / ``async with``).

    Entering ends every member's ``queue`` stage; stages recorded inside (through
    ``inferprof.stage`` in this context, or ``b.stage`` anywhere) are this batch's stages.
    An exception escaping the block is recorded on every member request.
    """
    handles = list(handles)
    for h in handles:
        if not isinstance(h, QueueHandle):
            raise ValueError(f"batch() takes the handles inferprof.enqueue() returned, got {h!r}")
    if max_size is not None and (
        isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1
    ):
        raise ValueError(f"max_size must be a positive int, got {max_size!r}")
    if model is not None and not isinstance(model, str):
        raise ValueError(f"model must be a string, got {model!r}")
    encoding = batch_encoding_setting(batch_encoding) if batch_encoding is not None else None
    return Batch(handles, max_size, model, encoding, attributes)


class _NoBatch:
    """What :func:`current_batch` returns where no batch is recorded (inferprof off or not
    configured, or outside a batch): the same calls, checked the same way, recording
    nothing, so code written for a recorded batch runs unchanged. It is falsy."""

    __slots__ = ()
    batch_id = None

    def set_tokens(self, *, effective: int | None = None, padded: int | None = None) -> None:
        set_batch_tokens(None, effective, padded)

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "<inferprof batch: not recorded>"


_NO_BATCH = _NoBatch()


def current_batch() -> BatchRecord | _NoBatch:
    """The batch being processed in this context (e.g. from inside ``collate``).

    Where none is recorded (inferprof off or not configured, or outside a batch) a falsy
    stand-in with the same ``set_tokens()``/``set_attribute()``, which record nothing:
    ``current_batch().set_tokens(...)`` works in every mode, as the batcher does.
    """
    scope = SCOPE.get()
    if scope is None or not isinstance(scope[0], BatchRecord):
        return _NO_BATCH
    return scope[0]


def set_tokens(*, effective: int | None = None, padded: int | None = None) -> None:
    """Token counts for the current batch (no-op outside one)."""
    current_batch().set_tokens(effective=effective, padded=padded)


__all__ = ["Batch", "QueueHandle", "batch", "current_batch", "enqueue", "set_tokens"]
