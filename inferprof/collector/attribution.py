"""Where a request's end-to-end time went, and the tail-attribution sketch.

Two per-request figures per stage (times in seconds), computed by
``inferprof.timing.partition`` (shared with the in-process summaries):

* **stage time** — the summed duration of the stage's spans, each clipped to the
  request span's ``[start, end]``. This is what per-stage quantiles are computed over:
  it is what a user sees summing the bars of one stage in Jaeger. Clipping guards
  against clock skew between the batcher and the request handler.
* **exclusive time** — a partition of the request's end-to-end time. The request's
  interval is cut at every stage-span boundary; each elementary segment goes to the
  stages covering it (split equally when several distinct stages overlap) or to
  ``unattributed`` when none does. Exclusive times of all stages plus ``unattributed``
  therefore sum to the end-to-end time exactly. When stage spans do not overlap (the
  normal serving path) exclusive time equals stage time.

``share_of_p95`` (contract §6) is computed from exclusive times, so the shares of all
stages including ``unattributed`` sum to 1.

The tail-attribution sketch keeps, per time slice and per log-spaced end-to-end
bucket (the quantile sketch's own mapping), the traced count, the weighted count, the
weighted sum of end-to-end time and the weighted sum of each stage's exclusive time.
``share_of_p95`` sums the buckets at and above the bucket holding the window's p95.
Boundary error: the p95 bucket also holds requests up to a factor ``gamma`` (1% at the
default accuracy) below p95; they are included in the tail set. Their weight is at most
that bucket's weight, so the error on a share is bounded by the bucket's weight over the
tail's weight times the difference of that bucket's share from the rest; on continuous
latency distributions it is a fraction of a percentage point (tests check it against
exact computation).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from inferprof import semconv as sc
from inferprof.collector.sketch import KEY_BITS, KEY_MASK

#: Columns of a tail-table row (``COL_STAGE0 + stage index`` for each stage).
COL_TRACED = 0
COL_WEIGHT = 1
COL_E2E = 2
COL_STAGE0 = 3
COL_BITS = 10
COL_MASK = (1 << COL_BITS) - 1
#: Maximum number of distinct stage names (canonical + custom) the engine tracks.
MAX_STAGE_COLUMNS = COL_MASK + 1 - COL_STAGE0
#: Distinct stage names a collector tracks by default, the contract's stages and
#: ``unattributed`` included: every (service, model) series carries a quantile, share and
#: histogram per stage on ``/metrics``, so the names multiply the exposition
#: (docs/concepts.md). ``inferprof report`` has no ``/metrics`` and tracks the most.
DEFAULT_MAX_STAGES = 64
#: The fewest: the contract's stages and ``unattributed``.
MIN_MAX_STAGES = len(sc.CANONICAL_STAGES) + 1
#: The most the column bits allow (column 0 is "no stage").
MAX_MAX_STAGES = MAX_STAGE_COLUMNS - 1


def stage_row(name: str, count: float, quantiles: dict, shares: dict, shares50: dict,
              shares99: dict) -> dict:
    """One entry of the breakdown document's ``stages`` (contract §5): its count,
    quantiles and share of the tail at p95, p50 and p99."""
    return {
        "stage": name,
        "count": round(count),
        **quantiles,
        "share_of_p95": float(shares.get(name, 0.0)),
        "share_of_p50": float(shares50.get(name, 0.0)),
        "share_of_p99": float(shares99.get(name, 0.0)),
    }


def tail_codes(series: np.ndarray, keys: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Pack (series id, e2e bucket key, column) into one sortable int64 code."""
    return (series << (KEY_BITS + COL_BITS)) | (keys << COL_BITS) | cols


def series_range(series_id: int) -> tuple[int, int]:
    lo = series_id << (KEY_BITS + COL_BITS)
    return lo, lo + (1 << (KEY_BITS + COL_BITS))


def tail_shares(
    codes: np.ndarray, values: np.ndarray, p95_key: int, stage_names: Sequence[str]
) -> tuple[dict[str, float], float, float]:
    """Shares of the tail (e2e bucket key >= ``p95_key``) per stage.

    ``codes``/``values`` are tail-table entries of the series of interest (merged or not;
    the series bits are ignored). Returns ``(shares, traced_tail, weighted_tail)``;
    shares include ``unattributed`` under the name ``stage_names[i]`` of its column.
    """
    keys = (codes >> COL_BITS) & KEY_MASK
    mask = keys >= p95_key
    cols = (codes[mask] & COL_MASK).astype(np.int64)
    sums = np.bincount(cols, weights=values[mask], minlength=COL_STAGE0 + len(stage_names))
    total_e2e = sums[COL_E2E]
    shares: dict[str, float] = {}
    if total_e2e > 0:
        for i, name in enumerate(stage_names):
            v = sums[COL_STAGE0 + i]
            if v != 0.0:
                shares[name] = float(v / total_e2e)
    return shares, float(sums[COL_TRACED]), float(sums[COL_WEIGHT])


def exact_tail_shares(
    e2e: Sequence[float],
    weights: Sequence[float],
    exclusive: Sequence[dict[str, float]],
    p95: float,
) -> dict[str, float]:
    """Exact §6 ``share_of_p95`` of per-request exclusive times (reference for tests)."""
    num: dict[str, float] = defaultdict(float)
    den = 0.0
    for x, w, ex in zip(e2e, weights, exclusive, strict=False):
        if x >= p95:
            den += w * x
            for k, v in ex.items():
                num[k] += w * v
    return {k: v / den for k, v in num.items()} if den > 0 else {}


__all__ = ["exact_tail_shares", "series_range", "tail_codes", "tail_shares"]
