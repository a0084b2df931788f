"""The engine's telemetry with inferprof: the LLM demo's calls into ``inferprof.Engine``.

Each scheduler event maps onto the step API (docs/generation.md): a request's arrival
opens its handle in the request's own context (so its ``queue``, ``prefill``, ``decode``
and ``preempted`` stages join its trace); each engine step is one ``inferprof.Engine``
step whose members are the step's prefill chunks (``final`` where the chunk ends the
request's prompt, or its recomputation after an eviction) and decode tokens, with the
model pass as its ``compute`` stage; an eviction is ``preempt()``, and the end of a
request ``finish()`` or ``cancel()``. Admission, resumption and token emission need no
call of their own: the step API derives them from the step's members.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from inferprof.demo.llm.instrument import EngineInstrument
from inferprof.demo.llm.request import GenRequest, ScheduledItem


class StepTelemetry(EngineInstrument):
    """Engine telemetry through inferprof's step API (inferprof must be configured)."""

    def __init__(self, engine_id: str = "0", model: str | None = None) -> None:
        import inferprof

        self._recorder = inferprof.Engine(engine_id, model=model)
        self._stage = inferprof.stage

    def arrive(self, request: GenRequest) -> Any:
        return self._recorder.request(prompt_tokens=len(request.prompt))

    def step_begin(self, items: Sequence[ScheduledItem], kv_usage: float) -> Any:
        step = self._recorder.step(kv_cache_usage=kv_usage)
        step.__enter__()
        for it in items:
            gen = it.request.telemetry
            if it.prefill:
                step.prefill(gen, it.count, final=it.samples)
            else:
                step.decode(gen, it.count)
        compute = self._stage("compute")
        compute.__enter__()
        return step, compute

    def step_end(self, token: Any, items: Sequence[ScheduledItem],
                 error: BaseException | None = None) -> None:
        step, compute = token
        exc_info = (type(error), error, error.__traceback__) if error else (None, None, None)
        try:
            compute.__exit__(*exc_info)
        finally:
            step.__exit__(*exc_info)

    def evict(self, request: GenRequest) -> None:
        request.telemetry.preempt()

    def finish(self, request: GenRequest) -> None:
        request.telemetry.finish()

    def cancel(self, request: GenRequest) -> None:
        request.telemetry.cancel()


__all__ = ["StepTelemetry"]
