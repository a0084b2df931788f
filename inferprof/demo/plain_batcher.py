"""A minimal dynamic batcher with no telemetry at all: the demo's uninstrumented baseline.

The ``none`` and ``otel`` instrumentation choices of the demo service must not run
any inferprof code, or the overhead benchmark would compare inferprof with itself.
This batcher does what a typical hand-written serving loop does: requests wait in an
asyncio queue; a batch leaves when it is full or when the oldest request has waited
``max_delay_ms``; collate and the model run on one worker thread (batches run one at
a time, as on one GPU stream) so the event loop keeps accepting requests meanwhile.
Its interface matches the subset of ``inferprof.DynamicBatcher`` the demo uses.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any


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
        self._queue: asyncio.Queue[tuple[Any, asyncio.Future[Any]]] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="demo-batch")

    async def submit(self, item: Any, tokens: int | None = None) -> Any:
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._worker = asyncio.get_running_loop().create_task(self._run())
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        await self._queue.put((item, future))
        return await future

    async def _run(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            first = await self._queue.get()
            pending = [first]
            deadline = loop.time() + self._max_delay
            while len(pending) < self.max_batch_size:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    pending.append(await asyncio.wait_for(self._queue.get(), remaining))
                except asyncio.TimeoutError:
                    break
            live = [(item, fut) for item, fut in pending if not fut.done()]
            if not live:
                continue
            try:
                results = await loop.run_in_executor(self._pool, self._call, [i for i, _ in live])
            except Exception as exc:  # noqa: BLE001
                # One failed batch fails its members, not the server.
                for _, fut in live:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, fut), result in zip(live, results):
                if not fut.done():
                    fut.set_result(result)

    def _call(self, items: list[Any]) -> Sequence[Any]:
        return self._fn(self._collate(items))

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["PlainBatcher"]
