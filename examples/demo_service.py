"""How to instrument a FastAPI model server with inferprof, in one page.

This is the demo service written the way you would write your own: a FastAPI route,
a tokenizer, a dynamic batcher and a model whose batch is copied to a device, run,
and copied back. Five additions make every stage of the request visible:

1. ``inferprof.configure()`` at start-up (where the spans go, which mode);
2. ``inferprof.fastapi.instrument(app)``: the request span, ``receive`` and ``serialize``;
3. ``inferprof.stage("tokenize")`` / ``("postprocess")`` around per-request work;
4. ``inferprof.DynamicBatcher``: ``queue`` and ``batch_assembly`` (with padding figures);
5. ``inferprof.stage("h2d" | "compute" | "d2h")`` inside the batch function.

Run it (from the repository root) and send it a request::

    inferprof collect &                                   # or any OTLP collector
    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 uvicorn examples.demo_service:app
    curl -s localhost:8000/v1/classify -H 'content-type: application/json' \\
         -d '{"text": "The tide came in over the harbour wall."}'

See examples/README.md for every option.
"""

import contextlib
import gc

from fastapi import FastAPI
from pydantic import BaseModel, Field

import inferprof
import inferprof.fastapi
from inferprof.batching import Collated
from inferprof.demo.device import HostDevice
from inferprof.demo.model import build_model, collate
from inferprof.demo.tokenizer import build_tokenizer

MODEL_NAME = "demo-topic"
MAX_BATCH_SIZE = 16
MAX_TOKENS = 256

tokenizer = build_tokenizer()  # byte-level BPE, trained on the shipped text in ~50 ms
model = build_model(tokenizer, size="small")
device = HostDevice(MAX_BATCH_SIZE, MAX_TOKENS)  # preallocated "device" input buffers


def collate_batch(token_lists):
    """Pad to the longest sequence; tell inferprof how much of the batch is padding."""
    batch = collate(token_lists)
    return Collated(batch, tokens_effective=batch.effective_tokens,
                    tokens_padded=batch.padded_tokens)


def run_batch(batch):
    """The model call. Runs on the batcher's worker thread, once per batch."""
    with inferprof.stage("h2d") as s:
        on_device = device.to_device(batch)
        s.set_attribute(inferprof.semconv.ATTR_BYTES, on_device.nbytes)
    with inferprof.stage("compute"):
        out = model.forward(on_device.ids, on_device.mask)
    with inferprof.stage("d2h"):
        host, _ = device.to_host(out)
    # One result per request, in the order the requests were submitted.
    return [(host.logits[i], host.token_scores[i, :n]) for i, n in enumerate(batch.lengths)]


batcher = inferprof.DynamicBatcher(run_batch, max_batch_size=MAX_BATCH_SIZE, max_delay_ms=5,
                                   collate=collate_batch, model_name=MODEL_NAME)


@contextlib.asynccontextmanager
async def lifespan(app):
    # Endpoint, protocol and mode come from INFERPROF_* / OTEL_* environment variables
    # unless given here; configure() at start-up, never at import.
    inferprof.configure(service_name="demo-classifier")
    # Model and tokenizer are loaded: keep them out of full garbage collections, which
    # otherwise stall every request in flight (docs/overhead.md, "Garbage collection").
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        await batcher.stop()
        inferprof.shutdown()  # flushes the spans still buffered


app = FastAPI(lifespan=lifespan)
inferprof.fastapi.instrument(app, excluded_paths=("/healthz",), model_name=MODEL_NAME)


class ClassifyRequest(BaseModel):
    text: str = Field(min_length=1, max_length=20_000)


@app.get("/healthz")
async def healthz():
    return {"status": "ok"}


@app.post("/v1/classify")
async def classify(request: ClassifyRequest):
    with inferprof.stage("tokenize"):
        ids = tokenizer.encode(request.text).ids[:MAX_TOKENS]
    logits, token_scores = await batcher.submit(ids, tokens=len(ids))
    with inferprof.stage("postprocess"):
        best = int(logits.argmax())
        top = token_scores.argsort()[::-1][:5]
        return {
            "topic": model.topics[best],
            "top_tokens": [tokenizer.decode([ids[i]]).strip() for i in top],
        }
