"""The one seam between the LLM demo's engine and telemetry.

The engine calls exactly these methods, always from the engine thread except
:meth:`EngineInstrument.arrive`, which runs in the submitting request's context (inside
its request span, on the event loop) so that an implementation can capture that
request's telemetry handle. :class:`EngineInstrument` itself does nothing: the engine
runs the same code with telemetry off. ``telemetry.py`` holds the implementation that
records inferprof's generation encoding through the step API.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from inferprof.demo.llm.request import GenRequest, ScheduledItem


class EngineInstrument:
    """No-op telemetry for the engine; subclasses override what they record."""

    def arrive(self, request: GenRequest) -> Any:
        """A request was submitted (caller's context); the return value is kept on it."""
        return None

    def admit(self, request: GenRequest) -> None:
        """First admission into the running batch (the end of its queue wait)."""

    def evict(self, request: GenRequest) -> None:
        """Preempted: its blocks were freed and it went back to the waiting queue."""

    def resume(self, request: GenRequest) -> None:
        """Re-admitted after an eviction; its prompt and output so far are recomputed."""

    def step_begin(self, items: Sequence[ScheduledItem], kv_usage: float) -> Any:
        """A step is about to run ``items``; the return value is passed to step_end."""
        return None

    def step_end(self, token: Any, items: Sequence[ScheduledItem],
                 error: BaseException | None = None) -> None:
        """The step's model pass and sampling are done (``error``: they failed with it)."""

    def emit(self, request: GenRequest, tokens: Sequence[int]) -> None:
        """``tokens`` were produced for ``request`` and handed to its stream."""

    def finish(self, request: GenRequest) -> None:
        """The request produced its last token, or the engine failed it (a failed step,
        the engine stopping); its blocks are freed."""

    def cancel(self, request: GenRequest) -> None:
        """The request was cancelled (client gone); its blocks are freed."""


__all__ = ["EngineInstrument"]
