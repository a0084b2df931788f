"""The engine's (service, model) series and stage columns: ids, names, the series cap and
the reclaiming of idle series, stage names to sketch columns."""

from __future__ import annotations

import math

import numpy as np

from inferprof import semconv as sc
from inferprof.collector.labels import bounded, utf8_bytes
from inferprof.collector.layout import (
    _NO_COLUMN,
    SERIES_NAME_BYTES,
)


class SeriesPart:
    """Part of :class:`~inferprof.collector.engine.Engine` (a mixin: it reads the
    engine's state)."""

    def _init_series(self, max_series: int) -> None:
        """The (service, model) series: ids, names, counters, and their byte budget."""
        self._series: dict[tuple[str, str], int] = {}
        self._series_keys: list[tuple[str, str]] = []
        self._series_requests: list[float] = []
        #: weighted requests with an ERROR status per series, since start (a counter)
        self._series_errors: list[float] = []
        #: collector-clock time each series was last folded into (reclaiming idle ones)
        self._series_last: list[float] = []
        #: UTF-8 bytes of the series' names together, bounded so that /metrics, which
        #: repeats them on every row of their series, is bounded in bytes as in series
        self._series_bytes = 0
        self._max_series_bytes = max_series * SERIES_NAME_BYTES
        #: "service" / "model" -> requests whose name was cut (labels.bounded)
        self._truncated = {"service": 0, "model": 0}
        #: no series becomes reclaimable before this time (a scan that found none)
        self._reclaim_after = -math.inf
        self._reclaimed = 0

    def _series_id(self, service: str, model: str, now: float, requests: int = 1) -> int:
        """The series of a (service, model) pair not found as it came: new, one whose
        names are too long (cut: ``labels.py``), or past a cap (the overflow series).
        ``requests``: how many requests a cut name counts for (0: already counted)."""
        cut_service, cut_model = bounded(service), bounded(model)
        if cut_service is not service:
            self._truncated["service"] += requests
        if cut_model is not model:
            self._truncated["model"] += requests
        key = (cut_service, cut_model)
        sid = self._series.get(key)
        if sid is None:
            size = utf8_bytes(cut_service) + utf8_bytes(cut_model)
            if (len(self._series) >= self.max_series
                    or self._series_bytes + size > self._max_series_bytes):
                sid = self._reclaim(now, size)
                if sid is not None:
                    self._series[key] = sid
                    self._series_keys[sid] = key
                    self._series_last[sid] = now
                    self._series_bytes += size
                    return sid
                key = (sc.OVERFLOW_SERIES, "")
                sid = self._series.get(key)
                if sid is not None:
                    return sid
                size = utf8_bytes(sc.OVERFLOW_SERIES)
            sid = len(self._series_keys)
            self._series[key] = sid
            self._series_keys.append(key)
            self._series_requests.append(0.0)
            self._series_errors.append(0.0)
            self._series_last.append(now)
            self._series_bytes += size
        return sid

    def _reclaim(self, now: float, size: int = 0) -> int | None:
        """Free the slot of the series idle longest, if it has been idle long enough that
        no retained slice holds any of it (folded more than ``retention_s + slice_s``
        ago); None when no series has. Its cumulative histograms leave ``/metrics`` with
        it (a returning pair starts them again from zero: a counter reset to
        Prometheus)."""
        if now < self._reclaim_after or not math.isfinite(self.retention_s):
            return None
        horizon = self.retention_s + self.slice_s
        overflow = self._series.get((sc.OVERFLOW_SERIES, ""))
        last = self._series_last
        sid = min(
            (i for i in range(len(self._series_keys)) if i != overflow),
            key=last.__getitem__,
            default=None,
        )
        if sid is None or last[sid] + horizon > now:
            # Nothing reclaimable before the idlest series is: no scan until then.
            self._reclaim_after = (last[sid] + horizon) if sid is not None else math.inf
            return None
        old = self._series_keys[sid]
        if self._series_bytes - sum(map(utf8_bytes, old)) + size > self._max_series_bytes:
            return None  # the new pair's names would not fit in the idlest one's room
        self._series_bytes -= sum(map(utf8_bytes, old))
        del self._series[old]  # the caller puts the new pair in its slot
        self._series_requests[sid] = 0.0
        self._series_errors[sid] = 0.0
        for hk in [hk for hk in self._hist if hk[0] == sid]:
            del self._hist[hk]
            del self._hist_sum[hk]
        self._examples.forget_series(sid)
        self._exemplars.forget_series(sid)
        self._gen.forget_series(sid)
        self._cost.forget_series(sid)
        self._fleet.forget_series(sid)
        self._reclaimed += 1
        return sid

    def _stage_id(self, stage: str) -> int | None:
        idx = self._stage_index.get(stage)
        if idx is None:
            # _stage_names[0] is "" (no stage): max_stages names take max_stages + 1.
            if len(self._stage_names) > self.max_stages:
                return None
            idx = len(self._stage_names)
            self._stage_names.append(stage)
            self._stage_index[stage] = idx
        return idx

    def _stage_columns(self, asm_ids: np.ndarray) -> np.ndarray:
        """Stage column of each assembler stage number (``Assembler.stage_names``).

        Names get a column on first fold, in order of first appearance among the spans
        folded. Names beyond ``max_stages`` map to ``_NO_COLUMN + number``
        (distinct per name, so that their drop is counted once per (request, stage) like
        every other per-stage figure; ``_fold`` moves their time to ``unattributed``).
        """
        names = self._asm.stage_names
        col_of = self._col_of
        if col_of.size < len(names):
            col_of = self._col_of = np.concatenate(
                [col_of, np.full(len(names) - col_of.size, -1, np.int64)]
            )
        cols = col_of[asm_ids]
        if cols.size and cols.min() < 0:
            unknown = asm_ids[cols < 0]
            uniq, first = np.unique(unknown, return_index=True)
            for aid in uniq[np.argsort(first)].tolist():
                idx = self._stage_id(names[aid])
                col_of[aid] = _NO_COLUMN + aid if idx is None else idx
            cols = col_of[asm_ids]
        return cols

    def _column_name(self, col: int) -> str:
        if col >= _NO_COLUMN:
            return self._asm.stage_names[col - _NO_COLUMN]
        return self._stage_names[col]
