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
