"""A generation request as the engine sees it, and one request's share of a step."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

WAITING = "waiting"
RUNNING = "running"
FINISHED = "finished"
CANCELLED = "cancelled"

_ids = itertools.count()


class GenRequest:
    """One generation request, as the engine thread sees it."""

    __slots__ = ("blocks", "computed", "id", "max_tokens", "output", "preemptions",
                 "prefill_target", "prompt", "status", "stream", "telemetry")

    def __init__(self, prompt: list[int], max_tokens: int, stream: Any = None) -> None:
        if not prompt:
            raise ValueError("the prompt must have at least one token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens!r}")
        self.id = next(_ids)
        self.prompt = list(prompt)
        self.max_tokens = max_tokens
        self.output: list[int] = []
        self.blocks: list[int] = []
        #: positions whose keys and values are in the cache
        self.computed = 0
        #: tokens to (re)compute before decoding: the prompt, plus the output so far after
        #: an eviction
        self.prefill_target = len(self.prompt)
        self.status = WAITING
        self.preemptions = 0
        #: the caller's delivery target (the service's asyncio queue); opaque here
        self.stream = stream
        #: what EngineInstrument.arrive() returned
        self.telemetry: Any = None

    @property
    def known(self) -> int:
        """Tokens known so far: the prompt and the output."""
        return len(self.prompt) + len(self.output)

    def token_at(self, position: int) -> int:
        n = len(self.prompt)
        return self.prompt[position] if position < n else self.output[position - n]

    @property
    def in_prefill(self) -> bool:
        return self.computed < self.prefill_target

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_tokens


@dataclass(frozen=True)
class ScheduledItem:
    """``count`` tokens of ``request`` starting at position ``start`` in this step."""

    request: GenRequest
    start: int
    count: int
    prefill: bool
    #: this item ends the request's (re)computation or is a decode token: it samples
    samples: bool


__all__ = ["CANCELLED", "FINISHED", "RUNNING", "WAITING", "GenRequest", "ScheduledItem"]
