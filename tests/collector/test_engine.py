"""Trace assembly and folding: batch encodings, late spans, incomplete traces, weights,
bad spans, back-pressure, windows, cardinality."""

from __future__ import annotations

import math

import numpy as np
import pytest

from inferprof import semconv as sc
from inferprof.collector.assembly import trace_state_weight
from inferprof.collector.engine import Engine, Overloaded
from tests.collector.synth import CLIENT, INTERNAL, FakeClock, TraceBuilder

REL = 0.011  # sketch bound (1%) plus float slack


def make_engine(**kw) -> tuple[Engine, FakeClock]:
    clock = FakeClock()
    return Engine(clock=clock, **kw), clock


def settle(engine: Engine, clock: FakeClock, dt: float = 5.0) -> None:
    clock.tick(dt)
    engine.advance()


def stage_of(doc: dict, name: str) -> dict:
    return next(s for s in doc["stages"] if s["stage"] == name)


def close(a: float, b: float, rel: float = REL) -> bool:
    return abs(a - b) <= rel * abs(b) + 1e-12


def test_sequential_stages_quantiles_and_shares_sum_to_one():
    engine, clock = make_engine()
    b = TraceBuilder()
    for i in range(20):
        b.sequential(i, [("queue", 0.010 * (i + 1)), ("compute", 0.020)], tail_gap=0.005)
    result = engine.ingest_traces(b.export())
    assert result.accepted_spans == 60 and result.rejected_spans == 0
    settle(engine, clock)
    doc = engine.breakdown("svc")
    assert doc["requests"] == 20 and doc["model"] == "m"
    queue = stage_of(doc, "queue")
    assert queue["count"] == 20
    assert close(queue["p50"], 0.100) and close(queue["p99"], 0.200)
    assert close(stage_of(doc, "unattributed")["p50"], 0.005)
    assert math.isclose(sum(s["share_of_p95"] for s in doc["stages"]), 1.0, rel_tol=1e-9)
    # p95 of e2e is request 19 (rank ceil(0.95*20)=19): tail = requests 19 and 20.
    tail_e2e = [0.010 * k + 0.025 for k in (19, 20)]
    assert math.isclose(queue["share_of_p95"], (0.19 + 0.20) / sum(tail_e2e), rel_tol=0.02)


def test_request_not_final_before_settle_and_late_child_still_counted():
    engine, clock = make_engine(settle_s=2.0)
    b = TraceBuilder()
    req = b.request(0.0, 0.1)
    engine.ingest_traces(b.export())
    clock.tick(1.0)
    engine.advance()
    assert engine.breakdown("svc") is None  # not finalised yet: no series
    b.stage(req, "compute", 0.02, 0.07)  # child arrives after its parent, before settle
    engine.ingest_traces(b.export())
    settle(engine, clock, 1.5)
    doc = engine.breakdown("svc")
    assert doc["requests"] == 1
    assert close(stage_of(doc, "compute")["p50"], 0.05)


def test_out_of_order_grandchildren_attributed_through_intermediate_spans():
    engine, clock = make_engine()
    b = TraceBuilder()
    req = b.request(0.0, 0.1)
    handler = b.span("handler", 0.0, 0.1, parent=req)
    spans = b.spans
    b.spans = []
    b.stage(handler, "tokenize", 0.0, 0.03)
    # Grandchild first, then the intermediate span, then the request span.
    engine.ingest_traces(b.export())
    engine.ingest_traces(b.export([spans[1]]))
    engine.ingest_traces(b.export([spans[0]]))
    settle(engine, clock)
    doc = engine.breakdown("svc")
    assert close(stage_of(doc, "tokenize")["p50"], 0.03)
    assert engine.stats.spans_ignored == 1  # the intermediate, non-stage span


def _batch_members(b: TraceBuilder, n: int):
    members = [b.request(0.0, 0.100, model="m") for _ in range(n)]
    for m in members:
        b.stage(m, "queue", 0.0, 0.040)
    return members


def test_batch_encoding_a_repeated_under_each_member_counts_padding_once():
    engine, clock = make_engine()
    b = TraceBuilder()
    members = _batch_members(b, 4)
    for m in members:
        b.stage(m, "compute", 0.040, 0.090, batch_id="b1", batch_size=4, effective=30, padded=40)
    engine.ingest_traces(b.export())
    settle(engine, clock)
    doc = engine.breakdown("svc")
    assert stage_of(doc, "compute")["count"] == 4
    assert close(stage_of(doc, "compute")["p50"], 0.05)
    assert doc["padding"]["effective_tokens"] == 30 and doc["padding"]["padded_tokens"] == 40
    assert math.isclose(doc["padding"]["waste_ratio"], 0.25)


@pytest.mark.parametrize("order", ["links_first", "links_last", "split_exports"])
def test_batch_encoding_b_links_in_any_order_and_export(order):
    engine, clock = make_engine()
    members_b = TraceBuilder()
    members = _batch_members(members_b, 3)
    batch_b = TraceBuilder()
    batch_b.stage(
        None,
        "compute",
        0.040,
        0.090,
        links=members,
        batch_id="b7",
        batch_size=3,
        effective=10,
        padded=12,
    )
    batch_b.stage(None, "d2h", 0.090, 0.095, links=members, batch_id="b7", batch_size=3)
    if order == "links_first":
        engine.ingest_traces(batch_b.export())
        clock.tick(1.0)
        engine.ingest_traces(members_b.export())
    elif order == "links_last":
        engine.ingest_traces(members_b.export())
        clock.tick(1.0)  # within settle_s of the members' arrival
        engine.ingest_traces(batch_b.export())
    else:
        spans = members_b.spans
        members_b.spans = []
        engine.ingest_traces(members_b.export(spans[:2]))
        engine.ingest_traces(batch_b.export(batch_b.spans[:1]))
        engine.ingest_traces(members_b.export(spans[2:]))
        engine.ingest_traces(batch_b.export())
    settle(engine, clock)
    doc = engine.breakdown("svc")
    assert doc["requests"] == 3
    assert stage_of(doc, "compute")["count"] == 3
    assert stage_of(doc, "d2h")["count"] == 3
    assert close(stage_of(doc, "compute")["p95"], 0.05)
    assert doc["padding"]["padded_tokens"] == 12  # once per batch, not per member
    assert engine.pending_spans() == 0
    assert engine.stats.traces_incomplete == 0


def test_linked_batch_span_arriving_after_finalisation_is_counted_late():
    engine, clock = make_engine(settle_s=1.0, trace_timeout_s=10.0)
    b = TraceBuilder()
    member = b.request(0.0, 0.1)
    engine.ingest_traces(b.export())
    settle(engine, clock, 2.0)
    b.stage(None, "compute", 0.01, 0.09, links=[member])
    engine.ingest_traces(b.export())
    settle(engine, clock, 11.0)
    assert engine.stats.spans_dropped.get(sc.DROP_LATE) == 1
    assert engine.pending_spans() == 0


def test_children_arriving_after_their_request_was_folded_are_counted_late():
    # Parent first, children 5 s later (an exporter per process, or a child ending after
    # its parent): the request is folded without them; they are evicted a trace timeout
    # after they came, when the parent's trace is no longer remembered, and still `late`.
    engine, clock = make_engine(settle_s=1.0, trace_timeout_s=10.0)
    b = TraceBuilder()
    req = b.request(0.0, 0.1)
    member = b.request(0.0, 0.1)
    engine.ingest_traces(b.export())
    settle(engine, clock, 2.0)
    clock.tick(5.0)
    b.stage(req, "compute", 0.01, 0.09)
    b.stage(None, "compute", 0.01, 0.09, links=[member])
    engine.ingest_traces(b.export())
    for _ in range(11):  # advancing every second, as the collector does
        settle(engine, clock, 1.0)
    stats = engine.stats
    assert stats.spans_dropped.get(sc.DROP_LATE) == 2
    assert sc.DROP_INCOMPLETE_TRACE not in stats.spans_dropped
    assert sc.DROP_ORPHAN_STAGE not in stats.spans_dropped
    assert stats.traces_incomplete == 0
    assert engine.pending_spans() == 0


def test_export_resent_after_finalisation_is_not_counted_twice():
    # An exporter whose answer was lost (or a persistent queue replaying) sends the same
    # export again after its requests were finalised.
    engine, clock = make_engine(settle_s=1.0, trace_timeout_s=30.0)
    b = TraceBuilder()
    for i in range(3):
        b.sequential(i, [("queue", 0.01), ("compute", 0.02)])
    export = b.export()
    engine.ingest_traces(export)
    settle(engine, clock, 2.0)
    engine.ingest_traces(export)
    settle(engine, clock, 2.0)
    doc = engine.breakdown("svc")
    assert doc["requests"] == 3
    assert stage_of(doc, "compute")["count"] == 3
    assert engine.stats.spans_dropped[sc.DROP_DUPLICATE] == 9
    assert engine.pending_spans() == 0


def test_resent_member_with_linked_batch_span_is_not_counted_twice():
    engine, clock = make_engine(settle_s=1.0, trace_timeout_s=30.0)
    b = TraceBuilder()
    members = [b.request(0.0, 0.1) for _ in range(2)]
    b.stage(None, "compute", 0.01, 0.09, links=members, batch_id="b1", batch_size=2)
    export = b.export()
    engine.ingest_traces(export)
    settle(engine, clock, 2.0)
    engine.ingest_traces(export)
    settle(engine, clock, 2.0)
    doc = engine.breakdown("svc")
    assert doc["requests"] == 2
    assert stage_of(doc, "compute")["count"] == 2
    assert engine.stats.spans_dropped[sc.DROP_DUPLICATE] == 4  # 2 requests, 2 link uses
    assert engine.pending_spans() == 0


def test_another_services_request_arriving_after_finalisation_is_still_counted():
    engine, clock = make_engine(settle_s=1.0, trace_timeout_s=30.0)
    gateway = TraceBuilder("gateway")
    model_svc = TraceBuilder("model-svc")
    outer = gateway.request(0.0, 0.2, model=None)
    gateway.stage(outer, "network", 0.01, 0.19)
    engine.ingest_traces(gateway.export())
    settle(engine, clock, 2.0)
    inner = model_svc.request(0.02, 0.18, parent=outer)
    model_svc.stage(inner, "compute", 0.03, 0.17)
    engine.ingest_traces(model_svc.export())
    settle(engine, clock, 2.0)
    assert engine.breakdown("gateway")["requests"] == 1
    assert engine.breakdown("model-svc")["requests"] == 1
    assert sc.DROP_DUPLICATE not in engine.stats.spans_dropped


def test_incomplete_trace_counted_and_evicted():
    engine, clock = make_engine(trace_timeout_s=30.0)
    b = TraceBuilder()
    ghost = b.span("gone", 0.0, 1.0)  # its request span never arrives
    b.spans = []
    b.stage(ghost, "queue", 0.0, 0.5)
    engine.ingest_traces(b.export())
    settle(engine, clock, 10.0)
    assert engine.pending_spans() == 1
    settle(engine, clock, 25.0)
    assert engine.pending_spans() == 0
    assert engine.stats.traces_incomplete == 1
    assert engine.stats.spans_dropped[sc.DROP_INCOMPLETE_TRACE] == 1


def test_health_check_without_stages_is_not_a_request():
    engine, clock = make_engine()
    b = TraceBuilder()
    b.span("GET /healthz", 0.0, 0.001, kind=2)
    b.sequential(0.0, [("compute", 0.01)])
    engine.ingest_traces(b.export())
    settle(engine, clock)
    assert engine.breakdown("svc")["requests"] == 1


def test_local_root_rules_remote_parent_and_nested_server_span():
    engine, clock = make_engine()
    gateway = TraceBuilder("gateway")
    model_svc = TraceBuilder("model-svc")
    outer = gateway.request(0.0, 0.2, model=None)
    client = gateway.span("call model", 0.01, 0.19, parent=outer, kind=CLIENT)
    gateway.stage(outer, "receive", 0.0, 0.01)
    gateway.stage(outer, "network", 0.01, 0.19)
    inner = model_svc.request(0.02, 0.18, parent=client)  # parent in another service
    nested = model_svc.span("nested server", 0.02, 0.18, parent=inner, kind=2)
    model_svc.stage(nested, "compute", 0.03, 0.17)
    engine.ingest_traces(gateway.export())
    engine.ingest_traces(model_svc.export())
    settle(engine, clock)
    gw = engine.breakdown("gateway")
    ms = engine.breakdown("model-svc")
    assert gw["requests"] == 1 and ms["requests"] == 1  # nested SERVER span is not a request
    assert {s["stage"] for s in gw["stages"]} == {"receive", "network", "unattributed"}
    assert close(stage_of(ms, "compute")["p50"], 0.14)
    assert close(ms["latency"]["p50"], 0.16)


def test_explicit_request_attribute_and_model_from_stage():
    engine, clock = make_engine()
    b = TraceBuilder()
    req = b.span("job", 0.0, 0.2, kind=INTERNAL, attrs={sc.ATTR_REQUEST: True})
    b.stage(req, "compute", 0.0, 0.1, model="bert")
    engine.ingest_traces(b.export())
    settle(engine, clock)
    assert engine.breakdown("svc", "bert")["requests"] == 1
    assert engine.services() == [{"service": "svc", "models": ["bert"], "requests": 1}]


def test_trace_state_threshold_weight():
    assert trace_state_weight("ot=th:8") == pytest.approx(2.0)  # p = 1/2
    assert trace_state_weight("vendor=x,ot=rv:abc;th:c") == pytest.approx(4.0)  # p = 1/4
    assert trace_state_weight("ot=th:0") == pytest.approx(1.0)
    assert trace_state_weight("ot=th:zz") is None
    assert trace_state_weight("") is None
    engine, clock = make_engine()
    b = TraceBuilder()
    b.sequential(0.0, [("compute", 0.01)], trace_state="ot=th:c")
    engine.ingest_traces(b.export())
    settle(engine, clock)
    assert engine.breakdown("svc")["requests"] == 4


def test_tail_biased_weighted_sample_matches_full_data():
    rng = np.random.default_rng(7)
    n = 40_000
    queue = rng.lognormal(math.log(0.02), 0.6, n)
    compute = rng.lognormal(math.log(0.03), 0.2, n)
    e2e = queue + compute
    slow = e2e >= np.quantile(e2e, 0.9)
    keep_fast = rng.random(n) < 0.05
    full, clock_f = make_engine()
    sampled, clock_s = make_engine()
    fb, sb = TraceBuilder(), TraceBuilder()
    for i in range(n):
        stages = [("queue", float(queue[i])), ("compute", float(compute[i]))]
        fb.sequential(i * 1e-4, stages)
        if slow[i]:
            sb.sequential(i * 1e-4, stages)
        elif keep_fast[i]:
            sb.sequential(i * 1e-4, stages, weight=20.0)
        if i % 5000 == 4999:
            full.ingest_traces(fb.export())
            sampled.ingest_traces(sb.export())
    settle(full, clock_f)
    settle(sampled, clock_s)
    a = full.breakdown("svc")
    s = sampled.breakdown("svc")
    assert s["traced_requests"] < 0.2 * n
    assert abs(s["requests"] - n) < 0.02 * n
    for q in ("p50", "p95", "p99"):
        # p50 rests on the 5% sample (sampling noise); the tail is kept whole.
        tol = 0.03 if q == "p50" else REL
        assert close(s["latency"][q], a["latency"][q], tol), q
    for st in ("queue", "compute"):
        assert abs(stage_of(s, st)["share_of_p95"] - stage_of(a, st)["share_of_p95"]) < 0.01
        assert close(stage_of(s, st)["p99"], stage_of(a, st)["p99"], 0.03)


@pytest.mark.parametrize(
    "mutate,reason",
    [
        (lambda s: setattr(s, "trace_id", b"\x00" * 16), sc.DROP_INVALID_ID),
        (lambda s: setattr(s, "span_id", b"\x01" * 4), sc.DROP_INVALID_ID),
        (
            lambda s: setattr(s, "end_time_unix_nano", s.start_time_unix_nano - 1),
            sc.DROP_NEGATIVE_DURATION,
        ),
        (
            lambda s: setattr(s, "end_time_unix_nano", s.start_time_unix_nano + 2 * 86_400 * 10**9),
            sc.DROP_ABSURD_DURATION,
        ),
        (
            lambda s: s.attributes[0].value.__setattr__("string_value", "Bad Stage!"),
            sc.DROP_INVALID_STAGE,
        ),
        (
            lambda s: s.attributes[0].value.__setattr__("string_value", "unattributed"),
            sc.DROP_INVALID_STAGE,
        ),
    ],
)
def test_bad_spans_dropped_by_reason_others_unaffected(mutate, reason):
    engine, clock = make_engine()
    b = TraceBuilder()
    b.sequential(0.0, [("queue", 0.01), ("compute", 0.02)])
    bad = b.spans[1]  # the queue span: attributes[0] is inferprof.stage
    assert bad.attributes[0].key == sc.ATTR_STAGE
    mutate(bad)
    result = engine.ingest_traces(b.export())
    assert result.rejected_spans == 1 and result.accepted_spans == 2
    assert result.errors and isinstance(result.errors[0], str)
    assert engine.stats.spans_dropped == {reason: 1}
    settle(engine, clock)
    doc = engine.breakdown("svc")
    assert doc["requests"] == 1 and close(stage_of(doc, "compute")["p50"], 0.02)


def test_duplicate_span_and_oversize_trace_dropped():
    engine, _clock = make_engine(max_spans_per_trace=3)
    b = TraceBuilder()
    req, _ = b.sequential(0.0, [("queue", 0.01), ("compute", 0.02)])
    dup = b.spans[1]
    engine.ingest_traces(b.export())
    result = engine.ingest_traces(b.export([dup]))
    assert result.rejected_spans == 1
    b.stage(req, "d2h", 0.03, 0.031)
    result = engine.ingest_traces(b.export())
    assert result.rejected_spans == 1
    assert engine.stats.spans_dropped == {sc.DROP_DUPLICATE: 1, sc.DROP_TRACE_TOO_LARGE: 1}


def test_overloaded_rejects_whole_export_before_accepting_anything():
    engine, clock = make_engine(max_pending_spans=5)
    b = TraceBuilder()
    b.sequential(0.0, [("queue", 0.01), ("compute", 0.02)])  # 3 spans
    engine.ingest_traces(b.export())
    b.sequential(1.0, [("queue", 0.01), ("compute", 0.02)])
    with pytest.raises(Overloaded) as info:
        engine.ingest_traces(b.export())
    assert info.value.pending == 3 and info.value.incoming == 3
    assert engine.stats.spans_received == 3 and engine.pending_spans() == 3
    settle(engine, clock)  # finalising frees room
    b.sequential(2.0, [("queue", 0.01), ("compute", 0.02)])
    assert engine.ingest_traces(b.export()).accepted_spans == 3


def test_an_export_larger_than_the_pending_limit_is_taken_when_nothing_is_pending():
    # Refused, it could never fit: its sender would get 429 and retry it forever.
    engine, clock = make_engine(max_pending_spans=5)
    b = TraceBuilder()
    for i in range(3):
        b.sequential(float(i), [("queue", 0.01), ("compute", 0.02)])  # 9 spans > 5
    assert engine.ingest_traces(b.export()).accepted_spans == 9
    b = TraceBuilder()
    b.sequential(5.0, [("compute", 0.02)])
    with pytest.raises(Overloaded):  # something pending: the limit holds again
        engine.ingest_traces(b.export())


def test_sliding_windows_forget_old_slices():
    engine, clock = make_engine(windows_s=(60.0, 300.0), slice_s=10.0)
    b = TraceBuilder()
    for i in range(10):
        b.sequential(i, [("compute", 0.010)])
    engine.ingest_traces(b.export())
    settle(engine, clock)
    clock.tick(120.0)
    for i in range(10):
        b.sequential(200 + i, [("compute", 0.050)])
    engine.ingest_traces(b.export())
    settle(engine, clock)
    recent = engine.breakdown("svc", window_s=60.0)
    longer = engine.breakdown("svc", window_s=300.0)
    assert recent["requests"] == 10 and close(recent["latency"]["p50"], 0.05)
    assert longer["requests"] == 20 and close(longer["latency"]["p50"], 0.01)
    clock.tick(400.0)
    engine.advance()
    assert engine.breakdown("svc", window_s=300.0)["requests"] == 0
    assert engine.breakdown("svc", window_s=300.0)["latency"]["p50"] is None
    with pytest.raises(ValueError):
        engine.breakdown("svc", window_s=0)


def test_series_cap_folds_into_overflow():
    engine, clock = make_engine(max_series=2)
    b = TraceBuilder()
    for i, model in enumerate(["a", "b", "c", "d"]):
        b.sequential(i, [("compute", 0.01)], model=model)
    engine.ingest_traces(b.export())
    settle(engine, clock)
    services = {(s, m) for s, m in engine.series()}
    assert services == {("svc", "a"), ("svc", "b"), (sc.OVERFLOW_SERIES, "")}
    assert engine.breakdown(sc.OVERFLOW_SERIES)["requests"] == 2
    assert engine.stats.series_overflow == 2


def _fold_models(engine, clock, models, dt=5.0):
    """One export with a request per model, then let it settle."""
    b = TraceBuilder()
    for i, model in enumerate(models):
        b.sequential(i * 0.01, [("compute", 0.01)], model=model)
    engine.ingest_traces(b.export())
    settle(engine, clock, dt)


def test_series_idle_past_retention_gives_up_its_slot_at_the_cap():
    # Retention 60 s, slices of 10 s: a series with no request for 70 s is in no window.
    engine, clock = make_engine(max_series=2, windows_s=(60.0,), slice_s=10.0)
    _fold_models(engine, clock, ["a"])
    clock.tick(40.0)
    _fold_models(engine, clock, ["b"])
    clock.tick(40.0)  # a idle for 85 s, b for 45 s
    _fold_models(engine, clock, ["c"])
    assert set(engine.series()) == {("svc", "b"), ("svc", "c")}
    assert engine.stats.series_reclaimed == 1 and engine.stats.series_overflow == 0
    assert engine.breakdown("svc", model="c")["requests"] == 1
    assert engine.breakdown("svc", model="a") is None
    # a's cumulative histograms left with its slot; c's start from its own request.
    hist = {(m, st): arr.sum() for _, m, st, arr, _ in engine.histograms()}
    assert ("a", "compute") not in hist and hist[("c", "compute")] == 1
    assert hist[("b", "compute")] == 1


def test_series_seen_within_retention_keeps_its_slot_and_new_pairs_overflow():
    engine, clock = make_engine(max_series=2, windows_s=(60.0,), slice_s=10.0)
    _fold_models(engine, clock, ["a", "b"])
    clock.tick(50.0)  # idle 55 s: still inside the 60 s window plus a slice
    _fold_models(engine, clock, ["c"])
    assert set(engine.series()) == {("svc", "a"), ("svc", "b"), (sc.OVERFLOW_SERIES, "")}
    assert engine.stats.series_reclaimed == 0 and engine.stats.series_overflow == 1
    clock.tick(30.0)  # now a and b are past it
    _fold_models(engine, clock, ["c"])
    assert ("svc", "c") in engine.series() and engine.stats.series_reclaimed == 1


def test_series_folded_in_the_same_export_is_not_reclaimed_for_a_later_pair():
    engine, clock = make_engine(max_series=2, windows_s=(60.0,), slice_s=10.0)
    _fold_models(engine, clock, ["a", "b"])
    clock.tick(100.0)
    # a comes back in the same export as the new pair c: c must take b's slot, not a's.
    _fold_models(engine, clock, ["a", "c"])
    assert set(engine.series()) == {("svc", "a"), ("svc", "c")}
    assert engine.breakdown("svc", model="a")["requests"] == 1
    assert engine.breakdown("svc", model="c")["requests"] == 1


def test_offline_engine_never_reclaims():
    engine, clock = make_engine(max_series=1, retention_s=math.inf)
    _fold_models(engine, clock, ["a"])
    clock.tick(10_000.0)
    _fold_models(engine, clock, ["b"])
    assert set(engine.series()) == {("svc", "a"), (sc.OVERFLOW_SERIES, "")}
    assert engine.stats.series_reclaimed == 0


def test_overlapping_stages_partition_keeps_shares_summing_to_one():
    engine, clock = make_engine()
    b = TraceBuilder()
    for i in range(10):
        req = b.request(i, i + 0.1)
        b.stage(req, "compute", i, i + 0.08)
        b.stage(req, "prefill", i + 0.02, i + 0.04)  # nested inside compute
    engine.ingest_traces(b.export())
    settle(engine, clock)
    doc = engine.breakdown("svc")
    shares = {s["stage"]: s["share_of_p95"] for s in doc["stages"]}
    assert math.isclose(sum(shares.values()), 1.0, rel_tol=1e-9)
    assert math.isclose(shares["prefill"], 0.01 / 0.1, rel_tol=1e-6)
    assert math.isclose(shares["compute"], 0.07 / 0.1, rel_tol=1e-6)
    assert close(stage_of(doc, "compute")["p50"], 0.08)  # quantiles use full stage time


def test_constructor_rejects_bad_arguments():
    for kw in (
        {"settle_s": -1},
        {"slice_s": 0},
        {"windows_s": ()},
        {"max_series": 0},
        {"relative_accuracy": 0.2},
        {"max_pending_spans": 1.5},
    ):
        with pytest.raises(ValueError):
            Engine(**kw)


def test_spans_from_the_opentelemetry_sdk_encoded_by_its_otlp_encoder():
    """What real services send: SDK spans, encoded by the OTLP exporter's own encoder."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({sc.RESOURCE_SERVICE_NAME: "sdk-svc"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    members = []
    requests = []
    for _ in range(3):
        with tracer.start_as_current_span("POST /infer", kind=trace.SpanKind.SERVER) as req:
            req.set_attribute(sc.ATTR_MODEL_NAME, "bert")
            with tracer.start_as_current_span(sc.span_name("queue")) as q:
                q.set_attribute(sc.ATTR_STAGE, "queue")
            members.append(req.get_span_context())
            requests.append(req)
    links = [trace.Link(ctx) for ctx in members]
    # the batch ran while its members waited: from the first one's start to the last's end
    c = tracer.start_span(
        sc.span_name("compute"), links=links, context=None, start_time=requests[0].start_time
    )
    c.set_attribute(sc.ATTR_STAGE, "compute")
    c.set_attribute(sc.ATTR_BATCH_ID, "b1")
    c.end(end_time=requests[-1].end_time)
    provider.shutdown()
    engine, clock = make_engine()
    result = engine.ingest_traces(encode_spans(exporter.get_finished_spans()))
    assert result.accepted_spans == 7 and result.rejected_spans == 0
    settle(engine, clock)
    doc = engine.breakdown("sdk-svc", "bert")
    assert doc["requests"] == 3
    assert stage_of(doc, "queue")["count"] == 3
    assert stage_of(doc, "compute")["count"] == 3


def _workload() -> tuple[list, list]:
    """Spans of 30 requests (per-request stages, encoding (a) and (b) batches)."""
    members_b, batch_b = TraceBuilder(), TraceBuilder()
    for batch in range(10):
        t = batch * 0.5
        members = [members_b.request(t, t + 0.2 + 0.01 * k) for k in range(3)]
        for k, m in enumerate(members):
            members_b.stage(m, "queue", t, t + 0.05 + 0.01 * k)
            members_b.stage(m, "batch_assembly", t + 0.08, t + 0.09, batch_id=f"a{batch}")
        batch_b.stage(None, "compute", t + 0.09, t + 0.19, links=members, batch_id=f"c{batch}")
    return members_b.spans, batch_b.spans


def _doc_after(chunks) -> dict:
    engine, clock = make_engine()
    b = TraceBuilder()
    for chunk in chunks:
        engine.ingest_traces(b.export(chunk))
        clock.tick(0.01)  # all within settle_s of each other
        engine.advance()
    settle(engine, clock)
    return engine.breakdown("svc")


def test_any_arrival_order_and_export_split_gives_the_same_breakdown():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    members, batches = _workload()
    spans = members + batches
    expected = _doc_after([spans])
    assert expected["requests"] == 30
    assert stage_of(expected, "compute")["count"] == 30

    @settings(max_examples=25, deadline=None)
    @given(st.permutations(range(len(spans))), st.lists(st.integers(1, 20), min_size=1, max_size=8))
    def check(order, sizes):
        shuffled = [spans[i] for i in order]
        chunks, pos, k = [], 0, 0
        while pos < len(shuffled):
            size = sizes[k % len(sizes)]
            chunks.append(shuffled[pos : pos + size])
            pos += size
            k += 1
        assert _doc_after(chunks) == expected

    check()


def test_concurrent_ingest_and_readers():
    import threading

    engine, clock = make_engine()
    errors = []

    def writer(seed: int) -> None:
        try:
            b = TraceBuilder(f"svc{seed % 2}")
            for i in range(200):
                b.sequential(i * 0.01, [("queue", 0.01), ("compute", 0.02)])
                if i % 20 == 19:
                    engine.ingest_traces(b.export())
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    def reader() -> None:
        try:
            for _ in range(30):
                engine.services()
                engine.breakdown("svc0")
                engine.advance()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    threads.append(threading.Thread(target=reader))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    settle(engine, clock)
    assert {s["service"]: s["requests"] for s in engine.services()} == {"svc0": 400, "svc1": 400}
    assert engine.stats.spans_received == 4 * 600 and engine.pending_spans() == 0


def test_weight_k_is_the_same_as_k_copies():
    rng = np.random.default_rng(3)
    weighted, clock_w = make_engine()
    copies, clock_c = make_engine()
    wb, cb = TraceBuilder(), TraceBuilder()
    for i in range(150):
        stages = [
            ("queue", float(rng.exponential(0.02))),
            ("compute", float(rng.uniform(0.01, 0.03))),
        ]
        k = int(rng.integers(1, 5))
        wb.sequential(i, stages, weight=float(k))
        for _ in range(k):
            cb.sequential(i, stages)
    weighted.ingest_traces(wb.export())
    copies.ingest_traces(cb.export())
    settle(weighted, clock_w)
    settle(copies, clock_c)
    a, b = weighted.breakdown("svc"), copies.breakdown("svc")
    assert a["traced_requests"] == 150 and b["traced_requests"] == a["requests"]
    for doc in (a, b):
        doc.pop("traced_requests")
        doc["verdict"].pop("confidence")  # rests on the traced count, by design
    assert a["latency"] == b["latency"]
    assert [(s["stage"], s["count"], s["p50"], s["p95"], s["p99"]) for s in a["stages"]] == [
        (s["stage"], s["count"], s["p50"], s["p95"], s["p99"]) for s in b["stages"]
    ]
    for sa, sb in zip(a["stages"], b["stages"]):
        assert sa["share_of_p95"] == pytest.approx(sb["share_of_p95"], rel=1e-9, abs=1e-12)


def test_a_weight_above_two_to_the_56_is_ignored_and_counts_stay_finite():
    engine, clock = make_engine()
    tb = TraceBuilder()
    tb.sequential(0, [("compute", 0.01)], weight=1e308)
    tb.sequential(1, [("compute", 0.02)], weight=1e308)
    tb.sequential(2, [("compute", 0.03)], weight=float(2**56))
    engine.ingest_traces(tb.export())
    settle(engine, clock)
    doc = engine.breakdown("svc")
    # the two hostile weights read as 1 (no tracestate), the largest valid one as is
    assert doc["requests"] == pytest.approx(2 + 2**56)
    assert all(math.isfinite(s["share_of_p95"]) for s in doc["stages"])


def test_window_s_says_what_the_document_covers():
    engine, clock = make_engine(windows_s=(60.0, 900.0))
    _fold_models(engine, clock, ["m"])
    assert engine.breakdown("svc", window_s=60)["window_s"] == 60.0
    assert isinstance(engine.breakdown("svc", window_s=60)["window_s"], float)
    # longer than the retention: the retention is what it covers
    assert engine.breakdown("svc", window_s=100_000)["window_s"] == 900.0
    assert engine.breakdown("svc", window_s=None)["window_s"] is None


def test_a_request_linked_twice_from_one_batch_span_counts_its_stage_once():
    engine, clock = make_engine()
    b = TraceBuilder()
    for i in range(10):
        reqs = [b.request(i + 0.0, i + 0.1) for _ in range(4)]
        # a sender linking once per item: the first request had two items in the batch
        b.stage(None, "compute", i + 0.02, i + 0.07, links=[*reqs, reqs[0]])
    engine.ingest_traces(b.export())
    settle(engine, clock)
    compute = stage_of(engine.breakdown("svc"), "compute")
    assert compute["count"] == 40
    assert close(compute["p99"], 0.05)  # 0.1 when the doubled link was added twice


def test_reclaim_waits_for_the_retention_plus_one_slice_exactly():
    # Retention 60 s, slices of 10 s: a pair last folded at t0 can sit in a slice that is
    # kept until t0 + 70 s; reclaimed any sooner, its slot's new pair would inherit it.
    engine, clock = make_engine(max_series=1, windows_s=(60.0,), slice_s=10.0, settle_s=0.0)
    t0 = clock.t = 1_800_000_005.0  # mid-slice

    def fold(model, at):
        clock.t = at
        b = TraceBuilder()
        b.sequential(0.0, [("compute", 0.01)], model=model)
        engine.ingest_traces(b.export())
        engine.advance()

    fold("a", t0)
    fold("c", t0 + 69.0)  # idle 69 s: past the retention, not past the slice after it
    assert engine.stats.series_reclaimed == 0 and ("svc", "a") in engine.series()
    fold("c", t0 + 70.0)  # idle 70 s: reclaimed
    assert engine.stats.series_reclaimed == 1 and ("svc", "c") in engine.series()
    # the new pair holds only its own request: nothing of a's, nor the overflowed one
    assert engine.breakdown("svc", model="c", window_s=None)["requests"] == 1


def test_a_stage_wholly_outside_its_request_is_absent_and_counted():
    # §6: a request that never entered the stage counts as absent, not as zero. A
    # postprocess span dated after its request (clock skew between processes) is not a
    # measured 0 s.
    engine, clock = make_engine()
    b = TraceBuilder()
    for i in range(200):
        req = b.request(i, i + 0.1)
        b.stage(req, "compute", i, i + 0.08)
        if i % 2:
            b.stage(req, "postprocess", i + 0.1, i + 0.13)  # starts at the request's end
        else:
            b.stage(req, "postprocess", i + 0.08, i + 0.1)
    engine.ingest_traces(b.export())
    settle(engine, clock)
    post = stage_of(engine.breakdown("svc"), "postprocess")
    assert post["count"] == 100 and close(post["p50"], 0.02)  # only where it was measured
    assert engine.stats.spans_dropped[sc.DROP_OUTSIDE_REQUEST] == 100


def test_requests_with_an_error_status_are_counted_weighted_and_windowed():
    engine, clock = make_engine(windows_s=(60.0, 900.0))
    b = TraceBuilder()
    for i in range(40):
        failed = i % 4 == 0  # 10 of 40
        req = b.request(i * 0.01, i * 0.01 + 0.02, status=2 if failed else 1,
                        weight=3.0 if i == 0 else None)
        b.stage(req, "compute", i * 0.01, i * 0.01 + 0.02)
    engine.ingest_traces(b.export())
    settle(engine, clock)
    doc = engine.breakdown("svc", window_s=60)
    assert doc["requests"] == 42 and doc["errors"] == 12  # request 0 weighs 3
    assert engine.request_errors() == [("svc", "m", 12.0)]
    # the window moves on, the counter stays
    clock.tick(120)
    engine.advance()
    b = TraceBuilder()
    req = b.request(0, 0.02)
    b.stage(req, "compute", 0, 0.02)
    engine.ingest_traces(b.export())
    settle(engine, clock)
    assert engine.breakdown("svc", window_s=60)["errors"] == 0
    assert engine.breakdown("svc", window_s=900)["errors"] == 12
    assert engine.request_errors() == [("svc", "m", 12.0)]


def test_a_status_on_a_stage_span_is_not_a_failed_request():
    engine, clock = make_engine()
    b = TraceBuilder()
    req = b.request(0, 0.02)
    b.span("inferprof.compute", 0, 0.02, parent=req, attrs={sc.ATTR_STAGE: "compute"}, status=2)
    engine.ingest_traces(b.export())
    settle(engine, clock)
    assert engine.breakdown("svc")["errors"] == 0


def test_reserved_otlp_flag_bits_do_not_mark_a_request_failed():
    engine, clock = make_engine()
    b = TraceBuilder()
    for i in range(10):
        req = b.request(i * 0.01, i * 0.01 + 0.02, status=1)
        b.stage(req, "compute", i * 0.01, i * 0.01 + 0.02)
    export = b.export()
    for rs in export.resource_spans:
        for ss in rs.scope_spans:
            for span in ss.spans:
                span.flags |= 0x10000 | 0x100  # a reserved bit; is-remote known, false
    engine.ingest_traces(export)
    settle(engine, clock)
    doc = engine.breakdown("svc")
    assert doc["requests"] == 10 and doc["errors"] == 0
