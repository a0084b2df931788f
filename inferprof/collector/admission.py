"""Sharing the pending-span cap between senders when the collector is overloaded.

Without it, whoever retries first after traces are folded takes the room they free: in a
drill with two replicas flooding a saturated collector, one got 11 times the other's
requests in, the other's exporter dropping the rest (which one depended on timing, not on
their load); with it, 1.14 times, and as many requests in all
(``benchmarks/collector_overload_share.py``). Without it the breakdown describes the lucky
replica, at the moment it matters.

The rule: while some sender has less than half its share of the recent intake (it was
refused, or is new), every other sender may fill the cap only up to ``cap - reserve``, and
the starved one up to ``cap``: it finds ``reserve`` spans of room unless other starved
senders took it first. Without a starved sender everyone may fill the cap, so one sender
alone, or senders getting their shares, lose nothing. Shares are those of the spans
admitted recently, decayed with the time a span stays pending (about ``settle_s``), among
the senders that tried to export within ``active_s`` (a refused sender counts: it is the
one that needs the room). While the starved sender waits out its retry delay the reserve
may sit unused; holding back every sender over its share, starved sender or not, lost
10-13% of the intake in some runs of the drill, this rule nothing measurable.

A sender is the resource of the export: ``service.name`` with ``service.instance.id``
(else ``host.name``; else the client's address). An export holding several resources (an
OpenTelemetry Collector batching many replicas) is one sender per client address.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

from inferprof import semconv as sc
from inferprof.collector.labels import bounded

#: Share of the cap kept for starved senders (under half their share) while one is about.
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
        # The table keeps up to MAX_SENDERS of these: names are cut as series names are.
        name, instance, host = bounded(name), bounded(instance), bounded(host)
        # No instance named (an exporter that sets neither): its client tells replicas apart.
        this = (name, instance or host) if instance or host else (name, "", peer or "")
        if key is None:
            key = this
        elif key != this:
            return ("", "", peer or "")  # several resources: one sender per client
    return key if key is not None else ("", "", peer or "")


class FairShare:
    """Recent intake per sender, and the limit each export is held to.

    Senders are kept in the order of their last attempt: those that have not tried for
    ``active_s``, and the oldest past ``MAX_SENDERS``, are forgotten from the front, so
    the table stays small however many instances come and go. Not thread-safe: the
    engine calls it under its lock.
    """

    def __init__(
        self, cap: int, *, tau_s: float, active_s: float,
        reserve_fraction: float = DEFAULT_RESERVE_FRACTION,
    ) -> None:
        self.cap = cap
        self.reserve = int(cap * reserve_fraction)
        self.tau_s = max(tau_s, 1e-3)
        self.active_s = active_s
        #: sender -> [admitted spans (decayed to `at`), at, last attempt], oldest attempt
        #: first
        self._senders: OrderedDict[tuple[str, ...], list[float]] = OrderedDict()

    def limit(self, sender: tuple[str, ...], now: float) -> int:
        """The pending-span limit for an export from ``sender`` now (records the attempt).

        A sender far under its share (under half of it: refused, or new) may fill the cap;
        while such a sender is about, the others are held to ``cap - reserve``."""
        entry = self._touch(sender, now)
        if len(self._senders) < 2 or not self.reserve:
            return self.cap
        values = [self._decayed(e, now) for e in self._senders.values()]
        half_share = sum(values) / len(values) / 2
        if self._decayed(entry, now) < half_share:
            return self.cap
        if min(values) < half_share:
            return self.cap - self.reserve
        return self.cap

    def admitted(self, sender: tuple[str, ...], spans: int, now: float) -> None:
        entry = self._touch(sender, now)
        entry[0] = self._decayed(entry, now) + spans
        entry[1] = now

    def senders(self, now: float) -> int:
        """Senders that tried to export within ``active_s``."""
        self._forget(now)
        return len(self._senders)

    def _touch(self, sender: tuple[str, ...], now: float) -> list[float]:
        entry = self._senders.get(sender)
        if entry is None:
            entry = self._senders[sender] = [0.0, now, now]
        else:
            entry[2] = now
            self._senders.move_to_end(sender)
        self._forget(now)
        return entry

    def _forget(self, now: float) -> None:
        senders = self._senders
        horizon = now - self.active_s
        while senders:
            oldest = next(iter(senders.values()))
            if oldest[2] >= horizon and len(senders) <= MAX_SENDERS:
                break
            senders.popitem(last=False)

    def _decayed(self, entry: list[float], now: float) -> float:
        dt = now - entry[1]
        return entry[0] * math.exp(-dt / self.tau_s) if dt > 0 else entry[0]


__all__ = ["DEFAULT_RESERVE_FRACTION", "MAX_SENDERS", "FairShare", "sender_of"]
