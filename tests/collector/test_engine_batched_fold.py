"""The batched (numpy) finalisation agrees with the per-request reference (``partition``)
on awkward inputs: overlapping and out-of-request stage spans, several requests per trace,
timestamps past int64, and odd attribute values."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue

from inferprof import semconv as sc
from inferprof.collector.attribution import exact_tail_shares
from inferprof.collector.engine import Engine
from inferprof.collector.sketch import exact_weighted_quantile
from inferprof.timing import partition
from tests.collector.synth import FakeClock, TraceBuilder

REL = 0.011  # sketch bound (1%) plus float slack


def _fold(builder_calls, **engine_kw):
    clock = FakeClock()
    engine = Engine(clock=clock, **engine_kw)
    b = TraceBuilder()
    builder_calls(b)
    engine.ingest_traces(b.export())
    clock.tick(5.0)
    engine.advance()
    return engine


def test_random_overlapping_stages_match_the_reference_partition():
    rng = random.Random(7)
    stages = ["queue", "compute", "tokenize", "custom_a"]
    requests = []  # (start, end, [(stage, s, e)])
    for i in range(300):
        start = i * 1.0
        e2e = rng.uniform(0.05, 0.5)
        spans = []
        for _ in range(rng.randint(0, 5)):
            s = start + rng.uniform(-0.05, e2e)  # some start before the request
            spans.append((rng.choice(stages), s, s + rng.uniform(0.0, 0.2)))
        requests.append((start, start + e2e, spans))

    def build(b):
        for start, end, spans in requests:
            req = b.request(start, end)
            for stage, s, e in spans:
                b.stage(req, stage, s, e)

    engine = _fold(build)
    doc = engine.breakdown("svc", window_s=None)
    ns = round(TraceBuilder().ns(0.0))
    ref = [
        partition(
            ns + round(st * 1e9),
            ns + round(en * 1e9),
            [(g, ns + round(s * 1e9), ns + round(e * 1e9)) for g, s, e in spans],
        )
        for st, en, spans in requests
    ]
    e2e = [(round(en * 1e9) - round(st * 1e9)) * 1e-9 for st, en, _ in requests]
    assert doc["requests"] == len(requests)
    for stage in [*stages, sc.STAGE_UNATTRIBUTED]:
        if stage == sc.STAGE_UNATTRIBUTED:
            values = [u for _, _, u in ref]
        else:
            values = [t[stage] for t, _, _ in ref if stage in t]
        got = next(s for s in doc["stages"] if s["stage"] == stage)
        assert got["count"] == len(values)
        for q, name in zip(sc.QUANTILES, ("p50", "p95", "p99")):
            exact = exact_weighted_quantile(values, None, q)
            assert abs(got[name] - exact) <= REL * abs(exact) + 1e-9, (stage, name)
    exclusive = [{**x, sc.STAGE_UNATTRIBUTED: u} for _, x, u in ref]
    # The tail is what the sketch calls it: every request in the p95 bucket or above
    # (attribution module docstring), so the comparison is exact up to float rounding.
    p95 = exact_weighted_quantile(e2e, None, 0.95)
    keys = engine.mapping.key(np.asarray(e2e))
    tail_from = float(min(x for x, k in zip(e2e, keys) if k >= engine.mapping.scalar_key(p95)))
    shares = exact_tail_shares(e2e, [1.0] * len(e2e), exclusive, tail_from)
    for s in doc["stages"]:
        assert abs(s["share_of_p95"] - shares.get(s["stage"], 0.0)) < 1e-9, s["stage"]
    assert math.isclose(sum(s["share_of_p95"] for s in doc["stages"]), 1.0, rel_tol=1e-9)


def test_two_requests_in_one_trace_each_get_their_own_stages():
    def build(b):
        gateway = b.request(0.0, 1.0, model="g")
        b.stage(gateway, "queue", 0.0, 0.1)
        inner = b.request(0.2, 0.9, model="m", parent=gateway)
        b.stage(inner, "compute", 0.3, 0.8)

    engine = _fold(build)
    # The inner request is a local root only if in another service; here both are in
    # "svc", so the inner SERVER span is no request and its compute belongs to gateway.
    doc = engine.breakdown("svc", window_s=None)
    assert doc["requests"] == 1
    names = {s["stage"] for s in doc["stages"]}
    assert {"queue", "compute"} <= names


def test_timestamps_past_int64_fold_exactly():
    # 2**63 ns is in year 2262; OTLP times are unsigned 64-bit, so such spans are valid.
    far = (2**63 + 10**12) / 1e9

    def build_at(base):
        def build(b):
            b.base = base
            for i in range(10):
                b.sequential(i, [("queue", 0.01 * (i + 1)), ("compute", 0.02)], tail_gap=0.003)

        return build

    far_doc = _fold(build_at(far)).breakdown("svc", window_s=None)
    near_doc = _fold(build_at(1.7e9)).breakdown("svc", window_s=None)
    assert far_doc["requests"] == near_doc["requests"] == 10
    for a, b in zip(far_doc["stages"], near_doc["stages"]):
        assert a["stage"] == b["stage"]
        for q in ("p50", "p95", "p99"):
            # Float seconds of the far base lose sub-microsecond digits in the builder.
            assert abs(a[q] - b[q]) <= REL * b[q] + 2e-6, (a["stage"], q)


def test_stage_attribute_with_an_array_value_is_an_invalid_stage():
    clock = FakeClock()
    engine = Engine(clock=clock)
    b = TraceBuilder()
    b.sequential(0.0, [("queue", 0.01), ("compute", 0.02)])
    bad = b.spans[1]
    assert bad.attributes[0].key == sc.ATTR_STAGE
    bad.attributes[0].value.CopyFrom(
        AnyValue(array_value=ArrayValue(values=[AnyValue(string_value="queue")]))
    )
    result = engine.ingest_traces(b.export())
    assert result.rejected_spans == 1 and result.accepted_spans == 2
    assert engine.stats.spans_dropped[sc.DROP_INVALID_STAGE] == 1


def test_too_many_stage_names_count_one_drop_per_request_and_stage():
    from inferprof.collector.attribution import MAX_STAGE_COLUMNS

    n_custom = MAX_STAGE_COLUMNS  # more than the columns left after the canonical ones

    def build(b):
        for i in range(n_custom):
            req = b.request(float(i), i + 0.1)
            b.stage(req, f"custom_{i}", i + 0.0, i + 0.05)
            b.stage(req, f"custom_{i}", i + 0.05, i + 0.06)  # same stage twice: one drop

    # The most the column bits allow (the default, DEFAULT_MAX_STAGES, is far lower).
    engine = _fold(build, max_spans_per_trace=10, max_stages=MAX_STAGE_COLUMNS - 1)
    stats = engine.stats
    dropped = stats.spans_dropped.get(sc.DROP_TOO_MANY_STAGES, 0)
    columns_left = MAX_STAGE_COLUMNS - 2 - len(sc.CANONICAL_STAGES)
    assert dropped == n_custom - columns_left
    doc = engine.breakdown("svc", window_s=None)
    # A dropped stage's time is its request's unattributed time: 0.04 s for the requests
    # whose stage has a column (98.6%), all 0.1 s for the others; the shares sum to 1.
    unatt = next(s for s in doc["stages"] if s["stage"] == sc.STAGE_UNATTRIBUTED)
    assert abs(unatt["p50"] - 0.04) <= REL * 0.04
    assert abs(unatt["p99"] - 0.1) <= REL * 0.1
    assert abs(sum(s["share_of_p95"] for s in doc["stages"]) - 1.0) < 1e-9


def test_cyclic_gc_is_restored_after_ingest_and_left_off_if_the_app_turned_it_off():
    import gc

    clock = FakeClock()
    engine = Engine(clock=clock, settle_s=0.0)
    b = TraceBuilder()
    b.sequential(0.0, [("queue", 0.01)])
    was = gc.isenabled()
    try:
        gc.enable()
        engine.ingest_traces(b.export())
        assert gc.isenabled()
        gc.disable()
        b.sequential(1.0, [("queue", 0.01)])
        engine.ingest_traces(b.export())
        engine.flush()
        assert not gc.isenabled()
    finally:
        if was:
            gc.enable()
        else:
            gc.disable()
    assert engine.stats.requests_finalised == 2


def test_stage_names_past_max_stages_are_dropped_and_counted():
    from inferprof.collector.attribution import (
        DEFAULT_MAX_STAGES,
        MAX_STAGE_COLUMNS,
        MIN_MAX_STAGES,
    )

    n_custom = 5

    def build(b):
        for i in range(n_custom):
            req = b.request(float(i), i + 0.1)
            b.stage(req, "compute", i + 0.0, i + 0.05)
            b.stage(req, f"custom_{i}", i + 0.05, i + 0.06)

    # Room for two custom names beside the contract's stages and unattributed.
    engine = _fold(build, max_stages=MIN_MAX_STAGES + 2)
    assert engine.stats.spans_dropped.get(sc.DROP_TOO_MANY_STAGES, 0) == n_custom - 2
    doc = engine.breakdown("svc", window_s=None)
    names = {s["stage"] for s in doc["stages"]}
    assert {"custom_0", "custom_1", "compute"} <= names and "custom_2" not in names
    # The dropped stages' time went to unattributed: the shares still sum to 1.
    assert abs(sum(s["share_of_p95"] for s in doc["stages"]) - 1.0) < 1e-9
    # The default leaves room for DEFAULT_MAX_STAGES - MIN_MAX_STAGES custom names.
    engine = _fold(build)
    assert DEFAULT_MAX_STAGES - MIN_MAX_STAGES >= n_custom
    assert engine.stats.spans_dropped.get(sc.DROP_TOO_MANY_STAGES, 0) == 0
    for bad in (MIN_MAX_STAGES - 1, MAX_STAGE_COLUMNS, True, 20.0):
        with pytest.raises(ValueError, match="max_stages"):
            Engine(max_stages=bad)
