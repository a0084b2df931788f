"""Relative-error quantile sketches, filled in batches with numpy.

The bucket layout is DDSketch's (DataDog's ``ddsketch`` library, its
``LogarithmicMapping``): a positive value ``x`` falls in bucket
``k = ceil(log_gamma(x))`` with ``gamma = (1 + a) / (1 - a)`` for relative accuracy
``a``, and the bucket is represented by ``2 * gamma**k / (1 + gamma)``. Every value in
a bucket lies within ``a`` (relative) of that representative, so any rank-based
quantile read from the buckets is within ``a`` of the exact quantile of the same data.
With the default ``a = 0.005`` the contract's bound (1%) holds with a factor-two margin
for floating-point edge cases.

Why not ``DDSketch.add`` per value: the collector folds millions of (request, stage)
values; one Python call per value is most of the ingest budget. We keep the mapping
(and therefore the guarantee) of the library and do the bucketing vectorised: keys of a
whole batch in one ``numpy.log`` call, then equal keys summed with ``numpy.bincount``.
Buckets are kept sparse, as sorted ``(code, weight)`` arrays, so merging time slices and
series is a concatenation plus a reduction.

Quantile definition (the same for the sketch and for the exact reference used in tests):
the weighted *lower* quantile, i.e. the smallest value ``v`` such that the total weight
of values ``<= v`` is at least ``q * W`` (``W`` the total weight). With unit weights this
is the order statistic of rank ``ceil(q * n)``.

Values ``<= 0`` (zero-length stages) go to a dedicated zero bucket whose value is 0.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

import numpy as np

from inferprof._optional import require

#: Key offset so that every bucket key of a value in [1 ns, 1e6 s] is a positive int.
KEY_OFFSET = 1 << 13
#: Bits a bucket key takes in a packed code (``(series << ..) | key``).
KEY_BITS = 14
KEY_MASK = (1 << KEY_BITS) - 1
#: Smallest and largest value bucketed (seconds); smaller positives are clamped to
#: MIN_VALUE (1 ns is the resolution of span timestamps), larger to MAX_VALUE.
#: The relative accuracies :class:`KeyMapping` takes (its docstring says why).
RELATIVE_ACCURACY_MIN = 0.0015
RELATIVE_ACCURACY_MAX = 0.05
MIN_VALUE = 1e-9
MAX_VALUE = 1e6
#: Relative tolerance on ``q * W`` so that the sketch and the exact reference agree on
#: ties even when their cumulative sums are added in different orders.
_RANK_RTOL = 1e-12


class KeyMapping:
    """DDSketch's logarithmic mapping, vectorised.

    Raises ``ValueError`` for a relative accuracy outside [0.0015, 0.05]: below, the
    keys of [1 ns, 1e6 s] no longer fit the packed codes; above, the sketch would not
    meet the contract's 1% bound anyway.
    """

    def __init__(self, relative_accuracy: float = 0.005) -> None:
        if not isinstance(relative_accuracy, (int, float)) or not (
            RELATIVE_ACCURACY_MIN <= relative_accuracy <= RELATIVE_ACCURACY_MAX
        ):
            raise ValueError(
                f"relative_accuracy must be in [{RELATIVE_ACCURACY_MIN}, "
                f"{RELATIVE_ACCURACY_MAX}], got {relative_accuracy!r}"
            )
        ddsketch_mapping = require("ddsketch.mapping", "collector")
        self._mapping = ddsketch_mapping.LogarithmicMapping(relative_accuracy)
        self.relative_accuracy = relative_accuracy
        self.gamma = self._mapping.gamma
        self._multiplier = 1.0 / math.log(self.gamma)
        self._rep_factor = 2.0 / (1.0 + self.gamma)
        lo, hi = self.key(np.array([MIN_VALUE, MAX_VALUE]))
        if lo < 1 or hi > KEY_MASK:  # pragma: no cover - guarded by the accuracy check
            raise ValueError("relative_accuracy too small for the key range")

    def key(self, values: np.ndarray) -> np.ndarray:
        """Bucket keys (offset, >= 1) of ``values``; 0 for values <= 0."""
        v = np.asarray(values, dtype=np.float64)
        clipped = np.clip(v, MIN_VALUE, MAX_VALUE)
        keys = np.ceil(np.log(clipped) * self._multiplier).astype(np.int64) + KEY_OFFSET
        keys[v <= 0.0] = 0
        return keys

    def value(self, keys: np.ndarray) -> np.ndarray:
        """Representative value of each (offset) bucket key; 0 for the zero bucket."""
        k = np.asarray(keys, dtype=np.int64)
        out = np.power(self.gamma, (k - KEY_OFFSET).astype(np.float64)) * self._rep_factor
        out[k == 0] = 0.0
        return out

    def scalar_key(self, value: float) -> int:
        return int(self.key(np.array([value]))[0])


def reduce_codes(codes: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sum ``weights`` of equal ``codes``: sorted unique codes and their total weights."""
    if codes.size == 0:
        return codes.astype(np.int64), weights.astype(np.float64)
    uniq, inverse = np.unique(codes, return_inverse=True)
    return uniq, np.bincount(inverse.ravel(), weights=weights, minlength=uniq.size)


def concat_reduce(parts: Iterable[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    parts = [p for p in parts if p[0].size]
    if not parts:
        return np.empty(0, np.int64), np.empty(0, np.float64)
    if len(parts) == 1:
        return parts[0]
    return reduce_codes(
        np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    )


def rank_index(cum: np.ndarray, q: float) -> int:
    """Index of the first cumulative weight reaching ``q`` of the total."""
    target = q * cum[-1] * (1.0 - _RANK_RTOL)
    return min(int(np.searchsorted(cum, target, side="left")), cum.size - 1)


def quantiles_from_buckets(
    mapping: KeyMapping, keys: np.ndarray, weights: np.ndarray, qs: Sequence[float]
) -> list[float | None]:
    """Lower weighted quantiles from sorted bucket ``keys`` and their ``weights``.

    Returns ``None`` for each quantile when there is no weight at all.
    """
    if keys.size == 0 or not np.any(weights > 0):
        return [None for _ in qs]
    cum = np.cumsum(weights)
    values = mapping.value(keys)
    return [float(values[rank_index(cum, q)]) for q in qs]


def exact_weighted_quantile(
    values: Sequence[float], weights: Sequence[float] | None, q: float
) -> float | None:
    """Exact lower weighted quantile (the sketch's definition), for tests and checks."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return None
    w = np.ones_like(v) if weights is None else np.asarray(weights, dtype=np.float64)
    order = np.argsort(v, kind="stable")
    cum = np.cumsum(w[order])
    return float(v[order][rank_index(cum, q)])


# --- windowed storage -----------------------------------------------------------------------


class TimeSlice:
    """What the engine keeps for one time slice of ``slice_s`` seconds.

    ``q_chunks``: sparse quantile buckets, codes ``(series, stage, key)``;
    ``t_chunks``: tail-attribution entries (``attribution.tail_codes``);
    ``padding``: series -> [effective tokens, padded tokens, batches];
    ``compute``: series -> compute-span windows for the GPU join;
    ``queue``: series -> a sample of queue-span rows (instance, start s, end s, weight,
    reported ``inferprof.queue.behind_batches_s`` or NaN, random key); ``work``: series -> the
    union of batch work windows (instance, start s,
    end s), sorted; ``work_seen`` / ``work_estimate``: series -> the work windows' summed
    durations / the weighted batch work of the traced members (``queueing``);
    ``queue_version`` / ``queue_cache``: a change count per series and the cached
    ``queueing.partial`` of this slice's queue (engine); ``errors``: series -> weighted
    count of requests whose request span has status ERROR.
    Chunks are appended per finalisation batch and compacted on read.
    """

    __slots__ = (
        "compute", "errors", "index", "padding", "q_chunks", "queue", "queue_cache",
        "queue_version",
        "t_chunks", "work", "work_estimate", "work_seen",
    )

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self.q_chunks: list[tuple[np.ndarray, np.ndarray]] = []
        self.t_chunks: list[tuple[np.ndarray, np.ndarray]] = []
        self.padding: dict[int, list[int]] = {}
        self.compute: dict[int, list[tuple[str, str, float, float]]] = defaultdict(list)
        self.queue: dict[int, np.ndarray] = {}
        self.work: dict[int, np.ndarray] = {}
        self.work_seen: dict[int, float] = defaultdict(float)
        self.work_estimate: dict[int, float] = defaultdict(float)
        self.queue_version: dict[int, int] = defaultdict(int)
        self.queue_cache: dict[int, tuple] = {}
        self.errors: dict[int, float] = defaultdict(float)

    def quantile_store(self) -> tuple[np.ndarray, np.ndarray]:
        if len(self.q_chunks) > 1:
            self.q_chunks = [concat_reduce(self.q_chunks)]
        return self.q_chunks[0] if self.q_chunks else (np.empty(0, np.int64), np.empty(0))

    def tail_store(self) -> tuple[np.ndarray, np.ndarray]:
        if len(self.t_chunks) > 1:
            self.t_chunks = [concat_reduce(self.t_chunks)]
        return self.t_chunks[0] if self.t_chunks else (np.empty(0, np.int64), np.empty(0))


def gather(
    store: tuple[np.ndarray, np.ndarray], ids: list[int], shift: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The entries of sorted ``store`` whose code's high bits (``code >> shift``) are in
    ``ids``, with those bits stripped (so several series merge by key)."""
    codes, weights = store
    low = (1 << shift) - 1
    out = []
    for i in ids:
        lo = np.searchsorted(codes, i << shift, side="left")
        hi = np.searchsorted(codes, (i + 1) << shift, side="left")
        if hi > lo:
            out.append((codes[lo:hi] & low, weights[lo:hi]))
    return out


def split_groups(
    codes: np.ndarray, weights: np.ndarray
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Sorted ``(group << KEY_BITS) | key`` codes -> {group: (keys, weights)}."""
    if codes.size == 0:
        return {}
    group = codes >> KEY_BITS
    keys = codes & KEY_MASK
    bounds = np.flatnonzero(np.diff(group)) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [codes.size]])
    return {
        int(group[a]): (keys[a:b], weights[a:b])
        for a, b in zip(starts.tolist(), ends.tolist(), strict=False)
    }


__all__ = [
    "KEY_BITS",
    "KEY_MASK",
    "KeyMapping",
    "TimeSlice",
    "concat_reduce",
    "exact_weighted_quantile",
    "gather",
    "quantiles_from_buckets",
    "rank_index",
    "reduce_codes",
    "split_groups",
]
