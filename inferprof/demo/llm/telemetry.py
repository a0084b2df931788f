"""The engine's telemetry with inferprof: where the LLM demo calls inferprof's step API.

inferprof's step API for continuous-batching engines (the producer of the generation
encoding, docs/span-contract.md §14) is not part of this build yet, so this records
nothing beyond what :class:`EngineInstrument` does; the engine already calls every
method at the right moment.
"""

from __future__ import annotations

from inferprof.demo.llm.instrument import EngineInstrument


class StepTelemetry(EngineInstrument):
    """Engine telemetry through inferprof's step API."""


__all__ = ["StepTelemetry"]
