"""The LLM demo service under uvicorn, streaming to a real client: each request's trace
is complete, and its times are what the client measured, within the network's share."""

import asyncio
import secrets
import time

import httpx
import pytest

from inferprof import semconv
from inferprof.demo.llm.processes import LLMServiceProcess
from inferprof.demo.llm.settings import LLMSettings
from tests.otlp_sink import attributes

pytestmark = pytest.mark.integration

STREAMS = 8
MAX_TOKENS = 150
PROMPT = "The ferry left the harbour at dawn, and the gulls followed it past the breakwater."
#: What may lie between the client's clock and the service's: connecting and parsing
#: before the request span starts, the socket and the client's event loop after a chunk
#: leaves (a loaded 2-core machine runs the service, the client and the test).
NETWORK_SHARE_S = 0.15


def _array(span, key):
    for kv in span.attributes:
        if kv.key == key:
            return [v.double_value for v in kv.value.array_value.values]
    return None


async def _stream(client, url, trace_id):
    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True}
    arrivals = []
    sent = time.perf_counter()
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter() - sent)
    return arrivals


async def _load(url, trace_ids):
    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(*(_stream(client, url, t) for t in trace_ids))


def test_streamed_requests_traces_are_complete_and_match_the_client(otlp_sink):
    # 8 streams of ~170 tokens need ~88 blocks of 16 tokens; the cache has 40: evictions.
    settings = LLMSettings(instrumentation="full", model_size="tiny", kv_blocks=40,
                           endpoint=otlp_sink.endpoint, gc_freeze=False)
    trace_ids = [secrets.token_hex(16) for _ in range(STREAMS)]
    with LLMServiceProcess(settings) as svc:
        client = dict(zip(trace_ids, asyncio.run(_load(svc.url, trace_ids))))
    # The service has stopped, so it has flushed: every request span is in the sink.

    def requests(sink):
        return {s.trace_id.hex(): s for _, s in sink.spans()
                if s.kind == s.SPAN_KIND_SERVER and s.trace_id.hex() in client}

    assert otlp_sink.wait_for(lambda s: len(requests(s)) == STREAMS, timeout=20)
    spans = [s for _, s in otlp_sink.spans()]
    steps = [s for s in spans if s.name == semconv.ENGINE_STEP_SPAN_NAME]
    assert steps and all(attributes(s)[semconv.ATTR_ENGINE_ID] == "0" for s in steps)
    preempted = 0
    for trace_id, request in requests(otlp_sink).items():
        attrs = attributes(request)
        arrivals = client[trace_id]
        assert len(arrivals) == MAX_TOKENS == attrs[semconv.ATTR_TOKENS_OUTPUT]
        assert attrs[semconv.ATTR_TOKENS_PROMPT] > 10
        assert attrs[semconv.ATTR_ENGINE_ID] == "0"
        # Complete: every stage of the request, all in its own trace, under its span.
        stages = {attributes(s).get(semconv.ATTR_STAGE) for s in spans
                  if s.trace_id == request.trace_id and s.parent_span_id == request.span_id}
        assert {semconv.STAGE_RECEIVE, semconv.STAGE_TOKENIZE, semconv.STAGE_QUEUE,
                semconv.STAGE_PREFILL, semconv.STAGE_DECODE, semconv.STAGE_SERIALIZE} <= stages
        if attrs.get(semconv.ATTR_GEN_PREEMPTIONS):
            preempted += 1
            assert semconv.STAGE_PREEMPTED in stages
        # The same tokens at the same times: one offset per chunk the client read, the
        # server's first token and stream inside the client's, by the network's share.
        offsets = _array(request, semconv.ATTR_GEN_EMIT_OFFSETS_S)
        assert len(offsets) == len(arrivals)
        assert offsets == sorted(offsets)
        assert 0 <= arrivals[0] - offsets[0] <= NETWORK_SHARE_S, (arrivals[0], offsets[0])
        client_stream = arrivals[-1] - arrivals[0]
        server_stream = offsets[-1] - offsets[0]
        assert abs(client_stream - server_stream) <= NETWORK_SHARE_S
    assert preempted > 0
