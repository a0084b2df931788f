"""Per-request partition of end-to-end time, and the tail-attribution sketch against
exact computation on synthetic traces whose truth is known."""

from __future__ import annotations

import math

import numpy as np
import pytest

from inferprof.collector.attribution import exact_tail_shares
from inferprof.collector.engine import Engine
from inferprof.collector.sketch import exact_weighted_quantile
from inferprof.timing import partition
from tests.collector.synth import FakeClock, TraceBuilder

MS = 1_000_000  # ns


def test_partition_sequential_stages():
    stage_time, exclusive, unattributed = partition(
        0, 100 * MS, [("queue", 0, 40 * MS), ("compute", 40 * MS, 90 * MS)]
    )
    assert stage_time == pytest.approx({"queue": 0.04, "compute": 0.05})
    assert exclusive == stage_time
    assert unattributed == pytest.approx(0.01)


def test_partition_clips_to_request_keeps_empty_stages_and_drops_outside_ones():
    stage_time, _, unattributed = partition(
        10 * MS,
        110 * MS,
        [("compute", 0, 50 * MS), ("d2h", 200 * MS, 210 * MS), ("queue", 50 * MS, 50 * MS)],
    )
    # queue: zero length inside the request, present with 0; d2h: wholly after it, absent
    # (§6: a request that never entered the stage counts as absent, not as zero)
    assert stage_time == pytest.approx({"compute": 0.04, "queue": 0.0})
    assert unattributed == pytest.approx(0.06)


def test_partition_overlaps_split_equally_and_sum_to_e2e():
    spans = [("compute", 0, 60 * MS), ("decode", 30 * MS, 90 * MS), ("compute", 10 * MS, 20 * MS)]
    stage_time, exclusive, unattributed = partition(0, 100 * MS, spans)
    # compute alone 0-30 (two compute spans overlap 10-20: still one stage), both 30-60,
    # decode alone 60-90, nothing 90-100.
    assert exclusive["compute"] == pytest.approx(0.030 + 0.015)
    assert exclusive["decode"] == pytest.approx(0.015 + 0.030)
    assert unattributed == pytest.approx(0.010)
    assert sum(exclusive.values()) + unattributed == pytest.approx(0.1, abs=1e-12)
    assert stage_time["compute"] == pytest.approx(0.070)  # summed, as documented


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_share_of_p95_matches_exact_computation(seed):
    rng = np.random.default_rng(seed)
    n = 6000
    recv = rng.uniform(0.0005, 0.002, n)
    queue = rng.exponential(0.02, n)
    compute = rng.lognormal(math.log(0.03), 0.3, n)
    gap = rng.uniform(0, 0.003, n)
    weights = rng.choice([1.0, 3.0], n)
    clock = FakeClock()
    engine = Engine(clock=clock)
    b = TraceBuilder()
    e2e, exclusive = [], []
    for i in range(n):
        stages = [("receive", recv[i]), ("queue", queue[i]), ("compute", compute[i])]
        _, total = b.sequential(
            i * 0.001,
            [(s, float(d)) for s, d in stages],
            tail_gap=float(gap[i]),
            weight=float(weights[i]),
        )
        e2e.append(total)
        exclusive.append(
            {"receive": recv[i], "queue": queue[i], "compute": compute[i], "unattributed": gap[i]}
        )
        if i % 1000 == 999:
            engine.ingest_traces(b.export())
    clock.tick(5)
    doc = engine.breakdown("svc")
    p95 = exact_weighted_quantile(e2e, weights, 0.95)
    truth = exact_tail_shares(e2e, weights, exclusive, p95)
    got = {s["stage"]: s["share_of_p95"] for s in doc["stages"]}
    assert math.isclose(sum(got.values()), 1.0, rel_tol=1e-9)
    for stage, share in truth.items():
        # Boundary-bucket error (requests within 1% below p95 counted in the tail).
        assert abs(got[stage] - share) < 0.01, (stage, got[stage], share)
