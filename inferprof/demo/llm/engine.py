"""The LLM demo's engine: the scheduler and the model driven by one thread.

:meth:`Engine.submit` and :meth:`Engine.cancel` may be called from any thread (the
service calls them on its event loop); everything else happens on the engine thread,
which blocks when there is nothing to do. Each step's new tokens are handed to
``deliver`` once per step, as a list of :class:`Delivery` — the service's ``deliver``
does one ``loop.call_soon_threadsafe`` per step, not one per token.

The thread starts in a fresh ``contextvars.Context``: the engine serves many requests
at once, and no request's context (its trace) may leak into the engine's own work
(docs/batching.md, "start loops in a fresh context").
"""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from inferprof.demo.llm.instrument import EngineInstrument
from inferprof.demo.llm.model import StepItem, TinyLM
from inferprof.demo.llm.request import GenRequest, ScheduledItem
from inferprof.demo.llm.scheduler import Scheduler

_log = logging.getLogger(__name__)

FINISH_LENGTH = "length"
FINISH_ERROR = "error"


@dataclass(frozen=True)
class Delivery:
    """What one step produced for one request: new tokens, and why it ended if it did."""

    request: GenRequest
    tokens: tuple[int, ...]
    finish_reason: str | None = None


@dataclass
class EngineCounts:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    evictions: int = 0
    finished: int = 0
    cancelled: int = 0


class Engine:
    """Continuous batching over a :class:`TinyLM` with a paged KV cache."""

    def __init__(self, model: TinyLM, scheduler: Scheduler,
                 deliver: Callable[[list[Delivery]], None],
                 instrument: EngineInstrument | None = None) -> None:
        self.model = model
        self.scheduler = scheduler
        self.instrument = instrument or scheduler.instrument
        scheduler.instrument = self.instrument
        # The scheduler's allocator hands out this cache's blocks: one budget.
        self.cache = model.new_cache(scheduler.allocator.num_blocks, scheduler.block_size)
        self._deliver = deliver
        self._inbox: queue.SimpleQueue[tuple[str, GenRequest] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.counts = EngineCounts()

    # --- any thread ---------------------------------------------------------------

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """ValueError when such a request could never run (too long for cache or model)."""
        if prompt_tokens + max_tokens > self.model.config.max_seq_len:
            raise ValueError(f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) "
                             f"exceeds the model's {self.model.config.max_seq_len} positions")
        self.scheduler.check(prompt_tokens, max_tokens)

    def submit(self, prompt: Sequence[int], max_tokens: int, stream: object = None) -> GenRequest:
        """Queue a request; its tokens arrive through ``deliver`` with ``stream`` on it."""
        self.check(len(prompt), max_tokens)
        req = GenRequest(list(prompt), max_tokens, stream)
        req.telemetry = self.instrument.arrive(req)
        self._inbox.put(("add", req))
        return req

    def cancel(self, req: GenRequest) -> None:
        self._inbox.put(("cancel", req))

    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=contextvars.Context().run, args=(self._run,),
                                            name="inferprof-demo-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    # --- the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            if not self._drain(block=self.scheduler.idle):
                break
            try:
                self._step()
            except Exception:
                _log.exception("engine step failed; failing the requests in it")
                self._fail_all()
        self._fail_all()

    def _drain(self, block: bool) -> bool:
        """Take new requests and cancellations; False when asked to stop."""
        while True:
            try:
                msg = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if msg is None:
                return False
            kind, req = msg
            if kind == "add":
                self.scheduler.add(req)
            elif self.scheduler.cancel(req):
                self.counts.cancelled += 1

    def poll(self) -> list[Delivery]:
        """Take what was submitted or cancelled, then run one step; for driving the engine
        without its thread (tests). Returns what the step delivered."""
        if not self._drain(block=False):
            self._stopping = True
            return []
        return self._step()

    def _step(self) -> list[Delivery]:
        sched = self.scheduler
        items = sched.schedule()
        if not items:
            return []
        token = self.instrument.step_begin(items, sched.allocator.usage)
        error: BaseException | None = None
        try:
            logits = self.model.step(
                [StepItem(it.request.blocks, it.start,
                          [it.request.token_at(p) for p in range(it.start, it.start + it.count)])
                 for it in items],
                self.cache, logits_for=[it.samples for it in items])
            sampled = {it.request.id: int(t)
                       for it, t in zip(items, np.argmax(logits, axis=-1), strict=False)
                       if it.samples}
            finished = sched.advance(items, sampled)
        except BaseException as exc:
            error = exc
            raise
        finally:
            self.instrument.step_end(token, items, error)
        self._count(items, finished)
        deliveries = []
        done = {r.id for r in finished}
        for it in items:
            req = it.request
            tok = sampled.get(req.id)
            if tok is None:
                continue
            self.instrument.emit(req, (tok,))
            reason = FINISH_LENGTH if req.id in done else None
            if reason:
                self.instrument.finish(req)
            deliveries.append(Delivery(req, (tok,), reason))
        if deliveries:
            self._deliver(deliveries)
        return deliveries

    def _count(self, items: list[ScheduledItem], finished: list[GenRequest]) -> None:
        c = self.counts
        c.steps += 1
        for it in items:
            if it.prefill:
                c.prefill_tokens += it.count
            else:
                c.decode_tokens += it.count
        c.evictions = self.scheduler.evictions
        c.finished += len(finished)

    def _fail_all(self) -> None:
        failed = [*self.scheduler.running, *self.scheduler.waiting]
        for req in failed:
            self.scheduler.cancel(req, failed=True)
        if failed:
            self._deliver([Delivery(r, (), FINISH_ERROR) for r in failed])


__all__ = ["FINISH_ERROR", "FINISH_LENGTH", "Delivery", "Engine", "EngineCounts"]
