"""The demo model-serving service: FastAPI + a dynamic batcher + a real tokenizer and model.

``create_app()`` builds a service in which every stage of the span contract happens
for real: the middleware reads the body (``receive``) and writes the response
(``serialize``); the handler tokenizes (``tokenize``); the batcher holds the request
until a batch leaves (``queue``) and pads it (``batch_assembly``); the batch is copied
into preallocated buffers (``h2d``), run through the model (``compute``) and copied
back (``d2h``); the handler turns the scores into a label and top tokens
(``postprocess``). How much of that is traced depends on ``instrumentation``:

- ``none``: no telemetry code runs at all (a plain batcher; the overhead baseline);
- ``otel``: only ``opentelemetry-instrumentation-fastapi``, exporting its server spans;
- ``full`` / ``production`` / ``off``: inferprof, configured in that mode.

Run it with ``uvicorn --factory inferprof.demo.service:create_app`` (options from
``INFERPROF_DEMO_*`` env vars, see ``settings.py``) or let ``inferprof demo`` do it.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the handler's annotations
# at runtime, and the request model is local to create_app().
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from inferprof import semconv
from inferprof._optional import require
from inferprof.demo import host
from inferprof.demo.pipeline import DemoPipeline, RowOutput, no_stage
from inferprof.demo.settings import (
    INSTRUMENTATION_NONE,
    INSTRUMENTATION_OTEL,
    DemoSettings,
)

_log = logging.getLogger(__name__)

CLASSIFY_PATH = "/v1/classify"
HEALTH_PATH = "/healthz"
#: Longest accepted prompt, in characters; longer bodies get a 422, not a slow batch.
MAX_TEXT_CHARS = 20_000


def create_app(settings: DemoSettings | None = None, **overrides: Any) -> Any:
    """Build the demo FastAPI app. With no arguments, settings come from the environment."""
    if settings is None:
        settings = DemoSettings.from_env(**overrides)
    elif overrides:
        raise ValueError("pass either settings or keyword overrides, not both")
    fastapi = require("fastapi", "demo")
    pydantic = require("pydantic", "demo")

    telemetry = _Telemetry(settings)
    pipeline = DemoPipeline(settings, stage=telemetry.stage)
    counts = BatchCounts()
    batcher = telemetry.batcher(pipeline, counts)

    class ClassifyRequest(pydantic.BaseModel):
        text: str = pydantic.Field(min_length=1, max_length=MAX_TEXT_CHARS)

    gc_clock = host.GcClock()

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        if settings.gc_freeze:
            gc.collect()
            gc.freeze()  # see DemoSettings.gc_freeze
        thresholds = gc.get_threshold()
        if settings.gc_threshold:
            gc.set_threshold(settings.gc_threshold, *thresholds[1:])  # see DemoSettings
        gc_clock.install()
        try:
            yield
        finally:
            gc_clock.uninstall()
            gc.set_threshold(*thresholds)
            await batcher.stop()
            telemetry.shutdown()

    app = fastapi.FastAPI(title="inferprof demo", lifespan=lifespan,
                          **without_native_telemetry(fastapi.FastAPI))

    @app.get(HEALTH_PATH)
    async def healthz() -> dict[str, Any]:
        # Batch counts and telemetry counters let the overhead benchmark show that every
        # configuration batched alike and how much each one exported (health is untraced).
        return {"status": "ok", "instrumentation": settings.instrumentation,
                "batches": counts.batches, "batched_requests": counts.requests,
                "padded_tokens": counts.padded_tokens,
                "gc_collections": [g["collections"] for g in gc.get_stats()],
                "gc_threshold": list(gc.get_threshold()),
                "gc_seconds": list(gc_clock.seconds),
                "minor_faults": host.minor_faults(),
                "thread_cpu_s": host.thread_cpu_seconds(),
                "telemetry": telemetry.stats()}

    @app.post(CLASSIFY_PATH)
    async def classify(request: ClassifyRequest) -> dict[str, Any]:
        try:
            ids = pipeline.tokenize(request.text)
        except ValueError as exc:
            raise fastapi.HTTPException(status_code=422, detail=str(exc)) from None
        out: RowOutput = await batcher.submit(ids, tokens=len(ids))
        return pipeline.postprocess(ids, out)

    telemetry.instrument(app)
    app.state.settings = settings
    app.state.pipeline = pipeline
    return app


def without_native_telemetry(fastapi_class: Any) -> dict[str, Any]:
    """``FastAPI(...)`` keyword arguments that turn FastAPI's own OpenTelemetry off.

    Recent FastAPI releases trace every request themselves (a server span plus
    dependency/endpoint/serialization spans, and an HTTP duration histogram) as soon
    as a global tracer provider exists, which ``inferprof.configure()`` installs. The
    demo compares instrumentation choices, so each choice must bring only its own
    telemetry; older FastAPI versions have no such option and need nothing.
    """
    import inspect

    if "telemetry" not in inspect.signature(fastapi_class).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False,
                          "operation_spans": False, "auto_configure": False}}


class BatchCounts:
    """Batches run, requests and padded tokens in them, the same way in every configuration."""

    __slots__ = ("batches", "padded_tokens", "requests")

    def __init__(self) -> None:
        self.batches = 0
        self.requests = 0
        self.padded_tokens = 0

    def counted(self, run_batch: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def run(batch: Any) -> Any:
            # Three int adds per batch; only one batch runs at a time in the demo.
            self.batches += 1
            self.requests += len(batch.lengths)
            self.padded_tokens += batch.padded_tokens
            return run_batch(batch)

        return run


class _Telemetry:
    """The one place that knows how each instrumentation choice is wired."""

    def __init__(self, settings: DemoSettings) -> None:
        self.settings = settings
        self._provider: Any = None
        self.stage: Callable[..., Any]
        choice = settings.instrumentation
        self.inferprof = choice not in (INSTRUMENTATION_NONE, INSTRUMENTATION_OTEL)
        if self.inferprof:
            import inferprof

            kwargs: dict[str, Any] = {"service_name": settings.service_name, "mode": choice}
            if settings.endpoint:
                kwargs["endpoint"] = settings.endpoint
            inferprof.configure(**kwargs)
            self.stage = inferprof.stage
        else:
            self.stage = no_stage
            if choice == INSTRUMENTATION_OTEL:
                self._provider = _otel_provider(settings)

    def batcher(self, pipeline: DemoPipeline, counts: BatchCounts) -> Any:
        """The same batching algorithm in every configuration; only its telemetry differs."""
        s = self.settings
        run_batch = counts.counted(pipeline.run_batch)
        if self.inferprof:
            import inferprof
            from inferprof.batching.dynamic import Collated

            def collate(items: list) -> Collated:
                # Report real vs padded tokens on batch_assembly (the padding waste figure).
                batch = pipeline.collate(items)
                return Collated(batch, batch.effective_tokens, batch.padded_tokens)

            return inferprof.DynamicBatcher(
                run_batch, max_batch_size=s.max_batch_size, max_delay_ms=s.max_delay_ms,
                collate=collate, model_name=s.model_name,
            )
        from inferprof.demo.plain_batcher import PlainBatcher

        return PlainBatcher(run_batch, max_batch_size=s.max_batch_size,
                            max_delay_ms=s.max_delay_ms, collate=pipeline.collate)

    def stats(self) -> dict[str, int] | None:
        """inferprof's own counters (spans emitted/exported/dropped, traces kept)."""
        if not self.inferprof:
            return None
        from dataclasses import asdict

        from inferprof.instrumentation import stats

        snap = stats()
        return asdict(snap) if snap is not None else None

    def instrument(self, app: Any) -> None:
        if self.inferprof:
            from inferprof.fastapi import instrument

            instrument(app, excluded_paths=(HEALTH_PATH,), model_name=self.settings.model_name)
        elif self._provider is not None:
            instrumentor = require("opentelemetry.instrumentation.fastapi", "demo")
            instrumentor.FastAPIInstrumentor.instrument_app(
                app, tracer_provider=self._provider, excluded_urls=HEALTH_PATH
            )

    def shutdown(self) -> None:
        try:
            if self.inferprof:
                import inferprof

                inferprof.shutdown()
            elif self._provider is not None:
                self._provider.shutdown()
        except Exception:
            _log.exception("telemetry shutdown failed")


def _otel_provider(settings: DemoSettings) -> Any:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(
        resource=Resource.create({semconv.RESOURCE_SERVICE_NAME: settings.service_name})
    )
    exporter = (OTLPSpanExporter(endpoint=settings.endpoint, insecure=True)
                if settings.endpoint else OTLPSpanExporter())
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


__all__ = ["CLASSIFY_PATH", "HEALTH_PATH", "MAX_TEXT_CHARS", "create_app"]
