"""OpenMetrics exemplars of the collector's duration histograms.

Each bucket of ``inferprof_stage_duration_seconds`` and
``inferprof_request_duration_seconds`` carries, on an OpenMetrics scrape, an exemplar:
the trace id (label ``trace_id``) of a real request whose time fell in that bucket, its
time, and when the collector folded it. Grafana shows them as points on the panels that
read the histograms and links each to its trace.

Which request: per (series, stage, bucket), the slowest request of the latest fold that
put one there. Slow requests are preferred where there is a choice (within a bucket, the
slower is the more telling one); newer ones replace older ones, so an exemplar points at
a trace the trace store still holds. The timestamp is the collector's clock at the fold
(not the service's), so every bucket's exemplars move forward in time, as Prometheus'
exemplar storage requires. Memory: one (trace id, value, time) per histogram bucket.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: The exemplar label naming the trace (what Grafana's exemplar links read).
TRACE_ID_LABEL = "trace_id"

#: An exemplar: (trace id in hex, observed seconds, collector time of the fold).
Exemplar = tuple[str, float, float]


class ExemplarStore:
    """Per (series, stage) histogram, the exemplar of each bucket; not thread-safe (the
    engine locks)."""

    def __init__(self, buckets: int) -> None:
        self.buckets = buckets
        self._kept: dict[tuple[int, int], list[Exemplar | None]] = {}

    def add(
        self,
        pair: np.ndarray,
        bucket: np.ndarray,
        value: np.ndarray,
        row: np.ndarray,
        trace_ids: Sequence[bytes],
        now: float,
        split: tuple[int, int],
    ) -> None:
        """Offer one fold's observations: per observation its histogram (``pair``, a
        series and stage packed as ``split`` says: series = pair >> split[0], stage =
        pair & split[1]), bucket index, value in seconds and request row (indexing
        ``trace_ids``)."""
        if not value.size or len(trace_ids) <= int(row.max()):
            return
        code = pair * self.buckets + bucket
        order = np.lexsort((-value, code))
        c = code[order]
        first = order[np.flatnonzero(np.r_[True, c[1:] != c[:-1]])]
        shift, mask = split
        nb = self.buckets
        kept = self._kept
        for p, b, v, r in zip(
            pair[first].tolist(), bucket[first].tolist(), value[first].tolist(),
            row[first].tolist(), strict=True,
        ):
            key = (p >> shift, p & mask)
            slots = kept.get(key)
            if slots is None:
                slots = kept[key] = [None] * nb
            slots[b] = (trace_ids[r].hex(), v, now)

    def get(self, sid: int, stage: int) -> list[Exemplar | None]:
        """The exemplar of each bucket of one histogram (None: no request yet)."""
        slots = self._kept.get((sid, stage))
        return list(slots) if slots is not None else [None] * self.buckets

    def forget_series(self, sid: int) -> None:
        for key in [k for k in self._kept if k[0] == sid]:
            del self._kept[key]


__all__ = ["TRACE_ID_LABEL", "Exemplar", "ExemplarStore"]
