"""``DynamicBatcher``: an asyncio dynamic batcher (the Triton / BentoML / Ray Serve pattern).

Requests call ``await batcher.submit(item)``; a background task forms a batch when
``max_batch_size`` items wait or the oldest has waited ``max_delay_ms``, runs
``collate(items)`` then ``fn(batch)`` and hands result ``i`` back to request ``i``. At most
``max_concurrent_batches`` batches run at once; while they run, new requests keep queueing,
so the next batch forms as soon as a slot frees.

A sync ``fn`` (and its ``collate``) runs on the batcher's own worker threads, so the event
loop keeps admitting requests while the model runs; an async ``fn`` runs on the loop.

Telemetry comes from the hooks in ``inferprof.batching.hooks``: per request a ``queue``
stage with ``inferprof.queue.depth``; per batch ``batch_assembly`` around ``collate`` (with
``inferprof.tokens.*``) and whatever stages ``fn`` marks with ``inferprof.stage`` (``h2d``,
``compute``, ``d2h``...), which see the batch as current. The batcher works the same with
inferprof off.

Failure semantics: a request cancelled while waiting leaves the queue (its ``queue`` stage
ends with ``inferprof.cancelled``); a request cancelled after its batch formed just stops
waiting. An exception from ``collate``/``fn`` fails that batch's requests only, with the
error on their spans; the batcher keeps serving.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

from inferprof import semconv
from inferprof.batching.forming import batch_ready
from inferprof.batching.hooks import Batch, QueueHandle, _enqueue
from inferprof.instrumentation.config import batch_encoding_setting
from inferprof.instrumentation.records import SummaryRecord

_logger = logging.getLogger(__name__)
_ATTR_BEHIND = semconv.ATTR_QUEUE_BEHIND_BATCHES_S


@dataclass(frozen=True)
class Collated:
    """What ``collate`` may return to report token counts alongside the batch."""

    batch: Any
    tokens_effective: int | None = None
    tokens_padded: int | None = None


class _Entry:
    __slots__ = ("busy0", "future", "handle", "item", "t", "taken", "tokens")

    def __init__(
        self, item: Any, tokens: int | None, handle: QueueHandle, future: asyncio.Future
    ) -> None:
        self.item = item
        self.tokens = tokens
        self.handle = handle
        self.future = future
        self.taken = False
        self.t = time.monotonic()
        self.busy0 = 0.0


class DynamicBatcher:
    """Batch concurrent ``submit()`` calls into calls of ``fn(batch) -> sequence of results``."""

    def __init__(
        self,
        fn: Callable[[Any], Sequence[Any]] | Callable[[Any], Awaitable[Sequence[Any]]],
        *,
        max_batch_size: int,
        max_delay_ms: float,
        collate: Callable[[list], Any] | None = None,
        model_name: str | None = None,
        batch_encoding: str | None = None,
        max_queue_size: int | None = None,
        max_concurrent_batches: int = 1,
    ) -> None:
        if not callable(fn):
            raise ValueError(f"fn must be callable, got {fn!r}")
        if collate is not None and not callable(collate):
            raise ValueError(f"collate must be callable, got {collate!r}")
        if (
            isinstance(max_batch_size, bool)
            or not isinstance(max_batch_size, int)
            or max_batch_size < 1
        ):
            raise ValueError(f"max_batch_size must be a positive int, got {max_batch_size!r}")
        if (
            isinstance(max_delay_ms, bool)
            or not isinstance(max_delay_ms, (int, float))
            or max_delay_ms < 0
        ):
            raise ValueError(f"max_delay_ms must be a number >= 0, got {max_delay_ms!r}")
        if max_queue_size is not None and (
            isinstance(max_queue_size, bool)
            or not isinstance(max_queue_size, int)
            or max_queue_size < 1
        ):
            raise ValueError(f"max_queue_size must be a positive int, got {max_queue_size!r}")
        if (
            isinstance(max_concurrent_batches, bool)
            or not isinstance(max_concurrent_batches, int)
            or max_concurrent_batches < 1
        ):
            raise ValueError(
                f"max_concurrent_batches must be a positive int, got {max_concurrent_batches!r}"
            )
        if model_name is not None and not isinstance(model_name, str):
            raise ValueError(f"model_name must be a string, got {model_name!r}")
        self.fn = fn
        self.collate = collate
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_ms / 1000.0
        self.model_name = model_name
        self.batch_encoding = (
            batch_encoding_setting(batch_encoding) if batch_encoding is not None else None
        )
        self.max_queue_size = max_queue_size
        self.max_concurrent_batches = max_concurrent_batches
        # an async callable object counts too (its __call__ is a coroutine function)
        self._is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            type(fn).__call__
        )
        self._queue: collections.deque[_Entry] = collections.deque()
        # set by start(), before anything reads them
        self._wakeup: asyncio.Event = None  # type: ignore[assignment]
        self._task: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._slots: asyncio.Semaphore = None  # type: ignore[assignment]
        self._inflight: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        # Time every slot was running a batch, as a clock: _busy_at(t2) - _busy_at(t1) is
        # how long of [t1, t2] a request could not have had a slot. Touched on the loop only.
        self._running = 0
        self._busy = 0.0
        self._busy_since = 0.0

    # --- lifecycle ---------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        """Start the batching task on the running event loop (``submit`` does it if needed)."""
        loop = asyncio.get_running_loop()
        if self.running and self._loop is loop:
            return
        if self._loop is not loop:
            if self._loop is not None:
                # Started on an event loop that is gone (a test's asyncio.run, a reloaded
                # server): its task and waiters cannot be resumed from here; start afresh.
                self._queue.clear()
                self._inflight.clear()
            self._slots = asyncio.Semaphore(self.max_concurrent_batches)
            self._running, self._busy = 0, 0.0
        # Restarted on the same loop (a submit() while stop() waits for running batches):
        # those batches still hold their slots and will release them, so the semaphore and
        # the busy clock carry on.
        self._loop = loop
        self._wakeup = asyncio.Event()
        if not self._is_async and self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=self.max_concurrent_batches, thread_name_prefix="inferprof-batcher"
            )
        # A fresh context: the loop must not inherit the request that happened to start it.
        self._task = contextvars.Context().run(loop.create_task, self._run_loop())

    async def stop(self) -> None:
        """Stop batching: wait for running batches, fail requests still queued."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError as exc:
                # The task keeps this error (Python 3.12 re-raises the same object), and its
                # traceback holds this frame and our callers' frames with their locals
                # (requests' records and queue handles) for as long as the task lives.
                exc.__traceback__ = None
            task = None
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)
        while self._queue:
            entry = self._queue.popleft()
            entry.handle.cancel()
            if not entry.future.done():
                entry.future.set_exception(
                    RuntimeError("DynamicBatcher stopped before this request was batched")
                )
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    async def __aenter__(self) -> DynamicBatcher:
        self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    # --- requests ----------------------------------------------------------------------
    async def submit(self, item: Any, *, tokens: int | None = None) -> Any:
        """Queue ``item`` for the next batch and wait for its result.

        ``tokens``: the item's real token count; when ``collate`` reports none, the batch's
        ``inferprof.tokens.effective`` is their sum and ``inferprof.tokens.padded`` is
        ``max * batch size`` (padding to the longest).
        """
        if tokens is not None and (
            isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0
        ):
            raise ValueError(f"tokens must be a non-negative int, got {tokens!r}")
        if not self.running or self._loop is not asyncio.get_running_loop():
            self.start()
        if self.max_queue_size is not None and len(self._queue) >= self.max_queue_size:
            raise asyncio.QueueFull(f"DynamicBatcher queue is full ({self.max_queue_size} waiting)")
        handle = _enqueue(len(self._queue))
        entry = _Entry(item, tokens, handle, self._loop.create_future())
        request = handle.request
        if request is not None and request.__class__ is not SummaryRecord:
            # recorded: when it arrived on the busy clock (a request summarised untimed
            # holds no stage attribute: its summary carries none)
            entry.busy0 = self._busy_at(entry.t)
        self._queue.append(entry)
        self._wakeup.set()
        try:
            return await entry.future
        except asyncio.CancelledError:
            if not entry.taken:
                try:
                    self._queue.remove(entry)
                except ValueError:
                    pass
                handle.cancel()
            raise

    # --- the batching loop -------------------------------------------------------------
    async def _run_loop(self) -> None:
        queue, wakeup, slots = self._queue, self._wakeup, self._slots
        while True:
            await slots.acquire()
            try:
                await batch_ready(queue, wakeup, self.max_batch_size, self.max_delay_s)
                entries = self._take()
            except BaseException:
                slots.release()
                raise
            if not entries:
                slots.release()
                continue
            task = asyncio.get_running_loop().create_task(self._run_batch(entries))
            self._inflight.add(task)
            task.add_done_callback(self._batch_done)
            self._running += 1
            if self._running == self.max_concurrent_batches:
                self._busy_since = time.monotonic()
            # Not kept by this frame while it waits for the next batch: the entries hold
            # the batch's inputs and its requests' records.
            del entries, task

    def _take(self) -> list[_Entry]:
        """The next batch's entries, oldest first (in a frame of its own: no local of the
        waiting loop keeps an entry alive). Each recorded request's ``queue`` stage gets
        ``inferprof.queue.behind_batches_s``: how long of its wait every slot was busy."""
        queue = self._queue
        entries: list[_Entry] = []
        busy = self._busy_at(time.monotonic())
        while queue and len(entries) < self.max_batch_size:
            entry = queue.popleft()
            if entry.future.done():  # cancelled while we were waiting
                continue
            entry.taken = True
            entries.append(entry)
            request = entry.handle.request
            if request is not None and request.__class__ is not SummaryRecord:
                entry.handle.attrs[_ATTR_BEHIND] = max(0.0, busy - entry.busy0)
        return entries

    def _busy_at(self, now: float) -> float:
        """Seconds every slot has been running a batch, up to ``now`` (since start)."""
        if self._running >= self.max_concurrent_batches:
            return self._busy + (now - self._busy_since)
        return self._busy

    def _batch_done(self, task: asyncio.Task) -> None:
        self._inflight.discard(task)
        if self._running == self.max_concurrent_batches:
            self._busy += time.monotonic() - self._busy_since
        self._running -= 1
        self._slots.release()

    async def _run_batch(self, entries: list[_Entry]) -> None:
        try:
            if self._is_async:
                results = await self._process_async(entries)
            else:
                ctx = contextvars.Context()
                results = await self._loop.run_in_executor(
                    self._executor, ctx.run, self._process_sync, entries
                )
        except BaseException as exc:
            for entry in entries:
                if not entry.future.done():
                    entry.future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for entry, result in zip(entries, results):  # noqa: B905 - lengths checked above
            if not entry.future.done():
                entry.future.set_result(result)

    def _open_batch(self, entries: list[_Entry]) -> Batch:
        # What batch() returns, its arguments checked once in __init__ rather than per batch.
        return Batch(
            [e.handle for e in entries],
            self.max_batch_size,
            self.model_name,
            self.batch_encoding,
            {},
            quiet=True,
        )

    def _assemble(self, b: Batch, entries: list[_Entry]) -> Any:
        with b.stage(semconv.STAGE_BATCH_ASSEMBLY):
            items = [e.item for e in entries]
            collated = self.collate(items) if self.collate is not None else items
            if isinstance(collated, Collated):
                b.set_tokens(effective=collated.tokens_effective, padded=collated.tokens_padded)
                collated = collated.batch
            record = b.record
            if record is not None and not record.tokens:
                counts = [e.tokens for e in entries if e.tokens is not None]
                if counts and len(counts) == len(entries):
                    b.set_tokens(effective=sum(counts), padded=max(counts) * len(counts))
        return collated

    def _process_sync(self, entries: list[_Entry]) -> list[Any]:
        with self._open_batch(entries) as b:
            return _checked(self.fn(self._assemble(b, entries)), len(entries))

    async def _process_async(self, entries: list[_Entry]) -> list[Any]:
        with self._open_batch(entries) as b:
            pending = cast(Awaitable[Sequence[Any]], self.fn(self._assemble(b, entries)))
            return _checked(await pending, len(entries))


def _checked(results: Any, n: int) -> list[Any]:
    # inside the batch block, so a mismatch is recorded on the members like any failure
    results = list(results)
    if len(results) != n:
        raise ValueError(f"batch function returned {len(results)} results for {n} inputs")
    return results


__all__ = ["Collated", "DynamicBatcher"]
