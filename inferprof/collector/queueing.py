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
"""

from __future__ import annotations

import numpy as np


def _covered(starts: np.ndarray, ends: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Length of ``(-inf, t]`` covered by the union of the intervals ``[starts, ends]``
    (``ends >= starts``), for each ``t`` in ``at``."""
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    # Merge: a run begins where a start passes every end before it.
    reach = np.maximum.accumulate(e)
    begins = np.flatnonzero(np.concatenate([[True], s[1:] > reach[:-1]]))
    run_start = s[begins]
    run_end = reach[np.concatenate([begins[1:] - 1, [s.size - 1]])]
    before = np.concatenate([[0.0], np.cumsum(run_end - run_start)])
    i = np.searchsorted(run_start, at, side="right") - 1
    j = np.maximum(i, 0)
    within = np.minimum(at, run_end[j]) - run_start[j]
    return np.where(i >= 0, before[j] + within, 0.0)


def behind_batches(queue: np.ndarray, work: np.ndarray, work_estimate: float) -> dict | None:
    """The breakdown's ``queue`` section.

    ``queue``: rows (instance, start s, end s, weight) of queue spans; ``work``: rows
    (instance, start s, end s) of batch work spans, repeats allowed; ``work_estimate``:
    the weighted sum of traced members' parts of their batches' work (0: unknown, no
    scaling). None when there is no queue time or no batch work to compare it with.
    """
    if queue.size == 0 or work.size == 0:
        return None
    work = np.unique(work, axis=0)
    q_len = np.clip(queue[:, 2] - queue[:, 1], 0.0, None)
    total = float(np.dot(queue[:, 3], q_len))
    if total <= 0.0:
        return None
    overlap = 0.0
    for inst in np.unique(queue[:, 0]):
        w = work[work[:, 0] == inst]
        if not w.size:
            continue
        q = queue[queue[:, 0] == inst]
        ends = np.maximum(q[:, 2], q[:, 1])
        covered = _covered(w[:, 1], np.maximum(w[:, 2], w[:, 1]), np.concatenate([q[:, 1], ends]))
        k = q.shape[0]
        overlap += float(np.dot(q[:, 3], covered[k:] - covered[:k]))
    measured = min(1.0, overlap / total)
    seen = float(np.sum(np.clip(work[:, 2] - work[:, 1], 0.0, None)))
    coverage = min(1.0, seen / work_estimate) if work_estimate > 0 and seen > 0 else 1.0
    return {
        "behind_batches": min(1.0, measured / coverage),
        "behind_batches_seen": measured,
        "batch_coverage": coverage,
    }


__all__ = ["behind_batches"]
