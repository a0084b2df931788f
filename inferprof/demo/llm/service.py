"""The LLM demo service: an OpenAI-style ``/v1/completions`` over the demo engine.

``POST /v1/completions`` takes ``{"prompt": str, "max_tokens": int, "stream": bool}``.
Streaming answers are Server-Sent Events, one ``data: {...}`` chunk per generated token
(OpenAI's ``text_completion`` chunk shape) and a final ``data: [DONE]``; otherwise one
JSON document with the text and ``usage``. The engine runs on its own thread
(:mod:`inferprof.demo.llm.engine`); each step's tokens come back to the event loop in
one ``call_soon_threadsafe`` and are put on each request's ``asyncio.Queue``. A client
that goes away mid-stream cancels its request, which frees its KV-cache blocks.

Run it with ``python -m inferprof.demo.llm.serve`` or let ``inferprof demo --workload
llm`` do it. Options: :class:`~inferprof.demo.llm.settings.LLMSettings`.
"""

# No ``from __future__ import annotations``: FastAPI reads the handler's annotations at
# runtime, and the request model is local to create_app().
import asyncio
import contextlib
import gc
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import Any

from inferprof._optional import require
from inferprof.demo.llm.engine import FINISH_ERROR, Delivery, Engine
from inferprof.demo.llm.instrument import EngineInstrument
from inferprof.demo.llm.model import TinyLM
from inferprof.demo.llm.scheduler import Scheduler
from inferprof.demo.llm.settings import LLMSettings
from inferprof.demo.service import HEALTH_PATH, without_native_telemetry
from inferprof.demo.settings import INSTRUMENTATION_NONE
from inferprof.demo.tokenizer import build_tokenizer

_log = logging.getLogger(__name__)

COMPLETIONS_PATH = "/v1/completions"
#: Longest accepted prompt, in characters (longer: 422).
MAX_PROMPT_CHARS = 20_000
#: Largest ``max_tokens`` accepted (larger: 422).
MAX_OUTPUT_TOKENS = 1024
_DONE = "data: [DONE]\n\n"


@contextlib.contextmanager
def _no_stage(name: str, **_: Any) -> Iterator[None]:
    yield


class Detokenizer:
    """Text of each new token, decoded incrementally (as vLLM does).

    Byte-level BPE tokens can end inside a UTF-8 character: a piece is decoded from a
    short window of recent tokens and held back while it ends in a replacement character,
    so every chunk is valid text and the cost per token does not grow with the output.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # the window's start
        self._read = 0  # tokens already turned into text

    def add(self, tokens: tuple[int, ...], final: bool = False) -> str:
        self._ids.extend(tokens)
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix:self._read])
        after = decode(self._ids[self._prefix:])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]


def create_app(settings: LLMSettings | None = None, *, instrument: EngineInstrument | None = None,
               **overrides: Any) -> Any:
    """Build the LLM demo app. With no arguments, settings come from the environment."""
    if settings is None:
        settings = LLMSettings.from_env(**overrides)
    elif overrides:
        raise ValueError("pass either settings or keyword overrides, not both")
    fastapi = require("fastapi", "demo")
    pydantic = require("pydantic", "demo")
    responses = require("fastapi.responses", "demo")

    telemetry = _Telemetry(settings)
    tokenizer = build_tokenizer()
    model = TinyLM(settings.model_config())
    state = _State(settings, telemetry.engine_instrument() if instrument is None else instrument)
    stage = telemetry.stage

    class CompletionRequest(pydantic.BaseModel):
        prompt: str = pydantic.Field(min_length=1, max_length=MAX_PROMPT_CHARS)
        max_tokens: int = pydantic.Field(default=16, ge=1, le=MAX_OUTPUT_TOKENS)
        stream: bool = False
        model: str | None = None

    app = fastapi.FastAPI(title="inferprof LLM demo",
                          lifespan=_lifespan(settings, model, state, telemetry),
                          **without_native_telemetry(fastapi.FastAPI))

    @app.get(HEALTH_PATH)
    async def healthz() -> dict[str, Any]:
        return state.health()

    @app.post(COMPLETIONS_PATH)
    async def completions(body: CompletionRequest) -> Any:
        engine = state.require_engine()
        if state.in_flight >= settings.max_in_flight:
            raise fastapi.HTTPException(status_code=429, detail="too many requests in flight")
        with stage("tokenize"):
            ids = tokenizer.encode(body.prompt).ids
        queue: asyncio.Queue[Delivery] = asyncio.Queue()
        try:
            req = engine.submit(ids, body.max_tokens, stream=queue)
        except ValueError as exc:
            raise fastapi.HTTPException(status_code=400, detail=str(exc)) from None
        state.in_flight += 1
        meta = {"id": f"cmpl-{req.id}", "created": int(time.time()),
                "model": body.model or settings.model_name}
        if body.stream:
            # The response starts with the first token, so a request that fails before it
            # still gets an error status, and the response's own time (serialize) begins
            # where the generation's output does.
            events = _events(engine, req, queue, Detokenizer(tokenizer), meta, state)
            first = await events.__anext__()
            if first == _DONE:
                await events.aclose()
                raise fastapi.HTTPException(status_code=500, detail="generation failed")
            return responses.StreamingResponse(
                _prepend(first, events), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        output, reason = await _collect(engine, req, queue, state)
        if reason == FINISH_ERROR:
            raise fastapi.HTTPException(status_code=500, detail="generation failed")
        with stage("postprocess"):
            text = tokenizer.decode(output)
        return {**meta, "object": "text_completion",
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": reason}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(output),
                          "total_tokens": len(ids) + len(output)}}

    telemetry.instrument(app)
    app.state.settings = settings
    app.state.llm = state
    return app


def _lifespan(settings: LLMSettings, model: TinyLM, state: "_State",
              telemetry: "_Telemetry") -> Callable[[Any], Any]:
    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        if settings.gc_freeze:
            gc.collect()
            gc.freeze()  # as the classify demo does (DemoSettings.gc_freeze)
        loop = asyncio.get_running_loop()
        scheduler = Scheduler(num_blocks=settings.kv_blocks, block_size=settings.block_size,
                              max_batched_tokens=settings.max_batched_tokens,
                              max_running=settings.max_running)
        state.engine = Engine(model, scheduler, _deliverer(loop), instrument=state.instrument)
        state.engine.start()
        try:
            yield
        finally:
            state.engine.stop()
            telemetry.shutdown()

    return lifespan


class _State:
    def __init__(self, settings: LLMSettings, instrument: EngineInstrument) -> None:
        self.settings = settings
        self.instrument = instrument
        self.engine: Engine | None = None
        self.in_flight = 0

    def health(self) -> dict[str, Any]:
        c = self.require_engine().counts
        return {"status": "ok", "instrumentation": self.settings.instrumentation,
                "in_flight": self.in_flight,
                "engine": {"steps": c.steps, "prefill_tokens": c.prefill_tokens,
                           "decode_tokens": c.decode_tokens, "evictions": c.evictions,
                           "finished": c.finished, "cancelled": c.cancelled,
                           "kv_blocks": self.settings.kv_blocks,
                           "kv_blocks_used": self.require_engine().scheduler.allocator.used}}

    def require_engine(self) -> Engine:
        if self.engine is None:
            raise RuntimeError("the LLM demo app is not started (run it with its lifespan)")
        return self.engine


def _deliverer(loop: asyncio.AbstractEventLoop) -> Callable[[list[Delivery]], None]:
    def dispatch(batch: list[Delivery]) -> None:
        for d in batch:
            d.request.stream.put_nowait(d)

    def deliver(batch: list[Delivery]) -> None:
        try:
            loop.call_soon_threadsafe(dispatch, batch)
        except RuntimeError:  # the loop has closed: nobody is waiting any more
            pass

    return deliver


async def _collect(engine: Engine, req: Any, queue: "asyncio.Queue[Delivery]",
                   state: _State) -> tuple[list[int], str]:
    """Every token of a non-streamed request, and why it ended."""
    output: list[int] = []
    reason = None
    try:
        while reason is None:
            delivery = await queue.get()
            output.extend(delivery.tokens)
            reason = delivery.finish_reason
    except BaseException:
        engine.cancel(req)  # the client went away: free the blocks
        raise
    finally:
        state.in_flight -= 1
    return output, reason


async def _events(engine: Engine, req: Any, queue: "asyncio.Queue[Delivery]",
                  detok: Detokenizer, meta: dict[str, Any],
                  state: _State) -> AsyncGenerator[str, None]:
    finished = False
    try:
        while not finished:
            delivery = await queue.get()
            finished = delivery.finish_reason is not None
            if delivery.finish_reason == FINISH_ERROR:
                break
            text = detok.add(delivery.tokens, final=finished)
            chunk = {**meta, "object": "text_completion",
                     "choices": [{"index": 0, "text": text, "logprobs": None,
                                  "finish_reason": delivery.finish_reason}]}
            yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
        yield _DONE
    finally:
        state.in_flight -= 1
        if not finished:  # the client went away mid-stream (or the app is stopping)
            engine.cancel(req)


async def _prepend(first: str,
                   events: AsyncGenerator[str, None]) -> AsyncGenerator[str, None]:
    """``first``, then the rest of ``events``; closing this closes ``events``.

    Were this never iterated (the client left before the response started), ``events``
    has started and is closed when collected, by the event loop's async-generator hooks:
    its ``finally`` cancels the request either way.
    """
    try:
        yield first
        async for chunk in events:
            yield chunk
    finally:
        await events.aclose()


class _Telemetry:
    """How each instrumentation choice is wired: nothing, or inferprof in a mode."""

    def __init__(self, settings: LLMSettings) -> None:
        self.settings = settings
        self.inferprof = settings.instrumentation != INSTRUMENTATION_NONE
        self.stage: Callable[..., Any] = _no_stage
        if self.inferprof:
            import inferprof

            kwargs: dict[str, Any] = {"service_name": settings.service_name,
                                      "mode": settings.instrumentation}
            if settings.endpoint:
                kwargs["endpoint"] = settings.endpoint
            inferprof.configure(**kwargs)
            self.stage = inferprof.stage

    def engine_instrument(self) -> EngineInstrument:
        if not self.inferprof:
            return EngineInstrument()
        from inferprof.demo.llm.telemetry import StepTelemetry

        return StepTelemetry(model=self.settings.model_name)

    def instrument(self, app: Any) -> None:
        if self.inferprof:
            from inferprof.fastapi import instrument

            instrument(app, excluded_paths=(HEALTH_PATH,), model_name=self.settings.model_name)

    def shutdown(self) -> None:
        if not self.inferprof:
            return
        try:
            import inferprof

            inferprof.shutdown()
        except Exception:
            _log.exception("telemetry shutdown failed")


__all__ = ["COMPLETIONS_PATH", "MAX_OUTPUT_TOKENS", "MAX_PROMPT_CHARS", "Detokenizer",
           "create_app"]
