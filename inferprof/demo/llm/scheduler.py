"""Continuous batching with chunked prefill and recompute preemption (vLLM's policy).

Every step the scheduler builds one batch under two budgets:

- a **token budget** (``max_batched_tokens``): decode tokens (one per running request
  that has finished its prefill) and prefill chunks share it, so a long prompt is cut
  into chunks that run interleaved with other requests' decode tokens;
- a **KV-cache budget** in blocks: a request needs blocks for every position it has
  computed. When the running requests' next tokens need more blocks than are free, the
  newest running request is evicted: its blocks are freed, it goes back to the front of
  the waiting queue, and on re-admission its prompt and the tokens it has produced so
  far are recomputed as a prefill (vLLM's recompute preemption). With greedy sampling
  it then produces exactly the tokens it would have without the eviction.

Running requests are served oldest first; waiting requests are admitted in order while
the token budget, ``max_running`` and free blocks (beyond a small watermark) allow, and
never in a step that had to evict. Pure bookkeeping: no model, no threads.
"""

from __future__ import annotations

from collections import deque

from inferprof.demo.llm.instrument import EngineInstrument
from inferprof.demo.llm.kv_cache import BlockAllocator, blocks_for
from inferprof.demo.llm.request import (
    CANCELLED,
    FINISHED,
    RUNNING,
    WAITING,
    GenRequest,
    ScheduledItem,
)


class Scheduler:
    """Builds each step's batch; the engine runs it and reports back with :meth:`advance`."""

    def __init__(self, *, num_blocks: int, block_size: int = 16, max_batched_tokens: int = 256,
                 max_running: int = 16, watermark: float = 0.01,
                 instrument: EngineInstrument | None = None) -> None:
        if max_batched_tokens < 1 or max_running < 1:
            raise ValueError("max_batched_tokens and max_running must be >= 1")
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.max_batched_tokens = max_batched_tokens
        self.max_running = max_running
        self._watermark_blocks = int(watermark * num_blocks)
        self.instrument = instrument or EngineInstrument()
        self.waiting: deque[GenRequest] = deque()
        self.running: list[GenRequest] = []
        self.evictions = 0

    def capacity_tokens(self) -> int:
        return self.allocator.num_blocks * self.block_size

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """ValueError when a request could never fit in the whole cache."""
        need = blocks_for(prompt_tokens + max_tokens, self.block_size)
        if need > self.allocator.num_blocks:
            raise ValueError(f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) "
                             f"needs {need} KV-cache blocks; the cache has "
                             f"{self.allocator.num_blocks}")

    def add(self, request: GenRequest) -> None:
        self.check(len(request.prompt), request.max_tokens)
        request.status = WAITING
        self.waiting.append(request)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> list[ScheduledItem]:
        """The next step's items (empty when there is nothing to run)."""
        budget = self.max_batched_tokens
        items: list[ScheduledItem] = []
        evicted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            count = min(req.known - req.computed, budget)
            if not self._reserve(req, count):
                # Free blocks by evicting the newest running requests, this one included
                # if it is the newest (then it reserves nothing: it waits with no block).
                while req in self.running and not self._reserve(req, count):
                    self._evict(self.running[-1])
                    evicted = True
                if req not in self.running:
                    break
            items.append(self._item(req, count))
            budget -= count
            i += 1
        while (self.waiting and budget > 0 and not evicted
               and len(self.running) < self.max_running):
            req = self.waiting[0]
            count = min(req.known - req.computed, budget)
            need = blocks_for(req.computed + count, self.block_size) - len(req.blocks)
            if need > self.allocator.free - self._watermark_blocks and self.running:
                break
            if not self._reserve(req, count):
                break
            self.waiting.popleft()
            req.status = RUNNING
            self.running.append(req)
            if req.preemptions:
                self.instrument.resume(req)
            else:
                self.instrument.admit(req)
            items.append(self._item(req, count))
            budget -= count
        return items

    def _item(self, req: GenRequest, count: int) -> ScheduledItem:
        prefill = req.in_prefill
        end = req.computed + count
        samples = end == req.known  # the last known token is in: the next one is sampled
        return ScheduledItem(req, req.computed, count, prefill, samples)

    def _reserve(self, req: GenRequest, count: int) -> bool:
        need = blocks_for(req.computed + count, self.block_size) - len(req.blocks)
        if need <= 0:
            return True
        blocks = self.allocator.allocate(need)
        if blocks is None:
            return False
        req.blocks.extend(blocks)
        return True

    def _evict(self, req: GenRequest) -> None:
        self.running.remove(req)
        self._release(req)
        req.computed = 0
        req.prefill_target = req.known
        req.preemptions += 1
        req.status = WAITING
        self.waiting.appendleft(req)
        self.evictions += 1
        self.instrument.evict(req)

    def _release(self, req: GenRequest) -> None:
        self.allocator.release(req.blocks)
        req.blocks = []

    def advance(self, items: list[ScheduledItem], sampled: dict[int, int]) -> list[GenRequest]:
        """Apply a step's results: ``sampled`` maps request id -> its new token.

        Returns the requests that finished in this step (their blocks already freed).
        """
        finished = []
        for item in items:
            req = item.request
            if req.status != RUNNING:  # cancelled while the step ran
                continue
            req.computed += item.count
            token = sampled.get(req.id)
            if token is None:
                continue
            req.output.append(token)
            if req.done:
                self.running.remove(req)
                self._release(req)
                req.status = FINISHED
                finished.append(req)
        return finished

    def cancel(self, req: GenRequest, *, failed: bool = False) -> bool:
        """Drop a waiting or running request and free its blocks; False if already done.
        ``failed``: the engine failed it (its telemetry ends it, not as cancelled)."""
        if req.status == RUNNING:
            self.running.remove(req)
        elif req.status == WAITING:
            try:
                self.waiting.remove(req)
            except ValueError:  # never added
                pass
        else:
            return False
        self._release(req)
        req.status = CANCELLED
        if failed:
            self.instrument.finish(req)
        else:
            self.instrument.cancel(req)
        return True


__all__ = ["Scheduler"]
