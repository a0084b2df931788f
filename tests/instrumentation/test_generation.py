"""The step API for continuous-batching engines (``inferprof.Engine``): the spans and
attributes of contract §14, from the steps an engine loop reports."""

import contextvars
import logging
import os
import time

import numpy as np
import pytest
from opentelemetry.trace import StatusCode

import inferprof
from inferprof import semconv
from inferprof.instrumentation import engine as engine_module
from inferprof.instrumentation.generation import emission_attributes, merge_pairs
from inferprof.instrumentation.sampling import TimingBudget
from tests.instrumentation.helpers import captured, children_of
from tests.otlp_sink import attributes


def _request_of(cap, request_span):
    """{stage name: [its spans, by start]} of one request span."""
    out = {}
    for s in sorted(children_of(cap.spans(), request_span), key=lambda s: s.start_time):
        out.setdefault(s.attributes[semconv.ATTR_STAGE], []).append(s)
    return out


def _steps(cap):
    return sorted(cap.by_name(semconv.ENGINE_STEP_SPAN_NAME), key=lambda s: s.start_time)


def _step_rows(cap):
    """Every step sent, per-step or compact (§14), as (start ns, end ns, prefill tokens,
    decode tokens, members, KV usage or None), by start."""
    rows = []
    for s in _steps(cap):
        a = s.attributes
        rows.append((s.start_time, s.end_time, a[semconv.ATTR_STEP_PREFILL_TOKENS],
                     a[semconv.ATTR_STEP_DECODE_TOKENS], a[semconv.ATTR_STEP_REQUESTS],
                     a.get(semconv.ATTR_STEP_KV_CACHE_USAGE)))
    for s in cap.by_name(semconv.ENGINE_STEPS_SPAN_NAME):
        a = s.attributes
        kv = a.get(semconv.ATTR_STEPS_KV_CACHE_USAGE)
        for i, (off, dur) in enumerate(zip(a[semconv.ATTR_STEPS_START_OFFSETS_S],
                                           a[semconv.ATTR_STEPS_DURATIONS_S], strict=True)):
            start = s.start_time + round(off * 1e9)
            rows.append((start, start + round(dur * 1e9),
                         a[semconv.ATTR_STEPS_PREFILL_TOKENS][i],
                         a[semconv.ATTR_STEPS_DECODE_TOKENS][i],
                         a[semconv.ATTR_STEPS_REQUESTS][i],
                         kv[i] if kv is not None and 0 <= kv[i] <= 1 else None))
    return sorted(rows)


def _offsets_ns(request_span):
    return [
        round(x * 1e9) + request_span.start_time
        for x in request_span.attributes[semconv.ATTR_GEN_EMIT_OFFSETS_S]
    ]


def _no_overlap(stage_spans):
    spans = sorted(stage_spans, key=lambda s: s.start_time)
    for a, b in zip(spans, spans[1:]):
        assert a.end_time <= b.start_time, (a.name, b.name)


def test_a_request_gets_queue_prefill_decode_and_one_offset_per_token():
    with captured() as cap:
        engine = inferprof.Engine("e1")
        gen = engine.request(prompt_tokens=5)
        time.sleep(0.002)  # waits in the queue
        for n in range(4):  # the prompt in one step, then three decode tokens
            with engine.step(kv_cache_usage=0.25) as step:
                if n == 0:
                    step.prefill(gen, 5)
                else:
                    step.decode(gen)
                with inferprof.stage("compute"):
                    time.sleep(0.001)
        gen.finish()

    (request,) = cap.requests()
    steps = _steps(cap)
    assert len(steps) == 4
    attrs = request.attributes
    assert attrs[semconv.ATTR_ENGINE_ID] == "e1"
    assert attrs[semconv.ATTR_TOKENS_PROMPT] == 5
    assert attrs[semconv.ATTR_TOKENS_OUTPUT] == 4
    assert semconv.ATTR_GEN_EMIT_TOKENS not in attrs  # every emission carried one token
    assert semconv.ATTR_GEN_PREEMPTIONS not in attrs
    # each token left at the end of the step that made it (1 µs: the double's rounding)
    assert _offsets_ns(request) == pytest.approx([s.end_time for s in steps], abs=1000)
    stages = _request_of(cap, request)
    assert sorted(stages) == ["decode", "prefill", "queue"]
    (queue,), (prefill,), (decode,) = stages["queue"], stages["prefill"], stages["decode"]
    assert queue.start_time == request.start_time
    assert queue.end_time == prefill.start_time == steps[0].start_time  # admitted in step 1
    assert queue.end_time - queue.start_time >= 2_000_000
    assert prefill.end_time == steps[0].end_time == decode.start_time  # the first token
    assert decode.end_time == steps[-1].end_time  # the last token
    assert prefill.attributes[semconv.ATTR_PREFILL_TOKENS] == 5
    assert prefill.attributes[semconv.ATTR_PREFILL_CHUNKS] == 1
    assert semconv.ATTR_PREFILL_RECOMPUTE not in prefill.attributes
    _no_overlap([queue, prefill, decode])
    # the step spans: roots of their own traces, with their stages under them
    for step in steps:
        assert step.parent is None
        assert step.context.trace_id != request.context.trace_id
        (compute,) = children_of(cap.spans(), step)
        assert compute.attributes[semconv.ATTR_STAGE] == "compute"
        assert compute.attributes[semconv.ATTR_ENGINE_ID] == "e1"
        assert step.attributes[semconv.ATTR_STEP_KV_CACHE_USAGE] == 0.25
        assert step.attributes[semconv.ATTR_STEP_REQUESTS] == 1
    assert steps[0].attributes[semconv.ATTR_STEP_PREFILL_TOKENS] == 5
    assert steps[0].attributes[semconv.ATTR_STEP_DECODE_TOKENS] == 0
    assert steps[1].attributes[semconv.ATTR_STEP_PREFILL_TOKENS] == 0
    assert steps[1].attributes[semconv.ATTR_STEP_DECODE_TOKENS] == 1


def test_chunked_prefill_is_one_prefill_span_over_its_steps():
    with captured() as cap:
        engine = inferprof.Engine()
        long, short = engine.request(prompt_tokens=10), engine.request(prompt_tokens=2)
        with engine.step() as step:
            step.prefill(long, 4)
            step.prefill(short, 2)  # done in one chunk: its first token
        with engine.step() as step:
            step.prefill(long, 4)
            step.decode(short)
        with engine.step() as step:
            step.prefill(long, 2)  # the prompt's last chunk
            step.decode(short)
        with engine.step() as step:
            step.decode(long)
            step.decode(short)
        long.finish()
        short.finish()

    steps = _steps(cap)
    assert [s.attributes[semconv.ATTR_STEP_PREFILL_TOKENS] for s in steps] == [6, 4, 2, 0]
    assert [s.attributes[semconv.ATTR_STEP_DECODE_TOKENS] for s in steps] == [0, 1, 1, 2]
    assert [s.attributes[semconv.ATTR_STEP_REQUESTS] for s in steps] == [2, 2, 2, 2]
    by_prompt = {r.attributes[semconv.ATTR_TOKENS_PROMPT]: r for r in cap.requests()}
    stages = _request_of(cap, by_prompt[10])
    (prefill,) = stages["prefill"]
    assert prefill.attributes[semconv.ATTR_PREFILL_TOKENS] == 10
    assert prefill.attributes[semconv.ATTR_PREFILL_CHUNKS] == 3
    assert (prefill.start_time, prefill.end_time) == (steps[0].start_time, steps[2].end_time)
    assert by_prompt[10].attributes[semconv.ATTR_TOKENS_OUTPUT] == 2
    assert _offsets_ns(by_prompt[10]) == pytest.approx(
        [steps[2].end_time, steps[3].end_time], abs=1000)
    assert by_prompt[2].attributes[semconv.ATTR_TOKENS_OUTPUT] == 4


def test_eviction_then_recompute_gives_preempted_and_a_recompute_prefill():
    with captured() as cap:
        engine = inferprof.Engine()
        gen = engine.request(prompt_tokens=3)
        with engine.step() as step:
            step.prefill(gen, 3)
        with engine.step() as step:
            step.decode(gen)
        gen.preempt()  # KV cache full: evicted after 2 tokens
        time.sleep(0.002)
        with engine.step() as step:  # re-admitted: prompt + the 2 tokens recomputed
            step.prefill(gen, 5)
        with engine.step() as step:
            step.decode(gen)
        gen.finish()

    (request,) = cap.requests()
    steps = _steps(cap)
    assert request.attributes[semconv.ATTR_GEN_PREEMPTIONS] == 1
    assert request.attributes[semconv.ATTR_TOKENS_OUTPUT] == 4  # 2, then 1 + 1 after
    stages = _request_of(cap, request)
    assert [len(stages[k]) for k in ("queue", "prefill", "decode", "preempted")] == [1, 2, 2, 1]
    first, again = stages["prefill"]
    (preempted,) = stages["preempted"]
    assert semconv.ATTR_PREFILL_RECOMPUTE not in first.attributes
    assert again.attributes[semconv.ATTR_PREFILL_RECOMPUTE] is True
    assert again.attributes[semconv.ATTR_PREFILL_TOKENS] == 5
    assert stages["decode"][0].end_time == steps[1].end_time  # the run's last token
    assert stages["decode"][0].end_time <= preempted.start_time
    assert preempted.end_time == again.start_time == steps[2].start_time
    assert preempted.end_time - preempted.start_time >= 2_000_000
    assert again.end_time == steps[2].end_time == stages["decode"][1].start_time
    _no_overlap([s for group in stages.values() for s in group])
    assert _offsets_ns(request) == pytest.approx([s.end_time for s in steps], abs=1000)


def test_a_request_swapped_back_in_decodes_on_without_a_prefill():
    with captured() as cap:
        engine = inferprof.Engine()
        gen = engine.request(prompt_tokens=1)
        with engine.step() as step:
            step.prefill(gen, 1)
        gen.preempt()
        with engine.step() as step:
            step.decode(gen)
        gen.finish()
    (request,) = cap.requests()
    stages = _request_of(cap, request)
    # the first run was the prefill's token alone: no decode stage for it
    assert len(stages["prefill"]) == 1 and len(stages["decode"]) == 1
    (preempted,) = stages["preempted"]
    assert preempted.end_time == stages["decode"][0].start_time == _steps(cap)[1].start_time
    assert request.attributes[semconv.ATTR_TOKENS_OUTPUT] == 2


def test_prefill_ends_at_the_first_decode_when_the_prompt_length_is_unknown():
    with captured() as cap:
        engine = inferprof.Engine()
        gen = engine.request()
        for _ in range(2):
            with engine.step() as step:
                step.prefill(gen, 8)
        with engine.step() as step:
            step.decode(gen)
        gen.finish()
    (request,) = cap.requests()
    steps = _steps(cap)
    (prefill,) = _request_of(cap, request)["prefill"]
    assert prefill.end_time == steps[1].end_time
    assert prefill.attributes[semconv.ATTR_PREFILL_CHUNKS] == 2
    assert semconv.ATTR_TOKENS_PROMPT not in request.attributes
    # the last prefill step's token, then the decode step's
    assert _offsets_ns(request) == pytest.approx([steps[1].end_time, steps[2].end_time], abs=1000)


def test_cancellation_mid_stream_keeps_what_was_recorded():
    with captured() as cap:
        engine = inferprof.Engine()
        gen = engine.request(prompt_tokens=2)
        with engine.step() as step:
            step.prefill(gen, 2)
        for _ in range(2):
            with engine.step() as step:
                step.decode(gen)
        gen.cancel()  # the client went away
        gen.finish()  # the engine's own clean-up: no second end
        with engine.step() as step:
            step.decode(gen)  # a late step: records nothing into the request
    (request,) = cap.requests()
    assert request.attributes[semconv.ATTR_CANCELLED] is True
    assert request.attributes[semconv.ATTR_TOKENS_OUTPUT] == 3
    assert len(request.attributes[semconv.ATTR_GEN_EMIT_OFFSETS_S]) == 3
    stages = _request_of(cap, request)
    assert [len(stages[k]) for k in ("queue", "prefill", "decode")] == [1, 1, 1]
    assert stages["decode"][0].end_time == _steps(cap)[2].end_time
    assert request.status.status_code is StatusCode.UNSET


def test_a_request_cancelled_in_the_queue_has_only_its_queue_stage():
    with captured() as cap:
        gen = inferprof.Engine().request(prompt_tokens=4)
        gen.cancel()
    (request,) = cap.requests()
    assert list(_request_of(cap, request)) == ["queue"]
    assert request.attributes[semconv.ATTR_TOKENS_OUTPUT] == 0
    assert semconv.ATTR_GEN_EMIT_OFFSETS_S not in request.attributes


def test_k_token_chunks_and_manual_emissions():
    with captured() as cap:
        engine = inferprof.Engine()
        gen = engine.request(prompt_tokens=1)
        with engine.step() as step:
            step.prefill(gen, 1)
        with engine.step() as step:
            step.decode(gen, 4)  # speculative decoding: 4 tokens in one step
        with engine.step() as step:
            step.decode(gen, emit=False)  # held back (a stop string?), sent with the next
        with engine.step() as step:
            step.decode(gen, emit=False)
        gen.emit(2)
        gen.finish()
    (request,) = cap.requests()
    assert request.attributes[semconv.ATTR_GEN_EMIT_TOKENS] == [1, 4, 2]
    assert request.attributes[semconv.ATTR_TOKENS_OUTPUT] == 7
    offsets = _offsets_ns(request)
    assert offsets[2] > _steps(cap)[3].end_time  # emitted after the step, when emit() said


def test_an_emission_of_no_token_is_none():
    """An engine handing out what its detokeniser released each step calls ``emit(0)``
    when a stop string holds everything back: no emission (as a step's ``decode(gen, 0)``
    and the middleware's ``chunk_tokens(0)``). Recorded as one, its time was read as the
    first token's (the ttft) and as the end of an itl gap."""
    with captured() as cap:
        engine = inferprof.Engine()
        gen = engine.request(prompt_tokens=1)
        with engine.step() as step:
            step.prefill(gen, 1, emit=False)  # the first token held back
        gen.emit(0)
        with engine.step() as step:
            step.decode(gen, emit=False)
        gen.emit(0)
        time.sleep(0.002)
        gen.emit(2)  # both released
        gen.finish()
    (request,) = cap.requests()
    assert request.attributes[semconv.ATTR_TOKENS_OUTPUT] == 2
    assert request.attributes[semconv.ATTR_GEN_EMIT_TOKENS] == [2]
    (offset,) = _offsets_ns(request)
    assert offset > _steps(cap)[1].end_time + 1_000_000


def test_inside_a_request_the_generation_goes_into_that_request(caplog):
    with captured() as cap:
        engine = inferprof.Engine("7")
        with inferprof.request(model="m") as req:
            gen = engine.request(prompt_tokens=1)
            with caplog.at_level(logging.WARNING, logger="inferprof"):
                second = engine.request(prompt_tokens=1)
            with inferprof.stage("tokenize"):
                pass
            with engine.step() as step:
                step.prefill(gen, 1)
                step.prefill(second, 1)
            gen.finish()
            second.finish()
    assert not second.timed
    assert "twice in one request" in caplog.text
    assert req.generation is None  # no record <-> handle cycle left for the GC
    (request,) = cap.requests()
    assert request.context.span_id == req.span_id
    assert request.attributes[semconv.ATTR_MODEL_NAME] == "m"
    assert request.attributes[semconv.ATTR_ENGINE_ID] == "7"
    assert request.attributes[semconv.ATTR_TOKENS_OUTPUT] == 1
    assert sorted(_request_of(cap, request)) == ["prefill", "queue", "tokenize"]
    # the step's span is not in the request's trace (no copies, no links)
    assert _steps(cap)[0].context.trace_id != request.context.trace_id


def test_an_exception_in_a_step_is_recorded_on_its_span_and_re_raised():
    with captured() as cap:
        engine = inferprof.Engine()
        gen = engine.request(prompt_tokens=1)
        with pytest.raises(RuntimeError, match="oom"):
            with engine.step() as step:
                step.prefill(gen, 1)
                raise RuntimeError("oom")
        gen.finish()
    (step,) = _steps(cap)
    assert step.status.status_code is StatusCode.ERROR
    assert step.events[0].name == "exception"


def test_off_and_unconfigured_record_nothing():
    engine = inferprof.Engine()
    gen = engine.request(prompt_tokens=1)  # not configured
    assert not gen.timed
    with engine.step() as step:
        step.prefill(gen, 1)
    gen.finish()
    with captured(mode="off") as cap:
        gen = engine.request(prompt_tokens=1)
        assert not gen.timed
        with engine.step() as step:
            step.prefill(gen, 1)
            step.decode(gen)
        gen.cancel()
    assert cap.spans() == []


def _untimed_budget():
    """The active runtime's timing budget, past a second of a million requests a second
    (every key): the next requests are timed with probability 1e-9."""

    class Clock:
        now = 100.0

        def __call__(self):
            return self.now

    clock = Clock()
    rt = inferprof._config.active_runtime()
    rt.timing_budget = TimingBudget(0.001, clock=clock)
    for key in ((semconv.REQUEST_SPAN_NAME, None), (semconv.REQUEST_SPAN_NAME, "m")):
        for _ in range(1_000_000 // 1000):
            rt.timing_budget.share(key)
    clock.now += 1000.0


def test_production_records_nothing_of_an_untimed_request_and_skips_its_steps():
    with captured(mode="production", sample_rate=1.0) as cap:
        engine = inferprof.Engine()
        timed = engine.request(prompt_tokens=1)
        with engine.step() as step:
            step.prefill(timed, 1)
        timed.finish()
        kept = len(cap.spans())
        assert kept == 4  # the request, its queue and prefill, and the step
        _untimed_budget()
        gen = engine.request(prompt_tokens=1)
        with inferprof.request(model="m") as req:  # also inside an untimed request
            inner = engine.request(prompt_tokens=1)
        assert req is None
        assert not gen.timed and not inner.timed
        for _ in range(3):
            with engine.step() as step:
                step.decode(gen)
                step.decode(inner)
        gen.finish()
        inner.finish()
        assert len(cap.spans()) == kept  # no member timed: no step span


def test_production_keeps_a_step_with_a_timed_member_and_its_untimed_tokens():
    with captured(mode="production", sample_rate=1.0) as cap:
        engine = inferprof.Engine()
        timed = engine.request(prompt_tokens=1)
        _untimed_budget()
        untimed = engine.request(prompt_tokens=1)
        with engine.step() as step:
            step.prefill(timed, 1)
            step.prefill(untimed, 1)
        timed.finish()
        untimed.finish()
    (step,) = _step_rows(cap)
    assert step[4] == 2  # members
    assert step[2] == 2  # prefill tokens
    assert len(cap.requests()) == 1


def test_production_sends_its_steps_in_one_compact_span_full_mode_a_span_per_step():
    # The collector reads a step's times and counts only (§14): production mode sends
    # them as arrays in one span, without the steps' stages; full mode a span per step
    # with its stages (a trace viewer shows each step).
    rows = {}
    for mode in ("production", "full"):
        with captured(mode=mode, sample_rate=1.0) as cap:
            engine = inferprof.Engine("e1")
            gen = engine.request(prompt_tokens=3)
            for n in range(3):
                with engine.step(kv_cache_usage=0.25 if n != 1 else None) as step:
                    step.prefill(gen, 1)
                    with inferprof.stage("compute"):
                        time.sleep(0.001)
            gen.finish()
        rows[mode] = _step_rows(cap)
        assert [r[2:] for r in rows[mode]] == [(1, 0, 1, 0.25), (1, 0, 1, None),
                                              (1, 0, 1, 0.25)], mode
        if mode == "production":
            assert _steps(cap) == []
            (compact,) = cap.by_name(semconv.ENGINE_STEPS_SPAN_NAME)
            assert compact.parent is None and compact.attributes[semconv.ATTR_ENGINE_ID] == "e1"
            assert compact.start_time == rows[mode][0][0]
            assert compact.end_time == rows[mode][-1][1]
            # a step with no reading: an entry outside 0..1
            assert list(compact.attributes[semconv.ATTR_STEPS_KV_CACHE_USAGE]) == [
                0.25, -1.0, 0.25]
            assert children_of(cap.spans(), compact) == []
        else:
            for s in _steps(cap):
                below = {c.attributes[semconv.ATTR_STAGE] for c in children_of(cap.spans(), s)}
                assert below == {"compute"}
        # the request's own stages are there either way, on the steps' times
        (req,) = cap.requests()
        stages = _request_of(cap, req)
        assert set(stages) == {"queue", "prefill"}, mode
        # to the nanosecond: the compact span's offsets and durations read back exactly
        assert stages["prefill"][0].start_time == rows[mode][0][0]
        assert stages["prefill"][0].end_time == rows[mode][-1][1]


def _production_engine(cap, engine_id="e1"):
    engine = inferprof.Engine(engine_id)
    return engine, engine.request(prompt_tokens=1)


def _one_step(engine, gen, decode=True):
    with engine.step() as step:
        if decode:
            step.decode(gen)
        else:
            step.prefill(gen, 1)


def test_production_sends_the_steps_when_steps_per_span_are_held(monkeypatch):
    from inferprof.instrumentation import engine as engine_mod

    monkeypatch.setattr(engine_mod, "STEPS_PER_SPAN", 4)
    with captured(mode="production", sample_rate=1.0) as cap:
        engine, gen = _production_engine(cap)
        _one_step(engine, gen, decode=False)
        for _ in range(8):
            _one_step(engine, gen)
        # nine steps: two spans of four sent, one step held while the request runs
        sizes = [len(s.attributes[semconv.ATTR_STEPS_DURATIONS_S])
                 for s in cap.by_name(semconv.ENGINE_STEPS_SPAN_NAME)]
        assert sizes == [4, 4]
        gen.finish()  # the engine's last open request: the rest goes out
        sizes = [len(s.attributes[semconv.ATTR_STEPS_DURATIONS_S])
                 for s in cap.by_name(semconv.ENGINE_STEPS_SPAN_NAME)]
        assert sizes == [4, 4, 1]
        assert len(_step_rows(cap)) == 9


def test_production_sends_the_steps_once_the_oldest_waited_steps_max_wait(monkeypatch):
    from inferprof.instrumentation import engine as engine_mod

    monkeypatch.setattr(engine_mod, "_MAX_WAIT_NS", 20_000_000)
    with captured(mode="production", sample_rate=1.0) as cap:
        engine, gen = _production_engine(cap)
        _one_step(engine, gen, decode=False)
        _one_step(engine, gen)
        assert cap.by_name(semconv.ENGINE_STEPS_SPAN_NAME) == []
        time.sleep(0.03)
        _one_step(engine, gen)  # ends 30 ms after the first step began
        (compact,) = cap.by_name(semconv.ENGINE_STEPS_SPAN_NAME)
        assert len(compact.attributes[semconv.ATTR_STEPS_DURATIONS_S]) == 3
        gen.finish()


def test_production_sends_the_steps_before_a_kept_request_and_on_flush():
    with captured(mode="production", sample_rate=1.0) as cap:
        engine = inferprof.Engine("e1")
        other = engine.request(prompt_tokens=1)  # keeps the engine busy throughout
        with inferprof.request(model="m"):
            gen = engine.request(prompt_tokens=1)
            _one_step(engine, gen, decode=False)
            _one_step(engine, gen)
            gen.finish()
            assert cap.by_name(semconv.ENGINE_STEPS_SPAN_NAME) == []  # others still run
        # the request is kept: the steps its gaps are split by went out before its trace
        names = [s.name for s in cap.spans()]
        assert names.index(semconv.ENGINE_STEPS_SPAN_NAME) < names.index(
            semconv.REQUEST_SPAN_NAME)
        assert len(_step_rows(cap)) == 2
        _one_step(engine, other, decode=False)
        engine.flush()
        engine.flush()  # nothing left: no empty span
        assert len(cap.by_name(semconv.ENGINE_STEPS_SPAN_NAME)) == 2
        assert len(_step_rows(cap)) == 3
        other.finish()


def test_production_sends_a_step_at_once_when_a_members_request_ended_while_it_ran():
    # The request was kept (its trace sent) while the step ran: a chunk streamed from
    # inside the step. The step covers its last gap, so it goes out with the steps sent
    # before that trace, not up to STEPS_MAX_WAIT_S later, whatever else still runs.
    def run(cap):
        engine = inferprof.Engine("e1")
        other = engine.request(prompt_tokens=1)  # keeps the engine busy throughout
        with inferprof.request(model="m"):
            gen = engine.request(prompt_tokens=1)
            _one_step(engine, gen, decode=False)
            step = engine.step().__enter__()
            step.decode(gen)
            step.decode(other)
        assert len(_step_rows(cap)) == 1  # sent before the trace
        step.__exit__(None, None, None)
        assert len(_step_rows(cap)) == 2
        other.finish()

    with captured(mode="production", sample_rate=1.0) as cap:
        # a context of its own: the step outlives the request it was entered in
        contextvars.Context().run(run, cap)


def test_production_sends_at_once_the_steps_of_a_request_kept_before_it_ended():
    # The response ended (its trace kept and sent) while the engine still generates for
    # the request: each later step it is a member of goes out at once; once it has ended,
    # the steps of the others are held again.
    def run(cap):
        engine = inferprof.Engine("e1")
        other = engine.request(prompt_tokens=1)  # keeps the engine busy throughout
        with inferprof.request(model="m"):
            gen = engine.request(prompt_tokens=1)
            _one_step(engine, gen, decode=False)
        assert len(_step_rows(cap)) == 1  # sent before the trace
        for sent in (2, 3):
            with engine.step() as step:
                step.decode(gen)
                step.decode(other)
            assert len(_step_rows(cap)) == sent
        with engine.step() as step:  # a step without it: held
            step.decode(other)
        assert len(_step_rows(cap)) == 3
        gen.finish()
        with engine.step() as step:
            step.prefill(other, 1)
        assert len(_step_rows(cap)) == 3
        engine.flush()
        assert len(_step_rows(cap)) == 5
        other.finish()

    with captured(mode="production", sample_rate=1.0) as cap:
        contextvars.Context().run(run, cap)


def test_a_kept_request_that_ends_leaves_its_engine_checking_no_member():
    # (Engine._kept_live: the steps of an engine none of whose open requests was kept
    # look at no member's request)
    with captured(mode="production", sample_rate=1.0) as cap:
        engine = inferprof.Engine("e1")
        other = engine.request(prompt_tokens=1)
        with inferprof.request(model="m"):
            gen = engine.request(prompt_tokens=1)
            _one_step(engine, gen, decode=False)
        assert list(engine._kept_live) == [gen]
        gen.cancel()
        assert not engine._kept_live
        with inferprof.request(model="m"):
            done = engine.request(prompt_tokens=1)
            _one_step(engine, done, decode=False)
            done.finish()
        assert not engine._kept_live  # kept after it ended
        other.finish()
    assert len(cap.requests()) == 3  # all kept (sample_rate=1.0)


def test_an_engine_that_drops_kept_requests_remembers_a_bounded_number(monkeypatch):
    # An engine that never says finish() or cancel() for requests whose traces were kept
    # must not hold them all (Engine._kept_live): past the bound the oldest go, and the
    # steps of every kept one still go out at once.
    monkeypatch.setattr(engine_module, "KEPT_LIVE_MAX", 4)

    def run(cap):
        engine = inferprof.Engine("e1")
        other = engine.request(prompt_tokens=1)  # keeps the engine busy throughout
        dropped = []
        for _ in range(10):
            with inferprof.request(model="m"):
                gen = engine.request(prompt_tokens=1)
                _one_step(engine, gen, decode=False)
            dropped.append(gen)
            assert len(engine._kept_live) <= 4
        assert list(engine._kept_live) == dropped[-4:]
        sent = len(_step_rows(cap))
        with engine.step() as step:  # a member the engine remembers: at once
            step.decode(dropped[-1])
            step.decode(other)
        assert len(_step_rows(cap)) == sent + 1
        with engine.step() as step:  # one it forgot, while it remembers others: at once
            step.decode(dropped[0])
            step.decode(other)
        assert len(_step_rows(cap)) == sent + 2
        dropped[-1].finish()
        assert list(engine._kept_live) == dropped[-4:-1]
        for gen in dropped[:-1]:
            gen.finish()
        other.finish()
        assert not engine._kept_live

    with captured(mode="production", sample_rate=1.0) as cap:
        contextvars.Context().run(run, cap)


def test_production_sends_the_steps_still_held_at_shutdown():
    # A request still generating when the service stops: its engine's steps recorded so
    # far go out with the last spans, as a span per step would have.
    with captured(mode="production", sample_rate=1.0) as cap:
        engine, gen = _production_engine(cap)
        _one_step(engine, gen, decode=False)
        _one_step(engine, gen)
        assert cap.by_name(semconv.ENGINE_STEPS_SPAN_NAME) == []
        inferprof.shutdown()
        assert len(_step_rows(cap)) == 2


def test_a_forked_child_sends_its_own_steps_not_the_parents():
    # The steps the parent held at the fork are the parent's to send (as its span queue
    # is): a child sending them too would count them twice.
    with captured(mode="production", sample_rate=1.0) as cap:
        engine, gen = _production_engine(cap)
        _one_step(engine, gen, decode=False)
        _one_step(engine, gen)
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 if it sends its one step and no other
            ok = False
            try:
                mine = engine.request(prompt_tokens=1)
                _one_step(engine, mine, decode=False)
                mine.finish()
                engine.flush()
                ok = len(_step_rows(cap)) == 1
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        gen.finish()
        assert len(_step_rows(cap)) == 2


def test_production_sends_a_failed_step_as_a_span_of_its_own_with_its_error():
    with captured(mode="production", sample_rate=1.0) as cap:
        engine, gen = _production_engine(cap)
        _one_step(engine, gen, decode=False)
        with pytest.raises(RuntimeError), engine.step() as step:
            step.decode(gen)
            raise RuntimeError("device lost")
        gen.finish()
    (failed,) = _steps(cap)
    assert failed.status.status_code == StatusCode.ERROR
    assert failed.attributes[semconv.ATTR_STEP_DECODE_TOKENS] == 1
    assert len(_step_rows(cap)) == 2  # the first in a compact span


def test_a_production_step_in_an_engine_thread_sets_no_context_variable():
    # A set context variable slows every lookup of another that misses (numpy's, per
    # array): a production step of a thread running no event loop names itself in
    # records.QUIET instead, and its stages record nothing (production sends none of them).
    import asyncio
    import threading

    from inferprof.instrumentation.records import SCOPE

    seen = {}
    with captured(mode="production", sample_rate=1.0) as cap:
        engine, gen = _production_engine(cap)

        def engine_loop():
            with engine.step() as step:
                step.prefill(gen, 1)
                seen["scope"] = SCOPE in contextvars.copy_context()
                with inferprof.stage("compute"):
                    seen["inner"] = SCOPE in contextvars.copy_context()
            seen["after"] = len(contextvars.copy_context())

        thread = threading.Thread(target=engine_loop)
        thread.start()
        thread.join()

        async def async_engine_loop():
            # in a coroutine, other tasks run in this thread: the step holds the scope
            with engine.step() as step:
                step.decode(gen)
                seen["in_loop"] = SCOPE.get()[0] is step
            async with engine.step() as step:
                step.decode(gen)
                seen["async_with"] = SCOPE.get()[0] is step

        asyncio.run(async_engine_loop())
        gen.finish()
    assert seen == {"scope": False, "inner": False, "after": 0, "in_loop": True,
                    "async_with": True}
    stage_spans = [s for s in cap.spans() if semconv.ATTR_STAGE in (s.attributes or {})
                   and semconv.ATTR_ENGINE_ID not in s.attributes]
    assert {s.attributes[semconv.ATTR_STAGE] for s in stage_spans} <= {"queue", "prefill",
                                                                      "decode"}
    assert [row[2:5] for row in _step_rows(cap)] == [(1, 0, 1), (0, 1, 1), (0, 1, 1)]


def test_a_production_step_exited_in_another_thread_leaves_its_thread_recording():
    # A step entered in one thread and exited in another (its with-block's generator closed
    # elsewhere, a step handed to a completion thread): the entering thread's later stages
    # and steps are not taken for that ended step's.
    import threading

    from inferprof.instrumentation.records import SCOPE

    entered = threading.Event()
    exited = threading.Event()
    seen = {}
    with captured(mode="production", sample_rate=1.0) as cap:
        engine, gen = _production_engine(cap)
        steps = []

        def engine_loop():
            step = engine.step()
            step.__enter__()
            step.prefill(gen, 1)
            steps.append(step)
            entered.set()
            exited.wait(10)
            with inferprof.stage("after"):
                pass
            with engine.step() as step:
                step.decode(gen)
                seen["second_quiet"] = SCOPE.get() is None

        thread = threading.Thread(target=engine_loop)
        thread.start()
        assert entered.wait(10)
        steps[0].__exit__(None, None, None)
        exited.set()
        thread.join()
        gen.finish()
    assert seen == {"second_quiet": True}
    assert [s for s in cap.spans() if (s.attributes or {}).get(semconv.ATTR_STAGE) == "after"]
    assert [row[2:5] for row in _step_rows(cap)] == [(1, 0, 1), (0, 1, 1)]


def test_a_full_mode_step_in_an_engine_thread_holds_the_scope_and_its_stages():
    import threading

    from inferprof.instrumentation.records import SCOPE

    seen = {}
    with captured(mode="full") as cap:
        engine, gen = _production_engine(cap)

        def engine_loop():
            with engine.step() as step:
                step.prefill(gen, 1)
                seen["scope"] = SCOPE.get()[0] is step
                with inferprof.stage("compute"):
                    pass

        thread = threading.Thread(target=engine_loop)
        thread.start()
        thread.join()
        gen.finish()
    assert seen == {"scope": True}
    (step_span,) = _steps(cap)
    assert [s.attributes[semconv.ATTR_STAGE] for s in children_of(cap.spans(), step_span)] \
        == ["compute"]


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        inferprof.Engine("")
    for tokens in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError):
            inferprof.Engine().request(prompt_tokens=tokens)
    for usage in (1.5, -0.1, "0.5", True, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            inferprof.Engine().step(kv_cache_usage=usage)
    # (a plain float in range takes a shorter check than the others accepted)
    for usage in (0.0, 0.5, 1.0, 0, 1, np.float64(0.25)):
        inferprof.Engine().step(kv_cache_usage=usage)


def test_merging_keeps_the_first_time_the_span_and_the_tokens():
    times, tokens = list(range(10, 17)), [1, 2, 1, 1, 3, 1, 1]
    assert merge_pairs(times, tokens) == 3
    assert times == [10, 12, 14, 16]
    assert tokens == [1, 3, 4, 2]


def test_the_emission_list_is_capped_by_pairwise_merges():
    cap_n = semconv.GEN_MAX_EMIT_ENTRIES
    start = 1_000_000_000
    times = [start + 1000 * (i + 1) for i in range(cap_n + 100)]
    attrs = emission_attributes(start, times, None)
    offsets = attrs[semconv.ATTR_GEN_EMIT_OFFSETS_S]
    assert len(offsets) <= cap_n
    assert offsets[0] == pytest.approx(1e-6)  # the first token: exact
    assert offsets[-1] == pytest.approx((times[-1] - start) / 1e9)
    assert sum(attrs[semconv.ATTR_GEN_EMIT_TOKENS]) == len(times)
    assert attrs[semconv.ATTR_GEN_EMIT_MERGED] == (cap_n + 100 - 1) // 2


def test_a_runaway_stream_keeps_bounded_memory_and_every_token():
    with captured() as cap:
        gen = inferprof.Engine().request(prompt_tokens=1)
        with inferprof.Engine().step() as step:
            step.prefill(gen, 1)
        n = 3 * semconv.GEN_MAX_EMIT_ENTRIES
        for _ in range(n):
            gen.emit()
        assert len(gen.emits) < 2 * semconv.GEN_MAX_EMIT_ENTRIES
        gen.finish()
    (request,) = cap.requests()
    attrs = request.attributes
    assert len(attrs[semconv.ATTR_GEN_EMIT_OFFSETS_S]) <= semconv.GEN_MAX_EMIT_ENTRIES
    assert sum(attrs[semconv.ATTR_GEN_EMIT_TOKENS]) == n + 1 == attrs[semconv.ATTR_TOKENS_OUTPUT]
    assert attrs[semconv.ATTR_GEN_EMIT_MERGED] > 0


def test_the_encoding_reaches_an_otlp_receiver(otlp_sink):
    """With configure()'s own exporter the spans are encoded straight to OTLP bytes: the
    arrays and the step traces arrive as the collector reads them."""
    inferprof.configure(service_name="gen", endpoint=otlp_sink.endpoint, set_global=False)
    engine = inferprof.Engine("e9")
    gen = engine.request(prompt_tokens=2)
    with engine.step() as step:
        step.prefill(gen, 2)
        with inferprof.stage("compute"):
            pass
    with engine.step() as step:
        step.decode(gen, 3)
    gen.finish()
    inferprof.shutdown()
    assert otlp_sink.wait_for(lambda s: len(s.spans()) >= 7)
    spans = [s for _, s in otlp_sink.spans()]
    (request,) = [s for s in spans if s.name == semconv.REQUEST_SPAN_NAME]
    attrs = attributes(request)
    assert [v.int_value for v in attrs[semconv.ATTR_GEN_EMIT_TOKENS].values] == [1, 3]
    offsets = [v.double_value for v in attrs[semconv.ATTR_GEN_EMIT_OFFSETS_S].values]
    assert len(offsets) == 2 and 0 < offsets[0] < offsets[1]
    assert attrs[semconv.ATTR_TOKENS_OUTPUT] == 4
    steps = [s for s in spans if s.name == semconv.ENGINE_STEP_SPAN_NAME]
    assert len(steps) == 2 and all(not s.parent_span_id for s in steps)
    assert {attributes(s)[semconv.ATTR_ENGINE_ID] for s in steps} == {"e9"}
    (compute,) = [s for s in spans if s.name == "inferprof.compute"]
    assert compute.parent_span_id in {s.span_id for s in steps}


def test_numpy_token_counts_reach_an_otlp_receiver_as_ints(otlp_sink):
    """Engines count tokens with numpy: a numpy int passed as a member's or an emission's
    tokens is read as the int it is. Kept as such, it made the request's trace and the
    engine's compact step span fail to encode (both lost, the steps 256 at a time)."""
    np = pytest.importorskip("numpy")
    inferprof.configure(service_name="gen", endpoint=otlp_sink.endpoint, set_global=False,
                        mode="production", sample_rate=1.0)
    engine = inferprof.Engine("e9")
    gen = engine.request(prompt_tokens=np.int64(2))
    with engine.step() as step:
        step.prefill(gen, np.int64(2))
    with engine.step() as step:
        step.decode(gen, np.int64(3))
    with engine.step() as step:
        step.decode(gen, np.int32(1), emit=False)
    gen.emit(np.int64(1))
    gen.finish()
    inferprof.shutdown()
    assert otlp_sink.wait_for(lambda s: {sp.name for _, sp in s.spans()} >= {
        semconv.REQUEST_SPAN_NAME, semconv.ENGINE_STEPS_SPAN_NAME})
    spans = [s for _, s in otlp_sink.spans()]
    (request,) = [s for s in spans if s.name == semconv.REQUEST_SPAN_NAME]
    attrs = attributes(request)
    assert attrs[semconv.ATTR_TOKENS_OUTPUT] == 5 and attrs[semconv.ATTR_TOKENS_PROMPT] == 2
    assert [v.int_value for v in attrs[semconv.ATTR_GEN_EMIT_TOKENS].values] == [1, 3, 1]
    (steps,) = [s for s in spans if s.name == semconv.ENGINE_STEPS_SPAN_NAME]
    steps_attrs = attributes(steps)
    assert [(v.WhichOneof("value"), v.int_value)
            for v in steps_attrs[semconv.ATTR_STEPS_PREFILL_TOKENS].values] == [
        ("int_value", 2), ("int_value", 0), ("int_value", 0)]
    assert [v.int_value for v in steps_attrs[semconv.ATTR_STEPS_DECODE_TOKENS].values] == [
        0, 3, 1]


def test_a_token_count_that_is_not_a_non_negative_int_raises():
    """As ``prompt_tokens``: a negative, fractional or bool count is a caller's error. Taken
    as given, one such step made the collector reject its whole compact span (up to 256
    steps, ``invalid_steps``), or read the other steps' counts as 0 (an array of mixed
    types)."""
    with captured(mode="production", sample_rate=1.0):
        engine = inferprof.Engine("e1")
        gen = engine.request(prompt_tokens=4)
        for bad in (-1, 1.5, True, "2", None):
            with engine.step() as step:
                with pytest.raises(ValueError):
                    step.prefill(gen, bad)
                with pytest.raises(ValueError):
                    step.decode(gen, bad)
            with pytest.raises(ValueError):
                gen.emit(bad)
        with engine.step() as step:
            step.prefill(gen, 4)
        with engine.step() as step:
            step.decode(gen, 0)
        assert gen.output == 1 and gen.prefilled == 4
        gen.finish()


def test_steps_and_requests_built_on_the_export_thread():
    """configure()'s own batch processor with a plain SDK exporter: the traces are queued
    as one entry each and built on its thread, a failed step's error frozen first."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    inferprof.configure(span_exporter=exporter, set_global=False, metric_readers=[])
    engine = inferprof.Engine()
    gen = engine.request(prompt_tokens=1)
    with pytest.raises(RuntimeError):
        with engine.step() as step:
            step.prefill(gen, 1)
            with inferprof.stage("compute"):
                raise RuntimeError("device lost")
    with engine.step() as step:
        step.decode(gen, 2)
    gen.finish()
    inferprof.shutdown()
    spans = exporter.get_finished_spans()
    steps = sorted((s for s in spans if s.name == semconv.ENGINE_STEP_SPAN_NAME),
                   key=lambda s: s.start_time)
    assert [s.status.status_code for s in steps] == [StatusCode.ERROR, StatusCode.UNSET]
    (compute,) = [s for s in spans if s.name == "inferprof.compute"]
    assert compute.status.status_code is StatusCode.ERROR
    assert compute.parent.span_id == steps[0].context.span_id
    (request,) = [s for s in spans if s.name == semconv.REQUEST_SPAN_NAME]
    assert list(request.attributes[semconv.ATTR_GEN_EMIT_TOKENS]) == [1, 2]


def _gauge_points(cap, name):
    out = {}
    data = cap.metric_reader.get_metrics_data()
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == name:
                    for point in metric.data.data_points:
                        out[point.attributes[semconv.ATTR_ENGINE_ID]] = point.value
    return out


def test_the_kv_cache_gauge_reads_each_engine_at_collection(caplog):
    usage = {"a": 0.25}

    def broken():
        raise RuntimeError("no allocator yet")

    with captured() as cap:
        a = inferprof.Engine("a", kv_cache_usage=lambda: usage["a"])
        b = inferprof.Engine("b", kv_cache_usage=broken)
        c = inferprof.Engine("c", kv_cache_usage=lambda: 7.0)  # out of range: no reading
        for engine in (a, b, c, a):
            with engine.step():
                pass
        with caplog.at_level(logging.ERROR, logger="inferprof"):
            assert _gauge_points(cap, semconv.METRIC_ENGINE_KV_CACHE_USAGE) == {"a": 0.25}
        usage["a"] = 0.9
        assert _gauge_points(cap, semconv.METRIC_ENGINE_KV_CACHE_USAGE) == {"a": 0.9}
    assert "kv_cache_usage callable failed" in caplog.text
    with pytest.raises(ValueError):
        inferprof.Engine("d", kv_cache_usage=0.5)


def test_a_prefill_member_cancelled_while_its_step_runs_stays_cancelled():
    # The client goes away (the event loop calls cancel()) while the engine thread runs the
    # step completing the prompt: the step's end must not revive the request (no token
    # after the cancel, no decode state), and the engine's later finish() must not clear
    # the cancellation the request span reports.
    with captured() as cap:
        engine = inferprof.Engine()
        with inferprof.request(model="m"):
            gen = engine.request(prompt_tokens=3)
            with engine.step() as step:
                step.prefill(gen, 3)
                gen.cancel()
            gen.finish()
    (request,) = cap.requests()
    assert request.attributes[semconv.ATTR_CANCELLED] is True
    assert request.attributes[semconv.ATTR_TOKENS_OUTPUT] == 0
    assert semconv.ATTR_GEN_EMIT_OFFSETS_S not in request.attributes
    assert sorted(_request_of(cap, request)) == ["prefill", "queue"]


@pytest.mark.parametrize("mode", ["full", "production"])
def test_usual_decode_members_and_others_count_alike_in_any_mix(mode):
    # decode(gen) of a decoding request (the usual member) is counted at the step's end,
    # other members at once: a step's counts and each request's tokens come out the same
    # whatever the mix, a member cancelled while the step runs gets no token, and a failed
    # step's span counts its members.
    with captured(mode=mode, sample_rate=1.0) as cap:
        engine = inferprof.Engine()
        a, b, c = (engine.request(prompt_tokens=p) for p in (1, 2, 3))
        with engine.step() as step:
            for gen, p in ((a, 1), (b, 2), (c, 3)):
                step.prefill(gen, p)
        with engine.step() as step:  # a mix: usual, speculative, held back
            step.decode(a)
            step.decode(b, 2)
            step.decode(c, emit=False)
        with engine.step() as step:  # usual members only
            step.decode(a)
            step.decode(b)
            step.decode(c, 1)
        with engine.step() as step:
            step.decode(a)
            step.decode(b)
            a.cancel()  # while the step runs: no token for it
        with pytest.raises(RuntimeError, match="oom"), engine.step() as step:
            step.decode(b)
            step.decode(c)
            raise RuntimeError("oom")
        for gen in (b, c):
            gen.finish()
        if mode == "production":
            engine.flush()
    rows = _step_rows(cap)
    assert [row[2:5] for row in rows] == [(6, 0, 3), (0, 4, 3), (0, 3, 3), (0, 2, 2),
                                          (0, 2, 2)]
    (failed,) = [s for s in _steps(cap) if s.status.status_code is StatusCode.ERROR]
    assert failed.attributes[semconv.ATTR_STEP_DECODE_TOKENS] == 2
    requests = {r.attributes[semconv.ATTR_TOKENS_PROMPT]: r.attributes for r in cap.requests()}
    assert requests[1][semconv.ATTR_TOKENS_OUTPUT] == 3  # prefill, 2 steps (not the 4th)
    assert requests[1][semconv.ATTR_CANCELLED] is True
    assert requests[2][semconv.ATTR_TOKENS_OUTPUT] == 5
    assert list(requests[2][semconv.ATTR_GEN_EMIT_TOKENS]) == [1, 2, 1, 1]
    assert requests[3][semconv.ATTR_TOKENS_OUTPUT] == 2  # its held-back token not emitted
    assert len(requests[3][semconv.ATTR_GEN_EMIT_OFFSETS_S]) == 2


def test_a_failed_step_emits_no_tokens_for_its_members():
    # A step whose model pass raised produced nothing: its decode member gets no token at
    # its end and its prefill member does not complete its prompt.
    with captured() as cap:
        engine = inferprof.Engine()
        a = engine.request(prompt_tokens=1)
        b = engine.request(prompt_tokens=4)
        with engine.step() as step:
            step.prefill(a, 1)
        with pytest.raises(RuntimeError, match="oom"), engine.step() as step:
            step.decode(a)
            step.prefill(b, 4)
            raise RuntimeError("oom")
        a.finish()
        b.finish()
    requests = {r.attributes[semconv.ATTR_TOKENS_PROMPT]: r for r in cap.requests()}
    assert requests[1].attributes[semconv.ATTR_TOKENS_OUTPUT] == 1  # the prefill's only
    assert len(requests[1].attributes[semconv.ATTR_GEN_EMIT_OFFSETS_S]) == 1
    assert "decode" not in _request_of(cap, requests[1])
    assert requests[4].attributes[semconv.ATTR_TOKENS_OUTPUT] == 0
    assert semconv.ATTR_GEN_EMIT_OFFSETS_S not in requests[4].attributes


def test_a_request_production_mode_does_not_keep_lets_go_of_its_handle():
    # record -> handle -> record is a cycle only the GC would find; a kept request breaks
    # it when its attributes are made, one production mode discards when it ends.
    # (Every request timed: the budget's cap would leave a tight loop's requests untimed.)
    with captured(mode="production", max_timed_rate=0) as cap:
        engine = inferprof.Engine()
        records = []
        for _ in range(2000):
            with inferprof.request(model="m") as req:
                gen = engine.request(prompt_tokens=1)
                with engine.step() as step:
                    step.prefill(gen, 1)
                gen.finish()
            records.append(req)
        timed = [r for r in records if hasattr(r, "generation")]
        assert len(timed) > len(cap.requests())  # some timed requests were not kept
        assert [r for r in timed if r.generation is not None] == []


def test_a_first_token_the_engine_emitted_itself_counts_once_when_the_prompt_length_is_unknown():
    # prefill(emit=False) and no prompt_tokens: the prefill's end is learnt at the first
    # decode; the first token was handed out by gen.emit() meanwhile, and counts once.
    with captured() as cap:
        engine = inferprof.Engine()
        gen = engine.request()
        with engine.step() as step:
            step.prefill(gen, 4, emit=False)
        gen.emit()  # the first token, handed out by the engine itself
        with engine.step() as step:
            step.decode(gen)
        gen.finish()
    (request,) = cap.requests()
    assert request.attributes[semconv.ATTR_TOKENS_OUTPUT] == 2
    offsets = request.attributes[semconv.ATTR_GEN_EMIT_OFFSETS_S]
    assert len(offsets) == 2 and list(offsets) == sorted(offsets)
    (prefill,) = _request_of(cap, request)["prefill"]
    assert prefill.end_time == _steps(cap)[0].end_time


def test_a_usual_member_that_changes_while_its_step_runs_is_recorded_as_it_now_is():
    # Step.decode() takes a member decoding on (Generation.usual) for the inline path; one
    # evicted, cancelled or given a multi-token emission before the step ends is recorded
    # by the general path, as any other member.
    def kept_request(change):
        with captured(mode="full") as cap:
            engine = inferprof.Engine("e1")
            gen = engine.request(prompt_tokens=1)
            _one_step(engine, gen, decode=False)  # its prefill and first token
            _one_step(engine, gen)  # opens its decode stage: usual from now on
            assert gen.usual
            with engine.step() as step:
                step.decode(gen)
                change(gen)
            _one_step(engine, gen)  # after an eviction: resumes (swapped in)
            gen.finish()
        (req,) = cap.requests()
        return gen, req.attributes, sorted(s.attributes[semconv.ATTR_STAGE] for s in
                                         children_of(cap.spans(), req))

    gen, attrs, stages = kept_request(lambda g: g.preempt())
    assert attrs[semconv.ATTR_TOKENS_OUTPUT] == 4  # the evicted step's token counts
    assert attrs[semconv.ATTR_GEN_PREEMPTIONS] == 1
    assert stages == ["decode", "decode", "preempted", "prefill", "queue"]
    gen, attrs, _ = kept_request(lambda g: g.emit(2))
    assert attrs[semconv.ATTR_TOKENS_OUTPUT] == 6
    assert list(attrs[semconv.ATTR_GEN_EMIT_TOKENS]) == [1, 1, 2, 1, 1]
    gen, attrs, stages = kept_request(lambda g: g.cancel())
    assert attrs[semconv.ATTR_TOKENS_OUTPUT] == 2  # the cancelled step's token is not
    assert attrs[semconv.ATTR_CANCELLED] is True
