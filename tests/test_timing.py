"""The summaries' bucket mapping (inferprof.timing) against OTLP's definition: bucket i at
scale s covers (base**i, base**(i+1)], base = 2**(2**-s), and its representative is within
the documented relative error of every value in it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferprof import timing
from inferprof.timing import (
    DEFAULT_SUMMARY_SCALE,
    exp_index,
    exp_log_representative,
    exp_relative_error,
    exp_representative,
    partition,
    partition_many,
)


@given(
    st.floats(min_value=1e-12, max_value=1e9, allow_nan=False, allow_infinity=False),
    st.integers(min_value=-10, max_value=20),
)
def test_every_value_lies_in_the_bucket_its_index_names(value, scale):
    i = int(exp_index([value], scale)[0])
    # in log space (base**i overflows at negative scales), with float slack at the ends
    pos = math.log2(value) * math.ldexp(1.0, scale)
    assert i - 1e-9 * max(1, abs(i)) < pos <= i + 1 + 1e-9 * max(1, abs(i))


@pytest.mark.parametrize("scale", [-3, 0, 3, DEFAULT_SUMMARY_SCALE, 12])
def test_exact_powers_of_two_end_their_bucket(scale):
    for k in range(-40, 40):
        assert int(exp_index([math.ldexp(1.0, k)], scale)[0]) == math.floor(
            k * math.ldexp(1.0, scale)) - 1 + (0 if scale >= 0 or k % (1 << -scale) == 0 else 1)


@pytest.mark.parametrize("scale", [0, 4, DEFAULT_SUMMARY_SCALE, 10])
def test_the_representative_is_within_the_relative_error_of_its_values(scale):
    rng = np.random.default_rng(1)
    values = rng.lognormal(-4, 2, 50_000)
    rep = exp_representative(exp_index(values, scale), scale)
    bound = exp_relative_error(scale)
    assert np.max(np.abs(rep / values - 1)) <= bound * (1 + 1e-9)
    assert exp_relative_error(DEFAULT_SUMMARY_SCALE) < 0.0028  # contract §15: 0.27%


@pytest.mark.parametrize("scale", [-10, -3, 0, DEFAULT_SUMMARY_SCALE, 20])
def test_the_log_representative_is_the_representative_in_logarithms(scale):
    index = np.arange(-40, 40)
    logs = exp_log_representative(index, scale)
    assert np.isfinite(logs).all()
    ln_base = math.log(2) * math.ldexp(1.0, -scale)
    assert ((logs > index * ln_base) & (logs <= (index + 1) * ln_base)).all()
    if scale >= 0:
        assert np.allclose(np.exp(logs), exp_representative(index, scale), rtol=1e-12)


_span = st.tuples(
    st.integers(min_value=0, max_value=4),  # stage number
    st.integers(min_value=-200, max_value=1200),  # start
    st.one_of(st.just(0), st.integers(min_value=0, max_value=600)),  # length (0: a point)
)


@given(st.lists(st.tuples(st.integers(min_value=0, max_value=1000),
                          st.integers(min_value=0, max_value=1000),
                          st.lists(_span, max_size=6)), min_size=1, max_size=8))
def test_partition_many_equals_partition_request_by_request(requests):
    """The vectorised partition (the summaries') and the per-request one (the
    collector's) give the same stage, exclusive and unattributed times, whether its
    (request, stage) pairs are counted densely (few stage names) or sorted (many)."""
    _check_partition_many(requests)
    dense = timing._DENSE_KEYS, timing._DENSE_PER_SPAN
    timing._DENSE_KEYS, timing._DENSE_PER_SPAN = 0, 0  # every pair sorted
    try:
        _check_partition_many(requests)
    finally:
        timing._DENSE_KEYS, timing._DENSE_PER_SPAN = dense


def _check_partition_many(requests):
    starts, ends, req, stage, s, e = [], [], [], [], [], []
    per = []
    for r, (a, length, spans) in enumerate(requests):
        starts.append(a)
        ends.append(a + length)
        per.append([(k, x, x + d) for k, x, d in spans])
        for k, x, d in spans:
            req.append(r)
            stage.append(k)
            s.append(x)
            e.append(x + d)

    def arr(v):
        return np.array(v, dtype=np.int64)

    pair_req, pair_stage, stage_ns, excl_ns, unatt_ns = partition_many(
        arr(starts), arr(ends), arr(req), arr(stage), arr(s), arr(e))
    for r in range(len(requests)):
        stage_time, exclusive, unattributed = partition(starts[r], ends[r], per[r])
        mine = pair_req == r
        got = dict(zip(pair_stage[mine].tolist(), stage_ns[mine].tolist(), strict=True))
        got_excl = dict(zip(pair_stage[mine].tolist(), excl_ns[mine].tolist(), strict=True))
        assert set(got) == set(stage_time)
        for k, v in stage_time.items():
            assert got[k] * 1e-9 == v
            assert got_excl[k] * 1e-9 == pytest.approx(exclusive[k], abs=1e-15)
        assert unatt_ns[r] * 1e-9 == unattributed
