import asyncio
import threading
import time

import pytest
from opentelemetry.trace import StatusCode

import inferprof
from inferprof import semconv
from inferprof.batching import Collated, current_batch
from tests.instrumentation.helpers import captured, children_of

BATCH_ATTRS = (
    semconv.ATTR_BATCH_ID,
    semconv.ATTR_BATCH_SIZE,
    semconv.ATTR_BATCH_MAX_SIZE,
    semconv.ATTR_MODEL_NAME,
)


def model_fn(xs):
    with inferprof.stage("h2d", **{semconv.ATTR_BYTES: 8 * len(xs)}):
        pass
    with inferprof.stage("compute"):
        ys = [x * 10 for x in xs]
    with inferprof.stage("d2h"):
        pass
    return ys


async def _serve(batcher, n, *, tokens=None):
    async def one(i):
        async with inferprof.request(model="m", i=i):
            return await batcher.submit(i, tokens=None if tokens is None else tokens[i])

    return await asyncio.gather(*(one(i) for i in range(n)))


async def test_children_encoding_copies_batch_stages_under_every_member(cap):
    async with inferprof.DynamicBatcher(
        model_fn, max_batch_size=4, max_delay_ms=50, model_name="m"
    ) as b:
        results = await _serve(b, 4, tokens=[3, 5, 2, 6])
    assert results == [0, 10, 20, 30]
    spans = cap.spans()
    requests = cap.requests()
    assert len(requests) == 4
    batch_ids = set()
    for r in requests:
        kids = children_of(spans, r)
        by_stage = {k.attributes[semconv.ATTR_STAGE]: k for k in kids}
        assert set(by_stage) == {"queue", "batch_assembly", "h2d", "compute", "d2h"}
        q = by_stage["queue"]
        assert semconv.ATTR_QUEUE_DEPTH in q.attributes
        assert semconv.ATTR_BATCH_ID not in q.attributes
        for name in ("batch_assembly", "h2d", "compute", "d2h"):
            s = by_stage[name]
            assert s.context.trace_id == r.context.trace_id
            assert s.attributes[semconv.ATTR_BATCH_SIZE] == 4
            assert s.attributes[semconv.ATTR_BATCH_MAX_SIZE] == 4
            assert s.attributes[semconv.ATTR_MODEL_NAME] == "m"
            batch_ids.add(s.attributes[semconv.ATTR_BATCH_ID])
        # the batch forms when the queue wait ends, stages follow in order
        assert q.end_time <= by_stage["batch_assembly"].start_time
        assert by_stage["batch_assembly"].end_time <= by_stage["h2d"].start_time
        assert (
            by_stage["h2d"].end_time <= by_stage["compute"].start_time <= by_stage["d2h"].start_time
        )
        assert by_stage["compute"].attributes[semconv.ATTR_TOKENS_EFFECTIVE] == 16
        assert by_stage["batch_assembly"].attributes[semconv.ATTR_TOKENS_PADDED] == 24
        assert semconv.ATTR_TOKENS_EFFECTIVE not in by_stage["h2d"].attributes
        assert by_stage["h2d"].attributes[semconv.ATTR_BYTES] == 32
    assert len(batch_ids) == 1
    # queue depths record the queue length each request found
    depths = sorted(s.attributes[semconv.ATTR_QUEUE_DEPTH] for s in cap.stages("queue"))
    assert depths == [0, 1, 2, 3]
    # copies are distinct spans
    computes = cap.stages("compute")
    assert len({c.context.span_id for c in computes}) == 4


async def test_links_encoding_one_span_per_stage_linked_to_every_member():
    with captured(batch_encoding="links") as cap:
        async with inferprof.DynamicBatcher(model_fn, max_batch_size=3, max_delay_ms=50) as b:
            await _serve(b, 3)
        requests = cap.requests()
        assert len(requests) == 3
        member_ids = {(r.context.trace_id, r.context.span_id) for r in requests}
        for name in ("batch_assembly", "h2d", "compute", "d2h"):
            (span,) = cap.stages(name)
            assert span.parent is None
            assert span.context.trace_id not in {t for t, _ in member_ids}
            assert {
                (link.context.trace_id, link.context.span_id) for link in span.links
            } == member_ids
            assert span.attributes[semconv.ATTR_BATCH_SIZE] == 3
            assert span.attributes[semconv.ATTR_MODEL_NAME] == "m"  # from the members
        # per-request stages stay in each request's trace
        assert len(cap.stages("queue")) == 3
        # and each request span links back to the batch's spans (trace view navigation)
        batch_spans = {
            (s.context.trace_id, s.context.span_id)
            for s in cap.stages()
            if s.attributes[semconv.ATTR_STAGE] != "queue"
        }
        for r in requests:
            assert {(lk.context.trace_id, lk.context.span_id) for lk in r.links} == batch_spans
        assert not cap.stages("compute")[0].attributes.get(semconv.ATTR_REQUEST, False)


async def test_links_encoding_links_only_sampled_members():
    with captured(batch_encoding="links", mode="production", sample_rate=0.5,
                  max_timed_rate=0) as cap:
        import random

        random.seed(3)
        async with inferprof.DynamicBatcher(model_fn, max_batch_size=8, max_delay_ms=50) as b:
            for _ in range(30):  # warm the sampler up
                await _serve(b, 8)
            cap.clear()
            for _ in range(4):
                await _serve(b, 8)
        kept = {(r.context.trace_id, r.context.span_id) for r in cap.requests()}
        # some of the 32 requests kept, some not (each is kept with probability >= 0.5, and
        # at most ~0.55 at steady state: all or none would be a ~1e-8 event)
        assert 0 < len(kept) < 32
        linked = [
            (lk.context.trace_id, lk.context.span_id)
            for span in cap.stages("compute")
            for lk in span.links
        ]
        # each kept member linked from exactly one batch, no member that was not kept
        assert sorted(linked) == sorted(kept)


async def test_batch_encoding_constructor_argument_wins(cap):
    async with inferprof.DynamicBatcher(
        model_fn, max_batch_size=2, max_delay_ms=20, batch_encoding="links"
    ) as b:
        await _serve(b, 2)
    (span,) = cap.stages("compute")
    assert len(span.links) == 2


async def test_cancelled_waiting_request_leaves_the_queue(cap):
    seen = []

    def fn(xs):
        seen.append(list(xs))
        return xs

    async with inferprof.DynamicBatcher(fn, max_batch_size=3, max_delay_ms=300) as b:

        async def one(i):
            async with inferprof.request(i=i):
                return await b.submit(i)

        tasks = [asyncio.create_task(one(i)) for i in range(2)]
        await asyncio.sleep(0.02)
        assert b.queue_depth == 2
        tasks[0].cancel()
        await asyncio.sleep(0)
        assert b.queue_depth == 1
        tasks.append(asyncio.create_task(one(2)))
        with pytest.raises(asyncio.CancelledError):
            await tasks[0]
        assert await tasks[1] == 1 and await tasks[2] == 2
    assert seen == [[1, 2]]
    queues = {s.parent.span_id: s for s in cap.stages("queue")}
    cancelled = [r for r in cap.requests() if r.attributes["i"] == 0][0]
    assert queues[cancelled.context.span_id].attributes[semconv.ATTR_CANCELLED] is True
    assert cap.stages("compute") == [] and len(cap.stages("batch_assembly")) == 2
    assert all(s.attributes[semconv.ATTR_BATCH_SIZE] == 2 for s in cap.stages("batch_assembly"))


async def test_exception_in_fn_fails_only_that_batch(cap):
    calls = []

    def fn(xs):
        calls.append(xs)
        if len(calls) == 1:
            with inferprof.stage("compute"):
                raise RuntimeError("CUDA out of memory")
        return [x + 1 for x in xs]

    async with inferprof.DynamicBatcher(fn, max_batch_size=2, max_delay_ms=50) as b:
        first = await asyncio.gather(*(_one(b, i) for i in range(2)), return_exceptions=True)
        second = await asyncio.gather(*(_one(b, i) for i in range(2, 4)), return_exceptions=True)
    assert all(isinstance(e, RuntimeError) and "out of memory" in str(e) for e in first)
    assert second == [3, 4]
    failed = [r for r in cap.requests() if r.attributes["i"] < 2]
    ok = [r for r in cap.requests() if r.attributes["i"] >= 2]
    assert len(failed) == len(ok) == 2
    assert all(r.status.status_code is StatusCode.ERROR for r in failed)
    assert all(r.status.status_code is StatusCode.UNSET for r in ok)
    bad_computes = [s for s in cap.stages("compute") if s.status.status_code is StatusCode.ERROR]
    assert len(bad_computes) == 2  # the failing stage, copied under both members
    assert all(s.events[0].attributes["exception.type"] == "RuntimeError" for s in bad_computes)


async def _one(b, i):
    async with inferprof.request(i=i):
        return await b.submit(i)


async def test_fn_returning_wrong_number_of_results_fails_the_batch(cap):
    async with inferprof.DynamicBatcher(lambda xs: [1], max_batch_size=2, max_delay_ms=20) as b:
        out = await asyncio.gather(*(_one(b, i) for i in range(2)), return_exceptions=True)
    assert len(out) == len(cap.requests()) == 2
    assert all(isinstance(e, ValueError) for e in out)
    assert all(r.status.description.startswith("ValueError") for r in cap.requests())


async def test_sync_fn_runs_off_the_event_loop(cap):
    loop_thread = threading.get_ident()
    fn_threads = []

    def slow(xs):
        fn_threads.append(threading.get_ident())
        time.sleep(0.1)
        return xs

    ticks = 0

    async def ticker():
        nonlocal ticks
        for _ in range(100):
            await asyncio.sleep(0.005)
            ticks += 1

    async with inferprof.DynamicBatcher(slow, max_batch_size=2, max_delay_ms=1) as b:
        t = asyncio.create_task(ticker())
        await asyncio.gather(*(_one(b, i) for i in range(2)))
        t.cancel()
    assert fn_threads and fn_threads[0] != loop_thread
    assert ticks >= 5  # the loop kept running while fn slept


async def test_async_fn_and_collate_reporting_tokens(cap):
    def collate(items):
        return Collated(batch=items, tokens_effective=7, tokens_padded=9)

    async def fn(xs):
        await asyncio.sleep(0)
        with inferprof.stage("compute"):
            pass
        return xs

    async with inferprof.DynamicBatcher(
        fn, max_batch_size=2, max_delay_ms=20, collate=collate
    ) as b:
        await asyncio.gather(*(_one(b, i) for i in range(2)))
    assert len(cap.stages("batch_assembly")) == 2  # one copy under each member request
    for s in cap.stages("batch_assembly"):
        assert s.attributes[semconv.ATTR_TOKENS_EFFECTIVE] == 7
        assert s.attributes[semconv.ATTR_TOKENS_PADDED] == 9


async def test_collate_can_report_tokens_through_the_current_batch(cap):
    def collate(items):
        current_batch().set_tokens(effective=4, padded=6)
        return items

    async with inferprof.DynamicBatcher(
        lambda xs: xs, max_batch_size=2, max_delay_ms=20, collate=collate
    ) as b:
        await asyncio.gather(*(_one(b, i) for i in range(2)))
    assert len(cap.stages("batch_assembly")) == 2
    for s in cap.stages("batch_assembly"):
        assert s.attributes[semconv.ATTR_TOKENS_EFFECTIVE] == 4


async def test_batches_never_exceed_max_size_and_all_requests_are_answered(cap):
    sizes = []

    def fn(xs):
        sizes.append(len(xs))
        return [x * 2 for x in xs]

    async with inferprof.DynamicBatcher(fn, max_batch_size=5, max_delay_ms=2) as b:
        results = await asyncio.gather(*(_one(b, i) for i in range(37)))
    assert results == [i * 2 for i in range(37)]
    assert max(sizes) <= 5 and sum(sizes) == 37


async def test_batcher_works_with_inferprof_off():
    inferprof.shutdown()
    async with inferprof.DynamicBatcher(model_fn, max_batch_size=4, max_delay_ms=5) as b:
        assert await asyncio.gather(*(b.submit(i) for i in range(6))) == [0, 10, 20, 30, 40, 50]


@pytest.mark.parametrize("mode", ["unconfigured", "off"])
async def test_collate_reporting_tokens_runs_unchanged_when_nothing_is_recorded(mode):
    # The batcher behaves identically when inferprof is off (docs/batching.md): a collate
    # written for a recorded batch must not fail the batch where none is recorded.
    if mode == "off":
        inferprof.configure(mode="off", set_global=False)
    seen = []

    def collate(items):
        b = inferprof.batching.current_batch()
        b.set_tokens(effective=4, padded=6)
        inferprof.batching.set_tokens(effective=4)
        seen.append((bool(b), b.batch_id))
        return items

    async with inferprof.DynamicBatcher(
        lambda xs: [x + 1 for x in xs], max_batch_size=2, max_delay_ms=5, collate=collate
    ) as b:
        assert await asyncio.gather(*(b.submit(i) for i in range(4))) == [1, 2, 3, 4]
    assert seen and set(seen) == {(False, None)}
    with pytest.raises(ValueError, match="padded"):  # still checked, as when recorded
        inferprof.batching.current_batch().set_tokens(effective=5, padded=2)


async def test_max_queue_size_rejects_when_full(cap):
    async with inferprof.DynamicBatcher(
        lambda xs: xs, max_batch_size=8, max_delay_ms=200, max_queue_size=2
    ) as b:
        waiting = [asyncio.create_task(b.submit(i)) for i in range(2)]
        await asyncio.sleep(0.01)
        with pytest.raises(asyncio.QueueFull):
            await b.submit(99)
        assert await asyncio.gather(*waiting) == [0, 1]


async def test_stop_fails_requests_still_queued(cap):
    b = inferprof.DynamicBatcher(lambda xs: xs, max_batch_size=8, max_delay_ms=10_000)
    b.start()
    task = asyncio.create_task(b.submit(1))
    await asyncio.sleep(0.01)
    await b.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        await task


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_batch_size": 0, "max_delay_ms": 1},
        {"max_batch_size": 2, "max_delay_ms": -1},
        {"max_batch_size": 2, "max_delay_ms": 1, "batch_encoding": "both"},
        {"max_batch_size": 2, "max_delay_ms": 1, "collate": 3},
        {"max_batch_size": 2, "max_delay_ms": 1, "max_concurrent_batches": 0},
    ],
)
def test_bad_constructor_arguments(kwargs):
    with pytest.raises(ValueError):
        inferprof.DynamicBatcher(lambda xs: xs, **kwargs)


def test_batcher_survives_a_new_event_loop():
    b = inferprof.DynamicBatcher(lambda xs: [x + 1 for x in xs], max_batch_size=4, max_delay_ms=1)

    async def use():
        return await asyncio.gather(*(b.submit(i) for i in range(3)))

    assert asyncio.run(use()) == [1, 2, 3]  # the first loop closes with the batcher running
    assert asyncio.run(use()) == [1, 2, 3]
    asyncio.run(b.stop())


async def test_max_delay_counts_from_the_oldest_arrival(cap):
    starts = []

    def fn(xs):
        starts.append((time.monotonic(), list(xs)))
        if len(starts) == 1:
            time.sleep(0.3)  # a slow first batch; the next request arrives meanwhile
        return xs

    async with inferprof.DynamicBatcher(fn, max_batch_size=2, max_delay_ms=200) as b:
        first = [asyncio.create_task(b.submit(x)) for x in ("a", "a2")]  # full: leaves at once
        await asyncio.sleep(0.05)
        second = asyncio.create_task(b.submit("b"))
        await asyncio.gather(*first, second)
    (t1, batch1), (t2, batch2) = starts
    assert batch1 == ["a", "a2"] and batch2 == ["b"]
    # "b" had waited 250 ms > max_delay when batch 1 finished: it leaves at once
    # (counting from when the loop got to it, it would leave 200 ms later)
    assert t2 - t1 < 0.3 + 0.15  # the wrong rule gives >= 0.3 + 0.2


@pytest.mark.parametrize("encoding", ["children", "links"])
async def test_a_served_batch_leaves_no_reference_cycle(encoding):
    """Batch records, their stages (``b.stage`` and nested ``inferprof.stage``) and the
    members' records are freed by reference counting alone once the requests end: a
    cycle per batch would be left for the garbage collector, whose collections then come
    sooner and scan every request in flight (docs/overhead.md)."""
    import gc

    from inferprof.batching.hooks import _NOTHING
    from inferprof.instrumentation.records import BatchRecord, RequestRecord, StageRecord

    def alive():  # (the shared handle of requests that record nothing lives forever)
        return [
            o
            for o in gc.get_objects()
            if isinstance(o, (BatchRecord, RequestRecord, StageRecord)) and o is not _NOTHING
        ]

    def fn(xs):
        with inferprof.stage("compute"):
            with inferprof.stage("h2d"):
                pass
        return [x + 1 for x in xs]

    with captured(batch_encoding=encoding) as cap:
        batcher = inferprof.DynamicBatcher(fn, max_batch_size=4, max_delay_ms=1)
        await _serve(batcher, 4)  # warm: the executor thread and the loop task exist
        gc.collect()
        gc.disable()
        try:
            assert await _serve(batcher, 8) == [i + 1 for i in range(8)]
            await asyncio.sleep(0.01)  # the batch tasks' done-callbacks
            assert alive() == []
        finally:
            gc.enable()
            await batcher.stop()
        assert len(cap.stages("h2d")) > 0


def _slow(seconds):
    def fn(xs):
        time.sleep(seconds)
        return xs

    return fn


async def _arrive(batcher, n, gap):
    async def one(i):
        async with inferprof.request(model="m", i=i):
            return await batcher.submit(i)

    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(one(i)))
        await asyncio.sleep(gap)
    return await asyncio.gather(*tasks)


def _behind(cap):
    spans = sorted(cap.stages(semconv.STAGE_QUEUE), key=lambda s: s.start_time)
    return [((s.end_time - s.start_time) / 1e9,
             s.attributes[semconv.ATTR_QUEUE_BEHIND_BATCHES_S]) for s in spans]


@pytest.mark.parametrize("slots", [1, 4])
async def test_queue_time_is_behind_batches_only_while_every_slot_runs_one(cap, slots):
    async with inferprof.DynamicBatcher(
        _slow(0.04), max_batch_size=1, max_delay_ms=0, max_concurrent_batches=slots
    ) as b:
        await _arrive(b, slots + 2, 0.005)
    behind = _behind(cap)
    # the first `slots` requests find a slot free; the next ones wait for one
    assert [m for _, m in behind[:slots]] == pytest.approx([0.0] * slots, abs=0.002)
    for queued, measured in behind[slots:]:
        assert queued > 0.015
        assert measured == pytest.approx(queued, abs=0.005)


async def test_waiting_for_the_delay_with_a_free_slot_is_not_behind_batches(cap):
    async with inferprof.DynamicBatcher(
        _slow(0.001), max_batch_size=8, max_delay_ms=30, max_concurrent_batches=2
    ) as b:
        await _arrive(b, 3, 0.002)
    for queued, measured in _behind(cap):
        assert queued > 0.02  # held for company
        assert measured == pytest.approx(0.0, abs=0.002)


async def test_a_running_batch_on_one_slot_does_not_make_the_other_slot_busy(cap):
    # Slot 1 runs a 100 ms batch; a request arriving meanwhile has slot 2 free and
    # waits only for the delay: none of that wait is behind batches.
    async with inferprof.DynamicBatcher(
        _slow(0.1), max_batch_size=2, max_delay_ms=30, max_concurrent_batches=2
    ) as b:
        first = asyncio.create_task(_arrive(b, 1, 0))
        await asyncio.sleep(0.04)  # the first batch formed at 30 ms and runs
        await _arrive(b, 1, 0)
        await first
    _, (queued, measured) = _behind(cap)
    assert queued > 0.02  # held for the delay
    assert measured == pytest.approx(0.0, abs=0.002)


async def test_restarted_while_batches_run_one_slot_stays_one_slot():
    running, most = 0, 0

    def fn(xs):
        nonlocal running, most
        running += 1
        most = max(most, running)
        time.sleep(0.05)
        running -= 1
        return xs

    b = inferprof.DynamicBatcher(fn, max_batch_size=1, max_delay_ms=0)
    first = asyncio.create_task(b.submit(1))
    await asyncio.sleep(0.01)  # its batch runs
    stopping = asyncio.create_task(b.stop())  # waits for that batch...
    await asyncio.sleep(0)
    second = asyncio.create_task(b.submit(2))  # ...while a request restarts the batcher
    assert await first == 1 and await second == 2
    await stopping
    third = await b.submit(3)
    await b.stop()
    assert third == 3
    assert most == 1  # never two batches on the one slot
    assert b._running == 0
