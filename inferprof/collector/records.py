"""Immutable records the collector engine hands out.

Everything a reader (HTTP API, Prometheus collector, ``inferprof report``) gets from the
engine is a frozen snapshot, so it can be used outside the engine's lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class IngestResult:
    """Outcome of one OTLP export handed to the engine.

    ``rejected_spans`` were dropped and counted (invalid ids, negative or absurd
    durations, duplicates, invalid stage names, oversize traces); ``errors`` holds the
    first few reasons in words, for OTLP ``partial_success.error_message``.
    """

    accepted_spans: int
    rejected_spans: int
    errors: tuple[str, ...] = ()


@dataclass(frozen=True)
class EngineStats:
    """Counters of the engine since it started (a snapshot)."""

    spans_received: int = 0
    spans_accepted: int = 0
    #: reason (``semconv.DROP_*``) -> spans dropped for it.
    spans_dropped: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    #: spans that are neither request nor stage spans: accepted, kept for the parent
    #: chain while their trace is open, not part of any breakdown.
    spans_ignored: int = 0
    traces_incomplete: int = 0
    #: Triton requests (translated from Triton's own spans) counted with some of their
    #: queue/h2d/compute/d2h stages missing: events absent, repeated or out of order.
    triton_requests_partial: int = 0
    requests_finalised: int = 0
    #: requests folded into the overflow series because of the (service, model) cap.
    series_overflow: int = 0
    series: int = 0
    #: (service, model) slots freed for a new pair at the cap (idle longer than retention).
    series_reclaimed: int = 0
    gpu_samples_received: int = 0
    #: reason (``gpu_samples.DROP_*``) -> GPU samples rejected or dropped for it
    gpu_samples_dropped: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    #: GPU samples retained now
    gpu_samples: int = 0
    #: "service" / "model" -> requests whose name was cut to semconv.MAX_LABEL_BYTES
    labels_truncated: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    #: requests counted from summaries (contract §15): timed (unweighted) and untimed; and
    #: summary data points rejected (malformed: named in the OTLP answer)
    summary_requests: int = 0
    summary_untimed_requests: int = 0
    summary_points_rejected: int = 0
    #: engine step spans (contract §14) received, and those the step index had no room for
    engine_steps_received: int = 0
    engine_steps_dropped: int = 0
    pending_spans: int = 0
    pending_traces: int = 0


@dataclass(frozen=True)
class RequestRecord:
    """One finalised request: what the engine folds into its sketches.

    ``stage_time`` is the summed (clipped) duration of each stage's spans; ``exclusive``
    partitions the request's end-to-end time between stages and ``unattributed`` so that
    it sums to ``e2e`` exactly (see ``inferprof.timing.partition``).
    """

    service: str
    model: str
    e2e: float
    weight: float
    stage_time: Mapping[str, float]
    exclusive: Mapping[str, float]
    end_unix: float


__all__ = ["EngineStats", "IngestResult", "RequestRecord"]
