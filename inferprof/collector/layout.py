"""The layout of the engine's numbers: histogram bounds, the bits of its integer codes,
and its bounds on what a slice keeps. Shared by the engine's series, fold and document
parts."""

from __future__ import annotations

import numpy as np

from inferprof.collector.finalised import Finalised
from inferprof.collector.sketch import KEY_BITS

#: Upper bounds (seconds) of the Prometheus histogram buckets: 0.5 ms .. 60 s, the
#: range of serving latencies from a single small-model stage to a long generation.
HISTOGRAM_BOUNDS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
_BOUNDS = np.asarray(HISTOGRAM_BOUNDS)
_NB = len(HISTOGRAM_BOUNDS) + 1
STAGE_BITS = 10
_STAGE_MASK = (1 << STAGE_BITS) - 1
_Q_LOCAL = KEY_BITS + STAGE_BITS
#: Stage index 0 is end-to-end latency in the quantile store, 1 is ``unattributed``.
_E2E = 0
_UNATTRIBUTED = 1
#: UTF-8 bytes of (service, model) names per series, on average over ``max_series``: the
#: names of all series together are bounded by ``max_series`` times this, a new pair past
#: it going to the overflow series as one past ``max_series`` does.
SERIES_NAME_BYTES = 64
#: Compute windows kept per (slice, series) for the GPU join.
_MAX_COMPUTE_WINDOWS = 5_000
#: Per (slice, series): a uniform sample of _MAX_QUEUE_ROWS queue spans (48 KB) and the
#: union of the batch work windows in at most _MAX_WORK_ROWS intervals (96 KB).
_MAX_QUEUE_ROWS = 1_000
_MAX_WORK_ROWS = 4_000
_INSTANCE_BITS = (1 << 52) - 1  # an instance's code, exact as a float64
#: Temporary stage ids of stage names beyond max_stages (dropped when folding).
_NO_COLUMN = 1 << 20
_NS = 1e-9
_INT64_LIMIT = 1 << 63
_LOW32 = (1 << 32) - 1
#: Pause between two shares of a backlog: the lock is then free for ingest and readers
#: (Python's locks are not fair: a thread taking one again at once usually wins it).
_YIELD_S = 0.001


def _instance_codes(fin: Finalised) -> list[float]:
    """Per request, a number naming its service instance (host.name and
    service.instance.id): a queue waits only for its own instance's batches."""
    return [float(hash(i) & _INSTANCE_BITS) for i in fin.instance]
