"""Load for the LLM demo: streaming completions, with prompt- and output-length mixes.

Each request is ``POST /v1/completions`` with ``stream: true``, read as Server-Sent
Events with ``httpx`` (a real streaming client, as an application would use). The client
measures, per request, the time to first token (send -> the first ``data:`` chunk with a
token), every inter-token gap (between consecutive token chunks) and the end-to-end
latency, and prints exact nearest-rank p50/p95/p99 over all requests (TTFT) and over all
gaps of all requests (ITL).

Two loops, as the classify load generator: **closed** (``concurrency=N`` streams, each
sending its next request when the previous one ends) and **open** (``rate=R``: Poisson
arrivals, measured from the scheduled arrival, so a stalled server shows as latency).
Prompt lengths come from the classify demo's classes (``short`` one sentence of the
shipped text, ``medium`` 2-4, ``long`` 6-12); output lengths (``max_tokens``) from
:data:`OUTPUT_CLASSES`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from inferprof.demo.loadgen import build_prompts, parse_mix, quantile

DEFAULT_DURATION_S = 20.0
DEFAULT_CONCURRENCY = 16
#: ``max_tokens`` classes: (fewest, most), drawn uniformly within a class.
OUTPUT_CLASSES = {"short": (8, 32), "medium": (32, 96), "long": (96, 192)}
DEFAULT_OUTPUT_MIX = {"short": 0.5, "medium": 0.35, "long": 0.15}
DEFAULT_PROMPT_MIX = {"short": 0.5, "medium": 0.3, "long": 0.2}
_REQUEST_TIMEOUT_S = 120.0
_ERROR_BACKOFF_S = 0.05
#: An open loop keeps at most this many streams open; arrivals beyond it count as errors.
MAX_OPEN_STREAMS = 256


def parse_output_mix(spec: str) -> dict[str, float]:
    """Parse ``short=0.5,medium=0.35,long=0.15`` over :data:`OUTPUT_CLASSES` (ValueError
    when malformed)."""
    return parse_mix(spec, OUTPUT_CLASSES, what="output mix")


def build_requests(prompt_mix: dict[str, float] | None = None,
                   output_mix: dict[str, float] | None = None, count: int = 256,
                   seed: int = 0) -> list[tuple[str, int]]:
    """``count`` (prompt, max_tokens) pairs, drawn by the two mixes' weights."""
    prompts = build_prompts(dict(DEFAULT_PROMPT_MIX if prompt_mix is None else prompt_mix),
                            count=count, seed=seed)
    mix = dict(DEFAULT_OUTPUT_MIX if output_mix is None else output_mix)
    rng = random.Random(seed + 1)
    names = list(mix)
    out = []
    for prompt in prompts:
        lo, hi = OUTPUT_CLASSES[rng.choices(names, weights=[mix[n] for n in names])[0]]
        out.append((prompt, rng.randint(lo, hi)))
    return out


@dataclass
class StreamResult:
    """What the client saw of every request that completed."""

    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def summary(self) -> dict[str, Any]:
        def q(values: Sequence[float]) -> dict[str, float | None]:
            return {"p50": quantile(values, 0.5), "p95": quantile(values, 0.95),
                    "p99": quantile(values, 0.99), "max": max(values) if values else None}

        tpot = [(e - t) / (n - 1)
                for t, e, n in zip(self.ttft_s, self.e2e_s, self.tokens, strict=False)
                if n >= 2]
        d = self.duration_s
        return {
            "requests": len(self.e2e_s),
            "errors": sum(self.errors.values()),
            "error_kinds": dict(self.errors),
            "duration_s": round(d, 3),
            "throughput_rps": round(len(self.e2e_s) / d, 2) if d > 0 else 0.0,
            "output_tokens": sum(self.tokens),
            "tokens_per_s": round(sum(self.tokens) / d, 1) if d > 0 else 0.0,
            "ttft_s": q(self.ttft_s),
            "itl_s": q(self.itl_s),
            "tpot_s": q(tpot),
            "latency_s": q(self.e2e_s),
        }


def format_summary(summary: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f}"

    lines = [(f"client: {summary['requests']} requests in {summary['duration_s']:.1f} s "
              f"({summary['throughput_rps']:.1f} req/s, {summary['output_tokens']} tokens, "
              f"{summary['tokens_per_s']:.0f} tokens/s), {summary['errors']} errors")]
    for key, label in (("ttft_s", "ttft"), ("itl_s", "itl"), ("tpot_s", "tpot"),
                       ("latency_s", "end-to-end")):
        v = summary[key]
        lines.append(f"        {label:<11} p50 {ms(v['p50'])} ms, p95 {ms(v['p95'])} ms, "
                     f"p99 {ms(v['p99'])} ms, max {ms(v['max'])} ms")
    if summary.get("error_kinds"):
        lines.append("        errors: " + ", ".join(
            f"{k} x{n}" for k, n in summary["error_kinds"].items()))
    return "\n".join(lines)


async def _one(client: Any, url: str, prompt: str, max_tokens: int, started: float,
               rec: StreamResult) -> bool:
    """One streamed completion; False when it failed (the caller backs off)."""
    import httpx

    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    arrivals: list[float] = []
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                rec.error(f"HTTP {resp.status_code}")
                return resp.status_code < 500
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                if line[5:].strip() == "[DONE]":
                    done = True
                    break
                arrivals.append(time.perf_counter())
    except (httpx.HTTPError, OSError, ValueError) as exc:
        rec.error(type(exc).__name__)
        return False
    if not done or not arrivals:
        rec.error("stream ended early")
        return False
    rec.ttft_s.append(arrivals[0] - started)
    rec.itl_s.extend(b - a for a, b in itertools.pairwise(arrivals))
    rec.e2e_s.append(arrivals[-1] - started)
    rec.tokens.append(len(arrivals))
    return True


async def run_load(url: str, *, duration_s: float = DEFAULT_DURATION_S,
                   concurrency: int | None = None, rate: float | None = None,
                   prompt_mix: dict[str, float] | None = None,
                   output_mix: dict[str, float] | None = None, seed: int = 0) -> StreamResult:
    """Drive ``url`` (the ``/v1/completions`` URL) for ``duration_s`` seconds.

    Requests started before the deadline run to their end (their figures count); the
    load's duration is until the last one ended.
    """
    import httpx

    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s!r}")
    if rate is not None and concurrency is not None:
        raise ValueError("choose a closed loop (concurrency) or an open loop (rate), not both")
    if rate is not None and rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate!r}")
    if rate is None:
        concurrency = DEFAULT_CONCURRENCY if concurrency is None else concurrency
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency!r}")
    if not url.startswith("http://"):
        raise ValueError(f"url must be http://host:port/v1/completions, got {url!r}")
    work = build_requests(prompt_mix, output_mix, seed=seed)
    rec = StreamResult()
    limits = httpx.Limits(max_connections=MAX_OPEN_STREAMS,
                          max_keepalive_connections=MAX_OPEN_STREAMS)
    timeout = httpx.Timeout(_REQUEST_TIMEOUT_S)
    start = time.perf_counter()
    deadline = start + duration_s
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        if rate is None:
            assert concurrency is not None

            async def worker(index: int) -> None:
                i = index * 7919 + seed
                while time.perf_counter() < deadline:
                    i += 1
                    prompt, max_tokens = work[i % len(work)]
                    if not await _one(client, url, prompt, max_tokens, time.perf_counter(), rec):
                        await asyncio.sleep(_ERROR_BACKOFF_S)

            await asyncio.gather(*(worker(n) for n in range(concurrency)))
        else:
            await _open_loop(client, url, work, rate, deadline, rec, seed)
    rec.duration_s = time.perf_counter() - start
    return rec


async def _open_loop(client: Any, url: str, work: list[tuple[str, int]], rate: float,
                     deadline: float, rec: StreamResult, seed: int) -> None:
    rng = random.Random(seed)
    tasks: set[asyncio.Task[bool]] = set()
    next_at = time.perf_counter()
    i = 0
    while next_at < deadline:
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        i += 1
        if len(tasks) >= MAX_OPEN_STREAMS:
            rec.error("client stream limit")
        else:
            prompt, max_tokens = work[i % len(work)]
            task = asyncio.get_running_loop().create_task(
                _one(client, url, prompt, max_tokens, next_at, rec))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        next_at += rng.expovariate(rate)
    if tasks:
        await asyncio.gather(*tasks)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inferprof.demo.llm.loadgen",
                                     description="Stream completions from the LLM demo.")
    parser.add_argument("url", help="http://host:port/v1/completions")
    parser.add_argument("--duration", type=float, default=DEFAULT_DURATION_S, help="seconds")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--concurrency", type=int,
                       help=f"closed loop: concurrent streams (default {DEFAULT_CONCURRENCY})")
    group.add_argument("--rate", type=float, help="open loop: requests per second")
    parser.add_argument("--prompt-mix", type=parse_mix, default=None,
                        help="prompt lengths, e.g. short=0.5,medium=0.3,long=0.2")
    parser.add_argument("--output-mix", type=parse_output_mix, default=None,
                        help="output lengths, e.g. short=0.5,medium=0.35,long=0.15")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    try:
        result = asyncio.run(run_load(args.url, duration_s=args.duration,
                                      concurrency=args.concurrency, rate=args.rate,
                                      prompt_mix=args.prompt_mix, output_mix=args.output_mix,
                                      seed=args.seed))
    except ValueError as exc:
        parser.error(str(exc))
    except KeyboardInterrupt:
        return 130
    summary = result.summary()
    print(json.dumps(summary) if args.json else format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
