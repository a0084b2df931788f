"""The LLM demo's engine recorded through inferprof's step API (``StepTelemetry``), under
real uvicorn with the middleware, streamed to a real client: every request's trace has its
engine stages and token times, and every step its span."""

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

import inferprof.fastapi
from inferprof import semconv
from inferprof.demo.llm.service import COMPLETIONS_PATH, create_app
from inferprof.demo.llm.settings import LLMSettings
from inferprof.demo.llm.telemetry import StepTelemetry
from tests.instrumentation.helpers import captured, children_of

pytestmark = pytest.mark.integration

PROMPT = "The harbour was quiet at dawn, and the boats lay still."


async def _stream(client, max_tokens, index):
    """(arrival time of each data chunk, [DONE] seen, when the request was sent)."""
    times, done = [], False
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "stream": True}
    sent = time.time_ns()
    # the request span continues this trace: the client's figures pair with its own span
    headers = {"traceparent": f"00-{index + 1:032x}-{index + 1:016x}-01"}
    async with client.stream("POST", COMPLETIONS_PATH, json=body, headers=headers) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                json.loads(line[6:])
                times.append(time.time_ns())
    return times, done, sent


def test_the_demo_engine_records_stages_steps_and_token_times():
    # 8 streams of ~14 + 60 tokens need ~40 blocks of 16: a cache of 12 forces evictions
    settings = LLMSettings(instrumentation="none", model_size="tiny", gc_freeze=False,
                           kv_blocks=12)
    with captured() as cap:
        app = inferprof.fastapi.InferprofMiddleware(
            create_app(settings, instrument=StepTelemetry()))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 30
            while not server.started and time.monotonic() < deadline:
                time.sleep(0.02)
            assert server.started
            url = f"http://127.0.0.1:{sock.getsockname()[1]}"

            async def load():
                async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                    return await asyncio.gather(*(_stream(client, 60, i) for i in range(8)))

            results = asyncio.run(load())
        finally:
            server.should_exit = True
            thread.join(timeout=15)
            sock.close()
        spans = cap.spans()
    assert all(done and len(times) == 60 for times, done, _ in results)
    requests = [s for s in spans if s.kind.name == "SERVER"]
    assert len(requests) == 8
    steps = [s for s in spans if s.name == semconv.ENGINE_STEP_SPAN_NAME]
    assert steps and all(s.parent is None for s in steps)
    for step in steps[:20]:
        (compute,) = children_of(spans, step)
        assert compute.attributes[semconv.ATTR_STAGE] == semconv.STAGE_COMPUTE
        assert 0.0 <= step.attributes[semconv.ATTR_STEP_KV_CACHE_USAGE] <= 1.0
    assert sum(s.attributes[semconv.ATTR_STEP_DECODE_TOKENS] for s in steps) > 0
    preempted = 0
    for request in requests:
        attrs = request.attributes
        assert attrs[semconv.ATTR_ENGINE_ID] == semconv.DEFAULT_ENGINE_ID
        assert attrs[semconv.ATTR_TOKENS_OUTPUT] == 60
        assert attrs[semconv.ATTR_TOKENS_PROMPT] > 0
        offsets = attrs[semconv.ATTR_GEN_EMIT_OFFSETS_S]
        assert len(offsets) == 60 and offsets == sorted(offsets)  # one SSE chunk a token
        stages = [s.attributes[semconv.ATTR_STAGE] for s in children_of(spans, request)]
        assert {"queue", "prefill", "decode", "serialize"} <= set(stages)
        if attrs.get(semconv.ATTR_GEN_PREEMPTIONS):
            preempted += 1
            assert "preempted" in stages
            recomputed = [s for s in children_of(spans, request)
                          if s.attributes.get(semconv.ATTR_PREFILL_RECOMPUTE)]
            assert recomputed
        # the engine's stages of a request never overlap each other
        engine_stages = sorted(
            (s for s in children_of(spans, request)
             if s.attributes[semconv.ATTR_STAGE] in ("queue", "prefill", "decode",
                                                     "preempted", "serialize")),
            key=lambda s: s.start_time)
        assert all(a.end_time <= b.start_time
                   for a, b in zip(engine_stages, engine_stages[1:]))
    assert preempted > 0
    # The server's figures against what the client measured, on one clock (one process):
    # each token left the service before the client read it, and the client read it within
    # the loopback's and its own event loop's share (the client's ttft also holds the
    # connection set-up before the request span starts, which is not the service's time).
    spans = {r.context.trace_id: r for r in requests}
    lags = []
    for index, (times, _, sent) in enumerate(results):
        request = spans[index + 1]
        left = [request.start_time + round(x * 1e9)
                for x in request.attributes[semconv.ATTR_GEN_EMIT_OFFSETS_S]]
        assert request.start_time >= sent
        assert all(server <= client for server, client in zip(left, times))
        lags.append(max(client - server for server, client in zip(left, times)) / 1e9)
    assert max(lags) < 0.5  # (client, server and engine threads share one GIL here)
