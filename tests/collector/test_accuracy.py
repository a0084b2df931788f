"""The documented error bound: every reported quantile within 1% of the exact weighted
lower quantile of the same data (``sketch.exact_weighted_quantile``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferprof.collector.engine import Engine
from inferprof.collector.sketch import (
    KeyMapping,
    exact_weighted_quantile,
    quantiles_from_buckets,
    reduce_codes,
)
from tests.collector.synth import FakeClock, TraceBuilder

BOUND = 0.01
_SEEDS = ("lognormal", "bimodal", "pareto", "constant", "tiny_and_huge")
QS = (0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999)


def _distributions(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    return {
        "lognormal": rng.lognormal(math.log(0.05), 1.0, n),
        "bimodal": np.where(
            rng.random(n) < 0.8, rng.normal(0.02, 0.002, n), rng.normal(0.5, 0.05, n)
        ).clip(1e-6),
        "pareto": (rng.pareto(1.2, n) + 1) * 0.001,
        "constant": np.full(n, 0.0421),
        "tiny_and_huge": np.concatenate(
            [rng.uniform(1e-6, 1e-5, n // 2), rng.uniform(100, 1000, n - n // 2)]
        ),
    }


def _sketch_quantiles(mapping: KeyMapping, values: np.ndarray, weights: np.ndarray, qs) -> list:
    # Fold in several chunks, as the engine does across finalisation batches and slices.
    parts = [
        reduce_codes(mapping.key(v), w)
        for v, w in zip(np.array_split(values, 7), np.array_split(weights, 7))
    ]
    keys, w = reduce_codes(
        np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    )
    return quantiles_from_buckets(mapping, keys, w, qs)


@pytest.mark.parametrize("name", ["lognormal", "bimodal", "pareto", "constant", "tiny_and_huge"])
@pytest.mark.parametrize("weighted", [False, True])
def test_sketch_quantiles_within_one_percent(name, weighted):
    rng = np.random.default_rng(sorted(_SEEDS).index(name) + 100)
    values = _distributions(rng, 50_000)[name]
    weights = rng.choice([1.0, 2.5, 20.0], values.size) if weighted else np.ones(values.size)
    mapping = KeyMapping(0.005)
    got = _sketch_quantiles(mapping, values, weights, QS)
    for q, g in zip(QS, got):
        exact = exact_weighted_quantile(values, weights, q)
        assert abs(g - exact) <= BOUND * exact, (name, q, g, exact)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(
        st.floats(min_value=1e-6, max_value=1e4, allow_nan=False), min_size=1, max_size=300
    ),
    data=st.data(),
)
def test_sketch_bound_holds_for_any_data(values, data):
    weights = data.draw(
        st.lists(
            st.floats(min_value=1.0, max_value=50.0), min_size=len(values), max_size=len(values)
        )
    )
    q = data.draw(st.sampled_from((0.0, 0.5, 0.95, 0.99, 1.0)))
    v, w = np.asarray(values), np.asarray(weights)
    mapping = KeyMapping(0.005)
    (got,) = _sketch_quantiles(mapping, v, w, (q,))
    exact = exact_weighted_quantile(v, w, q)
    assert abs(got - exact) <= BOUND * exact


def test_zero_values_and_empty():
    mapping = KeyMapping(0.005)
    keys, w = reduce_codes(mapping.key(np.array([0.0, 0.0, 0.3])), np.ones(3))
    assert quantiles_from_buckets(mapping, keys, w, (0.5, 0.99)) == [
        0.0,
        pytest.approx(0.3, rel=BOUND),
    ]
    empty = np.empty(0, np.int64)
    assert quantiles_from_buckets(mapping, empty, np.empty(0), (0.5,)) == [None]
    assert exact_weighted_quantile([], None, 0.5) is None


def test_mapping_matches_ddsketch_keys():
    from ddsketch.mapping import LogarithmicMapping

    ref = LogarithmicMapping(0.005)
    mapping = KeyMapping(0.005)
    values = np.geomspace(1e-6, 1e3, 997)
    ours = mapping.key(values) - (1 << 13)
    theirs = np.array([ref.key(float(v)) for v in values])
    # Identical up to floating-point rounding at exact bucket boundaries.
    assert np.max(np.abs(ours - theirs)) <= 1
    assert np.mean(ours == theirs) > 0.99


def test_relative_accuracy_argument_checked():
    for bad in (0.0, 0.5, -1, 0.001):
        with pytest.raises(ValueError):
            KeyMapping(bad)


@pytest.mark.parametrize("name", ["lognormal", "pareto", "bimodal"])
def test_engine_end_to_end_quantiles_within_bound(name):
    rng = np.random.default_rng(11)
    n = 3000
    stage_values = _distributions(rng, n)[name]
    weights = rng.choice([1.0, 4.0], n)
    clock = FakeClock()
    engine = Engine(clock=clock, slice_s=1.0)
    b = TraceBuilder()
    for i in range(n):
        b.sequential(i * 0.001, [("compute", float(stage_values[i]))], weight=float(weights[i]))
        if i % 500 == 499:
            engine.ingest_traces(b.export())
            clock.tick(0.7)  # spread over several slices, merged at query time
            engine.advance()
    clock.tick(5)
    doc = engine.breakdown("svc", window_s=None)
    compute = next(s for s in doc["stages"] if s["stage"] == "compute")
    # Span timestamps are integer nanoseconds: compare with what the spans carry.
    carried = np.round(stage_values * 1e9) / 1e9
    for key, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99)):
        exact = exact_weighted_quantile(carried, weights, q)
        assert abs(compute[key] - exact) <= BOUND * exact + 2e-9, (key, compute[key], exact)
    assert compute["count"] == round(weights.sum())
