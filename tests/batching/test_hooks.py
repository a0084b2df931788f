import asyncio
import threading

import pytest

import inferprof
from inferprof import semconv
from inferprof.batching.hooks import QueueHandle
from tests.instrumentation.helpers import children_of


async def _custom_batcher_requests(n, queue):
    """A user's own batching loop: requests enqueue (item, handle) and wait on a future."""
    loop = asyncio.get_running_loop()

    async def one(i):
        async with inferprof.request(model="custom", i=i):
            handle = inferprof.enqueue(depth=queue.qsize())
            fut = loop.create_future()
            await queue.put((i, handle, fut))
            return await fut

    return [asyncio.create_task(one(i)) for i in range(n)]


async def test_hooks_produce_queue_and_batch_stages(cap):
    queue = asyncio.Queue()
    tasks = await _custom_batcher_requests(3, queue)
    await asyncio.sleep(0.01)
    entries = [queue.get_nowait() for _ in range(3)]

    def run_in_thread():
        # Triton-python-backend style: the batch is processed on another thread
        with inferprof.batch([h for _, h, _ in entries], max_size=8) as b:
            with b.stage("batch_assembly"):
                b.set_tokens(effective=10, padded=12)
            with inferprof.stage("compute"):
                pass
        return b.id

    batch_id = await asyncio.to_thread(run_in_thread)
    for i, _, fut in entries:
        fut.set_result(i)
    assert await asyncio.gather(*tasks) == [0, 1, 2]

    spans = cap.spans()
    assert len(cap.requests()) == 3
    for r in cap.requests():
        kids = {k.attributes[semconv.ATTR_STAGE]: k for k in children_of(spans, r)}
        assert set(kids) == {"queue", "batch_assembly", "compute"}
        assert kids["compute"].attributes[semconv.ATTR_BATCH_ID] == batch_id
        assert kids["compute"].attributes[semconv.ATTR_BATCH_MAX_SIZE] == 8
        assert kids["compute"].attributes[semconv.ATTR_MODEL_NAME] == "custom"
        assert kids["batch_assembly"].attributes[semconv.ATTR_TOKENS_PADDED] == 12
        assert kids["queue"].end_time <= kids["batch_assembly"].start_time


async def test_batch_stage_bound_with_b_stage_works_from_any_context(cap):
    queue = asyncio.Queue()
    tasks = await _custom_batcher_requests(2, queue)
    await asyncio.sleep(0.01)
    entries = [queue.get_nowait() for _ in range(2)]
    with inferprof.batch([h for _, h, _ in entries]) as b:
        stage = b.stage("compute", device="cpu")
        t = threading.Thread(target=lambda: stage.__enter__() and stage.__exit__(None, None, None))
        t.start()
        t.join()
    for i, _, fut in entries:
        fut.set_result(i)
    await asyncio.gather(*tasks)
    assert len(cap.stages("compute")) == 2


def test_enqueue_outside_a_request_records_nothing(cap):
    h = inferprof.enqueue(depth=3)
    assert isinstance(h, QueueHandle) and h.request is None
    with inferprof.batch([h], max_size=2) as b:
        with inferprof.stage("compute"):
            pass
        assert b.size == 1
    assert cap.spans() == []


def test_hooks_bad_arguments():
    with pytest.raises(ValueError):
        inferprof.enqueue(depth=-1)
    with pytest.raises(ValueError):
        inferprof.batch(["not a handle"])
    with pytest.raises(ValueError):
        inferprof.batch([], max_size=0)
    with pytest.raises(ValueError):
        inferprof.batch([]).set_tokens(effective=5, padded=3)


async def test_exception_escaping_the_batch_is_recorded_on_members(cap):
    queue = asyncio.Queue()
    tasks = await _custom_batcher_requests(2, queue)
    await asyncio.sleep(0.01)
    entries = [queue.get_nowait() for _ in range(2)]
    with pytest.raises(ValueError):
        with inferprof.batch([h for _, h, _ in entries]):
            raise ValueError("bad batch")
    for i, _, fut in entries:
        fut.set_result(i)  # the handlers themselves return normally (e.g. a fallback answer)
    await asyncio.gather(*tasks)
    requests = cap.requests()
    assert len(requests) == 2
    assert all(r.status.description.startswith("ValueError") for r in requests)


@pytest.mark.parametrize("encoding", ["children", "links"])
async def test_nested_batch_stages_keep_their_parents_in_both_encodings(cap, encoding):
    queue = asyncio.Queue()
    tasks = await _custom_batcher_requests(2, queue)
    await asyncio.sleep(0.01)
    entries = [queue.get_nowait() for _ in range(2)]
    with inferprof.batch([h for _, h, _ in entries], batch_encoding=encoding):
        with inferprof.stage("compute"):
            with inferprof.stage("d2h"):
                pass
    for i, _, fut in entries:
        fut.set_result(i)
    await asyncio.gather(*tasks)

    computes, copies = cap.stages("compute"), cap.stages("d2h")
    by_id = {s.context.span_id: s for s in computes}
    if encoding == "children":
        # one copy per member, each nested under that member's own copy of `compute`
        assert len(computes) == len(copies) == 2
        for inner in copies:
            outer = by_id[inner.parent.span_id]
            assert outer.context.trace_id == inner.context.trace_id
            assert outer.parent.span_id in {r.context.span_id for r in cap.requests()}
    else:
        # one span each in the batch's trace; every request links back to the outer one
        assert len(computes) == len(copies) == 1
        assert copies[0].parent.span_id == computes[0].context.span_id
        assert computes[0].parent is None
        for r in cap.requests():
            assert [link.context.span_id for link in r.links] == [computes[0].context.span_id]


def test_stages_of_a_discarded_request_draw_no_span_id():
    from tests.instrumentation.helpers import captured

    with captured(mode="production", sample_rate=0.01, tail_quantile=1.0, max_timed_rate=0) as cap:
        handles = []
        for _ in range(200):
            with inferprof.request() as rec:
                with inferprof.stage("tokenize"):
                    pass
                handles.append(rec)
        kept = [r for r in handles if r.kept]
        dropped = [r for r in handles if not r.kept]
        assert dropped and len(cap.requests()) == len(kept)
        # ids are drawn only when a kept trace is built (none are for the rest)
        assert all(st.span_id == 0 for r in dropped for st in r.stages)
        assert all(st.span_id != 0 for r in kept for st in r.stages)
        span_ids = {s.context.span_id for s in cap.stages("tokenize")}
        assert span_ids == {st.span_id for r in kept for st in r.stages}


def _reset_warnings():
    from inferprof.batching import hooks

    hooks._warned.clear()


def test_a_handle_used_in_two_batches_records_only_in_the_first_and_says_so(cap, caplog):
    _reset_warnings()
    with inferprof.request():
        handle = inferprof.enqueue()
        with inferprof.batch([handle]), inferprof.stage("compute"):
            pass
        with caplog.at_level("WARNING", logger="inferprof.batching.hooks"):
            with inferprof.batch([handle]), inferprof.stage("decode"):
                pass
            with inferprof.batch([handle]):  # once per process, not per batch
                pass
    assert [s.attributes[semconv.ATTR_STAGE] for s in cap.stages()].count("compute") == 1
    assert not cap.stages("decode")
    assert caplog.text.count("already passed to an earlier batch()") == 1


def test_a_batch_formed_after_its_request_ended_is_skipped_and_links_batches_still_emit(
    cap, caplog
):
    _reset_warnings()
    with inferprof.request():
        late = inferprof.enqueue()
    with inferprof.request():
        live = inferprof.enqueue()
        with caplog.at_level("WARNING", logger="inferprof.batching.hooks"):
            with inferprof.batch([late, live], batch_encoding="links"):
                with inferprof.stage("compute"):
                    pass
    assert "request had already ended" in caplog.text
    # The batch waited for its members to end; the ended request was never one: the
    # links-encoded batch span is emitted, linked to the live request only.
    (compute,) = cap.stages("compute")
    live_req = cap.requests()[-1]
    assert [link.context.span_id for link in compute.links] == [live_req.context.span_id]


def test_b_stage_after_the_batch_block_records_nothing_and_says_so(cap, caplog):
    _reset_warnings()
    with inferprof.request():
        handle = inferprof.enqueue()
        with inferprof.batch([handle]) as b:
            pass
        with caplog.at_level("WARNING", logger="inferprof.batching.hooks"):
            with b.stage("compute"):
                pass

            @b.stage("decode")
            def step():
                return 7

            assert step() == 7  # inside the request: a plain stage would record it there
    assert not cap.stages("compute") and not cap.stages("decode")
    assert "after its `with inferprof.batch(...)` block ended" in caplog.text


def test_an_empty_batch_says_its_stages_belong_to_no_request(cap, caplog):
    _reset_warnings()
    with caplog.at_level("WARNING", logger="inferprof.batching.hooks"), inferprof.batch([]):
        pass
    assert "got no handles" in caplog.text


def test_an_empty_batch_is_silent_when_inferprof_is_not_configured(caplog):
    # Not configured (or off), every hook is a silent no-op: the same batching code runs
    # in every mode without log lines.
    _reset_warnings()
    with caplog.at_level("WARNING", logger="inferprof"), inferprof.batch([]) as b:
        with b.stage("compute"):
            pass
    assert caplog.records == []


def test_a_request_ending_while_its_links_batch_forms_never_holds_the_batch_back(
    cap, monkeypatch
):
    # The request ends on another thread exactly while the batch is being formed (between
    # the batch's check that it has not ended and its joining the batch): either way the
    # links-encoded batch must be emitted once the batch closes.
    import time

    from inferprof.batching import hooks

    rt = inferprof._config.active_runtime()
    with inferprof.request() as req:
        handle = inferprof.enqueue()
    rec = req  # the request's record; reopened below as if it were still waiting
    rec.finished = False
    rec.kept = False
    rec.batches = []
    handle.request, handle.end = rec, None
    ender = []

    def new_trace_id_then_end_the_request():
        t = threading.Thread(target=rt.finish_request, args=(rec,))
        t.start()
        ender.append(t)
        time.sleep(0.05)  # give it the chance to run in the window
        return 0xABC

    monkeypatch.setattr(hooks, "new_trace_id", new_trace_id_then_end_the_request)
    with inferprof.batch([handle], batch_encoding="links") as b, inferprof.stage("compute"):
        pass
    ender[0].join(5)
    assert b.record.pending == 0  # the member reported its end
    (compute,) = cap.stages("compute")
    assert [link.context.span_id for link in compute.links] == [rec.span_id]


async def test_a_custom_batcher_can_report_how_long_its_workers_were_all_busy(cap):
    queue = asyncio.Queue()
    tasks = await _custom_batcher_requests(2, queue)
    await asyncio.sleep(0.01)
    entries = [queue.get_nowait() for _ in range(2)]
    for n, (_, handle, _) in enumerate(entries):
        if handle.stage:  # as docs/batching.md shows
            handle.stage.set_attribute(semconv.ATTR_QUEUE_BEHIND_BATCHES_S, 0.004 * n)
    with inferprof.batch([h for _, h, _ in entries]):
        pass
    for i, _, fut in entries:
        fut.set_result(i)
    await asyncio.gather(*tasks)
    reported = sorted(s.attributes[semconv.ATTR_QUEUE_BEHIND_BATCHES_S]
                      for s in cap.stages(semconv.STAGE_QUEUE))
    assert reported == [0.0, 0.004]
    # a handle that records nothing has no stage to set it on
    assert inferprof.enqueue().stage is None


async def test_a_member_that_ends_while_its_children_batch_works_copies_no_running_stage(cap):
    # A request that times out mid-compute copies the stages that had ended, not the one
    # still running: the collector takes a batch's first copy of a stage as the batch's
    # work window, and a clipped copy from the member that left first would shrink it (a
    # review measured behind_batches 1.00 -> 0.75 and batch coverage 1.00 -> 0.13).
    queue = asyncio.Queue()
    tasks = await _custom_batcher_requests(2, queue)
    await asyncio.sleep(0.01)
    entries = [queue.get_nowait() for _ in range(2)]
    computing, release = threading.Event(), threading.Event()

    def run_in_thread():
        with inferprof.batch([h for _, h, _ in entries], batch_encoding="children") as b:
            with b.stage("batch_assembly"):
                pass
            with inferprof.stage("compute"):
                computing.set()
                release.wait(5)

    worker = asyncio.create_task(asyncio.to_thread(run_in_thread))
    await asyncio.to_thread(computing.wait, 5)
    tasks[0].cancel()  # the client gave up mid-compute
    with pytest.raises(asyncio.CancelledError):
        await tasks[0]
    release.set()
    await worker
    entries[1][2].set_result(1)
    await tasks[1]

    spans = cap.spans()
    left, stayed = sorted(cap.requests(), key=lambda r: r.end_time)
    copied = {k.attributes[semconv.ATTR_STAGE] for k in children_of(spans, left)}
    assert "batch_assembly" in copied and "compute" not in copied
    full = {k.attributes[semconv.ATTR_STAGE]: k for k in children_of(spans, stayed)}
    assert full["compute"].end_time > left.end_time  # the batch ran on, whole here


async def test_a_batching_loop_started_inside_a_request_records_its_stages_after_it(
        cap, caplog, monkeypatch):
    # The usual lazy start: `if self.task is None: self.task = create_task(self.loop())`
    # in submit() (Ray Serve's @serve.batch starts its loop the same way). The loop task
    # inherits the first request's scope; once that request has ended, the loop's stages
    # were appended to its finished record and lost without a word.
    from inferprof.instrumentation import stage as stage_module

    monkeypatch.setattr(stage_module, "_warned_outlived", False)  # warned once a process
    work = asyncio.Queue()
    loop_task = None

    async def batching_loop():
        while True:
            item = await work.get()
            if item is None:
                return
            with inferprof.stage("batch_assembly"):  # outside inferprof.batch(): a span
                with inferprof.stage("tokenize"):  # nested: under it, in its trace
                    pass

    async def submit(i):
        nonlocal loop_task
        async with inferprof.request(model="lazy", i=i):
            if loop_task is None:
                loop_task = asyncio.create_task(batching_loop())
            await work.put(i)
            await asyncio.sleep(0.01)  # the loop takes the item while this request runs

    with caplog.at_level("WARNING", logger="inferprof"):
        for i in range(3):
            await submit(i)
        await work.put(None)
        await loop_task
    assembly = cap.stages("batch_assembly")
    # the first while request 0 still ran (its stage); the other two as spans of their own
    assert len(assembly) == 3
    requests = {r.context.span_id for r in cap.requests()}
    own = [s for s in assembly if s.parent is None or s.parent.span_id not in requests]
    assert len(own) == 2
    warned = [r for r in caplog.records if "request that has ended" in r.getMessage()]
    assert len(warned) == 1
    # a stage nested in such a span hangs under it (not a trace of its own)
    by_id = {s.context.span_id: s for s in assembly}
    inner = [s for s in cap.stages("tokenize") if s.parent and s.parent.span_id in by_id
             and by_id[s.parent.span_id] in own]
    assert len(inner) == 2
    assert all(s.context.trace_id == by_id[s.parent.span_id].context.trace_id for s in inner)
