"""The step API for continuous-batching engines: ``inferprof.Engine``.

An engine loop takes one step after another; each step runs one batch whose members are
requests in prefill (a chunk of their prompt) or in decode (one token each). Requests join
and leave between steps, and may be evicted from the KV cache and taken again later. The
loop reports that as it happens::

    engine = inferprof.Engine("0")

    gen = engine.request(prompt_tokens=len(ids))        # where the request arrives
    ...
    with engine.step(kv_cache_usage=used / total) as step:   # in the engine loop
        step.prefill(gen_a, 512)                        # a prefill chunk of 512 tokens
        step.decode(gen_b)                              # one decode token
        with inferprof.stage("compute"):
            logits = model(batch)
    gen_b.preempt()                                     # evicted
    gen_a.finish()                                      # or gen_a.cancel()

In ``full`` mode each step becomes one ``inferprof.engine_step`` span, the root of a trace
of its own, with the step's stages (``h2d``, ``compute``, ``d2h``) as children (a trace
viewer shows each step). In ``production`` mode a step is one row appended to the engine's
buffer, and one ``inferprof.engine_steps`` span carries up to ``STEPS_PER_SPAN`` of them as
arrays (its stages are not sent: the collector does not read them). Each request gets its
``queue``, ``prefill``, ``decode`` and ``preempted`` stage spans and, per output token, one
timestamp (:mod:`inferprof.instrumentation.generation`). Contract §14 is the encoding.

The buffer is sent when it holds ``STEPS_PER_SPAN`` steps, when its oldest step is
``STEPS_MAX_WAIT_S`` old at a step's end, when a request of the engine is kept (before its
trace: the collector splits that request's gaps by these steps; at the end of a step it
was a member of that still ran then), when the engine's last
open request ends (an engine going idle), on :meth:`Engine.flush` and on
``inferprof.shutdown()``.

Cost: per token, a few attribute updates and one list append (no span, no lock); per step,
in ``full`` one span built like the request spans (runtime module docstring), less than the
OpenTelemetry SDK's ``start_span()``/``end()``; in ``production`` one tuple appended, and a
span per many steps. ``benchmarks/generation_cost.py`` measures both. In ``production``
mode a step none of whose members is timed records nothing; with inferprof off (or not
configured) every call returns at once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from itertools import repeat
from operator import sub as _sub
from operator import truediv as _truediv
from typing import Any, Literal

from opentelemetry.trace import SpanKind

from inferprof import semconv
from inferprof._version import __version__
from inferprof.instrumentation.active import active_runtime
from inferprof.instrumentation.asyncio_compat import running_loop
from inferprof.instrumentation.generation import (
    COMPACT_AT,
    DECODING,
    DONE,
    PREFILL,
    Generation,
    token_count,
)
from inferprof.instrumentation.records import (
    QUIET,
    SCOPE,
    UNTIMED,
    RequestRecord,
    StageRecord,
    SummaryRecord,
    span_id_of,
)
from inferprof.instrumentation.spans import SpanSpec, error_parts, new_span_id, new_trace_id
from inferprof.instrumentation.stage import begin_request, timed_share

_logger = logging.getLogger(__name__)
_time_ns = time.time_ns
_INTERNAL = SpanKind.INTERNAL

#: The handle of a request that is not recorded (one, shared: it records nothing).
_UNTIMED = Generation("", None, False, None, 0)
#: Production mode's compact step spans (contract §14): steps one span carries at most,
#: and how long a recorded step waits for its span while the engine keeps stepping.
STEPS_PER_SPAN = 256
STEPS_MAX_WAIT_S = 0.5
_MAX_WAIT_NS = int(STEPS_MAX_WAIT_S * 1e9)
#: A KV-cache entry of a step recorded without a reading (outside 0..1: none, §14).
_NO_KV = -1.0
#: Step.decode()'s usual token count, compared by identity: the default argument and any
#: other int 1 are this object (CPython shares small ints); anything else equal to 1 (a
#: numpy int, True, 1.0) takes the checked path.
_ONE = 1


class Engine:
    """The recorder of one engine instance: ``inferprof.Engine(engine_id="0")``.

    ``engine_id`` (``inferprof.engine.id``) tells apart engines of one service instance;
    ``model``: ``inferprof.model.name`` of the requests this engine opens itself (those
    that arrive outside any request, see :meth:`request`); ``kv_cache_usage``: a
    callable returning the KV cache's blocks in use over its total (0..1), read when
    metrics are collected into the ``inferprof.engine.kv_cache.usage`` gauge (contract §14;
    the step attribute ``Engine.step(kv_cache_usage=)`` is the cheaper alternative).
    """

    __slots__ = ("__weakref__", "_flush_lock", "_gauge_on", "_keeps", "_kept_live", "_live",
                 "_rows", "_rows_rt",
                 "_warned_second", "engine_id", "kv_cache_usage", "model")

    def __init__(self, engine_id: str = semconv.DEFAULT_ENGINE_ID, *, model: str | None = None,
                 kv_cache_usage: Callable[[], float] | None = None) -> None:
        if not isinstance(engine_id, str) or not engine_id:
            raise ValueError(f"engine_id must be a non-empty string, got {engine_id!r}")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"model must be a string, got {model!r}")
        if kv_cache_usage is not None and not callable(kv_cache_usage):
            raise ValueError(f"kv_cache_usage must be callable, got {kv_cache_usage!r}")
        self.engine_id = engine_id
        self.model = model
        self.kv_cache_usage = kv_cache_usage
        self._warned_second = False
        #: the meter provider the gauge is registered with (once per provider)
        self._gauge_on: Any = None
        #: production mode's recorded steps not sent yet: (start ns, end ns, prefill
        #: tokens, decode tokens, members, KV usage or None); appended by the stepping
        #: thread, taken by whichever thread flushes (a deque: both are atomic)
        self._rows: deque[tuple[int, int, int, int, int, float | None]] = deque()
        #: the runtime the rows were recorded under
        self._rows_rt: Any = None
        self._flush_lock = threading.Lock()
        #: timed requests opened and not ended (0: the engine is idle, its steps go out)
        self._live = 0
        #: Step._member_kept asks its members only when one may have been kept: when this
        #: engine's requests kept (its trace sent) changed while the step ran, or when a
        #: request kept before it ended is still open (``_kept_live``; its stores and pops
        #: are atomic). Neither, as in most steps: no member's request was.
        self._keeps = 0
        #: (a dict used as an ordered set: insertion order says which are the oldest)
        self._kept_live: dict[Generation, None] = {}
        if hasattr(os, "register_at_fork"):
            weak = weakref.WeakMethod(self._after_fork)
            os.register_at_fork(after_in_child=lambda: (m := weak()) and m())

    def _after_fork(self) -> None:
        # The steps held at the fork are the parent's to send (as its span queue is); the
        # parent's flushing thread may have held the lock.
        self._rows = deque()
        self._flush_lock = threading.Lock()
        self._live = 0
        # (_keeps and _kept_live stay: a request kept in the parent is kept in the child's
        # copy of its record too, and a step of the child with it as a member goes out at
        # once, as its record says)

    def request(self, *, prompt_tokens: int | None = None) -> Generation:
        """A request arrives for this engine: its handle. Its ``queue`` stage starts now.

        Call it in the request's context (the FastAPI handler, ``inferprof.request()``):
        the stages and attributes go into that request. Outside any request, the handle
        opens a request of its own (``inferprof.request``), ended by ``finish()`` or
        ``cancel()``. ``prompt_tokens`` lets the recorder see where prefill ends.
        """
        if prompt_tokens is not None and (type(prompt_tokens) is not int or prompt_tokens < 0):
            prompt_tokens = token_count(prompt_tokens)
        scope = SCOPE.get()
        if scope is UNTIMED:
            return _UNTIMED
        if scope is not None and scope[0].__class__ is SummaryRecord:
            scope[0].broken = True  # a generation is not summarised: only counted
            return _UNTIMED
        rt = active_runtime()
        if rt is None:
            return _UNTIMED
        try:
            return self._open(rt, scope, prompt_tokens)
        except Exception:
            _logger.exception("inferprof could not record a generating request")
            return _UNTIMED

    def _open(self, rt: Any, scope: Any, prompt_tokens: int | None) -> Generation:
        now = _time_ns()
        owner = scope[0] if scope is not None else None
        if isinstance(owner, RequestRecord) and not owner.finished:
            if owner.generation is not None:
                self._warn_second()
                return _UNTIMED
            gen = Generation(self.engine_id, owner, False, prompt_tokens, now)
            gen.engine = self
            self._live += 1
            owner.generation = gen
            return gen
        name = semconv.REQUEST_SPAN_NAME
        share = timed_share(rt, (name, self.model))
        if not share:
            return _UNTIMED
        attrs: dict[str, Any] = {}
        if self.model is not None:
            attrs[semconv.ATTR_MODEL_NAME] = self.model
        rec = begin_request(rt, name, _INTERNAL, attrs, None, now)
        if share < 1.0:
            rec.weight_hint = 1.0 / share
        gen = Generation(self.engine_id, rec, True, prompt_tokens, now)
        gen.engine = self
        self._live += 1
        rec.generation = gen
        return gen

    def _warn_second(self) -> None:
        if not self._warned_second:
            self._warned_second = True
            _logger.warning(
                "inferprof: Engine.request() was called twice in one request; the second "
                "generation records nothing (one generation per request)")

    def step(self, *, kv_cache_usage: float | None = None) -> Step | _NoopStep:
        """One engine step: ``with engine.step() as step:``. ``kv_cache_usage``: KV-cache
        blocks in use over the total at the step's start (0..1), when the engine knows."""
        if kv_cache_usage is not None and (
            kv_cache_usage.__class__ is not float or not 0.0 <= kv_cache_usage <= 1.0
        ) and (  # (a float in range, the usual reading, is accepted by the check above)
            isinstance(kv_cache_usage, bool) or not isinstance(kv_cache_usage, (int, float))
            or not 0.0 <= kv_cache_usage <= 1.0
        ):
            raise ValueError(f"kv_cache_usage must be a number in [0, 1], got {kv_cache_usage!r}")
        rt = active_runtime()
        if rt is None:
            return _NOOP_STEP
        if self.kv_cache_usage is not None and self._gauge_on is not rt.meter_provider:
            self._gauge_on = rt.meter_provider
            register_kv_gauge(rt.meter_provider, self.engine_id, self.kv_cache_usage)
        return Step(rt, self, kv_cache_usage)

    def flush(self) -> None:
        """Send the steps recorded and not sent yet (production mode's compact step spans,
        contract §14) now. Any thread; never raises."""
        try:
            with self._flush_lock:
                rows = self._rows
                taken = [rows.popleft() for _ in range(len(rows))]
                rt = self._rows_rt
            if taken and rt is not None:
                rt.emit_trace(new_trace_id(), [_steps_spec(self.engine_id, taken)])
        except Exception:
            _logger.exception("inferprof could not send an engine's steps")

    def _add_row(self, step: Step) -> None:
        """A production step (no error): one row; the rows go out as one span per many."""
        rt = step.rt
        if rt is not self._rows_rt:  # reconfigured: the old rows go to their runtime
            self.flush()
            self._rows_rt = rt
            rt.step_buffers.add(self)  # what it holds then goes out on shutdown
        rows = self._rows
        end = step.end
        rows.append((step.start, end, step.prefill_tokens, step.decode_tokens, step.requests,
                     step.kv))
        try:
            full = len(rows) >= STEPS_PER_SPAN or end - rows[0][0] >= _MAX_WAIT_NS
        except IndexError:  # another thread flushed them meanwhile
            return
        if full:
            self.flush()

    def _request_kept(self, gen: Generation) -> None:
        """The request of ``gen`` was kept: its trace goes out now."""
        self._keeps += 1
        if gen.state != DONE:
            kept = self._kept_live
            if len(kept) >= KEPT_LIVE_MAX:
                _forget_kept(kept)
            kept[gen] = None

    def _request_ended(self, gen: Generation) -> None:
        """A timed request of this engine ended; the last one sends the steps (an engine
        that goes idle would hold them until its next step)."""
        kept = self._kept_live
        if gen in kept:
            # A step it is a member of may be running (it was cancelled from another
            # thread): that step still asks its members (counted first, then removed).
            self._keeps += 1
            kept.pop(gen, None)
        self._live -= 1
        if self._live <= 0:
            self._live = 0
            if self._rows:
                self.flush()



def _member_done(gen: Generation, tokens: int, end: int) -> None:
    """A decode member of a step that ended at ``end``: it emits ``tokens``."""
    if gen.state == DONE:  # cancelled while the step ran
        return
    gen.last_step_end = end
    if gen.run_start:
        gen._open_run()
    if tokens == 1 and gen.emit_tokens is None:  # the usual token: Generation._emit
        emits = gen.emits
        emits.append(end)
        gen.output += 1
        if len(emits) >= COMPACT_AT:
            gen._compact()
    elif tokens:
        gen._emit(end, tokens)


#: Step._token of a step named in records.QUIET rather than set in SCOPE.
_QUIET_TOKEN = object()

#: Requests kept and still generating that an engine remembers (``Engine._kept_live``) at
#: most. An engine that drops requests without ``finish()`` or ``cancel()`` must not grow
#: it without bound: past it, those that ended are forgotten, then the oldest. (A step
#: asks its members whenever the engine remembers any: one with a forgotten member then
#: goes out at once all the same.)
KEPT_LIVE_MAX = 1024


def _forget_kept(kept: dict[Generation, None]) -> None:
    """Make room in a full ``Engine._kept_live``: drop the requests that ended, then the
    oldest. (``list()`` copies in one step: other threads add and pop meanwhile.)"""
    for gen in list(kept):
        if gen.state == DONE:
            kept.pop(gen, None)
    excess = len(kept) - KEPT_LIVE_MAX + 1
    if excess > 0:
        for gen in list(kept)[:excess]:
            kept.pop(gen, None)


class Step:
    """One engine step (``Engine.step()``): its members and its stages.

    ``prefill()``/``decode()`` add a member; ``inferprof.stage()`` blocks inside the
    ``with`` become the step's stages. Exceptions are recorded on the step span and
    re-raised unchanged; the members of a step that raised emit no token.
    """

    __slots__ = (
        "_decoders",
        "_keeps",
        "_prefills",
        "_special",
        "_token",
        "decode_tokens",
        "end",
        "engine",
        "error",
        "finished",
        "kv",
        "prefill_tokens",
        "requests",
        "rt",
        "stages",
        "stages_dropped",
        "start",
        "timed",
    )

    def __init__(self, rt: Any, engine: Engine, kv_cache_usage: float | None) -> None:
        self.rt = rt
        self.engine = engine
        self._keeps = engine._keeps  # (Engine._keeps)
        self.kv = kv_cache_usage
        self.start = self.end = 0
        self.prefill_tokens = self.decode_tokens = self.requests = 0
        #: a member is recorded (production mode emits only such steps)
        self.timed = False
        # What Stage.__enter__ reads and writes of its owner: the list is made when the step
        # becomes the scope's owner (__enter__, __aenter__); a quiet step (records.QUIET)
        # records no stage, and a tuple takes none.
        self.stages: list[StageRecord] = ()  # type: ignore[assignment]
        self.stages_dropped = 0
        self.finished = False
        #: decode members, in order: a handle decoding one token emitted at the step's end
        #: (the usual member: counted at the end), else (handle, tokens emitted then);
        #: ``_special``: how many of the latter
        self._decoders: list[Any] = []  # Generation | tuple[Generation, int]
        self._special = 0
        #: prefill members: (handle, emit its first token / None: its prompt goes on)
        self._prefills: list[tuple[Generation, bool | None]] = []
        self._token: Any = None
        self.error: Any = None

    @property
    def engine_id(self) -> str:
        """The engine's ``engine_id``."""
        return self.engine.engine_id

    # --- members ----------------------------------------------------------------------
    def prefill(self, gen: Generation, tokens: int, *, final: bool | None = None,
                emit: bool = True) -> None:
        """``gen`` processes a prefill chunk of ``tokens`` prompt tokens in this step.

        ``final``: this chunk completes the prompt, and the step samples the request's
        first token (emitted at the step's end, unless ``emit=False``). Default: when the
        request's ``prompt_tokens`` are known, once this run has processed them all (plus
        the tokens generated before an eviction, when it recomputes); else the prefill
        ends when the request first decodes.
        """
        if type(tokens) is not int or tokens < 0:
            tokens = token_count(tokens)
        self.prefill_tokens += tokens
        self.requests += 1
        if gen.rec is None:
            return
        self.timed = True
        state = gen.state
        if state != PREFILL:
            if state in (DONE, DECODING):
                return
            gen._admit(self.start)  # QUEUED or PREEMPTED: admitted in this step
        gen.prefilled += tokens
        gen.prefill_chunks += 1
        if final is None:
            target = gen._prefill_target()
            final = target is not None and gen.prefilled >= target
        # (handle, whether its first token is emitted; None: the prompt is not done yet)
        self._prefills.append((gen, emit if final else None))

    def decode(self, gen: Generation, tokens: int = 1, *, emit: bool = True) -> None:
        """``gen`` generates ``tokens`` (usually 1; more with speculative decoding) in this
        step; emitted at the step's end unless ``emit=False`` (then ``gen.emit()``)."""
        if tokens is _ONE and emit is True and gen.usual:
            # The usual member (Generation.usual; a timed handle): its counts are added at
            # the step's end, with its token.
            self._decoders.append(gen)
            return
        if type(tokens) is not int or tokens < 0:
            tokens = token_count(tokens)
        self.decode_tokens += tokens
        self.requests += 1
        if gen.rec is None:
            return
        self.timed = True
        if gen.state != DECODING:
            if gen.state == DONE:
                return
            gen._resume_decode(self.start)
        self._decoders.append((gen, tokens if emit else 0))
        self._special += 1

    # --- context manager -----------------------------------------------------------------
    def __enter__(self) -> Step:
        if self.rt.production and SCOPE.get() is None and running_loop() is None:
            # a step of a thread running no event loop (it runs no other task's code
            # before it exits), outside any scope and any other such step: named in QUIET,
            # SCOPE left unset (records.QUIET)
            quiet = QUIET.step
            if quiet is None or quiet.finished:  # (records.in_quiet_step)
                QUIET.step = self
                self._token = _QUIET_TOKEN
                self.start = _time_ns()
                return self
        self.stages = []
        self._token = SCOPE.set((self, None))
        self.start = _time_ns()
        return self

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        end = self.end = _time_ns()
        self.finished = True
        token = self._token
        if token is _QUIET_TOKEN:
            if QUIET.step is self:
                QUIET.step = None
        elif token is not None:
            try:
                SCOPE.reset(token)
            except ValueError:  # exited in another context
                SCOPE.set(None)
        self._token = None
        if exc is not None:
            self.error = exc
        try:
            usual = len(self._decoders) - self._special
            if usual:  # decode() left their counts to now
                self.decode_tokens += usual
                self.requests += usual
                self.timed = True
            if exc is None:  # a failed step produced no token
                self._members_done(end)
            if not self.rt.production:
                self._emit()
            elif self.timed:
                if self.error is None:
                    engine = self.engine
                    engine._add_row(self)
                    if ((engine._kept_live or engine._keeps != self._keeps)
                            and self._member_kept()):
                        # its trace went out while the step ran, with the steps held then:
                        # this one covers its last gap (§14), so it follows at once
                        engine.flush()
                else:  # a failed step keeps a span of its own, with its error
                    self._emit()
        except Exception:
            _logger.exception("inferprof could not record an engine step")
        return False

    async def __aenter__(self) -> Step:
        # (in a coroutine, always the scope: other tasks run in this thread meanwhile)
        self.stages = []
        self._token = SCOPE.set((self, None))
        self.start = _time_ns()
        return self

    async def __aexit__(self, exc_type, exc, tb) -> Literal[False]:
        return self.__exit__(exc_type, exc, tb)

    def _members_done(self, end: int) -> None:
        if self._special:
            self._special_members_done(end)
        else:
            compact_at = COMPACT_AT
            for gen in self._decoders:  # (all usual members when decode() took them)
                if gen.usual:  # what Generation._emit does, for one token
                    gen.last_step_end = end
                    n = gen.output + 1
                    gen.output = n
                    gen.emits.append(end)
                    if n >= compact_at:
                        gen._compact()
                else:  # changed while the step ran (cancelled, evicted)
                    _member_done(gen, 1, end)
        for gen, emit in self._prefills:
            if gen.state == DONE:  # cancelled while the step ran
                continue
            gen.prefill_end = end
            if emit is not None:
                gen._prefill_done(end, emit)

    def _special_members_done(self, end: int) -> None:
        """The decode members of a step not all of which are usual ones."""
        for member in self._decoders:
            if type(member) is tuple:
                _member_done(member[0], member[1], end)
            else:
                _member_done(member, 1, end)

    def _member_kept(self) -> bool:
        """Whether the request of a member was kept (its trace sent) before the row."""
        kept = self.engine._kept_live
        for gen in list(kept):  # (a copy: other threads add to it)
            if gen.state == DONE:  # it ended while its request was being kept
                kept.pop(gen, None)
        # (plain loops: the interpreter reads slots faster than attrgetter's C calls do)
        if not self._special:
            for gen in self._decoders:
                if gen.rec.kept:
                    return True
        else:
            for m in self._decoders:
                if (m[0] if type(m) is tuple else m).rec.kept:
                    return True
        # (few steps have prefill members: no generator for the others)
        return bool(self._prefills) and any(gen.rec.kept for gen, _ in self._prefills)

    # --- the step's span -------------------------------------------------------------------
    def _emit(self) -> None:
        rt = self.rt
        # The collector reads a step's span, never its stages (contract §14): production
        # mode sends the step span alone, full mode its stages too (for a trace viewer).
        stages = () if rt.production else self.stages
        if stages:
            _resolve_device(stages)
        trace_id = new_trace_id()
        attrs: dict[str, Any] = {
            semconv.ATTR_ENGINE_ID: self.engine_id,
            semconv.ATTR_STEP_PREFILL_TOKENS: self.prefill_tokens,
            semconv.ATTR_STEP_DECODE_TOKENS: self.decode_tokens,
            semconv.ATTR_STEP_REQUESTS: self.requests,
        }
        if self.kv is not None:
            attrs[semconv.ATTR_STEP_KV_CACHE_USAGE] = float(self.kv)
        if self.stages_dropped:
            attrs[semconv.ATTR_STAGES_DROPPED] = self.stages_dropped
        error = self.error
        if error is not None:
            error = error_parts(error, self.end)  # frozen now: no traceback kept queued
        root = new_span_id()
        specs = [SpanSpec(semconv.ENGINE_STEP_SPAN_NAME, root, None, _INTERNAL, self.start,
                          self.end, attrs, error, ())]
        for st in stages:
            # the engine id marks them as step stages to the collector (contract §14)
            st_attrs = {semconv.ATTR_STAGE: st.name, semconv.ATTR_ENGINE_ID: self.engine_id}
            st_attrs.update(st.attrs)
            st_error = st.error
            if st_error is not None:
                st_error = error_parts(st_error, st.end or self.end)
            parent = st.parent
            specs.append(SpanSpec(semconv.span_name(st.name), span_id_of(st),
                                  span_id_of(parent) if parent is not None else root, _INTERNAL,
                                  st.start, st.end or self.end, st_attrs, st_error, ()))
        rt.emit_trace(trace_id, specs)


def _steps_spec(engine_id: str, rows: list[tuple[int, int, int, int, int, float | None]]
                ) -> SpanSpec:
    """The compact step span (§14) of ``rows``: a root span from the first step's start to
    the last one's end, one array entry per step."""
    # by column (C loops: no Python step per row)
    starts, ends, prefill, decode, members, kv = zip(*rows, strict=True)
    start = min(starts)
    end = max(ends)
    attrs: dict[str, Any] = {
        semconv.ATTR_ENGINE_ID: engine_id,
        semconv.ATTR_STEPS_START_OFFSETS_S: list(
            map(_truediv, map(_sub, starts, repeat(start)), repeat(1e9))),
        semconv.ATTR_STEPS_DURATIONS_S: list(map(_truediv, map(_sub, ends, starts), repeat(1e9))),
        semconv.ATTR_STEPS_PREFILL_TOKENS: list(prefill),
        semconv.ATTR_STEPS_DECODE_TOKENS: list(decode),
        semconv.ATTR_STEPS_REQUESTS: list(members),
    }
    if kv.count(None) != len(kv):
        attrs[semconv.ATTR_STEPS_KV_CACHE_USAGE] = [
            float(k) if k is not None else _NO_KV for k in kv]
    return SpanSpec(semconv.ENGINE_STEPS_SPAN_NAME, new_span_id(), None, _INTERNAL, start, end,
                    attrs, None, ())


#: Engines reporting KV-cache usage, per meter provider: one gauge each, one callback.
_KV_READERS: dict[int, tuple[Any, list[tuple[str, Callable[[], float]]]]] = {}


def register_kv_gauge(meter_provider: Any, engine_id: str, read: Callable[[], float]) -> None:
    """Report ``read()`` as ``inferprof.engine.kv_cache.usage{inferprof.engine.id}`` on
    ``meter_provider`` (its gauge made once per provider). Never raises."""
    if meter_provider is None:
        return
    try:
        entry = _KV_READERS.get(id(meter_provider))
        if entry is not None and entry[0] is meter_provider:
            entry[1].append((engine_id, read))
            return
        readers = [(engine_id, read)]
        _KV_READERS[id(meter_provider)] = (meter_provider, readers)
        meter = meter_provider.get_meter(semconv.INSTRUMENTATION_SCOPE, __version__)
        meter.create_observable_gauge(
            semconv.METRIC_ENGINE_KV_CACHE_USAGE,
            callbacks=[lambda _options: _kv_observations(readers)],
            unit="1",
            description="KV-cache blocks in use over blocks in total, per engine",
        )
    except Exception:
        _logger.exception("inferprof could not register the KV-cache gauge")


def _kv_observations(readers: list[tuple[str, Callable[[], float]]]) -> list[Any]:
    from opentelemetry.metrics import Observation

    out = []
    for engine_id, read in list(readers):
        try:
            value = float(read())
        except Exception:  # the engine's callable failed: no reading, never an error
            _logger.exception("inferprof: an engine's kv_cache_usage callable failed")
            continue
        if 0.0 <= value <= 1.0:
            out.append(Observation(value, {semconv.ATTR_ENGINE_ID: engine_id}))
    return out


def _resolve_device(stages: list[StageRecord]) -> None:
    """Device-timed stages (``stage(device="cuda")``) get their GPU times."""
    if any(st.device is not None for st in stages):
        from inferprof.instrumentation.device import resolve_stages

        resolve_stages(stages)


class _NoopStep:
    """``Engine.step()`` with inferprof off or not configured: records nothing."""

    __slots__ = ()

    def prefill(self, gen: Generation, tokens: int, *, final: bool | None = None,
                emit: bool = True) -> None:
        pass

    def decode(self, gen: Generation, tokens: int = 1, *, emit: bool = True) -> None:
        pass

    def __enter__(self) -> _NoopStep:
        return self

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        return False

    async def __aenter__(self) -> _NoopStep:
        return self

    async def __aexit__(self, exc_type, exc, tb) -> Literal[False]:
        return False


_NOOP_STEP = _NoopStep()

__all__ = ["STEPS_MAX_WAIT_S", "STEPS_PER_SPAN", "Engine", "Generation", "Step"]
