"""The LLM demo service under real uvicorn, read by a real streaming client (httpx)."""

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from inferprof.demo.llm.instrument import EngineInstrument
from inferprof.demo.llm.service import COMPLETIONS_PATH, create_app
from inferprof.demo.llm.settings import LLMSettings
from inferprof.demo.service import HEALTH_PATH

pytestmark = pytest.mark.integration

PROMPTS = ["The harbour was quiet at dawn.", "He sharpened the chisel on the stone.",
           "Apples ripened along the south wall of the orchard, row after row."]


def _serve(settings, instrument=None):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(settings, instrument=instrument),
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    return server, thread, sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def service(request):
    overrides = dict(getattr(request, "param", {}))
    instrument = overrides.pop("instrument", None)
    settings = LLMSettings(instrumentation="none", model_size="tiny", gc_freeze=False,
                           **overrides)
    server, thread, sock, url = _serve(settings, instrument)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


async def _stream(client, prompt, max_tokens):
    """The parsed data chunks of one streamed completion, and whether [DONE] came."""
    chunks, done = [], False
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    async with client.stream("POST", COMPLETIONS_PATH, json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        async for line in resp.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            if line == "data: [DONE]":
                done = True
                continue
            assert not done, "nothing after [DONE]"
            chunks.append(json.loads(line[len("data: "):]))
    return chunks, done


async def test_a_stream_is_one_sse_chunk_per_token_then_done(service):
    async with httpx.AsyncClient(base_url=service, timeout=30) as client:
        chunks, done = await _stream(client, PROMPTS[0], 12)
        whole = (await client.post(COMPLETIONS_PATH,
                                   json={"prompt": PROMPTS[0], "max_tokens": 12})).json()
    assert done and len(chunks) == 12
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 11 + ["length"]
    # Greedy decoding: the streamed text is exactly the non-streamed completion.
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert whole["usage"]["completion_tokens"] == 12
    assert whole["usage"]["total_tokens"] == 12 + whole["usage"]["prompt_tokens"]


@pytest.mark.parametrize("service", [{"kv_blocks": 12, "block_size": 4}], indirect=True)
async def test_concurrent_streams_under_evictions_get_their_own_tokens(service):
    async with httpx.AsyncClient(base_url=service, timeout=60) as client:
        alone = [await _stream(client, p, 24) for p in PROMPTS]
        together = await asyncio.gather(*(_stream(client, p, 24) for p in PROMPTS * 2))
        health = (await client.get(HEALTH_PATH)).json()
    assert health["engine"]["evictions"] > 0  # the 12-block cache cannot hold them all

    def text(chunks):
        return "".join(c["choices"][0]["text"] for c in chunks)

    for i, (chunks, done) in enumerate(together):
        assert done and len(chunks) == 24
        assert text(chunks) == text(alone[i % len(PROMPTS)][0])
    assert health["engine"]["kv_blocks_used"] == 0 and health["in_flight"] == 0


async def test_a_client_leaving_mid_stream_cancels_its_request_and_frees_its_blocks(service):
    async with httpx.AsyncClient(base_url=service, timeout=30) as client:
        body = {"prompt": PROMPTS[2], "max_tokens": 1000, "stream": True}
        async with client.stream("POST", COMPLETIONS_PATH, json=body) as resp:
            lines = resp.aiter_lines()
            assert (await lines.__anext__()).startswith("data: {")
        # The connection is closed: the server notices, cancels, and frees the blocks.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            health = (await client.get(HEALTH_PATH)).json()
            if health["engine"]["cancelled"] == 1 and health["engine"]["kv_blocks_used"] == 0:
                break
            await asyncio.sleep(0.05)
        assert health["engine"]["cancelled"] == 1
        assert health["engine"]["kv_blocks_used"] == 0 and health["in_flight"] == 0
        # The service goes on serving.
        chunks, done = await _stream(client, PROMPTS[0], 3)
        assert done and len(chunks) == 3


@pytest.mark.parametrize("service", [{"kv_blocks": 64, "block_size": 16}],
                         indirect=True)
async def test_bad_requests_are_refused_with_a_reason(service):
    async with httpx.AsyncClient(base_url=service, timeout=30) as client:
        for body in ({"prompt": ""}, {}, {"prompt": "x", "max_tokens": 0},
                     {"prompt": "x", "max_tokens": 5000}):
            assert (await client.post(COMPLETIONS_PATH, json=body)).status_code == 422
        r = await client.post(COMPLETIONS_PATH, json={"prompt": PROMPTS[2], "max_tokens": 1024})
        assert r.status_code == 400 and "KV-cache blocks" in r.json()["detail"]
        chunks, done = await _stream(client, "Hi.", 2)
        assert done and len(chunks) == 2


class Gate(EngineInstrument):
    """Holds every engine step until opened: requests stay in flight as long as needed."""

    def __init__(self):
        self.open = threading.Event()

    def step_begin(self, items, kv_usage):
        self.open.wait(30)


GATE = Gate()


@pytest.mark.parametrize("service", [{"max_in_flight": 1, "instrument": GATE}], indirect=True)
async def test_beyond_max_in_flight_requests_are_429_and_nothing_is_lost(service):
    async with httpx.AsyncClient(base_url=service, timeout=30) as client:
        first = asyncio.ensure_future(
            client.post(COMPLETIONS_PATH, json={"prompt": "Hi.", "max_tokens": 3}))
        deadline = time.monotonic() + 15
        while (await client.get(HEALTH_PATH)).json()["in_flight"] == 0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        busy = await client.post(COMPLETIONS_PATH, json={"prompt": "Hi.", "max_tokens": 3})
        assert busy.status_code == 429 and "in flight" in busy.json()["detail"]
        GATE.open.set()
        r = await first
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
