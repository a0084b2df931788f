"""When a batch leaves: the batch-forming rule, shared by every batcher in the package.

Pure asyncio, no telemetry: the demo's uninstrumented baseline (``demo/plain_batcher``)
forms its batches with this same function, so batch sizes (and the model work that
follows from them) cannot differ between the configurations the overhead benchmark
compares.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any


async def batch_ready(queue: deque[Any], wakeup: asyncio.Event, max_batch_size: int,
                      max_delay_s: float) -> None:
    """Return once a batch should leave ``queue``: ``max_batch_size`` entries wait, or the
    oldest (``queue[0].t``, its ``time.monotonic()`` arrival) has waited ``max_delay_s``.

    Triton's ``max_queue_delay`` semantics: the delay runs from the oldest request's
    arrival, not from when the loop got to it (it may have waited for a slot). ``wakeup``
    is set by whoever appends to the queue.
    """
    while not queue:
        wakeup.clear()
        await wakeup.wait()
    deadline = queue[0].t + max_delay_s
    while len(queue) < max_batch_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        wakeup.clear()
        try:
            await asyncio.wait_for(wakeup.wait(), remaining)
        except asyncio.TimeoutError:
            return


__all__ = ["batch_ready"]
