"""CPU of the step API (``inferprof.Engine``) per emitted token and per engine step, against a
bare engine loop and against the OpenTelemetry SDK's own cost of one span per step; and the
spans and bytes a generating request exports.

    python3 benchmarks/generation_cost.py [--rounds 7] [--requests 64] [--output-tokens 256]

The workload is a continuous-batching loop with no model: ``batch`` slots, requests of
``--prompt-tokens`` prompt tokens (one prefill step) and ``--output-tokens`` output tokens,
a finished request's slot refilled at the next step. Its own bookkeeping (a Python list of
members per step, a token appended per member) is the bare row. Rows, each in a batch of 1
(one token per step: the step's cost shows) and of 32 (the token's cost shows), interleaved
over rounds, medians reported, CPU of the measuring thread (``time.thread_time``):

* bare: the loop alone (the baseline every "extra" is against);
* SDK span per step: the loop plus ``tracer.start_span()``, four attributes and ``end()``
  per step, on the same provider: the per-step target;
* inferprof off: ``configure(mode="off")``, the loop reporting to ``inferprof.Engine``;
* inferprof full: every request and step recorded and emitted;
* inferprof production: ``configure(mode="production")`` defaults (timing budget, tail
  sampling: most request traces are not kept; every step with a timed member is recorded,
  and sent as compact step spans of up to 256 steps, contract §14).

Spans go through a ``SimpleSpanProcessor`` into an exporter that discards them, so their
CPU is on the measured thread. Request spans, their stages and the step spans are all in
the figures: "per token" is the row's extra CPU over all tokens emitted, "per step" over all
steps. The second table encodes what one request exports with the real OTLP encoder
(``opentelemetry-exporter-otlp-proto-common``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import (  # noqa: E402
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

import inferprof  # noqa: E402
from inferprof import semconv  # noqa: E402


class Discard(SpanExporter):
    def __init__(self) -> None:
        self.spans: list = []
        self.keep = False

    def export(self, spans):
        if self.keep:
            self.spans.extend(spans)
        return SpanExportResult.SUCCESS


def run_loop(engine, requests: int, batch: int, prompt: int, output: int, tracer=None) -> tuple:
    """The engine loop: (steps, tokens). ``engine``: an ``inferprof.Engine`` or None (bare);
    ``tracer``: one SDK span per step."""
    pending = requests
    running: list[list] = []  # [handle, tokens left, output ids]
    steps = tokens = 0
    while pending or running:
        admitted = []
        while pending and len(running) + len(admitted) < batch:
            pending -= 1
            gen = engine.request(prompt_tokens=prompt) if engine is not None else None
            admitted.append([gen, output, []])
        span = tracer.start_span("engine_step") if tracer is not None else None
        if engine is not None:
            with engine.step() as step:
                for member in admitted:
                    step.prefill(member[0], prompt)
                for member in running:
                    step.decode(member[0])
        else:
            members = admitted + running  # what the scheduler hands the model
            len(members)
        if span is not None:
            span.set_attributes({
                semconv.ATTR_ENGINE_ID: "0",
                semconv.ATTR_STEP_PREFILL_TOKENS: prompt * len(admitted),
                semconv.ATTR_STEP_DECODE_TOKENS: len(running),
                semconv.ATTR_STEP_REQUESTS: len(admitted) + len(running),
            })
            span.end()
        steps += 1
        running.extend(admitted)
        still = []
        for member in running:
            member[2].append(steps)  # the sampled token id
            member[1] -= 1
            tokens += 1
            if member[1] == 0:
                if member[0] is not None:
                    member[0].finish()
            else:
                still.append(member)
        running = still
    return steps, tokens


def measure(args) -> dict:
    exporter = Discard()
    tp = TracerProvider(resource=Resource.create({"service.name": "bench"}))
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = tp.get_tracer("bench")
    rows = ("bare", "SDK span per step", "inferprof off", "inferprof full",
            "inferprof production")
    results: dict[tuple[str, int], list[float]] = {}
    counts: dict[int, tuple[int, int]] = {}
    for r in range(args.rounds):
        for batch in (1, 32):
            n_requests = args.requests if batch > 1 else max(2, args.requests // 16)
            order = list(rows)[r % len(rows):] + list(rows)[: r % len(rows)]
            for name in order:
                engine = None
                use_tracer = None
                if name == "SDK span per step":
                    use_tracer = tracer
                elif name.startswith("inferprof"):
                    mode = name.split()[1]
                    inferprof.configure(tracer_provider=tp, mode=mode, set_global=False)
                    engine = inferprof.Engine()
                    run_loop(engine, 2, batch, args.prompt_tokens, 16)  # warm-up
                t0 = time.thread_time()
                steps, tokens = run_loop(engine, n_requests, batch, args.prompt_tokens,
                                         args.output_tokens, use_tracer)
                elapsed = time.thread_time() - t0
                if engine is not None:
                    inferprof.shutdown()
                counts[batch] = (steps, tokens)
                results.setdefault((name, batch), []).append(elapsed)
    return {"results": results, "counts": counts, "rows": rows}


def _generate_one(args: argparse.Namespace) -> None:
    """One request of ``--output-tokens`` tokens through a fresh engine, a step (with its
    ``compute`` stage) per token; then inferprof is shut down, which flushes its spans."""
    engine = inferprof.Engine()
    with inferprof.request(model="m"):
        gen = engine.request(prompt_tokens=args.prompt_tokens)
        for i in range(args.output_tokens):
            with engine.step(kv_cache_usage=0.5) as step:
                if i == 0:
                    step.prefill(gen, args.prompt_tokens)
                else:
                    step.decode(gen)
                with inferprof.stage("compute"):
                    pass
        gen.finish()
    inferprof.shutdown()


def request_bytes(args) -> list[tuple[str, int, int]]:
    """(what, spans, bytes) one request of ``--output-tokens`` tokens exports, in full mode."""
    exporter = Discard()
    exporter.keep = True
    tp = TracerProvider(resource=Resource.create({"service.name": "bench"}))
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    inferprof.configure(tracer_provider=tp, mode="full", set_global=False)
    _generate_one(args)
    spans = exporter.spans
    steps = [s for s in spans if s.name == semconv.ENGINE_STEP_SPAN_NAME]
    step_ids = {s.context.span_id for s in steps}
    step_stages = [s for s in spans if s.parent is not None and s.parent.span_id in step_ids]
    own = [s for s in spans if s not in steps and s not in step_stages]

    def size(group):
        return len(encode_spans(group).SerializeToString())

    # production mode: the same request's steps as compact step spans (§14)
    exporter.spans = []
    inferprof.configure(tracer_provider=tp, mode="production", sample_rate=1.0,
                        set_global=False)
    _generate_one(args)
    compact = [s for s in exporter.spans if s.name == semconv.ENGINE_STEPS_SPAN_NAME]

    one_step = size([steps[1]])
    one_step_with_stage = size([steps[1], next(s for s in step_stages
                                               if s.parent.span_id == steps[1].context.span_id)])
    return [
        ("the request's own trace (request span + queue, prefill, decode)", len(own), size(own)),
        ("one step span, alone in an export", 1, one_step),
        ("one step span with its compute stage", 2, one_step_with_stage),
        (f"its {len(steps)} steps in a batch of 1 (with compute stages)",
         len(steps) + len(step_stages), size(steps + step_stages)),
        (f"its share of those steps in a batch of 32 (1/32 of them)",
         round((len(steps) + len(step_stages)) / 32), size(steps + step_stages) // 32),
        (f"production: its {len(steps)} steps as compact step spans",
         len(compact), size(compact)),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--requests", type=int, default=64, help="requests per round, batch 32")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=256)
    args = ap.parse_args()

    m = measure(args)
    results, counts, rows = m["results"], m["counts"], m["rows"]
    med = {key: statistics.median(vals) for key, vals in results.items()}
    print(f"CPU of the engine loop's thread, median of {args.rounds} rounds; requests of "
          f"{args.prompt_tokens} prompt + {args.output_tokens} output tokens; spans to a "
          "discarding exporter (SimpleSpanProcessor).\n")
    print("| batch | row | CPU per step (µs) | x bare | extra per token (µs) "
          "| extra per step (µs) | extra per step / SDK span's |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for batch in (1, 32):
        steps, tokens = counts[batch]
        base = med[("bare", batch)]
        sdk_extra = (med[("SDK span per step", batch)] - base) / steps
        for name in rows:
            value = med[(name, batch)]
            extra = value - base
            ratio = "-" if name == "bare" else f"{extra / steps / sdk_extra:.2f}"
            print(f"| {batch} | {name} | {value / steps * 1e6:.2f} | {value / base:.2f} | "
                  f"{extra / tokens * 1e6:+.2f} | {extra / steps * 1e6:+.2f} | {ratio} |")
    print(f"\n(batch 1: {counts[1][0]} steps, {counts[1][1]} tokens per round; batch 32: "
          f"{counts[32][0]} steps, {counts[32][1]} tokens per round)\n")

    print("Against the targets (µs of CPU; the step's fixed cost is batch 1's extra per step, "
          "its one token included; a token's marginal cost is what 31 more members add to a "
          "step at batch 32):\n")
    print("| mode | step fixed | SDK span per step | ratio (target <= 1) "
          "| token, marginal | token, all-in at batch 32 (target <= 2) |")
    print("|---|---:|---:|---:|---:|---:|")
    steps1, _ = counts[1]
    steps32, tokens32 = counts[32]
    sdk = (med[("SDK span per step", 1)] - med[("bare", 1)]) / steps1
    for name in ("inferprof full", "inferprof production", "inferprof off"):
        step1 = (med[(name, 1)] - med[("bare", 1)]) / steps1
        step32 = (med[(name, 32)] - med[("bare", 32)]) / steps32
        marginal = (step32 - step1) / (tokens32 / steps32 - 1)
        all_in = (med[(name, 32)] - med[("bare", 32)]) / tokens32
        print(f"| {name.split()[1]} | {step1 * 1e6:.2f} | {sdk * 1e6:.2f} | {step1 / sdk:.2f} "
              f"| {marginal * 1e6:.2f} | {all_in * 1e6:.2f} |")
    print()

    print(f"What one request of {args.output_tokens} output tokens exports (full mode), "
          "encoded as an OTLP ExportTraceServiceRequest:\n")
    print("| what | spans | bytes |")
    print("|---|---:|---:|")
    for what, n, nbytes in request_bytes(args):
        print(f"| {what} | {n} | {nbytes} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
