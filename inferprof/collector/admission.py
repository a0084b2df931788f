"""Sharing the pending-span cap between senders when the collector is overloaded.

Without it, whoever retries first after traces are folded takes the room they free: in a
drill with two replicas flooding a saturated collector, one got 11 times the other's
requests in, the other's exporter dropping the rest (which one depended on timing, not on
their load). The breakdown then describes the lucky replica, at the moment it matters.

The rule: a sender that holds more than its share of the recent intake may fill the cap
only up to ``cap - reserve``; a sender at or under its share may fill it to ``cap``. So a
sender starved by the others always finds ``reserve`` spans of room, and a single sender
(or senders all at their share) can still use the whole cap. Shares are those of the
spans admitted recently, decayed with the time a span stays pending (about ``settle_s``),
among the senders that tried to export within ``active_s`` (a refused sender counts: it
is the one that needs the room).

A sender is the resource of the export: ``service.name`` with ``service.instance.id``
(else ``host.name``). An export holding several resources (an OpenTelemetry Collector
batching many replicas) is one sender per client address.
"""

from __future__ import annotations

import math
from typing import Any

from inferprof import semconv as sc

#: Share of the cap kept for senders at or under their share while others are refused.
DEFAULT_RESERVE_FRACTION = 0.25
#: Senders remembered at most; past it the one seen longest ago is forgotten.
MAX_SENDERS = 4096


def sender_of(request: Any, peer: str | None) -> tuple[str, ...]:
    """The sender of an OTLP traces export (see the module docstring)."""
    key: tuple[str, ...] | None = None
    for rs in request.resource_spans:
        name = instance = host = ""
        for kv in rs.resource.attributes:
            k = kv.key
            if k == sc.RESOURCE_SERVICE_NAME:
                name = kv.value.string_value
            elif k == sc.RESOURCE_SERVICE_INSTANCE_ID:
                instance = kv.value.string_value
            elif k == sc.RESOURCE_HOST_NAME:
                host = kv.value.string_value
        this = (name, instance or host)
        if key is None:
            key = this
        elif key != this:
            return ("", "", peer or "")  # several resources: one sender per client
    return key if key is not None else ("", "", peer or "")


class FairShare:
    """Recent intake per sender, and the limit each export is held to.

    Not thread-safe: the engine calls it under its lock.
    """

    def __init__(
        self, cap: int, *, tau_s: float, active_s: float,
        reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
    ) -> None:
        self.cap = cap
        self.reserve = int(cap * reserve_fraction)
        self.tau_s = max(tau_s, 1e-3)
        self.active_s = active_s
        #: sender -> [admitted spans (decayed to `at`), at, last attempt]
        self._senders: dict[tuple[str, ...], list[float]] = {}

    def limit(self, sender: tuple[str, ...], now: float) -> int:
        """The pending-span limit for an export from ``sender`` now (records the attempt)."""
        entry = self._senders.get(sender)
        if entry is None:
            if len(self._senders) >= MAX_SENDERS:
                self._forget_oldest()
            entry = self._senders[sender] = [0.0, now, now]
        entry[2] = now
        if len(self._senders) < 2 or not self.reserve:
            return self.cap
        mine = self._decayed(entry, now)
        total = 0.0
        active = 0
        horizon = now - self.active_s
        for other in self._senders.values():
            if other[2] >= horizon:
                active += 1
                total += self._decayed(other, now)
        if active < 2 or mine * active <= total:
            return self.cap
        return self.cap - self.reserve

    def admitted(self, sender: tuple[str, ...], spans: int, now: float) -> None:
        entry = self._senders.get(sender)
        if entry is None:  # forgotten between limit() and now: remember it again
            entry = self._senders[sender] = [0.0, now, now]
        entry[0] = self._decayed(entry, now) + spans
        entry[1] = entry[2] = now

    def senders(self, now: float) -> int:
        """Senders that tried to export within ``active_s``."""
        horizon = now - self.active_s
        return sum(1 for e in self._senders.values() if e[2] >= horizon)

    def _decayed(self, entry: list[float], now: float) -> float:
        dt = now - entry[1]
        return entry[0] * math.exp(-dt / self.tau_s) if dt > 0 else entry[0]

    def _forget_oldest(self) -> None:
        oldest = min(self._senders, key=lambda s: self._senders[s][2])
        del self._senders[oldest]


__all__ = ["DEFAULT_RESERVE_FRACTION", "MAX_SENDERS", "FairShare", "sender_of"]
