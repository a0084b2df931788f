"""``inferprof demo``: the whole loop on one machine, in well under a minute.

It starts the collector in-process on ephemeral 127.0.0.1 ports, starts the demo
service under uvicorn in a child process exporting OTLP/gRPC to that collector,
drives it with the load generator in a second child process, stops the service
(which flushes its telemetry), and prints two views of the same run: what the
client saw (throughput, p50/p95/p99) and what the collector attributes, stage by
stage, at the tail (each stage's p50/p95/p99, its share of p95, the verdict and its
evidence). Everything it starts is stopped before it returns, on errors too.

The default load is an open loop well below the service's capacity against a batcher
that holds each batch up to 50 ms to fill: the tail is requests waiting for the batcher,
and the run ends with a definite verdict (``batching``) and what to do next. A closed loop
of more clients than a batch holds (``--concurrency 48 --max-delay-ms 5 --model-size
small``) shows the other
case: requests waiting behind the model.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from typing import Any

import click

from inferprof import semconv
from inferprof._optional import require
from inferprof.collector.command import trace_url_option
from inferprof.demo.breakdown import breakdown_lines, collect_breakdown
from inferprof.demo.settings import (
    INSTRUMENTATIONS,
    DemoSettings,
)

DEFAULT_DURATION_S = 20.0
DEFAULT_CONCURRENCY = 48
#: The command's default load: an open loop at this rate, against a batcher that holds a
#: batch up to ``DEFAULT_CLI_MAX_DELAY_MS`` to fill.
DEFAULT_RATE = 50.0
DEFAULT_CLI_MAX_DELAY_MS = 50.0
DEFAULT_CLI_MODEL_SIZE = "tiny"
SERVICE_NAME = "inferprof-demo"
LLM_SERVICE_NAME = "inferprof-demo-llm"
LLM_MODEL_SIZE = "small"
WORKLOAD_CLASSIFY = "classify"
WORKLOAD_LLM = "llm"


def _header(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> Any:
    from inferprof.collector.command import header_option  # as collect's

    return header_option(ctx, param, values)


def _echo(message: str, quiet: bool) -> None:
    if not quiet:
        click.echo(message, err=True)


@click.command("demo")
@click.option("--duration", type=click.FloatRange(min=0.5), default=DEFAULT_DURATION_S,
              show_default=True, help="Seconds of load.")
@click.option("--concurrency", type=click.IntRange(min=1), default=None,
              help="Closed loop: this many concurrent clients instead of the open loop.")
@click.option("--rate", type=click.FloatRange(min=0.1), default=None,
              help="Open loop: requests per second (Poisson arrivals) "
                   f"[default: {DEFAULT_RATE:g}].")
@click.option("--burst", type=click.IntRange(min=1), default=1, show_default=True,
              help="Open loop: requests arriving together.")
@click.option("--mode", type=click.Choice(INSTRUMENTATIONS), default=semconv.MODE_FULL,
              show_default=True,
              help="Instrumentation of the service: inferprof full/production/off, "
                   "otel (opentelemetry-instrumentation-fastapi only) or none.")
@click.option("--model-size", type=click.Choice(["tiny", "small", "medium", "large"]),
              default=None,
              help=f"Size of the demo model [default: {DEFAULT_CLI_MODEL_SIZE}; "
                   f"{LLM_MODEL_SIZE} for --workload llm, which has tiny and small].")
@click.option("--max-batch-size", type=click.IntRange(min=1), default=16, show_default=True,
              help="The dynamic batcher's largest batch.")
@click.option("--max-delay-ms", type=click.FloatRange(min=0), default=DEFAULT_CLI_MAX_DELAY_MS,
              show_default=True,
              help="A batch runs when full or when its oldest request has waited this long.")
@click.option("--forward", "forward", multiple=True, metavar="URL",
              help="Also re-export every span to this OTLP endpoint, e.g. Jaeger's "
                   "otlp-grpc://127.0.0.1:4317 (repeatable).")
@click.option("--forward-header", "forward_headers", multiple=True, metavar="KEY=VALUE",
              callback=_header,
              help="Header/metadata sent with forwarded exports, e.g. "
                   "'authorization=Bearer TOKEN' for a collector with a token (repeatable).")
@click.option("--service-name", default=None,
              help=f"service.name of the demo service [default: {SERVICE_NAME}, "
                   f"{LLM_SERVICE_NAME} for --workload llm].")
@click.option("--workload", type=click.Choice([WORKLOAD_CLASSIFY, WORKLOAD_LLM]),
              default=WORKLOAD_CLASSIFY, show_default=True,
              help="classify: batched classification; llm: streaming generation with "
                   "continuous batching (docs/demo.md, 'The LLM demo').")
@click.option("--kv-blocks", type=click.IntRange(min=1), default=None,
              help="llm: KV-cache size in blocks of 16 tokens [default: 96].")
@click.option("--max-batched-tokens", type=click.IntRange(min=1), default=None,
              help="llm: tokens per engine step, prefill chunks and decode together "
                   "[default: 256].")
@click.option("--max-running", type=click.IntRange(min=1), default=None,
              help="llm: requests in the running batch at most [default: 16].")
@click.option("--prompt-mix", default=None, metavar="MIX",
              help="llm: prompt lengths, e.g. short=0.5,medium=0.3,long=0.2.")
@click.option("--output-mix", default=None, metavar="MIX",
              help="llm: output lengths (max_tokens), e.g. short=0.5,medium=0.35,long=0.15.")
@trace_url_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of tables.")
def demo(duration: float, concurrency: int | None, rate: float | None, burst: int, mode: str,
         model_size: str | None, max_batch_size: int, max_delay_ms: float, forward: tuple[str, ...],
         forward_headers: tuple[tuple[str, str], ...] | None, service_name: str | None,
         workload: str, kv_blocks: int | None, max_batched_tokens: int | None,
         max_running: int | None, prompt_mix: str | None, output_mix: str | None,
         trace_url: str | None, as_json: bool) -> None:
    """Run the demo service under load and print where its requests' time goes."""
    if concurrency is not None and rate is not None:
        raise click.UsageError("choose --concurrency (closed loop) or --rate (open loop), not both")
    if forward_headers and not forward:
        raise click.UsageError("--forward-header needs --forward")
    if service_name is not None and not service_name.strip():
        raise click.BadParameter("must not be empty", param_hint="--service-name")
    llm_options = (kv_blocks, max_batched_tokens, max_running, prompt_mix, output_mix)
    if workload == WORKLOAD_LLM:
        _demo_llm(duration=duration, concurrency=concurrency, rate=rate, burst=burst, mode=mode,
                  model_size=model_size or LLM_MODEL_SIZE, forward=forward,
                  forward_headers=forward_headers or (),
                  service_name=(service_name or LLM_SERVICE_NAME).strip(), kv_blocks=kv_blocks,
                  max_batched_tokens=max_batched_tokens, max_running=max_running,
                  prompt_mix=prompt_mix, output_mix=output_mix, trace_url=trace_url,
                  as_json=as_json)
        return
    if any(v is not None for v in llm_options):
        raise click.UsageError("--kv-blocks, --max-batched-tokens, --max-running, "
                               "--prompt-mix and --output-mix need --workload llm")
    if rate is None and concurrency is None:
        rate = DEFAULT_RATE
    service_name = SERVICE_NAME if service_name is None else service_name
    model_size = model_size or DEFAULT_CLI_MODEL_SIZE
    _require_demo_extra()
    try:
        result = run_demo(duration_s=duration, concurrency=concurrency, rate=rate, burst=burst,
                          mode=mode, model_size=model_size, max_batch_size=max_batch_size,
                          max_delay_ms=max_delay_ms, forward=forward,
                          forward_headers=forward_headers or (),
                          service_name=service_name.strip(), trace_url=trace_url,
                          quiet=as_json)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--forward") from exc
    except (RuntimeError, OSError) as exc:  # a child failed to start, a port was refused...
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(render(result))


def _demo_llm(*, duration: float, concurrency: int | None, rate: float | None, burst: int,
              mode: str, model_size: str, forward: tuple[str, ...],
              forward_headers: tuple[tuple[str, str], ...], service_name: str,
              kv_blocks: int | None, max_batched_tokens: int | None, max_running: int | None,
              prompt_mix: str | None, output_mix: str | None, trace_url: str | None,
              as_json: bool) -> None:
    from inferprof.demo.llm.command import DEFAULT_CONCURRENCY as LLM_CONCURRENCY
    from inferprof.demo.llm.command import render as render_llm
    from inferprof.demo.llm.command import run_llm_demo
    from inferprof.demo.llm.loadgen import parse_output_mix
    from inferprof.demo.llm.settings import LLM_INSTRUMENTATIONS, LLM_MODEL_SIZES, LLMSettings
    from inferprof.demo.loadgen import parse_mix

    if burst != 1:
        raise click.UsageError("--burst is for the classify workload")
    if mode not in LLM_INSTRUMENTATIONS:
        raise click.BadParameter(f"--workload llm takes {', '.join(LLM_INSTRUMENTATIONS)}",
                                 param_hint="--mode")
    if model_size not in LLM_MODEL_SIZES:
        raise click.BadParameter(f"--workload llm takes {', '.join(LLM_MODEL_SIZES)}",
                                 param_hint="--model-size")
    for value, parse, hint in ((prompt_mix, parse_mix, "--prompt-mix"),
                               (output_mix, parse_output_mix, "--output-mix")):
        if value is not None:
            try:
                parse(value)
            except ValueError as exc:
                raise click.BadParameter(str(exc), param_hint=hint) from None
    _require_demo_extra()
    overrides = {"kv_blocks": kv_blocks, "max_batched_tokens": max_batched_tokens,
                 "max_running": max_running}
    settings = LLMSettings(instrumentation=mode, model_size=model_size,
                           service_name=service_name,
                           **{k: v for k, v in overrides.items() if v is not None})
    if rate is None and concurrency is None:
        concurrency = LLM_CONCURRENCY
    try:
        result = run_llm_demo(settings=settings, duration_s=duration, concurrency=concurrency,
                              rate=rate, prompt_mix=prompt_mix, output_mix=output_mix,
                              forward=forward, forward_headers=forward_headers,
                              trace_url=trace_url, quiet=as_json)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--forward") from exc
    except (RuntimeError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(json.dumps(result, indent=2) if as_json else render_llm(result))


def _require_demo_extra() -> None:
    # The demo's service and load generator run in child processes: a missing extra is
    # named here, in one line, rather than in a child's traceback.
    for module in ("fastapi", "uvicorn", "tokenizers", "httpx", "tqdm"):
        try:
            require(module, "demo")
        except ImportError as exc:
            raise click.ClickException(str(exc)) from None


def run_demo(*, duration_s: float = DEFAULT_DURATION_S,
             concurrency: int | None = DEFAULT_CONCURRENCY,
             rate: float | None = None, burst: int = 1, mode: str = semconv.MODE_FULL,
             model_size: str = "small", max_batch_size: int = 16, max_delay_ms: float = 5.0,
             forward: tuple[str, ...] = (),
             forward_headers: tuple[tuple[str, str], ...] = (),
             service_name: str = SERVICE_NAME, trace_url: str | None = None,
             quiet: bool = True) -> dict[str, Any]:
    """Run the demo end to end; return ``{"settings", "client", "breakdown"}``.

    ``breakdown`` is the collector's contract §5 document (None for modes that emit no
    inferprof stages — ``none``, ``off``, ``otel`` — or when the collector saw no request);
    with ``trace_url`` (a template with ``{trace_id}``) its slow traces carry their URL.
    """
    from inferprof.collector.app import CollectorApp
    from inferprof.collector.settings import CollectorSettings
    from inferprof.demo.processes import ServiceProcess, run_loadgen

    # Only inferprof's own modes emit stage spans; the collector folds traces that have them.
    traced = mode in (semconv.MODE_FULL, semconv.MODE_PRODUCTION)
    # ValueError for a bad forward URL, before anything starts.
    collector_settings = CollectorSettings(grpc_port=0, http_port=0, api_port=0,
                                           forward=tuple(forward),
                                           forward_headers=tuple(forward_headers))
    collector = CollectorApp(collector_settings).start()
    try:
        settings = DemoSettings(
            instrumentation=mode, model_size=model_size, max_batch_size=max_batch_size,
            max_delay_ms=max_delay_ms, service_name=service_name,
            endpoint=collector.otlp_grpc_endpoint,
        )
        _echo(f"collector: OTLP/gRPC {collector.otlp_grpc_endpoint}, API {collector.api_url}"
              + (f", forwarding to {', '.join(forward)}" if forward else ""), quiet)
        t0 = time.monotonic()
        service = ServiceProcess(settings).start()
        try:
            _echo(f"service:   {service.url} (pid {service.pid}, instrumentation {mode}, "
                  f"model {model_size}, batch <= {max_batch_size}, started in "
                  f"{time.monotonic() - t0:.1f} s)", quiet)
            load = (f"open loop, {rate:g} req/s" + (f" in bursts of {burst}" if burst > 1 else "")
                    if rate is not None else f"closed loop, {concurrency} concurrent clients")
            _echo(f"load:      {load} for {duration_s:g} s ...", quiet)
            client = run_loadgen(service.url, duration_s=duration_s, concurrency=concurrency,
                                 rate=rate, burst=burst)
        finally:
            service.close()  # SIGTERM: the service flushes its spans on the way out
        breakdown = None
        if traced:
            breakdown = collect_breakdown(collector, client["requests"], service_name,
                                          trace_url)
    finally:
        collector.stop()
    return {
        "settings": {"mode": mode, "model_size": model_size, "max_batch_size": max_batch_size,
                     "max_delay_ms": max_delay_ms, "duration_s": duration_s,
                     "concurrency": concurrency, "rate": rate, "burst": burst},
        "client": client,
        "breakdown": breakdown,
    }


def render(result: dict[str, Any]) -> str:
    from inferprof.demo.loadgen import format_summary

    doc = result["breakdown"]
    lines = [format_summary(result["client"]), "",
             *breakdown_lines(doc, result["settings"]["mode"])]
    if doc is not None:
        lines += ["", *next_steps(command_name(sys.argv[0], shutil.which("inferprof")))]
    return "\n".join(lines)


def command_name(argv0: str, on_path: str | None) -> str:
    """How to run this command again: ``inferprof`` when that name on PATH is this
    program, else the path it was started by (``.venv/bin/inferprof``, the README's
    first command, whose venv is not activated)."""
    if os.path.basename(argv0) != "inferprof":  # python -m ..., a test runner
        return "inferprof"
    if on_path and os.path.realpath(on_path) == os.path.realpath(argv0):
        return "inferprof"
    return argv0


def next_steps(prog: str = "inferprof") -> tuple[str, ...]:
    """What the demo suggests after its breakdown, ``prog`` being how to run inferprof."""
    return (
        "what to try next:",
        "  - instrument your own service: inferprof.configure() +"
        " inferprof.fastapi.instrument(app) (README, docs/instrumenting.md)",
        f"  - record now, report later: {prog} demo --forward file:///tmp/run.otlp, then"
        f" {prog} report /tmp/run.otlp --html report.html",
        f"  - see a slow request's trace: start Jaeger, then {prog} demo --forward"
        " otlp-grpc://127.0.0.1:4317 (docs/demo.md)",
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(demo())
