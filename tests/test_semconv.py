import pathlib

import pytest

from inferprof import semconv

CONTRACT = pathlib.Path(__file__).resolve().parents[1] / "docs" / "span-contract.md"


def test_every_canonical_stage_and_attribute_appears_in_the_contract():
    text = CONTRACT.read_text()
    for stage in semconv.CANONICAL_STAGES:
        assert f"`{stage}`" in text, stage
    for name in dir(semconv):
        if name.startswith(("ATTR_", "PROM_", "METRIC_")) and not name.startswith("PROM_LABEL"):
            value = getattr(semconv, name)
            if value.endswith("."):
                continue
            if name.startswith("METRIC_DCGM_"):  # the contract abbreviates these as `...sm_x`
                value = value.rsplit(".", 1)[1]
            assert value in text, (name, value)


@pytest.mark.parametrize(
    "bad", ["Tokenize", "to-ken", "", "a b", "unattributed", 3, "x" * 65, "x" * 1_000_000])
def test_invalid_stage_names_are_rejected_with_a_reason(bad):
    with pytest.raises(ValueError, match="stage"):
        semconv.validate_stage(bad)


def test_custom_stage_names_are_accepted():
    assert semconv.validate_stage("kv_cache_swap") == "kv_cache_swap"
    assert semconv.validate_stage("x" * 64) == "x" * 64  # the longest a stage name may be
    assert semconv.span_name("queue") == "inferprof.queue"
