"""Engine step spans and KV-cache readings, indexed per engine for the generation join.

Contract §14: an engine's step spans (compact or one per step) say when each engine step
ran and how many prefill and decode tokens it held; ``StepIndex`` keeps them, with the
engine's KV-cache usage readings, per engine (service, host, instance, engine id), so
that ``generation.GenerationFold`` can join a generating request's inter-token gaps to
the steps that ran during them.

Memory: each engine's steps are kept for ``retention_s`` of collector time after they
arrive, online at most ``max_rows`` per engine, ``max_total_rows`` steps and KV readings
in all, and ``max_engines`` engines; what it refuses is counted (``dropped``).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np

from inferprof import semconv as sc
from inferprof.collector import gen_spans as gs
from inferprof.collector.labels import bounded

#: A span's wanted attributes, as trace assembly read them.
Extra = dict[str, Any]
Arrays = tuple[np.ndarray, ...]

_NS = 1e-9

#: (service, host, instance, engine id): one engine's timeline.
EngineKey = tuple[str, ...]


def engine_key(service: str, host: str, instance: str, engine: Any) -> EngineKey:
    """An engine's key, its names cut like labels (``labels.bounded``): up to
    ``DEFAULT_MAX_ENGINES`` are held, and 1 MB names would make that gigabytes."""
    return (bounded(service), bounded(host), bounded(instance),
            bounded(engine) if isinstance(engine, str) else sc.DEFAULT_ENGINE_ID)


#: Online bounds of the step index.
DEFAULT_MAX_ENGINES = 4096
DEFAULT_MAX_STEP_ROWS = 200_000
#: Steps and KV readings held in all (about 40 bytes each once consolidated).
DEFAULT_MAX_TOTAL_ROWS = 1_000_000
#: Rows appended to an engine as tuples before they are consolidated into its arrays.
_PENDING_ROWS = 8192


class _Timeline:
    """One engine's steps and KV-cache readings: appended as tuples, consolidated into
    sorted arrays when read."""

    __slots__ = ("arrival", "kv", "kv_pending", "oldest", "pending", "rows", "touched")

    def __init__(self) -> None:
        self.pending: list[tuple[int, int, float, float, float]] = []
        self.kv_pending: list[tuple[float, float, float]] = []
        # start ns, end ns (int64); prefill, decode tokens; running maximum of the ends
        self.rows: tuple[np.ndarray, ...] | None = None
        self.arrival = np.empty(0)  # collector time each row arrived
        self.oldest = math.inf  # the earliest of them
        # time s, value, arrival
        self.kv: np.ndarray | None = None
        self.touched = -math.inf


class StepIndex:
    """Engine step spans and KV-cache readings by engine (service, host, instance, engine
    id), for joining generating requests by time (contract §14). Not thread-safe: the
    engine serialises calls."""

    def __init__(
        self,
        retention_s: float,
        *,
        max_engines: int | None = DEFAULT_MAX_ENGINES,
        max_rows: int | None = DEFAULT_MAX_STEP_ROWS,
        max_total_rows: int | None = DEFAULT_MAX_TOTAL_ROWS,
    ) -> None:
        self.retention_s = retention_s
        self.max_engines = max_engines
        self.max_rows = max_rows
        self.max_total_rows = max_total_rows
        #: steps and KV readings held now, pending or consolidated, all engines
        self.total = 0
        self.engines: dict[EngineKey, _Timeline] = {}
        # (time touched, engine) in time order: expiry pops from the left, O(1) amortised.
        self._touched: deque[tuple[float, EngineKey]] = deque()
        self.steps_received = 0
        self.dropped = 0

    def _timeline(self, key: EngineKey, now: float) -> _Timeline | None:
        tl = self.engines.get(key)
        if tl is None:
            if self.max_engines is not None and len(self.engines) >= self.max_engines:
                self.prune(now)
                if len(self.engines) >= self.max_engines:
                    return None
            tl = self.engines[key] = _Timeline()
        if tl.touched != now:
            tl.touched = now
            self._touched.append((now, key))
        return tl

    def add_step(
        self, resource: tuple[str, str, str], extra: Extra, start: int, end: int, now: float
    ) -> str | None:
        """One engine step span, per-step or compact (called by trace assembly); a reason
        when a compact one is malformed (none of its steps is read)."""
        compact = gs.compact_steps(extra, start, end)
        if compact is not None:
            if isinstance(compact, str):
                return compact
            self._add_steps(resource, extra.get(sc.ATTR_ENGINE_ID), compact, now)
            return None
        engine = extra.get(sc.ATTR_ENGINE_ID)
        tl = self._timeline(engine_key(*resource, engine), now)
        self.steps_received += 1
        if tl is None or not self._room(tl, now):
            self.dropped += 1
            return None
        p = gs.count(extra, sc.ATTR_STEP_PREFILL_TOKENS) or 0
        n = gs.count(extra, sc.ATTR_STEP_DECODE_TOKENS) or 0
        tl.pending.append((start, end, float(p), float(n), now))
        self.total += 1
        kv = extra.get(sc.ATTR_STEP_KV_CACHE_USAGE)
        if isinstance(kv, (float, int)) and not isinstance(kv, bool) and math.isfinite(kv) \
                and 0 <= kv <= 1:
            tl.kv_pending.append((start * _NS, float(kv), now))
            self.total += 1
        if len(tl.pending) > _PENDING_ROWS or len(tl.kv_pending) > _PENDING_ROWS:
            self._consolidate(tl, now)
        return None

    def _add_steps(self, resource: tuple[str, str, str], engine: Any, cols: Arrays,
                   now: float) -> None:
        """A compact step span's steps, as ``add_step`` adds each of a per-step span."""
        st, en, p, d, kv = cols
        n = st.size
        tl = self._timeline(engine_key(*resource, engine), now)
        self.steps_received += n
        if tl is None:
            self.dropped += n
            return
        room = n
        if self.max_total_rows is not None and self.total + n > self.max_total_rows:
            self._consolidate(tl, now)
            room = max(0, min(n, self.max_total_rows - self.total))
            self.dropped += n - room
        if not room:
            return
        pending = tl.pending
        pending.extend(zip(st[:room].tolist(), en[:room].tolist(), p[:room].tolist(),
                           d[:room].tolist(), [now] * room, strict=True))
        self.total += room
        has_kv = ~np.isnan(kv[:room])
        if has_kv.any():
            kv_room = int(has_kv.sum())
            if self.max_total_rows is not None:
                kv_room = max(0, min(kv_room, self.max_total_rows - self.total))
            if kv_room:
                times = (st[:room][has_kv][:kv_room] * _NS).tolist()
                tl.kv_pending.extend(zip(times, kv[:room][has_kv][:kv_room].tolist(),
                                         [now] * kv_room, strict=True))
                self.total += kv_room
        if len(pending) > _PENDING_ROWS or len(tl.kv_pending) > _PENDING_ROWS:
            self._consolidate(tl, now)

    def _room(self, tl: _Timeline, now: float) -> bool:
        """Whether the global bound leaves room for a row (consolidating ``tl`` first, which
        drops its expired rows, when it does not)."""
        if self.max_total_rows is None or self.total < self.max_total_rows:
            return True
        self._consolidate(tl, now)
        return self.total < self.max_total_rows

    def add_kv(self, key: EngineKey, t: float, value: float, now: float) -> bool:
        """One ``inferprof.engine.kv_cache.usage`` reading; False if refused."""
        if not (math.isfinite(value) and 0 <= value <= 1):
            return False
        tl = self._timeline(key, now)
        if tl is None or not self._room(tl, now):
            return False
        tl.kv_pending.append((t, float(value), now))
        self.total += 1
        if len(tl.kv_pending) > _PENDING_ROWS:
            self._consolidate(tl, now)
        return True

    def prune(self, now: float) -> None:
        """Forget engines nothing arrived for in ``retention_s``."""
        if not math.isfinite(self.retention_s):
            return
        horizon = now - self.retention_s
        touched = self._touched
        while touched and touched[0][0] < horizon:
            t, key = touched.popleft()
            tl = self.engines.get(key)
            if tl is not None and tl.touched == t:
                self.total -= _held(tl)
                del self.engines[key]

    def _consolidate(self, tl: _Timeline, now: float) -> None:
        before = _held(tl)
        self._merge(tl, now)
        self.total += _held(tl) - before

    def _merge(self, tl: _Timeline, now: float) -> None:
        horizon = now - self.retention_s if math.isfinite(self.retention_s) else -math.inf
        if tl.pending:
            new = tl.pending
            tl.pending = []
            st = np.fromiter((r[0] for r in new), np.int64, len(new))
            en = np.fromiter((r[1] for r in new), np.int64, len(new))
            rest = np.asarray([r[2:] for r in new], np.float64).reshape(-1, 3)
            cols = [st, en, rest[:, 0], rest[:, 1], rest[:, 2]]
            if tl.rows is not None:
                cols = [np.concatenate([a, b])
                        for a, b in zip((*tl.rows[:4], tl.arrival), cols, strict=True)]
            order = np.argsort(cols[0], kind="stable")
            cols = [c[order] for c in cols]
            keep = cols[4] >= horizon
            if self.max_rows is not None and keep.sum() > self.max_rows:
                self.dropped += int(keep.sum()) - self.max_rows
                keep &= np.cumsum(keep[::-1])[::-1] <= self.max_rows  # the latest rows
            tl.rows, tl.arrival = _with_end_max(tuple(c[keep] for c in cols[:4]), cols[4][keep])
        elif tl.rows is not None and tl.oldest < horizon:
            keep = tl.arrival >= horizon
            tl.rows, tl.arrival = _with_end_max(
                tuple(c[keep] for c in tl.rows[:4]), tl.arrival[keep]
            )
        tl.oldest = float(tl.arrival.min()) if tl.arrival.size else math.inf
        if tl.kv_pending:
            new_kv = np.asarray(tl.kv_pending, np.float64).reshape(-1, 3)
            tl.kv_pending = []
            kv = new_kv if tl.kv is None else np.concatenate([tl.kv, new_kv])
            kv = kv[np.argsort(kv[:, 0], kind="stable")]
            kv = kv[kv[:, 2] >= horizon]
            if self.max_rows is not None and kv.shape[0] > self.max_rows:
                kv = kv[-self.max_rows:]
            tl.kv = kv

    def steps(self, key: EngineKey, now: float) -> Arrays | None:
        """(start ns, end ns, prefill tokens, decode tokens, running maximum of the ends)
        sorted by start; None when the engine has sent no step span."""
        tl = self.engines.get(key)
        if tl is None:
            return None
        self._consolidate(tl, now)
        if tl.rows is None or not tl.rows[0].size:
            return None
        return tl.rows

    def kv_between(self, key: EngineKey, t0: float, t1: float, now: float) -> np.ndarray:
        """KV-cache readings of the engine in (t0, t1] (seconds)."""
        tl = self.engines.get(key)
        if tl is None:
            return np.empty(0)
        self._consolidate(tl, now)
        if tl.kv is None or not tl.kv.shape[0]:
            return np.empty(0)
        t = tl.kv[:, 0]
        lo, hi = np.searchsorted(t, t0, side="right"), np.searchsorted(t, t1, side="right")
        return tl.kv[lo:hi, 1]


def _held(tl: _Timeline) -> int:
    """Steps and KV readings ``tl`` holds, pending or consolidated."""
    rows = tl.rows[0].size if tl.rows is not None else 0
    kv = tl.kv.shape[0] if tl.kv is not None else 0
    return len(tl.pending) + len(tl.kv_pending) + rows + kv


def _with_end_max(cols: Arrays, arrival: np.ndarray) -> tuple[Arrays, np.ndarray]:
    return (*cols, np.maximum.accumulate(cols[1]) if cols[1].size else cols[1]), arrival


__all__ = [
    "DEFAULT_MAX_ENGINES",
    "DEFAULT_MAX_STEP_ROWS",
    "DEFAULT_MAX_TOTAL_ROWS",
    "EngineKey",
    "StepIndex",
    "engine_key",
]
