"""What a queue waits for: the batcher, or the batches ahead of it.

A request's ``queue`` span lasts from its enqueueing to the forming of its batch. It waits
either for the batcher (a batch to fill, or its delay to run out, while the worker idles)
or for the worker, busy with the batches before it. Only the first is a batching problem;
the second is whatever makes those batches slow. The stage shares cannot tell them apart,
nor can GPU utilisation during compute: a compute window is busy in both cases.

The spans can. ``behind_batches`` is the share of queue time (weighted by the requests'
sampling weights) during which a batch of the same service instance was doing its work
(``h2d``, a compute stage or ``d2h``). Batches are seen through the requests traced:
with sampling, some batches have no member traced and their work is not seen. The share
measured is then scaled by ``batch_coverage``, the work seen over the work estimated from
every traced member's part of its batch (duration / ``inferprof.batch.size``, times the
member's sampling weight: a Horvitz-Thompson estimate), assuming the unseen batches fall
in time like the seen ones. Without sampling the coverage is 1 and nothing is scaled.

A batcher that knows can say it instead: ``inferprof.queue.behind_batches_s`` on a queue
span (``DynamicBatcher`` sets it) is the time of that wait during which every one of the
batcher's slots was running a batch. Such spans count that figure, as measured: no
comparison with work windows, no coverage, right with concurrent batches
(``max_concurrent_batches`` > 1), where a running batch does not mean a request has to
wait. Spans without it are compared with the work windows as above.
"""

from __future__ import annotations

import numpy as np


def _merge(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of the intervals ``[starts, ends]`` (``ends >= starts``) as sorted,
    disjoint (start, end) runs."""
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    # A run begins where a start passes every end before it.
    reach = np.maximum.accumulate(e)
    begins = np.flatnonzero(np.concatenate([[True], s[1:] > reach[:-1]]))
    return s[begins], reach[np.concatenate([begins[1:] - 1, [s.size - 1]])]


def _covered(starts: np.ndarray, ends: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Length of ``(-inf, t]`` covered by the union of the intervals ``[starts, ends]``
    (``ends >= starts``), for each ``t`` in ``at``."""
    run_start, run_end = _merge(starts, ends)
    before = np.concatenate([[0.0], np.cumsum(run_end - run_start)])
    i = np.searchsorted(run_start, at, side="right") - 1
    j = np.maximum(i, 0)
    within = np.minimum(at, run_end[j]) - run_start[j]
    return np.where(i >= 0, before[j] + within, 0.0)


def union(work: np.ndarray, max_rows: int | None = None) -> np.ndarray:
    """The union of work windows (instance, start s, end s), per instance, as sorted
    disjoint intervals. Past ``max_rows`` intervals the shortest gaps between intervals
    of one instance are closed until ``max_rows`` remain: the busy time is then
    overstated by those gaps, the smallest there are."""
    if work.shape[0] < 2:
        return work
    runs = []
    for inst in np.unique(work[:, 0]):
        w = work[work[:, 0] == inst]
        start, end = _merge(w[:, 1], np.maximum(w[:, 2], w[:, 1]))
        runs.append(np.stack([np.full(start.size, inst), start, end], axis=1))
    out = np.concatenate(runs)
    if max_rows is not None and out.shape[0] > max_rows:
        gap = np.full(out.shape[0], np.inf)
        gap[1:] = np.where(out[1:, 0] == out[:-1, 0], out[1:, 1] - out[:-1, 2], np.inf)
        # close the (n - max_rows) shortest gaps: those intervals join the one before
        close = np.zeros(out.shape[0], bool)
        close[np.argsort(gap, kind="stable")[: out.shape[0] - max_rows]] = True
        close[0] = False
        keep_first = np.flatnonzero(~close)
        keep_last = np.append(keep_first[1:] - 1, out.shape[0] - 1)
        out = np.stack([out[keep_first, 0], out[keep_first, 1], out[keep_last, 2]], axis=1)
    return out


Part = tuple[float, float, float, float, bool, float, float]


def partial(queue: np.ndarray, work: np.ndarray, seen: float, work_estimate: float) -> Part:
    """One part of the ``queue`` section: (weighted queue time behind batches, weighted
    queue time, work seen, work estimated, whether any work was there to compare with)
    for the queue spans without a reported figure, then (weighted time behind batches,
    weighted queue time) of those with one.

    ``queue``: rows (instance, start s, end s, weight[, reported s]) of queue spans, the
    reported ``inferprof.queue.behind_batches_s`` NaN where absent; ``work``: rows
    (instance, start s, end s) of the batch work they may wait behind (windows or unions
    of them, overlaps allowed); ``seen``: the summed durations of the work windows this
    part counts (each batch in one part only); ``work_estimate``: the weighted sum of
    traced members' parts of their batches' work (0: unknown, no scaling).
    """
    reported_behind = reported_total = 0.0
    if queue.size and queue.shape[1] > 4:
        known = ~np.isnan(queue[:, 4])
        if known.any():
            r = queue[known]
            r_len = np.clip(r[:, 2] - r[:, 1], 0.0, None)
            reported_total = float(np.dot(r[:, 3], r_len))
            reported_behind = float(np.dot(r[:, 3], np.clip(r[:, 4], 0.0, r_len)))
            queue = queue[~known]
    if queue.size == 0:
        return 0.0, 0.0, seen, work_estimate, work.size > 0, reported_behind, reported_total
    q_len = np.clip(queue[:, 2] - queue[:, 1], 0.0, None)
    total = float(np.dot(queue[:, 3], q_len))
    overlap = 0.0
    if work.size and total > 0.0:
        for inst in np.unique(queue[:, 0]):
            w = work[work[:, 0] == inst]
            if not w.size:
                continue
            q = queue[queue[:, 0] == inst]
            ends = np.maximum(q[:, 2], q[:, 1])
            covered = _covered(
                w[:, 1], np.maximum(w[:, 2], w[:, 1]), np.concatenate([q[:, 1], ends])
            )
            k = q.shape[0]
            overlap += float(np.dot(q[:, 3], covered[k:] - covered[:k]))
    return (overlap, total, seen, work_estimate, work.size > 0, reported_behind,
            reported_total)


def combine(parts: list[Part]) -> dict | None:
    """The breakdown's ``queue`` section from its parts; None when there is no queue time,
    or none with a reported figure and no batch work to compare the rest with."""
    overlap = sum(p[0] for p in parts)
    total = sum(p[1] for p in parts)
    seen = sum(p[2] for p in parts)
    estimate = sum(p[3] for p in parts)
    reported = sum(p[5] for p in parts)
    reported_total = sum(p[6] for p in parts)
    compared = total > 0.0 and any(p[4] for p in parts)
    if not compared and reported_total <= 0.0:
        return None
    if not compared:  # nothing to compare the unreported spans with: left out
        overlap = total = 0.0
    coverage = min(1.0, seen / estimate) if estimate > 0 and seen > 0 else 1.0
    if coverage > 0.999 or not compared:  # every batch seen, up to rounding
        coverage = 1.0
    whole = total + reported_total
    return {
        "behind_batches": min(1.0, (min(total, overlap / coverage) + reported) / whole),
        "behind_batches_seen": min(1.0, (overlap + reported) / whole),
        "batch_coverage": coverage,
        "reported_by_batcher": reported_total / whole,
    }


def behind_batches(queue: np.ndarray, work: np.ndarray, work_estimate: float) -> dict | None:
    """The ``queue`` section of queue spans and work windows in one part (see
    ``partial``; repeated windows count once)."""
    work = np.unique(work, axis=0) if work.size else work
    seen = float(np.sum(np.clip(work[:, 2] - work[:, 1], 0.0, None)))
    return combine([partial(queue, work, seen, work_estimate)])


__all__ = ["behind_batches", "combine", "partial", "union"]
