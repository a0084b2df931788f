"""Generating requests folded into windowed figures (contract §7, encoding §14).

The engine hands each finalised batch of requests to ``GenerationFold.fold``; the requests
that generate (``Finalised.gen``) give

* per request: ttft, tpot, output tokens, and its ttft partitioned between stages;
* per inter-token gap (``generation_attribution.gap_causes``): its itl value, weight and
  causes, joined to the engine's step spans (``steps.StepIndex``);
* KV-cache readings of the engines serving them, while they ran;

all into relative-error sketches of the same mapping as the stage quantiles (so every
quantile is within §6's 1%), per (time slice, series), and cumulative Prometheus
histograms. ``section`` merges the slices of a window into the breakdown's ``generation``
section; the tail attributions read the buckets at and above the one holding p95 (§13).

Memory: per (slice, series) the sketches are sparse buckets (a few thousand at most);
``steps.StepIndex`` keeps each engine's steps for ``retention_s`` of collector time after they
arrive, online at most ``max_rows`` per engine, ``max_total_rows`` steps and KV readings in
all, and ``max_engines`` engines; what it refuses is counted (``dropped``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from inferprof import semconv as sc
from inferprof.collector import gen_spans as gs
from inferprof.collector.generation_attribution import (
    N_CAUSES,
    decide,
    gap_causes,
    ttft_stage_order,
)
from inferprof.collector.sketch import (
    KEY_BITS,
    KeyMapping,
    concat_reduce,
    gather,
    quantiles_from_buckets,
    rank_index,
    reduce_codes,
    split_groups,
)
from inferprof.collector.steps import (
    DEFAULT_MAX_ENGINES,
    DEFAULT_MAX_STEP_ROWS,
    DEFAULT_MAX_TOTAL_ROWS,
    EngineKey,
    StepIndex,
    engine_key,
)
from inferprof.timing import partition

#: A span's wanted attributes, as trace assembly read them.
Extra = dict[str, Any]
#: (stage name, start ns, end ns) of a request's stage spans.
Spans = list[tuple[str, int, int]]
Arrays = tuple[np.ndarray, ...]

_NS = 1e-9
_LOW32 = (1 << 32) - 1
#: Packed sketch codes:
#: series << _SERIES_SHIFT | metric << _METRIC_SHIFT | column << KEY_BITS | key.
_COL_BITS = 8
_METRIC_SHIFT = KEY_BITS + _COL_BITS
_SERIES_SHIFT = _METRIC_SHIFT + 4
# Metrics of the sketches: quantile stores, then tail-attribution stores.
Q_TTFT, Q_ITL, Q_TPOT, Q_TOKENS, Q_KV, T_TTFT, T_ITL = range(7)
#: Column of the summed ttft / gap time in the tail stores (causes take 0..4).
_TOTAL = (1 << _COL_BITS) - 1
#: The entries of each gap: its itl quantile entry, its time per cause, its whole time.
_GAP_METRICS = (Q_ITL, *[T_ITL] * (N_CAUSES + 1))
_GAP_COLS = (0, *range(N_CAUSES), _TOTAL)
# Per (slice, series) counters.
_REQUESTS, _PREEMPTED, _CANCELLED = range(3)
# Cumulative histograms (Prometheus).
H_TTFT, H_ITL, H_TPOT, H_GENAI_TTFT, H_GENAI_TPOT, H_GENAI_DURATION = range(6)
#: The OpenTelemetry GenAI conventions' advisory buckets (seconds).
GENAI_TTFT_BOUNDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                     2.5, 5.0, 7.5, 10.0)
GENAI_TPOT_BOUNDS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
GENAI_DURATION_BOUNDS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24,
                         20.48, 40.96, 81.92)
def _valid_offsets(extra: Extra) -> tuple[np.ndarray | None, np.ndarray | None]:
    raw = extra.get(sc.ATTR_GEN_EMIT_OFFSETS_S)
    if raw is None or not len(raw):
        return None, None
    offsets = np.frombuffer(raw, np.float64) if not isinstance(raw, np.ndarray) else raw
    if not np.isfinite(offsets).all() or (offsets > gs.MAX_SECONDS).any():
        return None, None
    # A producer's clock cannot run backwards within one request: keep it monotone.
    offsets = np.maximum.accumulate(np.maximum(offsets, 0.0))
    raw_tokens = extra.get(sc.ATTR_GEN_EMIT_TOKENS)
    tokens = None
    if raw_tokens is not None and len(raw_tokens) == offsets.size:
        tokens = np.frombuffer(raw_tokens, np.float64)
        if not (np.isfinite(tokens).all() and (tokens >= 0).all()):
            tokens = None
    return offsets, tokens


class _Entries:
    """Sketch entries and histogram values of one fold, packed at its end."""

    __slots__ = (
        "code_weights",
        "codes",
        "cols",
        "hist",
        "metrics",
        "one",
        "one_hist",
        "sids",
        "values",
        "weights",
    )

    def __init__(self) -> None:
        self.sids: list[np.ndarray] = []
        self.metrics: list[np.ndarray] = []
        self.cols: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        self.weights: list[np.ndarray] = []
        self.hist: list[tuple[int, int, np.ndarray, np.ndarray]] = []
        # single entries (per request), as plain tuples: numpy once per fold, not per call
        self.one: list[tuple[int, int, int, float, float]] = []
        self.one_hist: list[tuple[int, int, float, float]] = []
        # entries already packed into codes (gaps, reduced per request)
        self.codes: list[np.ndarray] = []
        self.code_weights: list[np.ndarray] = []

    def put(self, sid: int, metric: int, col: Any, v: Any, w: Any) -> None:
        v = np.atleast_1d(np.asarray(v, np.float64))
        self.sids.append(np.full(v.size, sid, np.int64))
        self.metrics.append(np.full(v.size, metric, np.int64))
        self.cols.append(np.broadcast_to(np.asarray(col, np.int64), v.shape))
        self.values.append(v)
        self.weights.append(np.broadcast_to(np.asarray(w, np.float64), v.shape))

    def scalar(self, sid: int, metric: int, col: int, v: float, w: float) -> None:
        self.one.append((sid, metric, col, v, w))

    def scalar_hist(self, sid: int, h: int, v: float, w: float) -> None:
        self.one_hist.append((sid, h, v, w))

    def histograms(self) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
        """Array histogram entries plus the single ones, one entry per (series, id)."""
        out = list(self.hist)
        if self.one_hist:
            rows = np.asarray(self.one_hist, np.float64)
            keys = rows[:, 0].astype(np.int64) << 8 | rows[:, 1].astype(np.int64)
            for key in np.unique(keys).tolist():
                sel = keys == key
                out.append((key >> 8, key & 0xFF, rows[sel, 2], rows[sel, 3]))
        return out

    def reduced(self, mapping: KeyMapping) -> tuple[np.ndarray, np.ndarray]:
        if self.one:
            rows = np.asarray(self.one, np.float64)
            ints = rows[:, :3].astype(np.int64)
            self.sids.append(ints[:, 0])
            self.metrics.append(ints[:, 1])
            self.cols.append(ints[:, 2])
            self.values.append(rows[:, 3])
            self.weights.append(rows[:, 4])
            self.one = []
        codes, weights = list(self.codes), list(self.code_weights)
        if self.values:
            codes.append(
                (np.concatenate(self.sids) << _SERIES_SHIFT)
                | (np.concatenate(self.metrics) << _METRIC_SHIFT)
                | (np.concatenate(self.cols) << KEY_BITS)
                | mapping.key(np.concatenate(self.values))
            )
            weights.append(np.concatenate(self.weights))
        return reduce_codes(np.concatenate(codes), np.concatenate(weights))


def _spans_by_request(fin: Any, stage_names: list[str]) -> Callable[[int], Spans]:
    """row -> [(stage name, start ns, end ns)] of the stage spans of ``fin.gen``'s rows."""
    key = np.frombuffer(fin.span_key, np.int64)
    span_req = key >> 32
    span_stage = key & _LOW32
    rows = np.asarray([row for row, _ in fin.gen], np.int64)
    mine = np.flatnonzero(np.isin(span_req, rows))
    mine = mine[np.argsort(span_req[mine], kind="stable")]
    mine_req = span_req[mine]

    def spans_of(row: int) -> list[tuple[str, int, int]]:
        lo = int(np.searchsorted(mine_req, row, side="left"))
        hi = int(np.searchsorted(mine_req, row, side="right"))
        return [(stage_names[int(span_stage[j])], fin.span_start[j], fin.span_end[j])
                for j in mine[lo:hi].tolist()]

    return spans_of


class _Merged:
    """The sketch entries of a window, by (metric, column)."""

    def __init__(
        self, groups: dict[int, tuple[np.ndarray, np.ndarray]], mapping: KeyMapping
    ) -> None:
        self.groups = groups
        self.mapping = mapping

    def group(self, metric: int, col: int) -> tuple[np.ndarray, np.ndarray]:
        empty = (np.empty(0, np.int64), np.empty(0))
        return self.groups.get((metric << _COL_BITS) | col, empty)

    def quantiles(self, metric: int) -> dict[str, float | None]:
        k, w = self.group(metric, 0)
        p50, p95, p99 = quantiles_from_buckets(self.mapping, k, w, sc.QUANTILES)
        return {"p50": p50, "p95": p95, "p99": p99}

    def tail(self, metric: int, of: int, names: list[str]) -> dict[str, float]:
        """Shares of each column over the entries keyed at or above the bucket holding
        the p95 of ``of`` (§13's reading), by ``names`` (column order)."""
        k, w = self.group(of, 0)
        if not k.size or not (w > 0).any():
            return {}
        key = int(k[rank_index(np.cumsum(w), 0.95)])
        k, w = self.group(metric, _TOTAL)
        total = float(w[k >= key].sum())
        if total <= 0:
            return {}
        out: dict[str, float] = {}
        for col, name in enumerate(names):
            kc, wc = self.group(metric, col)
            if kc.size:
                out[name] = out.get(name, 0.0) + float(wc[kc >= key].sum()) / total
        return out


class GenerationFold:
    """Not thread-safe: the engine serialises calls."""

    def __init__(
        self,
        mapping: KeyMapping,
        *,
        retention_s: float,
        step_retention_s: float,
        histogram_bounds: tuple[float, ...],
    ) -> None:
        online = math.isfinite(retention_s)
        self.mapping = mapping
        #: Bucket bounds of each histogram: ``histogram_bounds`` (the request histogram's)
        #: for inferprof's, the GenAI conventions' for theirs.
        self.bounds = {
            H_TTFT: histogram_bounds,
            H_ITL: histogram_bounds,
            H_TPOT: histogram_bounds,
            H_GENAI_TTFT: GENAI_TTFT_BOUNDS,
            H_GENAI_TPOT: GENAI_TPOT_BOUNDS,
            H_GENAI_DURATION: GENAI_DURATION_BOUNDS,
        }
        self.steps = StepIndex(
            step_retention_s if online else math.inf,
            max_engines=DEFAULT_MAX_ENGINES if online else None,
            max_rows=DEFAULT_MAX_STEP_ROWS if online else None,
            max_total_rows=DEFAULT_MAX_TOTAL_ROWS if online else None,
        )
        # slice index -> list of (codes, weights) chunks / series -> counters
        self._chunks: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._counts: dict[int, dict[int, np.ndarray]] = {}
        # ttft stage columns: name -> column (0 is unattributed), at most _TOTAL - 1 names.
        self._col: dict[str, int] = {sc.STAGE_UNATTRIBUTED: 0}
        self._col_names: list[str] = [sc.STAGE_UNATTRIBUTED]
        # (series, histogram) -> [bucket weights, weighted sum]
        self._hist: dict[tuple[int, int], list[Any]] = {}
        # (series, engine) -> time (s) up to which its KV readings were counted
        self._kv_mark: dict[tuple[int, EngineKey], float] = {}
        self.requests_folded = 0
        self.tokens_folded = 0

    # --- folding ------------------------------------------------------------------------
    def _stage_col(self, name: str) -> int:
        col = self._col.get(name)
        if col is None:
            if len(self._col_names) >= _TOTAL:
                return 0  # past the column cap the stage's time is unattributed
            col = self._col[name] = len(self._col_names)
            self._col_names.append(name)
        return col

    def fold(self, fin: Any, series: list[int], stage_names: list[str], slice_index: int,
             now: float) -> None:
        """Fold the generating requests of ``fin`` (``Finalised.gen``) into the slice."""
        if not fin.gen:
            return
        acc = _Entries()
        spans_of = _spans_by_request(fin, stage_names)
        counts = self._counts.setdefault(slice_index, {})
        # (series, engine) -> [earliest start, latest end] (s) of its requests here
        ran: dict[tuple[int, EngineKey], list[float]] = {}
        for row, extra in fin.gen:
            sid = series[row]
            engine = extra.get(sc.ATTR_ENGINE_ID)
            host, instance = fin.instance[row]
            ekey = engine_key(fin.service[row], host, instance, engine)
            c = counts.get(sid)
            if c is None:
                c = counts[sid] = np.zeros(3)
            self._fold_request(acc, sid, ekey, fin.weight[row], fin.start[row], fin.end[row],
                               extra, spans_of(row), c, now)
            span = ran.setdefault((sid, ekey), [math.inf, -math.inf])
            span[0] = min(span[0], fin.start[row] * _NS)
            span[1] = max(span[1], fin.end[row] * _NS)
        for (sid, ekey), (t0, t1) in ran.items():
            # KV readings while these requests ran, each counted once per series.
            mark = self._kv_mark.get((sid, ekey), -math.inf)
            lo = max(np.nextafter(t0, -math.inf), mark)
            if t1 > lo:
                self._kv_mark[(sid, ekey)] = t1
                readings = self.steps.kv_between(ekey, lo, t1, now)
                if readings.size:
                    acc.put(sid, Q_KV, 0, readings, 1.0)
        if acc.values or acc.one or acc.codes:
            chunks = self._chunks.setdefault(slice_index, [])
            chunks.append(acc.reduced(self.mapping))
            if len(chunks) > 16:
                self._chunks[slice_index] = [concat_reduce(chunks)]
        for sid, h, v, w in acc.histograms():
            self._histogram(sid, h, v, w)

    def device_shares(self, fin: Any, stage_names: list[str], device: np.ndarray,
                      now: float) -> None:
        """Rescale, in place, the shares of ``device`` rows (request, stage number,
        seconds, share: ``Finalised.device``) that are a generating request's own
        ``prefill``/``decode`` spans, when its engine sent step spans (§14). Such a span
        is wall time over many steps, each shared with the other requests it batched:
        charged whole, every request of the batch would be charged the whole step. The
        request is charged instead, per step within its span, the step's duration times
        its tokens over the step's tokens (prefill + decode): one token per decode step;
        in prefill, its ``inferprof.tokens.prompt`` spread over the steps' tokens (all the
        steps' prefill tokens when it names none). Steps are the step spans' times (host
        scheduling included)."""
        if not fin.gen or not device.size:
            return
        prefill = {i for i, name in enumerate(stage_names) if name == sc.STAGE_PREFILL}
        decode = {i for i, name in enumerate(stage_names) if name == sc.STAGE_DECODE}
        if not prefill and not decode:
            return
        spans_of = _spans_by_request(fin, stage_names)
        stage = device[:, 1].astype(np.int64)
        # the device rows of each request: a request's rows found by two binary searches
        by_row = np.argsort(device[:, 0], kind="stable")
        rows = device[by_row, 0].astype(np.int64)
        for row, extra in fin.gen:
            engine = extra.get(sc.ATTR_ENGINE_ID)
            if not isinstance(engine, str):
                continue  # an engine's own request span (vLLM, SGLang): no step spans
            host, instance = fin.instance[row]
            steps = self.steps.steps(engine_key(fin.service[row], host, instance, engine), now)
            if steps is None:
                continue
            st, en, p, n, _ = steps
            mid = (st + en) // 2
            dur = (en - st) * _NS
            tokens = p + n
            for name, numbers in ((sc.STAGE_PREFILL, prefill), (sc.STAGE_DECODE, decode)):
                own = by_row[int(np.searchsorted(rows, row, side="left")):
                             int(np.searchsorted(rows, row, side="right"))]
                mine = own[np.isin(stage[own], list(numbers))]
                if not mine.size:
                    continue
                gpu_s = 0.0
                for span_name, s, e in spans_of(row):
                    if span_name != name:
                        continue
                    inside = slice(int(np.searchsorted(mid, s, side="left")),
                                   int(np.searchsorted(mid, e, side="right")))
                    d, t = dur[inside], tokens[inside]
                    if not d.size or not (t > 0).any():
                        continue
                    d, t, pre = d[t > 0], t[t > 0], p[inside][t > 0]
                    if name == sc.STAGE_DECODE:
                        gpu_s += float(np.sum(d / t))
                    elif fin.tokens[row] > 0 and t.sum() > 0:
                        gpu_s += min(1.0, fin.tokens[row] / float(t.sum())) * float(d.sum())
                    else:
                        gpu_s += float(np.sum(d * pre / t))
                seconds = float(device[mine, 2].sum())
                device[mine, 3] = gpu_s / seconds if seconds > 0 else 0.0

    def _fold_request(self, acc: _Entries, sid: int, ekey: EngineKey, w: float, start: int,
                      end: int, extra: Extra, spans: Spans, counts: np.ndarray,
                      now: float) -> None:
        offsets, tokens = _valid_offsets(extra)
        ttft = float(offsets[0]) if offsets is not None else gs.seconds(
            extra, sc.ATTR_GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN)
        e2e = (end - start) * _NS
        if e2e == 0:
            e2e = gs.seconds(extra, sc.ATTR_GEN_AI_LATENCY_E2E) or 0.0
        out = gs.count(extra, sc.ATTR_TOKENS_OUTPUT)
        if out is None:
            out = gs.count(extra, sc.ATTR_GEN_AI_USAGE_COMPLETION_TOKENS)
        if out is None and offsets is not None:
            out = int(tokens.sum()) if tokens is not None else offsets.size
        preempted = [(s, e) for name, s, e in spans if name == sc.STAGE_PREEMPTED]
        counts[_REQUESTS] += w
        if preempted or (gs.count(extra, sc.ATTR_GEN_PREEMPTIONS) or 0) > 0:
            counts[_PREEMPTED] += w
        if extra.get(sc.ATTR_CANCELLED) is True:
            counts[_CANCELLED] += w
        self.requests_folded += 1
        if out is not None:
            acc.scalar(sid, Q_TOKENS, 0, float(out), w)
            self.tokens_folded += out
        acc.scalar_hist(sid, H_GENAI_DURATION, e2e, w)
        if ttft is not None:
            ttft = min(ttft, e2e) if e2e > 0 else ttft
            self._fold_ttft(acc, sid, w, start, ttft, spans)
            if out is not None and out >= 2:
                tpot = max(e2e - ttft, 0.0) / (out - 1)
                acc.scalar(sid, Q_TPOT, 0, tpot, w)
                acc.scalar_hist(sid, H_TPOT, tpot, w)
                acc.scalar_hist(sid, H_GENAI_TPOT, tpot, w)
        if offsets is not None and offsets.size > 1:
            # An eviction's cost within a gap: the wait and the prompt's recomputation (a
            # `prefill` after the first token is one), §14.
            evicted = preempted + [(s, e) for name, s, e in spans if name == sc.STAGE_PREFILL]
            self._fold_gaps(acc, sid, ekey, w, start, end, offsets, tokens, evicted, now)

    def _fold_ttft(self, acc: _Entries, sid: int, w: float, start: int, ttft: float,
                   spans: Spans) -> None:
        acc.scalar(sid, Q_TTFT, 0, ttft, w)
        acc.scalar_hist(sid, H_TTFT, ttft, w)
        acc.scalar_hist(sid, H_GENAI_TTFT, ttft, w)
        # The ttft partitioned between stages as §6 partitions e2e (§14); every entry is
        # keyed by the request's ttft: the tail is read by that key.
        first = start + round(ttft * 1e9)
        _, exclusive, unatt = partition(start, first, spans)
        for name, x in exclusive.items():
            acc.scalar(sid, T_TTFT, self._stage_col(name), ttft, w * x)
        acc.scalar(sid, T_TTFT, 0, ttft, w * unatt)
        acc.scalar(sid, T_TTFT, _TOTAL, ttft, w * (first - start) * _NS)

    def _fold_gaps(self, acc: _Entries, sid: int, ekey: EngineKey, w: float, start: int,
                   end: int, offsets: np.ndarray, tokens: np.ndarray | None,
                   preempted: list[tuple[int, int]],
                   now: float) -> None:
        steps = self.steps.steps(ekey, now)
        steps_rel = None
        if steps is not None:
            st, en, p, n, en_max = steps
            # The steps that can touch the request: started before its end, and not
            # among the leading steps that all ended before its start.
            sl = slice(int(np.searchsorted(en_max, start, side="right")),
                       int(np.searchsorted(st, end, side="right")))
            steps_rel = ((st[sl] - start) * _NS, (en[sl] - start) * _NS, p[sl], n[sl])
        pre = np.asarray([((s - start) * _NS, (e - start) * _NS) for s, e in preempted],
                         np.float64).reshape(-1, 2)
        itl, k, causes = gap_causes(offsets, tokens, pre, steps_rel)
        acc.hist.append((sid, H_ITL, itl, w * k))
        # The request's gaps summed per bucket first (a few dozen buckets for hundreds of
        # gaps): the quantile entries, then each cause's and the total's tail entries.
        keys, inverse = np.unique(self.mapping.key(itl), return_inverse=True)
        inverse = inverse.ravel()
        columns = (w * k, *(w * causes.T), w * itl * k)
        acc.codes.append((
            (sid << _SERIES_SHIFT)
            | (np.asarray(_GAP_METRICS) << _METRIC_SHIFT)[:, None]
            | (np.asarray(_GAP_COLS) << KEY_BITS)[:, None]
            | keys[None, :]
        ).ravel())
        acc.code_weights.append(np.concatenate(
            [np.bincount(inverse, weights=c, minlength=keys.size) for c in columns]))

    def _histogram(self, sid: int, h: int, v: np.ndarray, w: np.ndarray) -> None:
        bounds = self.bounds[h]
        acc = self._hist.get((sid, h))
        if acc is None:
            acc = self._hist[(sid, h)] = [np.zeros(len(bounds) + 1), 0.0]
        idx = np.searchsorted(np.asarray(bounds), v, side="left")
        acc[0] += np.bincount(idx, weights=w, minlength=len(bounds) + 1)
        acc[1] += float(np.dot(v, w))

    def ingest_kv(self, resource: Any, metric: Any, now: float) -> tuple[int, int]:
        """The data points of an ``inferprof.engine.kv_cache.usage`` metric (§14):
        (accepted, rejected)."""
        service, host, instance = "unknown_service", "", ""
        for kv in resource.attributes:
            if kv.key == sc.RESOURCE_SERVICE_NAME:
                service = kv.value.string_value or service
            elif kv.key == sc.RESOURCE_HOST_NAME:
                host = kv.value.string_value
            elif kv.key == sc.RESOURCE_SERVICE_INSTANCE_ID:
                instance = kv.value.string_value
        kind = metric.WhichOneof("data")
        if kind not in ("gauge", "sum"):
            return 0, 0
        ok = bad = 0
        for dp in getattr(metric, kind).data_points:
            engine = sc.DEFAULT_ENGINE_ID
            for kv in dp.attributes:
                if kv.key == sc.ATTR_ENGINE_ID:
                    engine = kv.value.string_value or engine
            v = dp.as_double if dp.WhichOneof("value") == "as_double" else float(dp.as_int)
            if self.steps.add_kv(engine_key(service, host, instance, engine),
                                 dp.time_unix_nano * _NS, v, now):
                ok += 1
            else:
                bad += 1
        return ok, bad

    # --- housekeeping -------------------------------------------------------------------
    def prune(self, oldest_index: int, now: float) -> None:
        for idx in [i for i in self._chunks if i < oldest_index]:
            del self._chunks[idx]
        for idx in [i for i in self._counts if i < oldest_index]:
            del self._counts[idx]
        self.steps.prune(now)
        # KV marks of engines gone from the index (scanned only once they outnumber the
        # live engines: amortised, not per call).
        if len(self._kv_mark) > 2 * len(self.steps.engines) + 64:
            live = self.steps.engines
            for mk in [k for k in self._kv_mark if k[1] not in live]:
                del self._kv_mark[mk]

    def forget_series(self, sid: int) -> None:
        """A reclaimed series slot: its cumulative histograms and KV marks go."""
        for hk in [k for k in self._hist if k[0] == sid]:
            del self._hist[hk]
        for mk in [k for k in self._kv_mark if k[0] == sid]:
            del self._kv_mark[mk]

    # --- readers ------------------------------------------------------------------------
    def histograms(self) -> list[tuple[int, int, np.ndarray, float]]:
        """(series, histogram id, bucket weights (per bucket, +Inf last), weighted sum)."""
        return [(sid, h, acc[0].copy(), acc[1]) for (sid, h), acc in self._hist.items()]

    def section(
        self, sids: list[int], slice_indices: list[int], base_verdict: dict[str, Any]
    ) -> dict[str, Any] | None:
        """The breakdown's ``generation`` section over the given slices; None when they
        hold no generating request of these series."""
        requests = preempted = cancelled = 0.0
        for idx in slice_indices:
            counts = self._counts.get(idx)
            if not counts:
                continue
            for sid in sids:
                c = counts.get(sid)
                if c is not None:
                    requests += c[_REQUESTS]
                    preempted += c[_PREEMPTED]
                    cancelled += c[_CANCELLED]
        if requests <= 0:
            return None
        parts = []
        for idx in slice_indices:
            chunks = self._chunks.get(idx)
            if chunks:
                if len(chunks) > 1:
                    chunks = self._chunks[idx] = [concat_reduce(chunks)]
                parts.extend(gather(chunks[0], sids, _SERIES_SHIFT))
        merged = _Merged(split_groups(*concat_reduce(parts)), self.mapping)
        qs = merged.quantiles
        tokens = qs(Q_TOKENS)
        ttft_shares = merged.tail(T_TTFT, Q_TTFT, self._col_names)
        itl_shares = merged.tail(T_ITL, Q_ITL, list(sc.ITL_CAUSES))
        ttft_stages = ttft_stage_order(list(ttft_shares))
        kv = qs(Q_KV)
        section: dict[str, Any] = {
            "requests": round(requests),
            "output_tokens": {
                name: (round(v) if v is not None else None) for name, v in tokens.items()
            },
            "ttft": {
                **qs(Q_TTFT),
                "stages": [{"stage": n, "share_of_p95": ttft_shares[n]} for n in ttft_stages],
            },
            "itl": {
                **qs(Q_ITL),
                "causes": [
                    {"cause": c, "share_of_p95": itl_shares.get(c, 0.0)} for c in sc.ITL_CAUSES
                ] if itl_shares else [],
            },
            "tpot": qs(Q_TPOT),
            "preempted_requests": round(preempted),
            "cancelled_requests": round(cancelled),
            "kv_cache": {"usage_p95": kv["p95"]},
        }
        section["verdict"] = decide(section, base_verdict)
        return section


__all__ = [
    "GENAI_DURATION_BOUNDS",
    "GENAI_TPOT_BOUNDS",
    "GENAI_TTFT_BOUNDS",
    "GenerationFold",
    "StepIndex",
]
