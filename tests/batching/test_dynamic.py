import asyncio
import threading
import time

import pytest
from opentelemetry.trace import StatusCode

import inferprof
from inferprof import semconv
from inferprof.batching import Collated, current_batch
from tests.instrumentation.helpers import captured, children_of

_ATTR_BEHIND = semconv.ATTR_QUEUE_BEHIND_BATCHES_S

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
    loop_ran = threading.Event()

    def slow(xs):
        fn_threads.append(threading.get_ident())
        # set by a task on the event loop: it can only happen while fn waits here if the
        # loop keeps running meanwhile
        assert loop_ran.wait(10), "the event loop stood still while fn ran"
        return xs

    async def on_the_loop():
        while not fn_threads:
            await asyncio.sleep(0.001)
        loop_ran.set()

    async with inferprof.DynamicBatcher(slow, max_batch_size=2, max_delay_ms=1) as b:
        t = asyncio.create_task(on_the_loop())
        await asyncio.gather(*(_one(b, i) for i in range(2)))
        await t
    assert fn_threads and fn_threads[0] != loop_thread


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
    runs = []
    release = threading.Event()

    def fn(xs):
        start = time.monotonic()
        if not runs:  # the first batch runs until released; the next request arrives meanwhile
            assert release.wait(30), "never released"
        runs.append((start, time.monotonic(), list(xs)))
        return xs

    async with inferprof.DynamicBatcher(fn, max_batch_size=2, max_delay_ms=500) as b:
        try:
            first = [asyncio.create_task(b.submit(x)) for x in ("a", "a2")]  # full: leaves at once
            await asyncio.sleep(0.01)
            second = asyncio.create_task(b.submit("b"))
            await asyncio.sleep(0.6)  # "b" waits past its delay behind the first batch
        finally:
            release.set()
        await asyncio.gather(*first, second)
    (_, end1, batch1), (start2, _, batch2) = runs
    assert batch1 == ["a", "a2"] and batch2 == ["b"]
    # "b" is overdue when the first batch ends: its batch starts at once. Counting from
    # when the loop got to it, it would start a whole delay (500 ms) after that.
    assert start2 - end1 < 0.5


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


class _Held:
    """A batch function whose first ``held`` calls block until ``release()``: a test
    decides when batches end instead of guessing how long they take on a loaded machine.
    Every call's run is kept as a ``(start, end)`` interval in the spans' clock."""

    def __init__(self, held):
        self.held = held
        self.runs = []
        self._calls = 0
        self._waiting = 0
        self._lock = threading.Lock()
        self._gate = threading.Event()

    def __call__(self, xs):
        start = time.time_ns()
        with self._lock:
            self._calls += 1
            hold = self._calls <= self.held
            if hold:
                self._waiting += 1
        if hold:
            assert self._gate.wait(30), "never released"
        self.runs.append((start, time.time_ns()))
        return xs

    async def all_held(self):
        """Return once every held call is running (each holds a slot)."""
        deadline = time.monotonic() + 30
        while self._waiting < self.held:
            assert time.monotonic() < deadline, "the held batches never started"
            await asyncio.sleep(0.001)

    def release(self):
        self._gate.set()


#: The batcher's busy clock is ``time.monotonic``, spans use ``time.time_ns``: durations
#: measured on the two agree to well within this (seconds).
_CLOCKS = 0.001


def _all_running(runs, n):
    """The periods (ns) during which at least ``n`` of ``runs`` ran at once."""
    edges = sorted([(s, 1) for s, _ in runs] + [(e, -1) for _, e in runs])
    periods, running, since = [], 0, None
    for t, step in edges:
        running += step
        if running >= n and since is None:
            since = t
        elif running < n and since is not None:
            periods.append((since, t))
            since = None
    return periods


def _overlap_s(span, periods):
    return sum(
        max(0, min(end, span.end_time) - max(start, span.start_time)) for start, end in periods
    ) / 1e9


def _queues(cap):
    return sorted(cap.stages(semconv.STAGE_QUEUE), key=lambda s: s.start_time)


@pytest.mark.parametrize("slots", [1, 4])
async def test_queue_time_is_behind_batches_only_while_every_slot_runs_one(cap, slots):
    fn = _Held(slots)
    async with inferprof.DynamicBatcher(
        fn, max_batch_size=1, max_delay_ms=0, max_concurrent_batches=slots
    ) as b:
        try:
            first = [asyncio.create_task(_one(b, i)) for i in range(slots)]
            await fn.all_held()  # every slot runs a batch...
            later = [asyncio.create_task(_one(b, i)) for i in range(slots, slots + 2)]
            await asyncio.sleep(0.03)  # ...while two more requests wait for one
        finally:
            fn.release()
        assert await asyncio.gather(*first, *later) == list(range(slots + 2))
    queues = _queues(cap)
    # the first `slots` requests found a slot free: none of their wait is behind batches
    assert [s.attributes[_ATTR_BEHIND] for s in queues[:slots]] == [0.0] * slots
    # The later ones waited while every slot ran a batch (their functions running, which
    # the batcher's busy clock encloses): all of that is behind batches, and nothing is
    # counted beyond their wait.
    busy = _all_running(fn.runs, slots)
    for s in queues[slots:]:
        behind = _overlap_s(s, busy)
        assert behind > 0.025  # the held batches ran through its wait
        queued = (s.end_time - s.start_time) / 1e9
        assert behind - _CLOCKS <= s.attributes[_ATTR_BEHIND] <= queued + _CLOCKS


async def test_waiting_for_the_delay_with_a_free_slot_is_not_behind_batches(cap):
    async with inferprof.DynamicBatcher(
        lambda xs: xs, max_batch_size=8, max_delay_ms=30, max_concurrent_batches=2
    ) as b:
        assert await asyncio.gather(*(_one(b, i) for i in range(3))) == [0, 1, 2]
    queues = _queues(cap)
    assert len(queues) == 3
    for s in queues:
        # held for company: no batch left before the oldest request had waited the delay
        assert (s.end_time - queues[0].start_time) / 1e9 >= 0.03 - _CLOCKS
        assert s.attributes[_ATTR_BEHIND] == 0.0


async def test_a_running_batch_on_one_slot_does_not_make_the_other_slot_busy(cap):
    # Slot 1 runs a batch held until the end; a request arriving meanwhile has slot 2
    # free and waits only for the delay: none of that wait is behind batches.
    fn = _Held(1)
    async with inferprof.DynamicBatcher(
        fn, max_batch_size=2, max_delay_ms=30, max_concurrent_batches=2
    ) as b:
        try:
            first = asyncio.create_task(_one(b, 0))
            await fn.all_held()
            assert await _one(b, 1) == 1  # served on slot 2 while slot 1 is held
        finally:
            fn.release()
        assert await first == 0
    _, second = _queues(cap)
    assert (second.end_time - second.start_time) / 1e9 >= 0.03 - _CLOCKS  # held for the delay
    assert second.attributes[_ATTR_BEHIND] == 0.0


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
