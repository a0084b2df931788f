"""Generating requests: what one request records while an engine generates for it.

A :class:`Generation` is the handle an engine holds for one request (``Engine.request()``,
:mod:`inferprof.instrumentation.engine`). It records, into the request's record, the
``queue``, ``prefill``, ``decode`` and ``preempted`` stage spans of contract §14 (children
of the request span) and, per output token or chunk, one timestamp appended to a list.
The request span's generation attributes (``inferprof.tokens.*``,
``inferprof.gen.emit_offsets_s``...) are made from those when the request's trace is kept
(:func:`generation_attributes`): a request production mode does not keep costs its list
appends and nothing more.

One source of emission times per request: when the FastAPI/ASGI middleware streamed the
response, the times its chunks left the service (contract §7's definition of a token's
time); else the engine's emissions (the end of the step that produced each token, or
:meth:`Generation.emit`).
"""

from __future__ import annotations

import logging
import operator
import time
from itertools import repeat
from typing import Any

from inferprof import semconv
from inferprof.instrumentation.records import StageRecord
from inferprof.instrumentation.stage import MAX_STAGES

_logger = logging.getLogger(__name__)
_time_ns = time.time_ns
_sub = operator.sub
_truediv = operator.truediv

_QUEUE = semconv.STAGE_QUEUE
_PREFILL = semconv.STAGE_PREFILL
_DECODE = semconv.STAGE_DECODE
_PREEMPTED = semconv.STAGE_PREEMPTED
#: Entries of the emission list that trigger a pairwise merge while recording: a runaway
#: stream keeps bounded memory (the merge halves it; the cap applies again at the end).
COMPACT_AT = 2 * semconv.GEN_MAX_EMIT_ENTRIES

# Generation states.
QUEUED, PREFILL, DECODING, PREEMPTED, DONE = range(5)


class Generation:
    """One request's generation, as the engine sees it (``Engine.request()`` returns it).

    The engine reports what happens to the request: step members (``Step.prefill()``,
    ``Step.decode()``), :meth:`preempt` (evicted from the KV cache), :meth:`emit` (tokens
    handed out, when not at the end of the step that produced them), :meth:`finish` and
    :meth:`cancel`. A request that is not timed (inferprof off, or production mode's timing
    budget) gets a handle that records nothing.
    """

    __slots__ = (
        "cancelled",
        "emit_tokens",
        "emits",
        "engine",
        "engine_id",
        "last_step_end",
        "merged",
        "output",
        "own",
        "preemptions",
        "prefill_chunks",
        "prefill_end",
        "prefilled",
        "prompt_tokens",
        "rec",
        "run_output",
        "run_start",
        "stage",
        "state",
        "usual",
    )

    def __init__(self, engine_id: str, rec: Any, own: bool, prompt_tokens: int | None,
                 arrival: int) -> None:
        self.engine_id = engine_id
        #: the ``Engine`` recording its steps (set by it for a timed request), or None
        self.engine: Any = None
        #: the request's record (None: not timed, nothing is recorded)
        self.rec = rec
        #: whether the handle opened the request itself (and ends it at finish/cancel)
        self.own = own
        self.state = QUEUED
        self.prompt_tokens = prompt_tokens
        #: output tokens emitted so far
        self.output = 0
        #: time_ns of each emission; ``emit_tokens`` (None while every one carried 1) the
        #: tokens of each
        self.emits: list[int] = []
        self.emit_tokens: list[int] | None = None
        self.merged = 0
        self.preemptions = 0
        #: prompt tokens processed in the current prefill run, and its chunks
        self.prefilled = 0
        self.prefill_chunks = 0
        #: end of the last step holding a prefill chunk of the current run
        self.prefill_end = 0
        #: end of the last step this request decoded in (the current decode run's end)
        self.last_step_end = 0
        #: start of a decode run whose stage opens with its first decode step (a run of
        #: one token, the prefill's, has no decode stage); 0: none pending
        self.run_start = 0
        #: output tokens emitted when the current prefill run began
        self.run_output = 0
        #: decoding, its decode stage open, every emission one token: a decode member of
        #: one token is then what Step._members_done records inline
        self.usual = False
        self.cancelled = False
        #: the open stage (its record, in the request's stages), or None
        self.stage: StageRecord | None = None
        if rec is not None:
            self.stage = self._open(_QUEUE, arrival)

    @property
    def timed(self) -> bool:
        """Whether this request is recorded."""
        return self.rec is not None

    # --- what the engine reports -------------------------------------------------------
    def emit(self, tokens: int = 1) -> None:
        """``tokens`` output tokens left the engine now (for engines that hand tokens out
        themselves: ``Step.decode(..., emit=False)``); 0 records nothing."""
        if type(tokens) is not int or tokens < 0:
            tokens = token_count(tokens)
        # 0: nothing left (a stop string held it back): no emission, as decode(gen, 0)
        if not tokens or self.rec is None or self.state == DONE:
            return
        self._emit(_time_ns(), tokens)

    def preempt(self) -> None:
        """The request was evicted from the KV cache; it waits (``preempted``) until a
        later step takes it again (recomputing its prefill, or decoding on after a swap)."""
        if self.rec is None or self.state in (DONE, PREEMPTED, QUEUED):
            return
        now = _time_ns()
        self._close_run(now)
        self.preemptions += 1
        self.state = PREEMPTED
        self.stage = self._open(_PREEMPTED, now)

    def finish(self) -> None:
        """The request is done (its last token emitted, or it failed in the engine)."""
        self._end(False)

    def cancel(self) -> None:
        """The request was cancelled (the client went away, a timeout): marks its request
        span ``inferprof.cancelled``; what it recorded so far is kept."""
        self._end(True)

    # --- internals, called by Step -----------------------------------------------------
    def _emit(self, when: int, tokens: int) -> None:
        emits = self.emits
        emits.append(when)
        self.output += tokens
        counts = self.emit_tokens
        if counts is not None:
            counts.append(tokens)
        elif tokens != 1:
            self.usual = False
            counts = self.emit_tokens = [1] * (len(emits) - 1)
            counts.append(tokens)
        if len(emits) >= COMPACT_AT:
            self._compact()

    def _compact(self) -> None:
        if self.emit_tokens is None:
            self.usual = False
            self.emit_tokens = [1] * len(self.emits)
        self.merged += merge_pairs(self.emits, self.emit_tokens)

    def _admit(self, step_start: int) -> None:
        """First prefill chunk of a run (arrival, or after an eviction)."""
        recompute = self.state == PREEMPTED
        self._close(step_start)
        self.state = PREFILL
        self.usual = False
        self.prefilled = self.prefill_chunks = 0
        self.run_output = self.output
        stage = self.stage = self._open(_PREFILL, step_start)
        if recompute and stage is not None:  # None: the request ended or has too many stages
            stage.attrs[semconv.ATTR_PREFILL_RECOMPUTE] = True

    def _prefill_done(self, step_end: int, emit: bool) -> None:
        """The step ending at ``step_end`` completed the prompt (and sampled a token)."""
        st = self.stage
        if st is not None:
            st.attrs[semconv.ATTR_PREFILL_TOKENS] = self.prefilled
            st.attrs[semconv.ATTR_PREFILL_CHUNKS] = self.prefill_chunks
            st.end = step_end
        self.state = DECODING
        self.usual = False  # until its decode stage opens (_open_run)
        self.last_step_end = step_end
        self.stage = None
        self.run_start = step_end
        if emit:
            self._emit(step_end, 1)

    def _resume_decode(self, step_start: int) -> None:
        """A decode member that was not decoding: its prefill ended without the engine
        saying so (close it at its last step and count that step's token, unless the
        engine emitted it itself meanwhile), or it resumes after an eviction without
        recomputing (swapped back in)."""
        if self.state == PREFILL:
            end = self.prefill_end or step_start
            self._prefill_done(end, self.output == self.run_output)
            return
        self._close(step_start)
        self.state = DECODING
        self.usual = False  # until its decode stage opens (_open_run)
        self.run_start = step_start

    def _open_run(self) -> None:
        """The decode run's first decode step ended: its stage, from the run's start."""
        self.stage = self._open(_DECODE, self.run_start)
        self.run_start = 0
        self.usual = self.state == DECODING and self.emit_tokens is None

    def _prefill_target(self) -> int | None:
        """Tokens the current prefill run must process: the prompt, plus what was
        generated before an eviction when it recomputes; None when the prompt is unknown."""
        if self.prompt_tokens is None:
            return None
        return self.prompt_tokens + (self.output if self.preemptions else 0)

    def _open(self, name: str, start: int) -> StageRecord | None:
        rec = self.rec
        if rec.finished:  # the request ended first (a client that went away)
            return None
        if len(rec.stages) >= MAX_STAGES:  # a request evicted over and over
            rec.stages_dropped += 1
            return None
        st = StageRecord(name, None, start, {})
        rec.stages.append(st)
        return st

    def _close(self, when: int) -> None:
        st = self.stage
        if st is not None:
            st.end = when
            self.stage = None

    def _close_run(self, now: int) -> None:
        """End the open run: a decode run at its last step, a prefill run (cut short by an
        eviction) now, a wait (queue, preempted) now."""
        self.run_start = 0
        self.usual = False
        st = self.stage
        if st is None:
            return
        if self.state == DECODING:
            st.end = self.last_step_end or now
        else:
            if self.state == PREFILL:
                st.attrs[semconv.ATTR_PREFILL_TOKENS] = self.prefilled
                st.attrs[semconv.ATTR_PREFILL_CHUNKS] = self.prefill_chunks
            st.end = now
        self.stage = None

    def _end(self, cancelled: bool) -> None:
        rec = self.rec
        if rec is None or self.state == DONE:
            return
        now = _time_ns()
        self._close_run(now)
        self.state = DONE
        self.cancelled = cancelled
        engine = self.engine
        if engine is not None:
            engine._request_ended(self)
        if self.own and not rec.finished:
            try:
                rec.end = now
                rec.runtime.finish_request(rec)
            except Exception:
                _logger.exception("inferprof could not end a generating request")
        if rec.finished:  # its spans are made (or discarded): no cycle left for the GC
            rec.generation = None

    def complete(self, rec: Any) -> None:
        """The request is kept: its generation attributes (RequestRecord._complete)."""
        rec.attrs.update(generation_attributes(rec, None))


def merge_pairs(times: list[int], tokens: list[int]) -> int:
    """Merge consecutive entries pairwise, in place, keeping the first one as it is (the
    first token's time stays exact): each merged entry keeps the later time and the summed
    tokens. Returns the number of merges."""
    n = len(times)
    if n < 3:
        return 0
    new_t, new_k = [times[0]], [tokens[0]]
    merges = 0
    i = 1
    while i + 1 < n:
        new_t.append(times[i + 1])
        new_k.append(tokens[i] + tokens[i + 1])
        merges += 1
        i += 2
    if i < n:
        new_t.append(times[i])
        new_k.append(tokens[i])
    times[:] = new_t
    tokens[:] = new_k
    return merges


def emission_attributes(
    start: int, times: list[int], tokens: list[int] | None, merged: int = 0
) -> dict[str, Any]:
    """``inferprof.gen.emit_offsets_s`` (and ``emit_tokens``, ``emit_merged``) of a request
    that started at ``start`` (ns) and emitted at ``times`` (ns); capped at
    ``GEN_MAX_EMIT_ENTRIES`` entries by pairwise merges."""
    times = list(times)
    tokens = list(tokens) if tokens is not None else None
    while len(times) > semconv.GEN_MAX_EMIT_ENTRIES:
        if tokens is None:
            tokens = [1] * len(times)
        merged += merge_pairs(times, tokens)
    if times and min(times) >= start:  # (C loops: no Python step per entry)
        offsets = list(map(_truediv, map(_sub, times, repeat(start)), repeat(1e9)))
    else:
        offsets = [max(0, t - start) / 1e9 for t in times]
    attrs: dict[str, Any] = {semconv.ATTR_GEN_EMIT_OFFSETS_S: offsets}
    if tokens is not None and any(k != 1 for k in tokens):
        attrs[semconv.ATTR_GEN_EMIT_TOKENS] = tokens
    if merged:
        attrs[semconv.ATTR_GEN_EMIT_MERGED] = merged
    return attrs


def token_count(tokens: Any) -> int:
    """A token count an engine passes, as an int: numpy's and torch's integers are read as
    the ints they are (the OTLP encoding takes plain ints only); a bool, a fraction or a
    negative count raises ``ValueError`` (as ``prompt_tokens`` does)."""
    if not isinstance(tokens, bool):
        try:
            n = operator.index(tokens)
        except TypeError:
            pass
        else:
            if n >= 0:
                return n
    raise ValueError(f"a token count must be a non-negative int, got {tokens!r}")


def generation_attributes(
    rec: Any, transport: tuple[list[int], list[int] | None, int] | None
) -> dict[str, Any]:
    """A kept request's generation attributes (for its request span).

    ``transport``: the times (ns) at which the response's chunks left the service, the
    tokens of each (None: one each) and the merges already made, from the HTTP middleware; they
    win over the engine's
    own emissions (:class:`Generation`). The engine's handle, when there is one, gives the
    token counts, the engine id and the preemptions.
    """
    gen = rec.generation
    attrs: dict[str, Any] = {}
    start = _span_start(rec)
    if gen is not None:
        engine = gen.engine
        if engine is not None:
            engine._request_kept(gen)  # the steps it is a member of follow at once
            # the steps its gaps are split by go out no later than its trace (§14)
            engine.flush()
        st = gen.stage
        if st is not None and st.end is None and gen.state == DECODING and gen.last_step_end:
            # the response ended before the engine said finish(): the run ended at its
            # last step, not at the request's end
            st.end = gen.last_step_end
        attrs[semconv.ATTR_ENGINE_ID] = gen.engine_id
        if gen.prompt_tokens is not None:
            attrs[semconv.ATTR_TOKENS_PROMPT] = gen.prompt_tokens
        if gen.preemptions:
            attrs[semconv.ATTR_GEN_PREEMPTIONS] = gen.preemptions
        if gen.cancelled:
            attrs[semconv.ATTR_CANCELLED] = True
    if transport is not None and transport[0]:
        times, tokens, merged = transport
        attrs.update(emission_attributes(start, times, tokens, merged))
        if gen is not None and gen.output:
            attrs[semconv.ATTR_TOKENS_OUTPUT] = gen.output
        else:
            attrs[semconv.ATTR_TOKENS_OUTPUT] = sum(tokens) if tokens is not None else len(times)
    elif gen is not None:
        attrs[semconv.ATTR_TOKENS_OUTPUT] = gen.output
        if gen.emits:
            attrs.update(
                emission_attributes(start, gen.emits, gen.emit_tokens, gen.merged)
            )
    # read once: record -> handle -> record is a cycle the GC need not find
    rec.generation = None
    return attrs


def _span_start(rec: Any) -> int:
    """When the request span started (ns): the offsets count from it (§14). Another
    instrumentation's span that inferprof enriches opened before the record did."""
    live = rec.live_span
    if live is not None:
        t = getattr(live, "start_time", None)
        if isinstance(t, int) and t > 0:
            return t
    return int(rec.start)


__all__ = ["Generation", "emission_attributes", "generation_attributes", "merge_pairs",
           "token_count"]
