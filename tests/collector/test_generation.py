"""Generating requests in the collector (contract §7, encoding §14) against exact truth.

Scenarios come from ``gen_synth.simulate`` (a toy continuous-batching engine); every export
goes through the protobuf decode path of the receivers (``through_the_wire``). Quantiles
must be within §6's 1% of the exact weighted quantiles of the same data, shares within one
percentage point of the shares computed directly from the request timelines.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import KeyValue

from inferprof import semconv as sc
from inferprof.collector.engine import Engine
from inferprof.collector.gen_spans import array_value
from inferprof.collector.steps import StepIndex
from tests.collector.gen_synth import (
    Scenario,
    inferprof_exports,
    quantiles,
    simulate,
    through_the_wire,
    truth_itl,
    truth_itl_shares,
    truth_tpot,
    truth_ttft,
    truth_ttft_shares,
    vllm_exports,
)
from tests.collector.gen_synth import (
    any_value as gen_any_value,
)
from tests.collector.synth import BASE_UNIX, FakeClock, TraceBuilder, attributes

BOUND = 0.01
POINT = 0.01


def _fold(exports, metrics=(), **kw) -> Engine:
    clock = FakeClock()
    engine = Engine(clock=clock, settle_s=1.0, **kw)
    for ex in exports:
        engine.ingest_traces(through_the_wire(ex))
    for m in metrics:
        engine.ingest_metrics(m)
    clock.tick(5)
    engine.advance()
    return engine


def _gen(engine: Engine, service: str = "llm") -> dict:
    return engine.breakdown(service)["generation"]


def _close(got: dict, truth: dict, what: str) -> None:
    for q in ("p50", "p95", "p99"):
        assert got[q] == pytest.approx(truth[q], rel=BOUND), (what, q, got[q], truth[q])


def _shares_close(got: list, truth: dict, key: str) -> None:
    as_dict = {g[key]: g["share_of_p95"] for g in got}
    for name in set(as_dict) | set(truth):
        assert abs(as_dict.get(name, 0.0) - truth.get(name, 0.0)) <= POINT, (
            name, as_dict, truth)
    assert sum(as_dict.values()) == pytest.approx(1.0, abs=1e-9)


@pytest.fixture(scope="module")
def scheduling() -> Scenario:
    # Every fifth step carries a 512-token prefill chunk: the slow gaps are those steps.
    return simulate(np.random.default_rng(11), n_requests=300, prefill_every=0.2,
                    weights=(1.0, 1.0, 4.0))


@pytest.fixture(scope="module")
def kv_pressure() -> Scenario:
    # Long admission waits, evictions, a nearly full KV cache, rare prefill chunks.
    return simulate(np.random.default_rng(12), n_requests=300, queue_s=0.06, prefill_every=0.02,
                    preempt_prob=0.3, kv=0.95, cancel_prob=0.1)


def test_quantiles_of_ttft_itl_tpot_and_tokens_within_one_percent(scheduling):
    gen = _gen(_fold(inferprof_exports(scheduling)))
    _close(gen["ttft"], quantiles(*truth_ttft(scheduling)), "ttft")
    itl, w, _ = truth_itl(scheduling)
    _close(gen["itl"], quantiles(itl, w), "itl")
    _close(gen["tpot"], quantiles(*truth_tpot(scheduling)), "tpot")
    tokens = np.array([r.output for r in scheduling.requests], float)
    weights = np.array([r.weight for r in scheduling.requests])
    for q, v in quantiles(tokens, weights).items():
        assert abs(gen["output_tokens"][q] - v) <= max(1, BOUND * v)
    assert gen["requests"] == round(weights.sum())


def test_scheduling_scenario_shares_and_verdict(scheduling):
    gen = _gen(_fold(inferprof_exports(scheduling)))
    _shares_close(gen["ttft"]["stages"], truth_ttft_shares(scheduling), "stage")
    truth = truth_itl_shares(scheduling)
    _shares_close(gen["itl"]["causes"], truth, "cause")
    assert max(truth, key=truth.get) == sc.ITL_CAUSE_PREFILL_INTERFERENCE
    verdict = gen["verdict"]
    assert verdict["bottleneck"] == sc.VERDICT_SCHEDULING
    assert "prefill" in verdict["evidence"][0]
    assert gen["preempted_requests"] == 0


def test_kv_cache_scenario_shares_preemption_and_verdict(kv_pressure):
    engine = _fold(inferprof_exports(kv_pressure))
    gen = _gen(engine)
    _shares_close(gen["ttft"]["stages"], truth_ttft_shares(kv_pressure), "stage")
    _shares_close(gen["itl"]["causes"], truth_itl_shares(kv_pressure), "cause")
    preempted = sum(r.weight for r in kv_pressure.requests if r.preemptions)
    assert preempted > 0 and gen["preempted_requests"] == round(preempted)
    # usage p95 of the step readings taken while the requests ran
    lo = min(r.start for r in kv_pressure.requests)
    hi = max(r.end for r in kv_pressure.requests)
    readings = [s.kv for s in kv_pressure.steps if lo <= s.start <= hi]
    exact = quantiles(np.array(readings), None)["p95"]
    assert gen["kv_cache"]["usage_p95"] == pytest.approx(exact, rel=BOUND)
    verdict = gen["verdict"]
    assert verdict["bottleneck"] == sc.VERDICT_KV_CACHE
    assert any("KV-cache admission" in e for e in verdict["evidence"])
    # a preempted stage is part of the §6 breakdown too
    stages = {s["stage"] for s in engine.breakdown("llm")["stages"]}
    assert sc.STAGE_PREEMPTED in stages


def test_cancelled_requests_are_counted_and_keep_their_figures(kv_pressure):
    gen = _gen(_fold(inferprof_exports(kv_pressure)))
    cancelled = sum(r.weight for r in kv_pressure.requests if r.cancelled)
    assert cancelled > 0 and gen["cancelled_requests"] == round(cancelled)
    assert gen["requests"] == round(sum(r.weight for r in kv_pressure.requests))
    _close(gen["ttft"], quantiles(*truth_ttft(kv_pressure)), "ttft")


def test_kv_gauge_joined_by_time_when_steps_carry_no_reading():
    scen = simulate(np.random.default_rng(13), n_requests=120, n_steps=2000, kv=None)
    rng = np.random.default_rng(14)
    t = np.arange(0.0, scen.steps[-1].end, 0.05)
    values = np.clip(0.7 + 0.1 * rng.standard_normal(t.size), 0, 1)
    gauge = ExportMetricsServiceRequest()
    rm = gauge.resource_metrics.add()
    rm.resource.attributes.extend(attributes({
        sc.RESOURCE_SERVICE_NAME: "llm", sc.RESOURCE_HOST_NAME: "host-1",
        sc.RESOURCE_SERVICE_INSTANCE_ID: "i-1"}))
    metric = rm.scope_metrics.add().metrics.add()
    metric.name = sc.METRIC_ENGINE_KV_CACHE_USAGE
    for ti, v in zip(t, values, strict=True):
        dp = metric.gauge.data_points.add()
        dp.time_unix_nano = round(BASE_UNIX * 1e9) + round(ti * 1e9)
        dp.as_double = float(v)
        dp.attributes.extend(attributes({sc.ATTR_ENGINE_ID: "0"}))
    gen = _gen(_fold(inferprof_exports(scen), [gauge]))
    lo = min(r.start for r in scen.requests)
    hi = max(r.end for r in scen.requests)
    inside = values[(t >= lo) & (t <= hi)]
    assert gen["kv_cache"]["usage_p95"] == pytest.approx(
        quantiles(inside, None)["p95"], rel=BOUND)


def test_without_step_spans_gaps_are_unattributed_but_preemption(kv_pressure):
    gen = _gen(_fold(inferprof_exports(kv_pressure, steps=False)))
    truth = truth_itl_shares(kv_pressure, with_steps=False)
    _shares_close(gen["itl"]["causes"], truth, "cause")
    got = {c["cause"]: c["share_of_p95"] for c in gen["itl"]["causes"]}
    assert got[sc.ITL_CAUSE_DECODE] == got[sc.ITL_CAUSE_HOST] == 0.0
    assert got[sc.ITL_CAUSE_PREEMPTED] > 0.5


def test_steps_join_their_own_engine_only(scheduling):
    # The requests name engine "7"; the steps are another engine's: no join.
    requests_only = inferprof_exports(scheduling, steps=False, engine_id="7")
    steps_only = inferprof_exports(Scenario(scheduling.steps, []), engine_id="3")
    gen = _gen(_fold(steps_only + requests_only))
    got = {c["cause"]: c["share_of_p95"] for c in gen["itl"]["causes"]}
    assert got[sc.ITL_CAUSE_UNATTRIBUTED] == pytest.approx(1.0)
    joined = _gen(_fold(inferprof_exports(scheduling, engine_id="7")))
    assert joined["verdict"]["bottleneck"] == sc.VERDICT_SCHEDULING


def test_engine_keys_are_cut_like_labels_and_still_join(scheduling):
    # Up to 4096 engines are held: their service names and engine ids are cut to
    # MAX_LABEL_BYTES like the series' names (1 MB each would be gigabytes), and the
    # requests still join their steps through the cut key.
    service, engine_id = "s" * 1000, "7" * 100_000
    engine = _fold(inferprof_exports(scheduling, service=service, engine_id=engine_id))
    keys = list(engine._gen.steps.engines)
    assert len(keys) == 1
    assert all(len(part.encode()) <= sc.MAX_LABEL_BYTES for part in keys[0])
    gen = engine.breakdown(engine.services()[0]["service"])["generation"]
    assert gen["verdict"]["bottleneck"] == sc.VERDICT_SCHEDULING


def _vllm_truth_ttft_shares(scen: Scenario) -> dict[str, float]:
    """vLLM's meaning: prefill runs from scheduling to the first token."""
    v, w = truth_ttft(scen)
    p95 = quantiles(v, w)["p95"]
    num = {"queue": 0.0, "prefill": 0.0, "unattributed": 0.0}
    den = 0.0
    for r in scen.requests:
        if r.ttft < p95:
            continue
        _, qs, qe = next(s for s in r.stages if s[0] == "queue")
        _, ps, _ = next(s for s in r.stages if s[0] == "prefill")
        num["queue"] += r.weight * (qe - qs)
        num["prefill"] += r.weight * (r.start + r.ttft - ps)
        num["unattributed"] += r.weight * (qs - r.start)
        den += r.weight * r.ttft
    return {k: x / den for k, x in num.items()}


@pytest.mark.parametrize("flags", ["remote", "absent"])
def test_vllm_llm_request_spans_are_requests_with_derived_stages(kv_pressure, flags):
    engine = _fold(vllm_exports(kv_pressure, flags=flags))
    assert engine.services() == [
        {"service": "vllm", "models": ["meta/llama"], "requests": len(kv_pressure.requests)}]
    doc = engine.breakdown("vllm")
    assert doc["model"] == "meta/llama"
    counts = {s["stage"]: s["count"] for s in doc["stages"]}
    n = len(kv_pressure.requests)
    assert counts[sc.STAGE_QUEUE] == counts[sc.STAGE_PREFILL] == counts[sc.STAGE_DECODE] == n
    gen = doc["generation"]
    # vLLM spans carry no sampling weight: each request counts 1.
    unweighted = Scenario(kv_pressure.steps, [
        type(r)(**{**r.__dict__, "weight": 1.0}) for r in kv_pressure.requests])
    _close(gen["ttft"], quantiles(*truth_ttft(unweighted)), "ttft")
    _close(gen["tpot"], quantiles(*truth_tpot(unweighted)), "tpot")
    _shares_close(gen["ttft"]["stages"], _vllm_truth_ttft_shares(unweighted), "stage")
    assert gen["itl"]["p50"] is None and gen["itl"]["causes"] == []
    tokens = np.array([r.output for r in kv_pressure.requests], float)
    assert gen["output_tokens"]["p50"] == pytest.approx(quantiles(tokens, None)["p50"], abs=1)
    assert engine.stats.spans_ignored == 0 and engine.stats.traces_incomplete == 0


def test_a_server_span_naming_only_a_model_is_not_a_request():
    b = TraceBuilder("gw")
    b.span("chat", 0.0, 0.1, kind=2, attrs={sc.ATTR_GEN_AI_REQUEST_MODEL: "x"})
    engine = _fold([b.export()])
    assert engine.services() == []


def test_step_spans_and_their_device_stages_are_never_pending():
    scen = simulate(np.random.default_rng(15), n_requests=0, n_steps=500)
    exports = inferprof_exports(scen)
    b = TraceBuilder("llm")
    for s in scen.steps[:50]:
        step = b.span(sc.ENGINE_STEP_SPAN_NAME, s.start, s.end, attrs={
            sc.ATTR_STEP_DECODE_TOKENS: s.decode, sc.ATTR_ENGINE_ID: "1"})
        b.stage(step, sc.STAGE_COMPUTE, s.start, s.end, **{sc.ATTR_ENGINE_ID: "1"})
    clock = FakeClock()
    engine = Engine(clock=clock, settle_s=1.0, trace_timeout_s=10.0)
    for ex in [*exports, b.export()]:
        engine.ingest_traces(through_the_wire(ex))
    assert engine.pending_spans() == 0
    clock.tick(60)
    engine.advance()
    stats = engine.stats
    assert stats.traces_incomplete == 0 and not stats.spans_dropped
    assert stats.spans_accepted == 500 + 100
    assert stats.engine_steps_received == 500 + 50 and stats.engine_steps_dropped == 0


@pytest.mark.parametrize("scenario", ["scheduling", "kv_pressure"])
def test_compact_step_spans_fold_exactly_as_a_span_per_step(scenario, request):
    # Production mode's encoding (§14): the same steps, 64 to a span, give the same
    # figures, attributions, KV-cache usage, verdict and cost to the last bit.
    scen = request.getfixturevalue(scenario)
    per_step = _fold(inferprof_exports(scen))
    compact = _fold(inferprof_exports(scen, compact=64))
    assert compact.stats.engine_steps_received == per_step.stats.engine_steps_received \
        == len(scen.steps)
    assert not compact.stats.spans_dropped
    doc_a, doc_b = per_step.breakdown("llm"), compact.breakdown("llm")
    assert doc_b["generation"] == doc_a["generation"]
    assert doc_b["cost"] == doc_a["cost"]
    assert doc_a["generation"]["requests"] > 0


def test_step_index_bounds_the_steps_of_a_compact_span_as_single_steps():
    from array import array

    index = StepIndex(10.0, max_engines=100, max_rows=1000, max_total_rows=250)
    n = 100
    compact = {
        sc.ATTR_STEPS_START_OFFSETS_S: array("d", [i * 1e-8 for i in range(n)]),
        sc.ATTR_STEPS_DURATIONS_S: array("d", [5e-9] * n),
        sc.ATTR_STEPS_DECODE_TOKENS: array("d", [1.0] * n),
        sc.ATTR_STEPS_KV_CACHE_USAGE: array("d", [0.5, -1.0] * (n // 2)),
    }
    for e in range(3):
        assert index.add_step(("s", "h", str(e)), compact, 0, 10 * n, 0.0) is None
    # 3 x (100 steps + 50 readings) offered, 250 held: the rest refused and counted
    assert index.total == 250 and index.steps_received == 3 * n
    assert index.dropped == 3 * n - sum(len(tl.pending) for tl in index.engines.values())
    st, en, p, d, _ = index.steps(("s", "h", "0", "0"), 0.0)
    assert st.tolist() == [10 * i for i in range(n)] and (en - st == 5).all()
    assert (d == 1).all() and (p == 0).all()
    assert index.add_step(("s", "h", "x"), {**compact, sc.ATTR_STEPS_DURATIONS_S: None},
                          0, 10 * n, 0.0) is not None  # malformed: a reason, nothing held


def test_step_index_is_bounded_and_expires():
    index = StepIndex(10.0, max_engines=2, max_rows=100)
    for i in range(1000):
        index.add_step(("s", "h", "i"), {sc.ATTR_STEP_DECODE_TOKENS: 1}, i * 10, i * 10 + 5, 0.0)
    rows = index.steps(("s", "h", "i", "0"), 0.0)
    assert rows[0].size == 100 and rows[0][0] == 900 * 10  # the latest rows stay
    index.add_step(("s", "h", "j"), {sc.ATTR_STEP_DECODE_TOKENS: 1}, 0, 5, 1.0)
    index.add_step(("s", "h", "k"), {sc.ATTR_STEP_DECODE_TOKENS: 1}, 0, 5, 2.0)
    assert len(index.engines) == 2 and index.dropped >= 1  # at the cap: refused
    index.prune(11.5)  # "i" (touched at 0) and "j" (at 1) have expired
    assert set(index.engines) == set()
    index.add_step(("s", "h", "k"), {sc.ATTR_STEP_DECODE_TOKENS: 1}, 0, 5, 12.0)
    assert set(index.engines) == {("s", "h", "k", "0")}
    assert math.isinf(StepIndex(math.inf).retention_s)


def test_step_index_holds_at_most_its_total_and_counts_what_it_refuses():
    index = StepIndex(10.0, max_engines=100, max_rows=1000, max_total_rows=250)
    step = {sc.ATTR_STEP_DECODE_TOKENS: 1, sc.ATTR_STEP_KV_CACHE_USAGE: 0.5}
    for e in range(5):
        for i in range(100):
            index.add_step(("s", "h", str(e)), step, i * 10, i * 10 + 5, 0.0)
    assert index.total <= 250 and index.steps_received == 500
    assert index.dropped == 500 - sum(
        tl.rows[0].size if tl.rows is not None else len(tl.pending)
        for tl in index.engines.values())
    index.prune(11.0)  # everything expired: the room comes back
    assert index.total == 0 and not index.engines
    index.add_step(("s", "h", "x"), step, 0, 5, 12.0)
    assert index.total == 2  # the step and its KV reading


@settings(max_examples=200, deadline=None)
@given(st.one_of(
    st.lists(st.floats(allow_nan=False, allow_infinity=False, width=64), max_size=40),
    st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=40),
    st.lists(st.integers(min_value=0, max_value=130), max_size=40),
))
def test_array_attributes_read_exactly_whatever_their_wire_shape(values):
    got = array_value(gen_any_value(values))
    assert got is not None and list(got) == [float(v) for v in values]


_NUMBER = st.one_of(st.floats(allow_nan=False, width=64),
                    st.integers(min_value=-(2**63), max_value=2**63 - 1),
                    st.integers(min_value=0, max_value=130))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(_NUMBER, _NUMBER, st.booleans(), st.text(max_size=3)), max_size=30))
def test_array_attributes_of_mixed_types_read_value_by_value_or_not_at_all(values):
    """Ints and doubles may mix (each read by its own type); an array holding anything
    else is not an array of numbers (None), never one with that value read as 0."""
    got = array_value(gen_any_value(values))
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        assert got is not None and list(got) == [float(v) for v in values]
    else:
        assert got is None


def test_sglang_shaped_request_span_of_any_kind_without_queue_latency():
    """SGLang's request span: ttft, e2e, prefill (dispatch to first token), decode and
    inference latencies, no queue time; an INTERNAL root span here."""
    b = TraceBuilder("sglang")
    rng = np.random.default_rng(16)
    ttfts = rng.uniform(0.05, 0.5, 40)
    for i, ttft in enumerate(ttfts):
        start, e2e = i * 1.0, float(ttft) + 0.8
        b.span("req", start, start + e2e, attrs={
            sc.ATTR_GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: float(ttft),
            sc.ATTR_GEN_AI_LATENCY_E2E: e2e,
            sc.ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: float(ttft) - 0.01,
            sc.ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: 0.8,
            "gen_ai.latency.time_in_model_inference": e2e - 0.01,
            sc.ATTR_GEN_AI_USAGE_COMPLETION_TOKENS: 41,
        })
    doc = _fold([b.export()]).breakdown("sglang")
    counts = {s["stage"]: s["count"] for s in doc["stages"]}
    assert counts == {sc.STAGE_PREFILL: 40, sc.STAGE_DECODE: 40, sc.STAGE_UNATTRIBUTED: 40}
    gen = doc["generation"]
    _close(gen["ttft"], quantiles(ttfts, None), "ttft")
    _close(gen["tpot"], quantiles(np.full(40, 0.8 / 40), None), "tpot")
    shares = {s["stage"]: s["share_of_p95"] for s in gen["ttft"]["stages"]}
    tail = ttfts[ttfts >= quantiles(ttfts, None)["p95"]]
    assert shares[sc.STAGE_PREFILL] == pytest.approx(((tail - 0.01).sum()) / tail.sum(), abs=POINT)


def test_malformed_generation_attributes_are_ignored_not_fatal():
    b = TraceBuilder("llm")
    bad = [
        {sc.ATTR_GEN_EMIT_OFFSETS_S: "0.1,0.2"},                      # not an array
        {sc.ATTR_GEN_EMIT_OFFSETS_S: [0.1, float("nan")]},            # not finite
        {sc.ATTR_GEN_EMIT_OFFSETS_S: ["a", "b"]},                     # not numbers
        {sc.ATTR_GEN_EMIT_OFFSETS_S: [0.3, 0.1, 0.2],                 # out of order
         sc.ATTR_GEN_EMIT_TOKENS: [1, 2]},                            # wrong length
        {sc.ATTR_TOKENS_OUTPUT: "many", sc.ATTR_GEN_PREEMPTIONS: -1},
        {sc.ATTR_GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: -5.0},
    ]
    for i, attrs in enumerate(bad):
        req = b.span("POST /v1/completions", i, i + 0.5, kind=2, attrs={})
        b.spans[-1].attributes.extend(
            KeyValue(key=k, value=gen_any_value(v)) for k, v in attrs.items())
        b.stage(req, "queue", i, i + 0.1)
    engine = _fold([b.export()])
    doc = engine.breakdown("llm")
    assert doc["requests"] == len(bad)
    gen = doc["generation"]
    # only the out-of-order one has usable token times (made monotone): ttft 0.3
    assert gen["ttft"]["p50"] == pytest.approx(0.3, rel=BOUND)
    assert gen["preempted_requests"] == 0
    assert not engine.stats.spans_dropped


def test_engine_latencies_too_large_to_place_are_ignored_not_fatal():
    # Finite seconds whose nanoseconds overflow (1e300 s) cannot place a stage: the
    # request and its neighbours still fold, no exception reaches the collector.
    b = TraceBuilder("vllm")
    huge = [
        {sc.ATTR_GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: 1e300,
         sc.ATTR_GEN_AI_LATENCY_TIME_IN_QUEUE: 0.1},
        {sc.ATTR_GEN_AI_LATENCY_TIME_IN_QUEUE: 1e300,
         sc.ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: 1e300,
         sc.ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: 1e300},
        {sc.ATTR_GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: 0.2,
         sc.ATTR_GEN_AI_LATENCY_TIME_IN_QUEUE: 0.1,
         sc.ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: 0.05},
    ]
    for i, attrs in enumerate(huge):
        b.span(sc.GEN_AI_REQUEST_SPAN_NAME, i, i + 0.5, kind=2, attrs={})
        b.spans[-1].attributes.extend(
            KeyValue(key=k, value=gen_any_value(v)) for k, v in attrs.items())
    engine = _fold([b.export()])
    doc = engine.breakdown("vllm")
    assert doc["requests"] == len(huge)
    assert doc["generation"]["requests"] == 2  # the two with a time to first token


def test_emission_offsets_too_large_to_place_are_ignored_not_fatal():
    # A request span of no duration gives no end to clamp a ttft of 1e300 s to: its
    # offsets are malformed, not read; the other requests fold.
    b = TraceBuilder("llm")
    for i, offsets in enumerate(([1e300, 2e300], [0.1, 0.2])):
        end = i if i == 0 else i + 0.5
        req = b.span("POST /v1/completions", i, end, kind=2, attrs={})
        b.spans[-1].attributes.extend([
            KeyValue(key=sc.ATTR_GEN_EMIT_OFFSETS_S, value=gen_any_value(offsets))])
        b.stage(req, "queue", i, i)
    engine = _fold([b.export()])
    doc = engine.breakdown("llm")
    assert doc["requests"] == 2
    assert doc["generation"]["ttft"]["p50"] == pytest.approx(0.1, rel=BOUND)
