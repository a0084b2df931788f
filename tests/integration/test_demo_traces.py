"""The demo service under real uvicorn, exporting OTLP to a real receiver.

Every request's trace must carry every contract stage, each inside its request span.
"""

import asyncio
from collections import defaultdict

import httpx
import pytest
from opentelemetry.proto.trace.v1 import trace_pb2

from inferprof import semconv
from inferprof._config import ENV_BATCH_ENCODING
from inferprof.demo.loadgen import build_prompts
from inferprof.demo.processes import ServiceProcess
from inferprof.demo.settings import DemoSettings
from tests.otlp_sink import attributes

pytestmark = pytest.mark.integration

REQUESTS = 50
DEMO_STAGES = (
    semconv.STAGE_RECEIVE, semconv.STAGE_TOKENIZE, semconv.STAGE_QUEUE,
    semconv.STAGE_BATCH_ASSEMBLY, semconv.STAGE_H2D, semconv.STAGE_COMPUTE, semconv.STAGE_D2H,
    semconv.STAGE_POSTPROCESS, semconv.STAGE_SERIALIZE,
)


def _is_request_span(span, attrs) -> bool:
    return (span.kind in (trace_pb2.Span.SPAN_KIND_SERVER, trace_pb2.Span.SPAN_KIND_CONSUMER)
            or attrs.get(semconv.ATTR_REQUEST) is True)


async def _drive(url: str, prompts: list[str]) -> list[int]:
    limit = asyncio.Semaphore(10)  # concurrent, so batches really hold several requests
    async with httpx.AsyncClient(timeout=30) as client:
        async def one(text):
            async with limit:
                return (await client.post(url, json={"text": text})).status_code
        return await asyncio.gather(*(one(p) for p in prompts))


@pytest.mark.parametrize(
    "encoding", [semconv.BATCH_ENCODING_CHILDREN, semconv.BATCH_ENCODING_LINKS]
)
def test_every_request_trace_has_every_stage_inside_its_request_span(otlp_sink, encoding):
    settings = DemoSettings(instrumentation=semconv.MODE_FULL, model_size="tiny", max_batch_size=8,
                            max_delay_ms=5, endpoint=otlp_sink.endpoint,
                            service_name="demo-traces-test")
    service = ServiceProcess(settings, extra_env={ENV_BATCH_ENCODING: encoding})
    try:
        service.start()
        statuses = asyncio.run(_drive(service.url, build_prompts(count=REQUESTS, seed=7)))
    finally:
        service.close()  # graceful: the service flushes its spans before exiting
    assert statuses == [200] * REQUESTS

    def request_spans(sink):
        return [(r, s) for r, s in sink.spans() if _is_request_span(s, attributes(s))]

    assert otlp_sink.wait_for(lambda s: len(request_spans(s)) >= REQUESTS, timeout=20)
    spans = otlp_sink.spans()
    requests = {(s.trace_id, s.span_id): s for r, s in request_spans(otlp_sink)}
    assert len(requests) == REQUESTS
    assert all(r["service.name"] == "demo-traces-test" for r, _ in spans)

    # A stage belongs to a request when it is in the request's trace (children encoding)
    # or links to the request span (links encoding).
    by_request = defaultdict(list)
    for _, span in spans:
        attrs = attributes(span)
        stage = attrs.get(semconv.ATTR_STAGE)
        if stage is None:
            continue
        owners = [key for key in ((span.trace_id, p) for p in _ancestors(span, spans))
                  if key in requests]
        owners += [(link.trace_id, link.span_id) for link in span.links
                   if (link.trace_id, link.span_id) in requests]
        assert owners, f"stage span {stage} belongs to no request"
        for key in set(owners):
            by_request[key].append((stage, span, attrs))

    batch_stage_spans_with_links = 0
    for key, request in requests.items():
        stages = by_request[key]
        assert {name for name, _, _ in stages} >= set(DEMO_STAGES), (
            f"missing {set(DEMO_STAGES) - {n for n, _, _ in stages}}")
        for name, span, attrs in stages:
            assert span.name == semconv.span_name(name)
            assert request.start_time_unix_nano <= span.start_time_unix_nano
            assert span.end_time_unix_nano <= request.end_time_unix_nano, name
            if name in semconv.BATCH_STAGES:
                assert attrs[semconv.ATTR_BATCH_SIZE] >= 1
                assert attrs[semconv.ATTR_BATCH_ID]
                batch_stage_spans_with_links += bool(span.links)
            if name == semconv.STAGE_BATCH_ASSEMBLY:
                assert attrs[semconv.ATTR_TOKENS_PADDED] >= attrs[semconv.ATTR_TOKENS_EFFECTIVE] > 0
            if name in (semconv.STAGE_H2D, semconv.STAGE_D2H):
                assert attrs[semconv.ATTR_BYTES] > 0
    if encoding == semconv.BATCH_ENCODING_LINKS:
        assert batch_stage_spans_with_links > 0
    # Batching really happened: some batch held more than one request.
    sizes = {attributes(s)[semconv.ATTR_BATCH_SIZE] for _, s in spans
             if attributes(s).get(semconv.ATTR_STAGE) == semconv.STAGE_COMPUTE}
    assert max(sizes) > 1
    # Request contents are not recorded by default.
    texts = set(build_prompts(count=REQUESTS, seed=7))
    for _, span in spans:
        assert not any(isinstance(v, str) and v in texts for v in attributes(span).values())


def _ancestors(span, spans):
    """span ids of the span and its ancestors within its trace."""
    by_id = {(s.trace_id, s.span_id): s for _, s in spans}
    out, cur = [], span
    while cur is not None:
        out.append(cur.span_id)
        cur = by_id.get((cur.trace_id, cur.parent_span_id)) if cur.parent_span_id else None
    return out
