"""One request's timing figures and the summaries' bucket mapping, shared by both halves.

``partition`` is the one definition of a request's per-stage figures (contract §6): the
collector computes them from spans, the in-process summaries (contract §15) from the
records the process kept, so both count the same request the same way.

* **stage time** — the summed duration of the stage's spans, each clipped to the
  request's ``[start, end]``.
* **exclusive time** — a partition of the request's end-to-end time: the request's
  interval is cut at every stage-span boundary; each elementary segment goes to the
  stages covering it (split equally when several distinct stages overlap) or to
  ``unattributed`` when none does. Exclusive times of all stages plus ``unattributed``
  sum to the end-to-end time exactly; without overlap they equal stage times.

``exp_index``/``exp_representative`` are OTLP's exponential-histogram bucket mapping
(bucket ``i`` at scale ``s`` covers ``(base**i, base**(i+1)]``, ``base = 2**(2**-s)``):
the producer buckets with the first, the collector reads a bucket back as the second.
At the default scale 7 a bucket's representative is within 0.27% of every value in it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, Final

import numpy as np
import numpy.typing as npt

#: The scale the in-process summaries use (contract §15): base ``2**(1/128)``.
DEFAULT_SUMMARY_SCALE: Final = 7
#: Scales a summary data point may carry (OTLP allows -10..20).
MIN_SUMMARY_SCALE: Final = -10
MAX_SUMMARY_SCALE: Final = 20

_NS = 1e-9
#: (request, stage) pairs :func:`partition_many` counts into a dense array whatever the
#: number of spans, and per span beyond that; past both it sorts them instead.
_DENSE_KEYS = 1 << 16
_DENSE_PER_SPAN = 4
_LN2 = math.log(2.0)


def partition(
    req_start: int, req_end: int, spans: Iterable[tuple[str, int, int]]
) -> tuple[dict[str, float], dict[str, float], float]:
    """Stage times, exclusive times and unattributed time of one request (seconds).

    ``spans`` are ``(stage, start_ns, end_ns)`` of the stage spans attributed to the
    request, clipped to it. A stage whose spans all lie wholly outside the request is
    absent (§6: "a request that never entered the stage counts as absent, not as zero"), a
    span only touching its start or end included; a zero-length span inside it appears
    with 0.
    """
    clipped: list[tuple[int, int, str]] = []
    stage_ns: dict[str, int] = {}
    for stage, start, end in spans:
        s = max(start, req_start)
        e = min(end, req_end)
        d = e - s
        if d > 0:
            clipped.append((s, e, stage))
            stage_ns[stage] = stage_ns.get(stage, 0) + d
        elif start == end and req_start <= start <= req_end and stage not in stage_ns:
            stage_ns[stage] = 0  # a zero-length stage inside the request: entered, 0 s
    e2e_ns = req_end - req_start
    stage_time = {k: v * _NS for k, v in stage_ns.items()}

    clipped.sort()
    overlap = False
    last_end = req_start
    for s, e, _ in clipped:
        if s < last_end:
            overlap = True
            break
        last_end = e
    if not overlap:
        covered = sum(stage_ns.values())
        return stage_time, dict(stage_time), (e2e_ns - covered) * _NS

    return stage_time, *_sweep(clipped, stage_ns, e2e_ns)


def _sweep(
    clipped: list[tuple[int, int, str]], stage_ns: dict[str, int], e2e_ns: int
) -> tuple[dict[str, float], float]:
    exclusive, covered = _sweep_ns(clipped, stage_ns)
    return {k: v * _NS for k, v in exclusive.items()}, (e2e_ns - covered) * _NS


def _sweep_ns(
    clipped: list[tuple[int, int, Any]], stage_ns: dict[Any, int]
) -> tuple[dict[Any, float], int]:
    """Exclusive nanoseconds per stage and the nanoseconds covered by any stage."""
    # Events: +1 at start, -1 at end; between consecutive boundaries the set of active
    # stages (with multiplicity, so two spans of one stage count as one stage) is fixed.
    events: list[tuple[int, int, Any]] = []
    for s, e, stage in clipped:
        events.append((s, 1, stage))
        events.append((e, -1, stage))
    events.sort(key=lambda ev: (ev[0], ev[1]))
    active: dict[Any, int] = defaultdict(int)
    exclusive = {k: 0.0 for k in stage_ns}
    covered = 0
    prev = events[0][0]
    for t, delta, stage in events:
        if t > prev and active:
            seg = t - prev
            share = seg / len(active)
            for name in active:
                exclusive[name] += share
            covered += seg
        prev = t
        if delta > 0:
            active[stage] += 1
        else:
            active[stage] -= 1
            if active[stage] == 0:
                del active[stage]
    return exclusive, covered


def exp_index(values: npt.ArrayLike, scale: int = DEFAULT_SUMMARY_SCALE) -> npt.NDArray[np.int64]:
    """OTLP exponential-histogram bucket index of each positive value at ``scale``.

    Bucket ``i`` covers ``(base**i, base**(i+1)]``. Values must be positive (callers send
    values ``<= 0`` to the zero bucket); exact powers of two land in the bucket they end.
    """
    v = np.asarray(values, dtype=np.float64)
    # v = m * 2**e with 0.5 <= m < 1: log2(m) + e is exact for an exact power of two
    # (log2(0.5) = -1), which then ends its bucket as OTLP requires.
    mant, exp = np.frexp(v)
    return np.ceil((np.log2(mant) + exp) * math.ldexp(1.0, scale)).astype(np.int64) - 1


def exp_representative(
    index: npt.ArrayLike, scale: int = DEFAULT_SUMMARY_SCALE
) -> npt.NDArray[np.float64]:
    """The value a bucket stands for: ``2*base**(i+1)/(1+base)``, the point whose relative
    distance to both bucket ends is equal (at most ``(base-1)/(base+1)``)."""
    i = np.asarray(index, dtype=np.float64)
    step = math.ldexp(1.0, -scale)
    out: npt.NDArray[np.float64] = 2.0 * np.exp2((i + 1) * step) / (1.0 + math.pow(2.0, step))
    return out


def exp_log_representative(
    index: npt.ArrayLike, scale: int = DEFAULT_SUMMARY_SCALE
) -> npt.NDArray[np.float64]:
    """The natural logarithm of ``exp_representative``, finite at every scale from
    ``MIN_SUMMARY_SCALE`` on (at scale -10 ``base`` is ``2**1024``, past a float): a reader
    of data points from any producer clamps it before taking the exponential."""
    i = np.asarray(index, dtype=np.float64)
    ln_base = _LN2 * math.ldexp(1.0, -scale)
    out: npt.NDArray[np.float64] = _LN2 + (i + 1) * ln_base - np.logaddexp(0.0, ln_base)
    return out


def exp_relative_error(scale: int = DEFAULT_SUMMARY_SCALE) -> float:
    """Largest relative distance of a value from its bucket's representative."""
    base = math.pow(2.0, math.ldexp(1.0, -scale))
    return (base - 1.0) / (base + 1.0)


def partition_many(
    req_start: npt.NDArray[np.int64],
    req_end: npt.NDArray[np.int64],
    span_req: npt.NDArray[np.int64],
    span_stage: npt.NDArray[np.int64],
    span_start: npt.NDArray[np.int64],
    span_end: npt.NDArray[np.int64],
) -> tuple[npt.NDArray[Any], ...]:
    """:func:`partition` of many requests at once, with numpy, in nanoseconds.

    Requests ``0..R-1`` span ``[req_start, req_end]``; span ``k`` of stage number
    ``span_stage[k]`` belongs to request ``span_req[k]``. Returns ``(pair_req,
    pair_stage, stage_ns, exclusive_ns, unattributed_ns)``: one pair per (request, stage
    it entered), with the same semantics as :func:`partition` (clipping, zero-length
    stages inside the request entered with 0); ``unattributed_ns`` per request. Times
    are float64 holding integer nanoseconds (exact below 2**53 ns, 104 days) but for the
    exclusive times of requests whose stages overlap, which are split equally as
    :func:`partition` splits them.
    """
    n_req = len(req_start)
    e2e = (req_end - req_start).astype(np.float64)
    if not len(span_req):
        empty_i = np.zeros(0, dtype=np.int64)
        empty_f = np.zeros(0, dtype=np.float64)
        return empty_i, empty_i, empty_f, empty_f.copy(), e2e
    rs = req_start[span_req]
    re_ = req_end[span_req]
    cs = np.maximum(span_start, rs)
    ce = np.minimum(span_end, re_)
    d = ce - cs
    pos = d > 0
    entered = pos | ((span_start == span_end) & (span_start >= rs) & (span_start <= re_))
    n_stages = int(span_stage.max()) + 1
    key = span_req[entered] * n_stages + span_stage[entered]
    weights = np.where(pos, d, 0)[entered].astype(np.float64)
    n_keys = n_req * n_stages
    if n_keys <= max(_DENSE_PER_SPAN * len(key), _DENSE_KEYS):  # dense: linear time
        ukey = np.flatnonzero(np.bincount(key, minlength=n_keys))
        stage_ns = np.bincount(key, weights=weights, minlength=n_keys)[ukey]
    else:  # many stage names: sorted
        ukey, inv = np.unique(key, return_inverse=True)
        stage_ns = np.bincount(inv, weights=weights, minlength=len(ukey))
    pair_req = ukey // n_stages
    pair_stage = ukey % n_stages
    exclusive_ns = stage_ns.copy()
    unattributed = e2e - np.bincount(pair_req, weights=stage_ns, minlength=n_req)
    # Overlap: sorted by start within a request, some span starts before the one before
    # it ends (any overlap shows between neighbours in that order).
    pr, ps, pe = span_req[pos], cs[pos], ce[pos]
    order = np.lexsort((ps, pr))
    pr, ps, pe = pr[order], ps[order], pe[order]
    overlapping = np.unique(pr[1:][(pr[1:] == pr[:-1]) & (ps[1:] < pe[:-1])])
    if len(overlapping):
        at = np.searchsorted(ukey, overlapping * n_stages)  # each request's first pair
        stages = span_stage[pos][order]
        for r in overlapping.tolist():
            lo, hi = np.searchsorted(pr, [r, r + 1])
            clipped = list(zip(ps[lo:hi].tolist(), pe[lo:hi].tolist(),
                               stages[lo:hi].tolist(), strict=True))
            own = {int(s): 0 for s in pair_stage[pair_req == r].tolist()}
            excl, covered = _sweep_ns(sorted(clipped), own)
            unattributed[r] = int(req_end[r] - req_start[r]) - covered
            i = int(at[np.searchsorted(overlapping, r)])
            while i < len(ukey) and pair_req[i] == r:
                exclusive_ns[i] = excl[int(pair_stage[i])]
                i += 1
    return pair_req, pair_stage, stage_ns, exclusive_ns, unattributed
