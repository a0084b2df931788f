"""The summaries' bucket mapping (inferprof.timing) against OTLP's definition: bucket i at
scale s covers (base**i, base**(i+1)], base = 2**(2**-s), and its representative is within
the documented relative error of every value in it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferprof.timing import (
    DEFAULT_SUMMARY_SCALE,
    exp_index,
    exp_log_representative,
    exp_relative_error,
    exp_representative,
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
