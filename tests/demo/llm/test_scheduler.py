"""The continuous-batching scheduler and engine, driven step by step without the thread."""

import numpy as np
import pytest

from inferprof.demo.llm.engine import FINISH_LENGTH, Engine
from inferprof.demo.llm.instrument import EngineInstrument
from inferprof.demo.llm.model import ModelConfig, TinyLM
from inferprof.demo.llm.request import CANCELLED, FINISHED
from inferprof.demo.llm.scheduler import Scheduler

CONFIG = ModelConfig(vocab_size=300, d_model=32, n_heads=2, n_layers=1, d_ff=64,
                     max_seq_len=512)
MODEL = TinyLM(CONFIG)


class Recorder(EngineInstrument):
    """Every call the engine makes, in order: what a telemetry implementation would see."""

    def __init__(self):
        self.events = []
        self.steps = []

    def admit(self, request):
        self.events.append(("admit", request.id))

    def evict(self, request):
        self.events.append(("evict", request.id))

    def resume(self, request):
        self.events.append(("resume", request.id))

    def step_begin(self, items, kv_usage):
        return kv_usage

    def step_end(self, token, items, error=None):
        self.steps.append([(it.request.id, it.count, it.prefill) for it in items])

    def finish(self, request):
        self.events.append(("finish", request.id))

    def cancel(self, request):
        self.events.append(("cancel", request.id))


def _engine(num_blocks=64, block_size=4, budget=16, max_running=8):
    got = {}
    rec = Recorder()

    def deliver(batch):
        for d in batch:
            got.setdefault(d.request.id, []).extend(d.tokens)
            if d.finish_reason:
                got.setdefault(("end", d.request.id), d.finish_reason)

    sched = Scheduler(num_blocks=num_blocks, block_size=block_size, max_batched_tokens=budget,
                      max_running=max_running, watermark=0.0)
    return Engine(MODEL, sched, deliver, instrument=rec), got, rec


def _prompt(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(1, CONFIG.vocab_size, n)]


def _run(engine, limit=10_000):
    for _ in range(limit):
        engine.poll()
        if engine.scheduler.idle:
            return
        _check_blocks(engine.scheduler)
    raise AssertionError("the engine did not finish")


def _check_blocks(sched):
    """No leak, no overcommit: running requests hold exactly the used blocks, each enough
    for what it has computed, and nobody else holds any."""
    held = [b for r in sched.running for b in r.blocks]
    assert len(held) == len(set(held)) == sched.allocator.used <= sched.allocator.num_blocks
    for r in sched.running:
        assert len(r.blocks) * sched.block_size >= r.computed
    assert all(not r.blocks for r in sched.waiting)


def test_chunked_prefill_respects_the_budget_and_interleaves_with_decode():
    engine, got, rec = _engine(budget=16)
    first = engine.submit(_prompt(0, 5), 12)
    engine.poll()  # first's prompt in one step
    engine.poll()  # it decodes...
    long = engine.submit(_prompt(1, 50), 3)  # ...when a 50-token prompt arrives
    _run(engine)
    assert all(sum(n for _, n, _ in step) <= 16 for step in rec.steps)
    chunks = [n for step in rec.steps for rid, n, pre in step if rid == long.id and pre]
    assert sum(chunks) == 50 and len(chunks) >= 4 and max(chunks) <= 15
    # Its chunks shared steps with the other request's decode tokens.
    mixed = [s for s in rec.steps
             if (long.id, 15, True) in s and any(rid == first.id and not pre for rid, _, pre in s)]
    assert mixed
    assert len(got[first.id]) == 12 and len(got[long.id]) == 3
    assert got[("end", first.id)] == got[("end", long.id)] == FINISH_LENGTH
    assert engine.scheduler.allocator.used == 0


def test_an_evicted_request_recomputes_and_produces_the_same_tokens():
    prompts = [_prompt(i, 10 + 3 * i) for i in range(6)]
    # Alone, with plenty of cache: the truth for each request.
    truth = {}
    for i, p in enumerate(prompts):
        engine, got, _ = _engine(num_blocks=64)
        req = engine.submit(p, 20)
        _run(engine)
        truth[i] = got[req.id]
    # Together, in a cache too small for all of them: evictions.
    engine, got, rec = _engine(num_blocks=24, block_size=4, budget=32)
    reqs = [engine.submit(p, 20) for p in prompts]
    _run(engine)
    evicted = {rid for kind, rid in rec.events if kind == "evict"}
    assert evicted and engine.scheduler.evictions >= len(evicted)
    for i, req in enumerate(reqs):
        assert req.status == FINISHED
        assert got[req.id] == truth[i], f"request {i} (evicted: {req.id in evicted})"
    for rid in evicted:  # each eviction was followed by a resumption with a recompute
        kinds = [k for k, r in rec.events if r == rid]
        assert kinds.count("resume") == kinds.count("evict")
        recompute = [n for step in rec.steps for r, n, pre in step if r == rid and pre]
        assert sum(recompute) > len(prompts[[r.id for r in reqs].index(rid)])
    assert engine.scheduler.allocator.used == 0


def test_the_newest_running_request_is_the_one_evicted():
    engine, _, rec = _engine(num_blocks=12, block_size=4, budget=64)
    reqs = [engine.submit(_prompt(i, 12), 30) for i in range(3)]
    _run(engine)
    first_eviction = next(rid for kind, rid in rec.events if kind == "evict")
    assert first_eviction == reqs[-1].id


def test_cancellation_frees_blocks_running_or_waiting():
    engine, got, rec = _engine(num_blocks=16, block_size=4, budget=64, max_running=1)
    running = engine.submit(_prompt(0, 20), 40)
    waiting = engine.submit(_prompt(1, 20), 40)
    for _ in range(3):
        engine.poll()
    assert engine.scheduler.allocator.used > 0 and waiting.status == "waiting"
    engine.cancel(running)
    engine.cancel(waiting)
    engine.poll()
    assert running.status == waiting.status == CANCELLED
    assert engine.scheduler.allocator.used == 0 and engine.scheduler.idle
    assert ("cancel", running.id) in rec.events and ("cancel", waiting.id) in rec.events
    assert len(got[running.id]) < 40
    # Cancelling a finished request is a no-op.
    done = engine.submit(_prompt(2, 5), 2)
    _run(engine)
    engine.cancel(done)
    engine.poll()
    assert done.status == FINISHED


def test_requests_that_can_never_fit_are_refused_at_submission():
    engine, _, _ = _engine(num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="KV-cache blocks"):
        engine.submit(_prompt(0, 30), 10)
    with pytest.raises(ValueError, match="positions"):
        engine.submit(_prompt(0, 10), 600)
    with pytest.raises(ValueError, match="at least one token"):
        engine.submit([], 10)


def test_the_engine_thread_serves_and_stops():
    import threading

    done = threading.Event()
    got = []

    def deliver(batch):
        got.extend(batch)
        if any(d.finish_reason for d in batch):
            done.set()

    engine = Engine(MODEL, Scheduler(num_blocks=16, block_size=4), deliver).start()
    try:
        engine.submit(_prompt(0, 6), 5)
        assert done.wait(10)
    finally:
        engine.stop()
    assert sum(len(d.tokens) for d in got) == 5 and got[-1].finish_reason == FINISH_LENGTH


def test_a_request_that_evicts_itself_holds_no_block_while_it_waits():
    # The newest running request cannot get its next block: it is the one evicted, and
    # it must not take a block again for the step it left (a waiting request holds none).
    from inferprof.demo.llm.request import GenRequest

    sched = Scheduler(num_blocks=5, block_size=1, watermark=0.0)
    older, newest = GenRequest([1, 2, 3], 2), GenRequest([4], 2)
    sched.add(older)
    sched.add(newest)
    for _ in range(2):
        items = sched.schedule()
        sched.advance(items, {it.request.id: 7 for it in items if it.samples})
        _check_blocks(sched)
    assert newest.preemptions == 1 and newest in sched.waiting
    while not sched.idle:  # and both still finish
        items = sched.schedule()
        sched.advance(items, {it.request.id: 7 for it in items if it.samples})
        _check_blocks(sched)
    assert older.status == newest.status == FINISHED and sched.allocator.used == 0


def test_requests_failed_by_the_engine_end_as_finished_not_cancelled():
    # A failed step fails the requests in flight: their telemetry ends them (finish()), it
    # does not report them cancelled, which says the client went away.
    import threading

    from inferprof.demo.llm.engine import FINISH_ERROR

    class Broken(TinyLM):
        def step(self, *args, **kwargs):
            raise RuntimeError("device lost")

    ended = threading.Event()
    got = {}

    def deliver(batch):
        for d in batch:
            got[d.request.id] = d.finish_reason
        ended.set()

    rec = Recorder()
    sched = Scheduler(num_blocks=16, block_size=4, watermark=0.0)
    engine = Engine(Broken(CONFIG), sched, deliver, instrument=rec).start()
    try:
        req = engine.submit(_prompt(0, 5), 4)
        assert ended.wait(10)
    finally:
        engine.stop()
    assert got[req.id] == FINISH_ERROR
    assert ("finish", req.id) in rec.events and ("cancel", req.id) not in rec.events
    assert sched.allocator.used == 0 and req.status == CANCELLED
