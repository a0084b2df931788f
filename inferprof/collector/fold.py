"""Folding finalised requests into a time slice: series, (request, stage) pairs and their
exclusive times, quantile and tail-attribution sketches, histograms, queue and work."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from inferprof import semconv as sc
from inferprof.collector.attribution import (
    COL_E2E,
    COL_STAGE0,
    COL_TRACED,
    COL_WEIGHT,
    tail_codes,
)
from inferprof.collector.finalised import Finalised
from inferprof.collector.layout import (
    _BOUNDS,
    _INT64_LIMIT,
    _LOW32,
    _MAX_COMPUTE_WINDOWS,
    _MAX_QUEUE_ROWS,
    _MAX_WORK_ROWS,
    _NB,
    _NO_COLUMN,
    _NS,
    _Q_LOCAL,
    _STAGE_MASK,
    _UNATTRIBUTED,
    STAGE_BITS,
    _instance_codes,
)
from inferprof.collector.queueing import union
from inferprof.collector.sketch import (
    KEY_BITS,
    TimeSlice,
    reduce_codes,
)
from inferprof.timing import partition


class FoldPart:
    """Part of :class:`~inferprof.collector.engine.Engine` (a mixin: it reads the
    engine's state)."""

    def _partition(
        self, fin: Finalised, stage: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``inferprof.timing.partition`` of every request of ``fin`` at once, with numpy.

        ``stage``: the column of each stage span. Returns per request ``e2e`` and
        ``unattributed`` (seconds), and per (request, stage) pair, request-major: request
        index, stage column, stage time and exclusive time (seconds). Durations are
        summed in integer nanoseconds, as ``partition`` does. Exclusive time equals stage
        time unless a request's stage spans overlap; those few requests go through the
        exact sweep of ``partition``.
        """
        n = len(fin)
        req_start = np.frombuffer(fin.start, np.uint64)
        req_end = np.frombuffer(fin.end, np.uint64)
        span_start = np.frombuffer(fin.span_start, np.uint64)
        span_end = np.frombuffer(fin.span_end, np.uint64)
        # OTLP times are unsigned; past 2**63 ns (year 2262) use exact Python integers.
        if max(req_end.max(initial=0), span_end.max(initial=0)) >= _INT64_LIMIT:
            return self._partition_slow(fin, stage)
        req_start = req_start.astype(np.int64)
        req_end = req_end.astype(np.int64)
        span_start = span_start.astype(np.int64)
        span_end = span_end.astype(np.int64)
        span_req = np.frombuffer(fin.span_key, np.int64) >> 32
        n_ids = int(stage.max()) + 1 if stage.size else 1
        # Clip each stage span to its request; durations in integer ns (exact sums).
        cs = np.maximum(span_start, req_start[span_req])
        ce = np.minimum(span_end, req_end[span_req])
        d = ce - cs
        dn = np.maximum(d, 0)
        # Sum per (request, stage): sort by a packed code, reduce runs.
        code = span_req * n_ids + stage
        order = np.argsort(code, kind="stable")
        sorted_code = code[order]
        if sorted_code.size:
            first = np.flatnonzero(np.concatenate(([True], sorted_code[1:] != sorted_code[:-1])))
            pair_code = sorted_code[first]
            pair_ns = np.add.reduceat(dn[order], first)
            # A (request, stage) none of whose spans overlaps the request is absent (§6);
            # a zero-length span inside it was entered, for 0 s.
            met = (d > 0) | (
                (span_start == span_end)
                & (span_start >= req_start[span_req])
                & (span_start <= req_end[span_req])
            )
            inside = np.maximum.reduceat(met[order].astype(np.int8), first) > 0
            if not inside.all():
                self._asm._drop(sc.DROP_OUTSIDE_REQUEST, int(inside.size - inside.sum()))
                pair_code, pair_ns = pair_code[inside], pair_ns[inside]
        else:
            pair_code = pair_ns = np.empty(0, np.int64)
        pair_req = pair_code // n_ids
        pair_stage = pair_code % n_ids
        covered = np.zeros(n, np.int64)
        np.add.at(covered, pair_req, pair_ns)
        e2e_ns = req_end - req_start
        pair_time = pair_ns * _NS
        pair_excl = pair_time.copy()
        unattributed = (e2e_ns - covered) * _NS
        # Overlap: in start order, some span starts before the previous one ends.
        pos = np.flatnonzero(d > 0)
        if pos.size > 1:
            o = np.lexsort((cs[pos], span_req[pos]))
            rr = span_req[pos][o]
            bad = (rr[1:] == rr[:-1]) & (cs[pos][o][1:] < ce[pos][o][:-1])
            if bad.any():
                self._sweep_overlapping(fin, stage, np.unique(rr[1:][bad]).tolist(),
                                        (sorted_code, order, n_ids),
                                        (pair_req, pair_stage, pair_excl), unattributed)
        return e2e_ns * _NS, unattributed, pair_req, pair_stage, pair_time, pair_excl

    def _sweep_overlapping(
        self, fin: Finalised, stage: np.ndarray, requests: list[int], spans: tuple,
        pairs: tuple, unattributed: np.ndarray,
    ) -> None:
        """Exclusive times of the ``requests`` whose stage spans overlap, by the exact
        sweep of ``partition``, written into ``pairs``' exclusive times and
        ``unattributed``. ``spans``: the spans' sorted (request, stage) codes, their
        order and the codes' stride; ``pairs``: each pair's request, stage and exclusive
        time (request-major)."""
        sorted_code, order, n_ids = spans
        pair_req, pair_stage, pair_excl = pairs
        for i in requests:
            lo = int(np.searchsorted(sorted_code, i * n_ids))
            hi = int(np.searchsorted(sorted_code, (i + 1) * n_ids))
            members = np.sort(order[lo:hi]).tolist()
            intervals = [
                (self._column_name(int(stage[j])), fin.span_start[j], fin.span_end[j])
                for j in members
            ]
            _, exclusive, unatt = partition(fin.start[i], fin.end[i], intervals)
            plo = int(np.searchsorted(pair_req, i))
            phi = int(np.searchsorted(pair_req, i + 1))
            for j in range(plo, phi):
                pair_excl[j] = exclusive[self._column_name(int(pair_stage[j]))]
            unattributed[i] = unatt

    def _partition_slow(
        self, fin: Finalised, stage: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        n = len(fin)
        per_req: list[list[tuple[str, int, int]]] = [[] for _ in range(n)]
        col_of: dict[str, int] = {}
        for key, col, s, e in zip(fin.span_key, stage.tolist(), fin.span_start, fin.span_end,
                                  strict=False):
            r = key >> 32
            name = self._column_name(col)
            per_req[r].append((name, s, e))
            col_of[name] = col
        e2e, unatt, pr, ps, pt, pe = [], [], [], [], [], []
        for i in range(n):
            stage_time, exclusive, u = partition(fin.start[i], fin.end[i], per_req[i])
            absent = {name for name, _, _ in per_req[i]} - stage_time.keys()
            if absent:
                self._asm._drop(sc.DROP_OUTSIDE_REQUEST, len(absent))
            e2e.append((fin.end[i] - fin.start[i]) * _NS)
            unatt.append(u)
            for name in sorted(stage_time, key=col_of.__getitem__):
                pr.append(i)
                ps.append(col_of[name])
                pt.append(stage_time[name])
                pe.append(exclusive[name])
        return (
            np.asarray(e2e, np.float64),
            np.asarray(unatt, np.float64),
            np.asarray(pr, np.int64),
            np.asarray(ps, np.int64),
            np.asarray(pt, np.float64),
            np.asarray(pe, np.float64),
        )

    def _slice_at(self, now: float) -> TimeSlice:
        """The time slice collector-clock time ``now`` falls in, created if new."""
        index = int(now // self.slice_s)
        slice_ = self._slices.get(index)
        if slice_ is None:
            slice_ = self._slices[index] = TimeSlice(index)
        return slice_

    def _fold(self, fin: Finalised, now: float) -> None:
        n = len(fin)
        if not n:
            return
        slice_ = self._slice_at(now)
        index = slice_.index
        series = self._fold_requests(fin, slice_, now)
        self._finalised += n

        stage = self._stage_columns(np.frombuffer(fin.span_key, np.int64) & _LOW32)
        gpu_seconds = None
        if fin.device:
            device = np.frombuffer(fin.device, np.float64).reshape(-1, 4)
            if fin.gen:  # a generating request's share of its engine's steps
                device = device.copy()
                self._gen.device_shares(fin, self._asm.stage_names, device, now)
            cols = self._stage_columns(device[:, 1].astype(np.int64))
            gpu_seconds = self._cost.add(index, np.asarray(series, np.int64),
                                         np.frombuffer(fin.weight, np.float64), device, cols,
                                         cols < _NO_COLUMN)
        queue_col = self._stage_index.get(sc.STAGE_QUEUE)
        is_queue = stage == queue_col if queue_col is not None else None
        if fin.work or (is_queue is not None and is_queue.any()):
            self._keep_queue_and_work(fin, slice_, series, is_queue)
        req_e2e, unattributed, pair_req, pair_stage, pair_time, pair_excl = self._stage_pairs(
            fin, stage
        )
        req_series = np.asarray(series, np.int64)
        req_w = np.frombuffer(fin.weight, np.float64)
        # Per (request, stage) entries, ``unattributed`` first: request-major within
        # each kind, so equal codes accumulate in request order.
        pr = np.concatenate([np.arange(n), pair_req])
        ps = np.concatenate([np.full(n, _UNATTRIBUTED, np.int64), pair_stage])
        pt = np.concatenate([unattributed, pair_time])
        pe = np.concatenate([unattributed, pair_excl])
        self._examples.add(index, req_series, fin.trace_id, req_e2e, pr, ps, pt, pe,
                           gpu_seconds)

        # Quantile sketches: end-to-end (stage 0) and per stage.
        q_series = np.concatenate([req_series, req_series[pr]])
        q_stage = np.concatenate([np.zeros(n, np.int64), ps])
        q_val = np.concatenate([req_e2e, pt])
        q_w = np.concatenate([req_w, req_w[pr]])
        # Requests their process's summaries count (contract §15) stay out of the counts,
        # the sketches and the histograms: their traces add only what summaries lack.
        live = np.frombuffer(fin.counted, np.uint8) == 0
        q_live = None if live.all() else np.concatenate([live, live[pr]])
        self._fold_sketches(slice_, (q_series, q_stage, q_val, q_w), q_live, req_series,
                            req_w, req_e2e, pr, ps, pe)
        self._fold_histograms(fin, now, n, pr, q_series, q_stage, q_val, q_w, q_live)
        if fin.gen:
            self._gen.fold(fin, series, self._asm.stage_names, index, now)

    def _fold_sketches(self, slice_: TimeSlice, q: tuple[np.ndarray, ...],
                       q_live: np.ndarray | None, req_series: np.ndarray, req_w: np.ndarray,
                       req_e2e: np.ndarray, pr: np.ndarray, ps: np.ndarray, pe: np.ndarray,
                       ) -> None:
        """Quantile codes ``q`` (series, stage, value, weight per entry: end to end, then
        per (request, stage)) and the tail table into the slice and the fleet tables;
        ``q_live``: the entries to count (None: all)."""
        q_series, q_stage, q_val, q_w = q
        mapping = self.mapping
        n = req_series.size
        q_codes = (q_series << _Q_LOCAL) | (q_stage << KEY_BITS) | mapping.key(q_val)
        sums = ((q_series << STAGE_BITS) | q_stage, q_w * q_val)
        if q_live is not None:
            q_codes, q_w = q_codes[q_live], q_w[q_live]
            sums = (sums[0][q_live], sums[1][q_live])
        q_reduced = reduce_codes(q_codes, q_w)
        slice_.q_chunks.append(q_reduced)

        # Tail attribution: per request traced/weight/e2e columns, per stage exclusive time.
        e2e_key = mapping.key(req_e2e)
        t_series = np.concatenate([req_series] * 3 + [req_series[pr]])
        t_key = np.concatenate([e2e_key] * 3 + [e2e_key[pr]])
        t_cols = np.concatenate(
            [
                np.full(n, COL_TRACED, np.int64),
                np.full(n, COL_WEIGHT, np.int64),
                np.full(n, COL_E2E, np.int64),
                COL_STAGE0 + ps,
            ]
        )
        t_vals = np.concatenate([np.ones(n), req_w, req_w * req_e2e, req_w[pr] * pe])
        t_codes = tail_codes(t_series, t_key, t_cols)
        if q_live is not None:
            live = q_live[:n]
            t_live = np.concatenate([live, live, live, live[pr]])
            t_codes, t_vals = t_codes[t_live], t_vals[t_live]
        t_reduced = reduce_codes(t_codes, t_vals)
        slice_.t_chunks.append(t_reduced)
        self._fleet.add(q_reduced, t_reduced, reduce_codes(*sums))
        if len(slice_.q_chunks) > 16:
            slice_.quantile_store()
            slice_.tail_store()

    def _fold_requests(self, fin: Finalised, slice_: TimeSlice, now: float) -> list[int]:
        """Each request's series id; its weight counted, its errors, batch padding and
        compute windows kept in the slice."""
        # Per request: series (a dict lookup each; requests, not spans).
        overflow_key = (sc.OVERFLOW_SERIES, "")
        series_id = self._series_id
        series_keys = self._series_keys
        series_requests = self._series_requests
        series_last = self._series_last
        known = self._series.get
        # A model attribute that is not a string (or none at all) is "".
        models = [m if isinstance(m, str) else "" for m in fin.model]
        series: list[int] = []
        # A request its summaries count (contract §15) was counted there, in the overflow
        # and cut-name counters too.
        counted = fin.counted
        for key, c in zip(zip(fin.service, models, strict=False), counted, strict=False):
            sid = known(key)
            if sid is None:  # a new series, or one folded into the overflow series
                sid = series_id(*key, now, 0 if c else 1)
                if series_keys[sid] == overflow_key and key != overflow_key and not c:
                    self._overflow += 1
            # Now, not after the loop: a series folded here must not be reclaimed for a
            # new one further down the same fold.
            series_last[sid] = now
            series.append(sid)
        # A request its summaries count (contract §15) is counted there, errors included.
        for sid, w, c in zip(series, fin.weight, counted, strict=False):
            if not c:
                series_requests[sid] += w
        if any(fin.error):
            errors = slice_.errors
            for sid, w, err, c in zip(series, fin.weight, fin.error, counted, strict=False):
                if err and not c:
                    errors[sid] += w
                    self._series_errors[sid] += w
        for row, eff, pad in fin.batches:
            acc = slice_.padding.setdefault(series[row], [0, 0, 0])
            acc[0] += eff
            acc[1] += pad
            acc[2] += 1
        if fin.compute:
            by_row: dict[int, list] = {}
            for row, window in fin.compute:
                by_row.setdefault(row, []).append(window)
            for row in sorted(by_row):
                windows = slice_.compute[series[row]]
                if len(windows) < _MAX_COMPUTE_WINDOWS:
                    windows.extend(by_row[row])
        return series

    def _stage_pairs(self, fin: Finalised, stage: np.ndarray) -> tuple[np.ndarray, ...]:
        """``_partition``'s (request, stage) pairs, minus the stages past ``max_stages``."""
        req_e2e, unattributed, pair_req, pair_stage, pair_time, pair_excl = self._partition(
            fin, stage
        )
        if pair_stage.size and pair_stage.max() >= _NO_COLUMN:
            keep = pair_stage < _NO_COLUMN
            self._asm._drop(sc.DROP_TOO_MANY_STAGES, int(keep.size - keep.sum()))
            # A dropped stage's exclusive time becomes its request's `unattributed`, so
            # that every request's parts still sum to its e2e (and the shares to 1).
            np.add.at(unattributed, pair_req[~keep], pair_excl[~keep])
            pair_req, pair_stage = pair_req[keep], pair_stage[keep]
            pair_time, pair_excl = pair_time[keep], pair_excl[keep]
        return req_e2e, unattributed, pair_req, pair_stage, pair_time, pair_excl

    def _fold_histograms(self, fin: Finalised, now: float, n: int, pr: np.ndarray,
                         q_series: np.ndarray, q_stage: np.ndarray, q_val: np.ndarray,
                         q_w: np.ndarray, q_live: np.ndarray | None = None) -> None:
        """Cumulative Prometheus histograms and their exemplars (no unattributed
        pseudo-stage there). ``q_live``: the entries counted in the histograms (None:
        all); exemplars come from every entry."""
        keep = q_stage != _UNATTRIBUTED
        hs, hst, hv, hw = q_series[keep], q_stage[keep], q_val[keep], q_w[keep]
        pair = (hs << STAGE_BITS) | hst
        bucket = np.searchsorted(_BOUNDS, hv, side="left")
        h_codes = pair * _NB + bucket
        q_row = np.concatenate([np.arange(n), pr])[keep]
        self._exemplars.add(pair, bucket, hv, q_row, fin.trace_id, now, (STAGE_BITS, _STAGE_MASK))
        if q_live is not None:
            live = q_live[keep]
            h_codes, hw, pair, hv = h_codes[live], hw[live], pair[live], hv[live]
        self._add_histograms(h_codes, hw, pair, hw * hv)

    def _add_histograms(self, h_codes: np.ndarray, hw: np.ndarray, pair: np.ndarray,
                        sums: np.ndarray) -> None:
        """Add weights ``hw`` to the histogram buckets ``h_codes`` (``(series <<
        STAGE_BITS | stage) * _NB + bucket``) and ``sums`` to the sums of ``pair``."""
        uniq, totals = reduce_codes(h_codes, hw)
        for code, w in zip(uniq.tolist(), totals.tolist(), strict=False):
            p, bucket = divmod(code, _NB)
            key = (p >> STAGE_BITS, p & _STAGE_MASK)
            arr = self._hist.get(key)
            if arr is None:
                arr = self._hist[key] = np.zeros(_NB)
                self._hist_sum[key] = 0.0
            arr[bucket] += w
        uniq, totals = reduce_codes(pair, sums)
        for p, s in zip(uniq.tolist(), totals.tolist(), strict=False):
            self._hist_sum[(p >> STAGE_BITS, p & _STAGE_MASK)] += s

    def _keep_queue_and_work(
        self, fin: Finalised, slice_: TimeSlice, series: list[int], is_queue: np.ndarray | None
    ) -> None:
        """Queue spans, batch work and the weighted work estimate of this fold
        (queueing.py), per (slice, series): a uniform sample of at most _MAX_QUEUE_ROWS
        queue spans (the smallest random keys), the union of all the work windows (at
        most _MAX_WORK_ROWS intervals: past that the shortest gaps are closed), the sum
        of the work windows' durations and the work estimate. The offline engine
        (unlimited retention) keeps every queue span and gap."""
        codes = np.asarray(_instance_codes(fin))
        sids = np.asarray(series, np.int64)
        parts: dict[int, list] = defaultdict(lambda: [None, None, 0.0, 0.0])
        if is_queue is not None and is_queue.any():
            rows = (np.frombuffer(fin.span_key, np.int64) >> 32)[is_queue]
            start = np.frombuffer(fin.span_start, np.uint64)[is_queue].astype(np.float64) * _NS
            end = np.frombuffer(fin.span_end, np.uint64)[is_queue].astype(np.float64) * _NS
            weight = np.frombuffer(fin.weight, np.float64)[rows]
            keys = self._rng.random(rows.size)
            # What the batcher itself measured (inferprof.queue.behind_batches_s), NaN
            # where it did not: those spans are compared with the work windows instead.
            reported = np.full(is_queue.size, np.nan)
            if fin.queue_behind:
                pairs = np.frombuffer(fin.queue_behind, np.float64).reshape(-1, 2)
                reported[pairs[:, 0].astype(np.int64)] = pairs[:, 1]
            rows_q = np.stack([codes[rows], start, end, weight, reported[is_queue], keys], axis=1)
            sid = sids[rows]
            for one in np.unique(sid).tolist():
                parts[one][0] = rows_q[sid == one]
        if fin.work:
            work = np.frombuffer(fin.work, np.float64).reshape(-1, 3)
            rows = work[:, 0].astype(np.int64)
            rows_w = np.stack([codes[rows], work[:, 1], work[:, 2]], axis=1)
            # Copies of one window (a linked span without batch id, Triton's batched
            # requests) once: sorted, then a row equal to the one before it goes.
            order = np.lexsort((rows_w[:, 2], rows_w[:, 1], rows_w[:, 0], sids[rows]))
            rows_w, sid = rows_w[order], sids[rows][order]
            keep = np.ones(sid.size, bool)
            keep[1:] = (np.diff(rows_w, axis=0) != 0).any(axis=1) | (sid[1:] != sid[:-1])
            rows_w, sid = rows_w[keep], sid[keep]
            bounds = np.flatnonzero(np.diff(sid)) + 1
            for chunk in np.split(np.arange(sid.size), bounds):
                w = rows_w[chunk]
                one = parts[int(sid[chunk[0]])]
                one[1] = w
                one[2] = float(np.clip(w[:, 2] - w[:, 1], 0.0, None).sum())
        if fin.work_share:
            share = np.frombuffer(fin.work_share, np.float64).reshape(-1, 2)
            rows = share[:, 0].astype(np.int64)
            part = np.frombuffer(fin.weight, np.float64)[rows] * share[:, 1]
            sid = sids[rows]
            for one in np.unique(sid).tolist():
                parts[one][3] = float(part[sid == one].sum())
        online = math.isfinite(self.retention_s)
        for one, (queue, work, seen, estimate) in parts.items():
            if queue is not None:
                kept = slice_.queue.get(one)
                queue = queue if kept is None else np.concatenate([kept, queue])
                if online and queue.shape[0] > _MAX_QUEUE_ROWS:
                    smallest = np.argpartition(queue[:, 5], _MAX_QUEUE_ROWS)[:_MAX_QUEUE_ROWS]
                    queue = queue[smallest]
                slice_.queue[one] = queue
            if work is not None:
                kept = slice_.work.get(one)
                work = union(work if kept is None else np.concatenate([kept, work]),
                             _MAX_WORK_ROWS if online else None)
                slice_.work[one] = work
            slice_.work_seen[one] += seen
            slice_.work_estimate[one] += estimate
            slice_.queue_version[one] += 1
