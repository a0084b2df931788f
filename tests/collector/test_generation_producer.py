"""inferprof's own producer (the step API, contract §14) into the collector: what
``inferprof.Engine`` exports over OTLP/gRPC is read back as the generation section."""

from __future__ import annotations

import math
import time
from array import array

import pytest

import inferprof
from inferprof import semconv as sc
from inferprof.collector import gen_spans as gs
from inferprof.collector.engine import Engine
from tests.collector.synth import FakeClock
from tests.otlp_sink import attributes


def _run_engine(engine):
    """A generating run through the step API: three requests, chunked prompts, another
    request's prompt beside decoding, an eviction with its prompt recomputed."""
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


def test_step_api_spans_fold_into_the_generation_section(otlp_sink):
    inferprof.configure(service_name="gen", endpoint=otlp_sink.endpoint, set_global=False)
    _run_engine(inferprof.Engine("e1"))
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


def _step_rows_and_rest(requests):
    """The per-step spans' rows (start, end, prefill, decode, members, kv) and copies of
    ``requests`` without the step traces (step spans and their stages)."""
    rows = []
    step_traces = set()
    for req in requests:
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    if sp.name == sc.ENGINE_STEP_SPAN_NAME:
                        a = attributes(sp)
                        step_traces.add(sp.trace_id)
                        rows.append((sp.start_time_unix_nano, sp.end_time_unix_nano,
                                     a[sc.ATTR_STEP_PREFILL_TOKENS], a[sc.ATTR_STEP_DECODE_TOKENS],
                                     a[sc.ATTR_STEP_REQUESTS], a.get(sc.ATTR_STEP_KV_CACHE_USAGE)))
    rest = []
    for req in requests:
        copy = type(req)()
        copy.CopyFrom(req)
        for rs in copy.resource_spans:
            for ss in rs.scope_spans:
                keep = [sp for sp in ss.spans if sp.trace_id not in step_traces]
                del ss.spans[:]
                ss.spans.extend(keep)
        rest.append(copy)
    return sorted(rows), rest


def _compact_request(template, engine_id, groups):
    """An export holding one compact step span (the producer's own encoding, §14) per
    group of rows, under ``template``'s first resource and scope."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans

    from inferprof.instrumentation.engine import _steps_spec
    from inferprof.instrumentation.otlp_encode import encode_trace_spans
    from inferprof.instrumentation.spans import new_trace_id

    out = ExportTraceServiceRequest()
    rs = out.resource_spans.add()
    rs.resource.CopyFrom(template.resource_spans[0].resource)
    ss = rs.scope_spans.add()
    ss.scope.CopyFrom(template.resource_spans[0].scope_spans[0].scope)
    for rows in groups:
        encoded = encode_trace_spans(new_trace_id(), [_steps_spec(engine_id, rows)])
        ss.spans.extend(ScopeSpans.FromString(encoded).spans)
    return out


def _fold(requests, payload):
    clock = FakeClock(time.time())
    collector = Engine(clock=clock, settle_s=1.0)
    for request in requests:
        result = collector.ingest_traces(
            request, payload=request.SerializeToString() if payload else None)
        assert result.rejected_spans == 0, result.errors
    clock.tick(5)
    return collector


def test_compact_step_spans_give_the_figures_of_a_span_per_step(otlp_sink):
    # The same run, its steps sent a span each (full mode) or as compact spans (production
    # mode's encoding, §14): ttft, itl, tpot, both tail attributions, the KV-cache usage
    # and the steps' GPU-seconds are the same, to the last bit.
    inferprof.configure(service_name="gen", endpoint=otlp_sink.endpoint, set_global=False)
    _run_engine(inferprof.Engine("e1"))
    inferprof.shutdown()
    assert otlp_sink.wait_for(
        lambda s: sum(1 for _, sp in s.spans() if sp.name == sc.REQUEST_SPAN_NAME) == 3)
    per_step = list(otlp_sink.trace_requests)
    rows, rest = _step_rows_and_rest(per_step)
    assert len(rows) == 8
    # two compact spans, in the order they would arrive
    compact = [*rest, _compact_request(per_step[0], "e1", [rows[:3], rows[3:]])]

    for payload in (False, True):  # the message path and the serialized-bytes path
        a = _fold(per_step, payload)
        b = _fold(compact, payload)
        doc_a, doc_b = a.breakdown("gen"), b.breakdown("gen")
        assert doc_a["generation"]["requests"] == 3
        causes = {c["cause"]: c["share_of_p95"] for c in doc_a["generation"]["itl"]["causes"]}
        assert causes[sc.ITL_CAUSE_UNATTRIBUTED] == 0.0  # the gaps were joined to steps
        assert doc_b["generation"] == doc_a["generation"]
        assert doc_b["cost"] == doc_a["cost"]
        assert b.stats.engine_steps_received == a.stats.engine_steps_received == 8
        assert not b.stats.spans_dropped


def test_production_mode_exports_compact_steps_the_collector_joins(otlp_sink):
    inferprof.configure(service_name="gen", endpoint=otlp_sink.endpoint, set_global=False,
                        mode="production", sample_rate=1.0)
    _run_engine(inferprof.Engine("e1"))
    inferprof.shutdown()
    assert otlp_sink.wait_for(
        lambda s: sum(1 for _, sp in s.spans() if sp.name == sc.REQUEST_SPAN_NAME) == 3)
    names = [sp.name for _, sp in otlp_sink.spans()]
    assert sc.ENGINE_STEP_SPAN_NAME not in names
    compact = [sp for _, sp in otlp_sink.spans() if sp.name == sc.ENGINE_STEPS_SPAN_NAME]
    assert sum(len(attributes(sp)[sc.ATTR_STEPS_DURATIONS_S].values) for sp in compact) == 8

    collector = _fold(otlp_sink.trace_requests, payload=True)
    gen = collector.breakdown("gen")["generation"]
    assert collector.stats.engine_steps_received == 8
    assert gen["requests"] == 3 and gen["preempted_requests"] == 1
    assert gen["kv_cache"]["usage_p95"] == pytest.approx(0.9, rel=0.01)
    causes = {c["cause"]: c["share_of_p95"] for c in gen["itl"]["causes"]}
    assert causes[sc.ITL_CAUSE_UNATTRIBUTED] == 0.0
    assert causes[sc.ITL_CAUSE_DECODE] + causes[sc.ITL_CAUSE_PREFILL_INTERFERENCE] + causes[
        sc.ITL_CAUSE_PREEMPTED] > 0.8


def test_a_malformed_compact_step_span_is_rejected_with_its_reason_the_rest_kept():
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans

    from inferprof.instrumentation.engine import _steps_spec
    from inferprof.instrumentation.otlp_encode import encode_trace_spans
    from inferprof.instrumentation.spans import SpanSpec, new_span_id, new_trace_id

    t0 = time.time_ns()
    good = _steps_spec("e1", [(t0, t0 + 10_000_000, 0, 4, 4, 0.5),
                              (t0 + 11_000_000, t0 + 20_000_000, 16, 4, 5, None)])

    def spec(**changes):
        attrs = dict(good.attributes)
        for key, value in changes.items():
            if value is None:
                attrs.pop(key)
            else:
                attrs[key] = value
        return SpanSpec(sc.ENGINE_STEPS_SPAN_NAME, new_span_id(), None, good.kind,
                        good.start, good.end, attrs, None, ())

    bad = [
        spec(**{sc.ATTR_STEPS_DURATIONS_S: None}),  # no durations
        spec(**{sc.ATTR_STEPS_DURATIONS_S: [0.01]}),  # one entry short
        spec(**{sc.ATTR_STEPS_START_OFFSETS_S: [0.0, -0.001]}),  # before the span
        spec(**{sc.ATTR_STEPS_DURATIONS_S: [0.01, 0.5]}),  # past the span's end
        spec(**{sc.ATTR_STEPS_DECODE_TOKENS: ["4", "4"]}),  # not numbers
        spec(**{sc.ATTR_STEPS_PREFILL_TOKENS: [0, -16]}),  # a negative count
        spec(**{sc.ATTR_STEPS_START_OFFSETS_S: [], sc.ATTR_STEPS_DURATIONS_S: []}),  # empty
        spec(**{sc.ATTR_STEPS_REQUESTS: [4]}),  # one entry short
        spec(**{sc.ATTR_STEPS_REQUESTS: [4, -5]}),  # a negative count
    ]
    request = ExportTraceServiceRequest()
    ss = request.resource_spans.add().scope_spans.add()
    for s in [*bad, good]:
        ss.spans.extend(ScopeSpans.FromString(encode_trace_spans(new_trace_id(), [s])).spans)

    for payload in (False, True):
        clock = FakeClock(time.time())
        collector = Engine(clock=clock, settle_s=1.0)
        result = collector.ingest_traces(
            request, payload=request.SerializeToString() if payload else None)
        assert (result.accepted_spans, result.rejected_spans) == (1, len(bad))
        assert all("engine steps span" in e for e in result.errors)
        assert any("durations" in e for e in result.errors)
        assert collector.stats.spans_dropped == {sc.DROP_INVALID_STEPS: len(bad)}
        assert collector.stats.engine_steps_received == 2  # the good span's steps
        assert collector.pending_spans() == 0


def test_compact_step_counts_of_mixed_number_types_are_read_each_by_its_type():
    """An array of ints and doubles (another producer's, or a count that became a float)
    is read value by value; a bool, a fraction or a string in it rejects the span whole
    (``invalid_steps``), the rest of the export kept. Read by its first value's type, the
    others read as 0."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans
    from opentelemetry.trace import SpanKind

    from inferprof.instrumentation.otlp_encode import encode_trace_spans
    from inferprof.instrumentation.spans import SpanSpec, new_span_id, new_trace_id

    t0 = time.time_ns()
    base = {sc.ATTR_ENGINE_ID: "e1", sc.ATTR_STEPS_START_OFFSETS_S: [0.0, 0.011],
            sc.ATTR_STEPS_DURATIONS_S: [0.01, 0.009]}

    def export(**arrays):
        spec = SpanSpec(sc.ENGINE_STEPS_SPAN_NAME, new_span_id(), None, SpanKind.INTERNAL, t0,
                        t0 + 20_000_000, {**base, **arrays}, None, ())
        request = ExportTraceServiceRequest()
        ss = request.resource_spans.add().scope_spans.add()
        ss.spans.extend(ScopeSpans.FromString(encode_trace_spans(new_trace_id(), [spec])).spans)
        return request

    def steps(request, payload):
        collector = Engine(clock=FakeClock(time.time()), settle_s=1.0)
        result = collector.ingest_traces(
            request, payload=request.SerializeToString() if payload else None)
        (tl,) = collector._gen.steps.engines.values() or [None]
        rows = [r[2:4] for r in tl.pending] if tl is not None else None
        return result.rejected_spans, collector.stats.spans_dropped, rows

    for payload in (False, True):
        for decode in ([4, 2.0], [4.0, 200], [300, 2.0]):
            assert steps(export(**{sc.ATTR_STEPS_DECODE_TOKENS: decode,
                                   sc.ATTR_STEPS_PREFILL_TOKENS: [decode[1], decode[0]]}),
                         payload) == (0, {}, [(decode[1], decode[0]), (decode[0], decode[1])])
        for bad in ([4, True], [True, 4], [4, 2.5], [4.0, 2.5], [4, "2"], [4, math.inf]):
            assert steps(export(**{sc.ATTR_STEPS_DECODE_TOKENS: bad}), payload) == (
                1, {sc.DROP_INVALID_STEPS: 1}, None), bad


def test_a_compact_step_starting_in_the_rounding_slack_past_its_span_ends_no_earlier():
    # Within the 1 us of slack a step may start after its span's end: read as starting
    # and ending there, never as a step that ends before it starts.
    t0 = 10**18
    extra = {sc.ATTR_STEPS_START_OFFSETS_S: array("d", [0.0, 0.0200009]),
             sc.ATTR_STEPS_DURATIONS_S: array("d", [0.01, 0.0])}
    st, en, *_ = gs.compact_steps(extra, t0, t0 + 20_000_000)
    assert (en >= st).all() and en.max() == t0 + 20_000_000 and st.max() <= en.max()
