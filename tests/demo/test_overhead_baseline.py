"""The overhead baseline is fair: the plain batcher batches exactly as DynamicBatcher does,
and the demo reports its batching and telemetry counters on /healthz."""

import asyncio
import threading
import time

import httpx
import pytest

import inferprof
from inferprof.demo.plain_batcher import PlainBatcher
from inferprof.demo.service import CLASSIFY_PATH, HEALTH_PATH, create_app
from inferprof.demo.settings import DemoSettings

#: Long enough that the later arrivals below (10 ms apart) land inside the oldest waiting
#: request's window however slowly a loaded machine runs the event loop.
_WINDOW_MS = 500


async def _batch_sizes(make) -> list[int]:
    """Sizes of the batches formed for one arrival pattern: 6 requests at once, then 3 more
    arriving 10 ms apart, each within the window of the oldest waiting one."""
    sizes: list[int] = []

    def fn(batch):
        sizes.append(len(batch))
        return list(batch)

    b = make(fn)
    try:
        first = [asyncio.ensure_future(b.submit(i)) for i in range(6)]
        await asyncio.sleep(0)
        later = []
        for i in range(3):
            await asyncio.sleep(0.01)
            later.append(asyncio.ensure_future(b.submit(10 + i)))
        results = await asyncio.gather(*first, *later)
    finally:
        await b.stop()
    assert sorted(results) == [0, 1, 2, 3, 4, 5, 10, 11, 12]
    return sizes


@pytest.fixture
def unconfigured():
    inferprof.shutdown()
    yield
    inferprof.shutdown()


async def test_plain_batcher_forms_the_same_batches_as_dynamic_batcher(unconfigured):
    plain = await _batch_sizes(
        lambda fn: PlainBatcher(fn, max_batch_size=4, max_delay_ms=_WINDOW_MS)
    )
    dynamic = await _batch_sizes(
        lambda fn: inferprof.DynamicBatcher(fn, max_batch_size=4, max_delay_ms=_WINDOW_MS)
    )
    # full batches leave at once, the last one when its window ends
    assert plain == dynamic == [4, 4, 1]


async def _overdue_pattern(make, max_delay_s: float) -> list[list]:
    """A request that waited through a running batch is overdue when that batch ends: it
    must leave at once (its deadline counts from its arrival), not wait for company."""
    seen: list[list] = []
    release = threading.Event()

    def fn(batch):
        seen.append(list(batch))
        if batch == ["a", "a2"]:
            assert release.wait(30), "never released"
        return list(batch)

    b = make(fn)
    try:
        a = [asyncio.ensure_future(b.submit(i)) for i in ("a", "a2")]  # full: leaves at once
        await _until(lambda: seen)
        x = asyncio.ensure_future(b.submit("x"))
        await asyncio.sleep(max_delay_s * 1.2)  # "x" waits past its delay behind the batch
        release.set()
        await asyncio.gather(*a)
        # Counted from its arrival, "x" is overdue and its batch starts at once; counted
        # from when the loop got to it, it would wait a whole delay more, and "y" (sent
        # before that) would join it.
        await _until(lambda: len(seen) > 1, max_delay_s * 0.8, fail=False)
        y = asyncio.ensure_future(b.submit("y"))
        await asyncio.gather(x, y)
    finally:
        release.set()
        await b.stop()
    return seen


async def _until(condition, timeout_s: float = 30.0, *, fail: bool = True) -> None:
    """Wait on the event loop until ``condition()``; after ``timeout_s``, fail or return."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            assert not fail, "timed out"
            return
        await asyncio.sleep(0.001)


async def test_plain_batcher_deadline_counts_from_the_oldest_arrival(unconfigured):
    plain = await _overdue_pattern(
        lambda fn: PlainBatcher(fn, max_batch_size=2, max_delay_ms=500), 0.5
    )
    dynamic = await _overdue_pattern(
        lambda fn: inferprof.DynamicBatcher(fn, max_batch_size=2, max_delay_ms=500), 0.5
    )
    assert plain == dynamic == [["a", "a2"], ["x"], ["y"]]


async def test_a_cancelled_request_leaves_the_plain_batchers_queue():
    seen = []

    def fn(batch):
        seen.append(list(batch))
        return list(batch)

    b = PlainBatcher(fn, max_batch_size=8, max_delay_ms=30)
    try:
        gone = asyncio.ensure_future(b.submit("gone"))
        kept = asyncio.ensure_future(b.submit("kept"))
        await asyncio.sleep(0)
        gone.cancel()
        assert await kept == "kept"
    finally:
        await b.stop()
    assert seen == [["kept"]]


@pytest.mark.parametrize("instrumentation", ["none", "off"])
async def test_healthz_reports_batches_and_batched_requests(instrumentation, unconfigured):
    app = create_app(DemoSettings(instrumentation=instrumentation, model_size="tiny",
                                  max_batch_size=4))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://demo") as c:
            before = (await c.get(HEALTH_PATH)).json()
            rs = await asyncio.gather(*(c.post(CLASSIFY_PATH, json={"text": f"gpu {i}"})
                                        for i in range(6)))
            after = (await c.get(HEALTH_PATH)).json()
    assert all(r.status_code == 200 for r in rs)
    assert before["batches"] == 0 and before["batched_requests"] == 0
    assert after["batched_requests"] == 6
    assert 2 <= after["batches"] <= 6  # batches of at most 4
    if instrumentation == "none":
        assert after["telemetry"] is None


async def _resumed_before_next_batch(make) -> list[int]:
    """For each batch, how many requests of earlier batches had resumed (their ``await
    submit`` returned and their first step ran) when its function started. Each resumed
    request then blocks the loop for 10 ms, as a response's post-processing would."""
    resumed = 0
    seen: list[int] = []

    def fn(batch):
        seen.append(resumed)
        return list(batch)

    async def one(i):
        nonlocal resumed
        out = await b.submit(i)
        resumed += 1
        time.sleep(0.01)
        return out

    b = make(fn)
    try:
        assert await asyncio.gather(*(one(i) for i in range(6))) == list(range(6))
    finally:
        await b.stop()
    return seen


async def test_plain_batcher_hands_results_back_before_the_next_batch_like_dynamic_batcher(
    unconfigured,
):
    """The order of work on a core shared with the model must match too: DynamicBatcher
    delivers a batch's results, lets its requests run their next step, and only then
    forms the next batch. A baseline that started the next batch first would overlap the
    model with the responses' post-processing, a different load on one core (measured on
    a slow VM: 77-93 µs more event-loop CPU per request, docs/overhead.md)."""
    dynamic = await _resumed_before_next_batch(
        lambda fn: inferprof.DynamicBatcher(fn, max_batch_size=2, max_delay_ms=50)
    )
    plain = await _resumed_before_next_batch(
        lambda fn: PlainBatcher(fn, max_batch_size=2, max_delay_ms=50)
    )
    assert dynamic == [0, 2, 4]
    assert plain == dynamic
