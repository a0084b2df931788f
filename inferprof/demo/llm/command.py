"""``inferprof demo --workload llm``: the generating demo end to end.

The collector in-process on ephemeral 127.0.0.1 ports, the LLM demo service under
uvicorn in a child process exporting to it, the streaming load generator in another
child process; then what the client saw (TTFT, ITL, TPOT), what the engine did (steps,
evictions, prefill recomputed) and what the collector attributes (its breakdown,
including the ``generation`` section and its verdict). Everything started is stopped
before it returns, on errors too.
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

from inferprof import semconv
from inferprof.demo.breakdown import breakdown_lines, collect_breakdown
from inferprof.demo.llm.settings import LLMSettings

DEFAULT_CONCURRENCY = 16


def _echo(message: str, quiet: bool) -> None:
    if not quiet:
        import click

        click.echo(message, err=True)


def run_llm_demo(*, settings: LLMSettings, duration_s: float,
                 concurrency: int | None = DEFAULT_CONCURRENCY, rate: float | None = None,
                 prompt_mix: str | None = None, output_mix: str | None = None,
                 forward: tuple[str, ...] = (),
                 forward_headers: tuple[tuple[str, str], ...] = (),
                 trace_url: str | None = None, quiet: bool = True) -> dict[str, Any]:
    """Run the LLM demo; return ``{"settings", "client", "engine", "breakdown"}``.

    ``settings.endpoint`` is replaced by the in-process collector's. ``breakdown`` is the
    collector's contract §5 document (None when the service emits no spans, or the
    collector saw no request); with ``trace_url`` (a template with ``{trace_id}``) its
    slow traces carry their URL.
    """
    from dataclasses import asdict, replace

    from inferprof.collector.app import CollectorApp
    from inferprof.collector.settings import CollectorSettings
    from inferprof.demo.llm.processes import LLMServiceProcess, run_llm_loadgen

    traced = settings.instrumentation in (semconv.MODE_FULL, semconv.MODE_PRODUCTION)
    collector = CollectorApp(CollectorSettings(
        grpc_port=0, http_port=0, api_port=0, forward=tuple(forward),
        forward_headers=tuple(forward_headers))).start()
    try:
        settings = replace(settings, endpoint=collector.otlp_grpc_endpoint)
        _echo(f"collector: OTLP/gRPC {collector.otlp_grpc_endpoint}, API {collector.api_url}"
              + (f", forwarding to {', '.join(forward)}" if forward else ""), quiet)
        t0 = time.monotonic()
        service = LLMServiceProcess(settings).start()
        try:
            _echo(f"service:   {service.url} (pid {service.pid}, instrumentation "
                  f"{settings.instrumentation}, model {settings.model_size}, KV cache "
                  f"{settings.kv_blocks} blocks x {settings.block_size} tokens, "
                  f"{settings.max_batched_tokens} tokens/step, started in "
                  f"{time.monotonic() - t0:.1f} s)", quiet)
            load = (f"open loop, {rate:g} req/s" if rate is not None
                    else f"closed loop, {concurrency} concurrent streams")
            _echo(f"load:      {load} for {duration_s:g} s ...", quiet)
            client = run_llm_loadgen(service.url, duration_s=duration_s,
                                     concurrency=concurrency, rate=rate,
                                     prompt_mix=prompt_mix, output_mix=output_mix)
            engine = _health(service.base_url).get("engine")
        finally:
            service.close()  # SIGTERM: the service flushes its spans on the way out
        breakdown = None
        if traced:
            breakdown = collect_breakdown(collector, client["requests"],
                                          settings.service_name, trace_url)
    finally:
        collector.stop()
    run_settings = {k: v for k, v in asdict(settings).items() if k != "endpoint"}
    run_settings.update(duration_s=duration_s, concurrency=concurrency, rate=rate,
                        prompt_mix=prompt_mix, output_mix=output_mix, workload="llm")
    return {"settings": run_settings, "client": client, "engine": engine,
            "breakdown": breakdown}


def _health(base_url: str) -> dict[str, Any]:
    from inferprof.demo.service import HEALTH_PATH

    try:
        with urllib.request.urlopen(base_url + HEALTH_PATH, timeout=5) as resp:
            return dict(json.loads(resp.read()))
    except (OSError, ValueError):
        return {}


def render(result: dict[str, Any]) -> str:
    from inferprof.demo.llm.loadgen import format_summary

    lines = [format_summary(result["client"])]
    engine = result.get("engine")
    if engine:
        total = engine["prefill_tokens"] + engine["decode_tokens"]
        lines.append(
            f"engine: {engine['steps']} steps, {engine['decode_tokens']} decode + "
            f"{engine['prefill_tokens']} prefill tokens"
            + (f" ({engine['prefill_tokens'] / total:.0%} of tokens computed were prefill)"
               if total else "")
            + f", {engine['evictions']} evictions (KV cache {engine['kv_blocks']} blocks)")
    # The table ends with the generation section and its verdict (report/render.py).
    lines += ["", *breakdown_lines(result["breakdown"], result["settings"]["instrumentation"])]
    return "\n".join(lines)


__all__ = ["DEFAULT_CONCURRENCY", "render", "run_llm_demo"]
