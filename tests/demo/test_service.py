"""The demo service in-process, uninstrumented: the HTTP contract and the batching."""

import asyncio

import httpx
import pytest

from inferprof.demo import corpus
from inferprof.demo.plain_batcher import PlainBatcher
from inferprof.demo.service import CLASSIFY_PATH, HEALTH_PATH, MAX_TEXT_CHARS, create_app
from inferprof.demo.settings import DemoSettings


@pytest.fixture
async def client():
    app = create_app(DemoSettings(instrumentation="none", model_size="tiny", max_batch_size=4))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://demo") as c:
            yield c


async def test_classify_answers_with_a_topic_and_top_tokens(client):
    paragraph = corpus.documents()[0].paragraphs[2]
    r = await client.post(CLASSIFY_PATH, json={"text": paragraph})
    assert r.status_code == 200
    body = r.json()
    assert body["topic"] in corpus.topics()
    assert sum(body["scores"].values()) == pytest.approx(1.0, abs=1e-3)
    assert 0 < len(body["top_tokens"]) <= 5
    assert all(tok.lower() in paragraph.lower() for tok in body["top_tokens"])
    assert body["tokens"] > 10


async def test_concurrent_requests_get_their_own_answers(client):
    texts = [d.paragraphs[0] for d in corpus.documents()] * 3
    alone = [(await client.post(CLASSIFY_PATH, json={"text": t})).json() for t in texts[:5]]
    together = await asyncio.gather(*(client.post(CLASSIFY_PATH, json={"text": t}) for t in texts))
    for i, r in enumerate(together):
        assert r.json()["topic"] == alone[i % 5]["topic"]
        assert r.json()["tokens"] == alone[i % 5]["tokens"]


@pytest.mark.parametrize(
    "body", [{"text": ""}, {}, {"text": 3}, {"text": "x" * (MAX_TEXT_CHARS + 1)}]
)
async def test_bad_bodies_are_422(client, body):
    assert (await client.post(CLASSIFY_PATH, json=body)).status_code == 422


async def test_health(client):
    r = await client.get(HEALTH_PATH)
    assert r.status_code == 200 and r.json()["instrumentation"] == "none"


def test_settings_or_overrides_not_both():
    with pytest.raises(ValueError):
        create_app(DemoSettings(), model_size="tiny")


async def test_plain_batcher_batches_up_to_the_limit_and_isolates_failures():
    seen = []

    def fn(batch):
        seen.append(list(batch))
        if "boom" in batch:
            raise RuntimeError("bad batch")
        return [x * 2 for x in batch]

    b = PlainBatcher(fn, max_batch_size=3, max_delay_ms=20)
    try:
        results = await asyncio.gather(*(b.submit(i) for i in range(7)))
        assert results == [i * 2 for i in range(7)]
        assert max(len(x) for x in seen) == 3 and sum(len(x) for x in seen) == 7
        with pytest.raises(RuntimeError, match="bad batch"):
            await b.submit("boom")
        assert await b.submit(5) == 10  # the batcher survives a failed batch
    finally:
        await b.stop()


@pytest.mark.parametrize("freeze", [True, False])
async def test_start_up_objects_are_frozen_out_of_garbage_collection(freeze):
    import gc

    gc.unfreeze()
    app = create_app(DemoSettings(instrumentation="none", model_size="tiny", gc_freeze=freeze))
    try:
        async with app.router.lifespan_context(app):
            frozen = gc.get_freeze_count()
            health = (await httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://demo"
            ).get(HEALTH_PATH)).json()
    finally:
        gc.unfreeze()  # the test process's collector back as it was
    assert (frozen > 10_000) is freeze  # the tokenizer, model and modules, when frozen
    assert len(health["gc_collections"]) == 3
    assert len(health["gc_seconds"]) == 3 and min(health["gc_seconds"]) >= 0.0
    assert health["minor_faults"] > 0
    assert health["thread_cpu_s"]["MainThread"] > 0


@pytest.mark.parametrize("threshold", [0, 9000])
async def test_young_gc_threshold_is_set_while_serving_and_restored_after(threshold):
    import gc

    before = gc.get_threshold()
    app = create_app(DemoSettings(instrumentation="none", model_size="tiny", gc_freeze=False,
                                  gc_threshold=threshold))
    async with app.router.lifespan_context(app):
        during = gc.get_threshold()
        health = (await httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://demo"
        ).get(HEALTH_PATH)).json()
    assert during == ((threshold or before[0]), *before[1:])  # 0: CPython's left alone
    assert health["gc_threshold"] == list(during)
    assert gc.get_threshold() == before
