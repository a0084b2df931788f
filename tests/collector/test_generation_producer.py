"""inferprof's own producer (the step API, contract §14) into the collector: what
``inferprof.Engine`` exports over OTLP/gRPC is read back as the generation section."""

from __future__ import annotations

import time

import pytest

import inferprof
from inferprof import semconv as sc
from inferprof.collector.engine import Engine
from tests.collector.synth import FakeClock
from tests.otlp_sink import attributes


def test_step_api_spans_fold_into_the_generation_section(otlp_sink):
    inferprof.configure(service_name="gen", endpoint=otlp_sink.endpoint, set_global=False)
    engine = inferprof.Engine("e1")
    gens = [engine.request(prompt_tokens=8) for _ in range(3)]
    with engine.step(kv_cache_usage=0.5) as step:  # prompts of two requests
        step.prefill(gens[0], 8)
        step.prefill(gens[1], 8)
        with inferprof.stage("compute"):
            time.sleep(0.01)
    # Steps of 10-40 ms: the Python between them (the host cause) stays small on a busy
    # machine, where a few ms of it against 1-4 ms steps was up to 40% of the gaps.
    for n in range(6):
        with engine.step(kv_cache_usage=0.9) as step:
            step.decode(gens[0])
            if n == 0:
                step.prefill(gens[2], 8)  # the third prompt interferes with decoding
            elif n != 2:
                step.decode(gens[2])
            if n < 2 or n >= 4:
                step.decode(gens[1])
            with inferprof.stage("compute"):
                time.sleep(0.04 if n == 0 else 0.01)
        if n == 1:
            gens[1].preempt()  # evicted for two steps, prompt recomputed after
        if n == 3:
            with engine.step() as step:
                step.prefill(gens[1], 10)
    for g in gens:
        g.finish()
    inferprof.shutdown()
    assert otlp_sink.wait_for(
        lambda s: sum(1 for _, sp in s.spans() if sp.name == sc.REQUEST_SPAN_NAME) == 3)

    clock = FakeClock(time.time())
    collector = Engine(clock=clock, settle_s=1.0)
    for request in otlp_sink.trace_requests:
        collector.ingest_traces(request)
    # Only the requests' traces wait to be finalised: step traces go to the step index.
    request_traces = {sp.trace_id for _, sp in otlp_sink.spans()
                      if sp.name == sc.REQUEST_SPAN_NAME}
    assert collector.pending_spans() == sum(
        1 for _, sp in otlp_sink.spans() if sp.trace_id in request_traces)
    clock.tick(5)
    gen = collector.breakdown("gen")["generation"]
    stats = collector.stats
    assert stats.traces_incomplete == 0 and not stats.spans_dropped

    requests = [sp for _, sp in otlp_sink.spans() if sp.name == sc.REQUEST_SPAN_NAME]
    ttfts = sorted(attributes(r)[sc.ATTR_GEN_EMIT_OFFSETS_S].values[0].double_value
                   for r in requests)
    assert gen["requests"] == 3
    assert gen["ttft"]["p50"] == pytest.approx(ttfts[1], rel=0.01)
    assert gen["ttft"]["p99"] == pytest.approx(ttfts[2], rel=0.01)
    assert gen["preempted_requests"] == 1
    assert gen["kv_cache"]["usage_p95"] == pytest.approx(0.9, rel=0.01)
    causes = {c["cause"]: c["share_of_p95"] for c in gen["itl"]["causes"]}
    assert sum(causes.values()) == pytest.approx(1.0)
    # joined to the engine's steps: the gaps are decode, other prompts and eviction
    assert causes[sc.ITL_CAUSE_UNATTRIBUTED] == 0.0
    assert causes[sc.ITL_CAUSE_DECODE] + causes[sc.ITL_CAUSE_PREFILL_INTERFERENCE] + causes[
        sc.ITL_CAUSE_PREEMPTED] > 0.8
    assert {s["stage"] for s in gen["ttft"]["stages"]} >= {sc.STAGE_QUEUE, sc.STAGE_PREFILL}


def test_step_api_requests_share_their_steps_device_time(otlp_sink):
    """Cost (concepts.md): a generating request is charged its share of each engine step
    it ran in (its tokens over the step's), not its whole prefill/decode span, so the
    requests' GPU-seconds sum to the steps' time instead of a multiple of it."""
    inferprof.configure(service_name="gen", endpoint=otlp_sink.endpoint, set_global=False)
    engine = inferprof.Engine("e1")
    a, b = engine.request(prompt_tokens=8), engine.request(prompt_tokens=24)
    with engine.step() as step:  # both prompts, then three decode steps
        step.prefill(a, 8)
        step.prefill(b, 24)
        with inferprof.stage("compute"):
            time.sleep(0.004)
    for _ in range(3):
        with engine.step() as step:
            step.decode(a)
            step.decode(b)
            with inferprof.stage("compute"):
                time.sleep(0.003)
    c = engine.request(prompt_tokens=16)
    with engine.step() as step:  # c's prompt beside a's and b's decode tokens
        step.decode(a)
        step.decode(b)
        step.prefill(c, 16)
        with inferprof.stage("compute"):
            time.sleep(0.004)
    for _ in range(2):
        with engine.step() as step:
            for g in (a, b, c):
                step.decode(g)
            with inferprof.stage("compute"):
                time.sleep(0.003)
    for g in (a, b, c):
        g.finish()
    inferprof.shutdown()
    assert otlp_sink.wait_for(
        lambda s: sum(1 for _, sp in s.spans() if sp.name == sc.REQUEST_SPAN_NAME) == 3)

    steps = sorted((sp for _, sp in otlp_sink.spans() if sc.ATTR_STEP_DECODE_TOKENS in
                    attributes(sp)), key=lambda sp: sp.start_time_unix_nano)
    assert len(steps) == 7
    d = [(sp.end_time_unix_nano - sp.start_time_unix_nano) * 1e-9 for sp in steps]
    expected = {  # prompt tokens -> (prefill, decode) GPU-seconds
        8: (d[0] * 8 / 32, sum(d[1:4]) / 2 + d[4] / 18 + sum(d[5:]) / 3),
        24: (d[0] * 24 / 32, sum(d[1:4]) / 2 + d[4] / 18 + sum(d[5:]) / 3),
        16: (d[4] * 16 / 18, sum(d[5:]) / 3),
    }
    prompt_of = {sp.trace_id.hex(): attributes(sp)[sc.ATTR_TOKENS_PROMPT]
                 for _, sp in otlp_sink.spans() if sp.name == sc.REQUEST_SPAN_NAME}

    clock = FakeClock(time.time())
    collector = Engine(clock=clock, settle_s=1.0)
    for request in otlp_sink.trace_requests:
        collector.ingest_traces(request)
    clock.tick(5)
    doc = collector.breakdown("gen")
    cost = {s["stage"]: s["gpu_seconds_per_request"] for s in doc["cost"]["stages"]}
    assert cost[sc.STAGE_PREFILL] == pytest.approx(sum(e[0] for e in expected.values()) / 3)
    assert cost[sc.STAGE_DECODE] == pytest.approx(sum(e[1] for e in expected.values()) / 3)
    # every token of every step is a traced request's: the shares add up to the steps
    assert doc["cost"]["gpu_seconds_per_request"] * 3 == pytest.approx(sum(d))
    seen = {ex["trace_id"]: ex["gpu_seconds"] for ex in doc["examples"]
            if ex["slowest"] == "latency"}
    assert len(seen) == 3
    for trace_id, gpu in seen.items():
        prefill_s, decode_s = expected[prompt_of[trace_id]]
        assert gpu[sc.STAGE_PREFILL] == pytest.approx(prefill_s)
        assert gpu[sc.STAGE_DECODE] == pytest.approx(decode_s)
