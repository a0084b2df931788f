"""The LLM demo engine through inferprof's step API, on an in-memory exporter."""

import numpy as np

from inferprof import semconv
from inferprof.demo.llm.engine import Engine
from inferprof.demo.llm.model import ModelConfig, TinyLM
from inferprof.demo.llm.scheduler import Scheduler
from inferprof.demo.llm.telemetry import StepTelemetry
from tests.instrumentation.helpers import captured, children_of

MODEL = TinyLM(ModelConfig(vocab_size=300, d_model=32, n_heads=2, n_layers=1, d_ff=64,
                           max_seq_len=512))


def _prompt(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(1, 300, n)]


def test_steps_evictions_and_tokens_reach_the_request_and_step_spans():
    with captured() as cap:
        engine = Engine(MODEL, Scheduler(num_blocks=16, block_size=4, max_batched_tokens=24),
                        lambda batch: None, instrument=StepTelemetry(model="m"))
        reqs = [engine.submit(_prompt(i, 9 + 4 * i), 16) for i in range(5)]
        cancelled = engine.submit(_prompt(9, 6), 40)
        for _ in range(3):
            engine.poll()
        engine.cancel(cancelled)
        for _ in range(2000):
            engine.poll()
            if engine.scheduler.idle:
                break
        assert engine.scheduler.idle and engine.counts.evictions > 0

    spans = cap.spans()
    steps = cap.by_name(semconv.ENGINE_STEP_SPAN_NAME)
    assert len(steps) == engine.counts.steps
    assert sum(s.attributes[semconv.ATTR_STEP_PREFILL_TOKENS] for s in steps) \
        == engine.counts.prefill_tokens
    assert sum(s.attributes[semconv.ATTR_STEP_DECODE_TOKENS] for s in steps) \
        == engine.counts.decode_tokens
    assert all(s.attributes[semconv.ATTR_STEP_PREFILL_TOKENS]
               + s.attributes[semconv.ATTR_STEP_DECODE_TOKENS] <= 24 for s in steps)
    assert all(0 <= s.attributes[semconv.ATTR_STEP_KV_CACHE_USAGE] <= 1 for s in steps)
    # The model pass is each step's compute stage.
    assert all([c.attributes[semconv.ATTR_STAGE] for c in children_of(spans, s)] == ["compute"]
               for s in steps)

    requests = cap.requests()
    assert len(requests) == len(reqs) + 1
    evicted = 0
    for req in [*reqs, cancelled]:
        span = next(r for r in requests if r.context.trace_id == req.telemetry.rec.trace_id)
        attrs = span.attributes
        stages = [s.attributes[semconv.ATTR_STAGE] for s in children_of(spans, span)]
        assert stages[0] == semconv.STAGE_QUEUE
        if req is cancelled:
            assert attrs[semconv.ATTR_CANCELLED] is True
            continue
        assert attrs[semconv.ATTR_TOKENS_PROMPT] == len(req.prompt)
        assert attrs[semconv.ATTR_TOKENS_OUTPUT] == 16 == len(req.output)
        assert len(attrs[semconv.ATTR_GEN_EMIT_OFFSETS_S]) == 16
        assert attrs.get(semconv.ATTR_GEN_PREEMPTIONS, 0) == req.preemptions
        prefills = [s for s in children_of(spans, span)
                    if s.attributes[semconv.ATTR_STAGE] == semconv.STAGE_PREFILL]
        assert len(prefills) == 1 + req.preemptions
        assert stages.count(semconv.STAGE_PREEMPTED) == req.preemptions
        if req.preemptions:
            evicted += 1
            assert all(p.attributes.get(semconv.ATTR_PREFILL_RECOMPUTE) for p in prefills[1:])
    assert evicted > 0
