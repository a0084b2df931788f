"""A dynamic batcher with no telemetry at all: the demo's uninstrumented baseline.

The ``none`` and ``otel`` instrumentation choices of the demo service must not run
any inferprof code, or the overhead benchmark would compare inferprof with itself.
But the baseline must batch *exactly* as ``inferprof.DynamicBatcher`` does: a
different batch-forming rule gives different batch sizes, hence different padding and
model work per request, and the benchmark would credit (or blame) telemetry for a
batching difference. So this is ``DynamicBatcher``'s algorithm with the telemetry hooks
taken out, step for step, forming its batches with the same function
(``inferprof.batching.forming.batch_ready``, pure asyncio):

- requests wait in a deque, each stamped with its arrival time; an ``asyncio.Event``
  wakes the batching task;
- a batch leaves when ``max_batch_size`` requests wait or the *oldest* has waited
  ``max_delay_ms`` since it arrived (Triton's ``max_queue_delay``), the next batch
  forming only once the previous one has finished (one batch in flight, as on one
  GPU stream);
- ``collate`` and the model run together on one worker thread, so the event loop keeps
  accepting requests meanwhile; results are handed back on the loop by a task of the
  batch's own, and the next batch forms only once that task is done, so a batch's
  requests run their next step before the model starts again (the same order of work on
  a core shared with the model).

The overhead benchmark reports the mean batch size of every configuration so a reader
can check that the batching really was the same. Its interface is the subset of
``inferprof.DynamicBatcher`` the demo uses.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import time
from collections.abc import Callable, Sequence
from typing import Any

from inferprof.batching.forming import batch_ready


class _Entry:
    __slots__ = ("future", "item", "t")

    def __init__(self, item: Any, future: asyncio.Future[Any]) -> None:
        self.item = item
        self.future = future
        self.t = time.monotonic()


class PlainBatcher:
    def __init__(self, fn: Callable[[Any], Sequence[Any]], *, max_batch_size: int = 32,
                 max_delay_ms: float = 5.0, collate: Callable[[list[Any]], Any] = list) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size!r}")
        if max_delay_ms < 0:
            raise ValueError(f"max_delay_ms must be >= 0, got {max_delay_ms!r}")
        self._fn = fn
        self._collate = collate
        self.max_batch_size = max_batch_size
        self._max_delay = max_delay_ms / 1000.0
        self._queue: collections.deque[_Entry] = collections.deque()
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="demo-batch")
        self._slot = asyncio.Semaphore(1)
        self._inflight: set[asyncio.Task[None]] = set()

    async def submit(self, item: Any, tokens: int | None = None) -> Any:
        if self._worker is None:
            self._loop = asyncio.get_running_loop()
            self._wakeup = asyncio.Event()
            self._worker = self._loop.create_task(self._run())
        assert self._loop is not None and self._wakeup is not None
        entry = _Entry(item, self._loop.create_future())
        self._queue.append(entry)
        self._wakeup.set()
        try:
            return await entry.future
        except asyncio.CancelledError:
            try:
                self._queue.remove(entry)
            except ValueError:
                pass  # already taken into a batch
            raise

    async def _run(self) -> None:
        assert self._loop is not None and self._wakeup is not None
        queue, wakeup, loop = self._queue, self._wakeup, self._loop
        slot = self._slot
        while True:
            await slot.acquire()  # the previous batch's results have been handed back
            try:
                await batch_ready(queue, wakeup, self.max_batch_size, self._max_delay)
                live: list[_Entry] = []
                while queue and len(live) < self.max_batch_size:
                    entry = queue.popleft()
                    if not entry.future.done():  # cancelled while waiting
                        live.append(entry)
            except BaseException:
                slot.release()
                raise
            if not live:
                slot.release()
                continue
            task = loop.create_task(self._run_batch(live))
            self._inflight.add(task)
            task.add_done_callback(self._batch_done)
            live = task = None  # type: ignore[assignment]

    async def _run_batch(self, live: list[_Entry]) -> None:
        assert self._loop is not None
        try:
            results = await self._loop.run_in_executor(self._pool, self._call,
                                                       [e.item for e in live])
        except Exception as exc:
            # One failed batch fails its members, not the server.
            for e in live:
                if not e.future.done():
                    e.future.set_exception(exc)
            return
        for e, result in zip(live, results, strict=False):
            if not e.future.done():
                e.future.set_result(result)

    def _batch_done(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        self._slot.release()

    def _call(self, items: list[Any]) -> Sequence[Any]:
        return self._fn(self._collate(items))

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["PlainBatcher"]
