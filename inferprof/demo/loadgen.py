"""A cheap HTTP/1.1 load generator for the demo service (closed or open loop).

Why not httpx or aiohttp: on a 2-core machine the load generator competes with the
service for CPU, and a general-purpose client spends several times more CPU per
request than the service's own framework does, so the client would saturate first
and the figures would describe the client. This one keeps one asyncio stream per
keep-alive connection, sends request bytes built once up front, and parses only the
status line, ``Content-Length`` (or chunked framing) and the body length. That is
all a benchmark client needs; it speaks to the demo service and to any HTTP/1.1
server that answers plain JSON.

Two loops:

- **closed** (``concurrency=N``): N connections, each sends its next request as soon
  as the previous answer arrives. Latency is send -> last byte.
- **open** (``rate=R``): requests *arrive* as a Poisson process at R per second
  regardless of how fast the server answers (``burst`` > 1 makes them arrive in
  groups), each on an idle pooled connection or a new one. Latency is measured from
  the *scheduled* arrival, so a stalled server shows up as latency rather than
  silently lowering the offered load (no coordinated omission).

Quantiles are exact nearest-rank quantiles over every completed request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
import urllib.parse
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from inferprof.demo import corpus

DEFAULT_DURATION_S = 20.0
DEFAULT_CONCURRENCY = 32
DEFAULT_PATH = "/v1/classify"
DEFAULT_MIX = {"short": 0.6, "medium": 0.3, "long": 0.1}
#: An open loop opens at most this many connections; arrivals beyond it count as errors.
MAX_OPEN_LOOP_CONNECTIONS = 512
_REQUEST_TIMEOUT_S = 30.0
_ERROR_BACKOFF_S = 0.05


# --- prompts -----------------------------------------------------------------------

#: Prompt length classes, in sentences of the shipped text: (fewest, most).
PROMPT_CLASSES = {"short": (1, 1), "medium": (2, 4), "long": (6, 12)}


def parse_mix(spec: str, classes: Collection[str] = PROMPT_CLASSES, *,
              what: str = "mix") -> dict[str, float]:
    """Parse ``short=0.6,medium=0.3,long=0.1`` into weights, each name one of ``classes``
    (ValueError when malformed, its message naming the mix as ``what``)."""
    mix: dict[str, float] = {}
    for part in spec.split(","):
        name, sep, weight = part.partition("=")
        name = name.strip()
        if not sep or name not in classes:
            raise ValueError(f"bad {what} entry {part!r}: expected NAME=WEIGHT with NAME one of "
                             f"{', '.join(classes)}")
        mix[name] = float(weight)
    _check_weights(mix, what)
    return mix


def _check_weights(mix: dict[str, float], what: str) -> None:
    weights = list(mix.values())
    if not mix or any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise ValueError(f"{what} weights must be finite, >= 0 and not all 0; got {mix!r}")


def _check_mix(mix: dict[str, float]) -> None:
    _check_weights(mix, "mix")
    unknown = set(mix) - set(PROMPT_CLASSES)
    if unknown:
        raise ValueError(f"unknown prompt classes {sorted(unknown)}")


def build_prompts(mix: dict[str, float] | None = None, count: int = 256,
                  seed: int = 0) -> list[str]:
    """``count`` prompts drawn from the shipped text, lengths drawn by ``mix`` weight."""
    mix = dict(DEFAULT_MIX if mix is None else mix)
    _check_mix(mix)
    rng = random.Random(seed)
    sentences = [s for d in corpus.documents() for s in d.sentences]
    names = list(mix)
    prompts = []
    for _ in range(count):
        lo, hi = PROMPT_CLASSES[rng.choices(names, weights=[mix[n] for n in names])[0]]
        n = rng.randint(lo, hi)
        start = rng.randrange(len(sentences))
        prompts.append(" ".join(sentences[(start + i) % len(sentences)] for i in range(n)))
    return prompts


# --- results -------------------------------------------------------------------------

def quantile(values: Sequence[float], q: float) -> float | None:
    """Exact nearest-rank quantile: the smallest value with at least ``q`` of the data <= it.

    None for no data (never 0: an empty window has no latency).
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q!r}")
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered) - 1e-9))
    return ordered[rank - 1]


@dataclass(frozen=True)
class LoadResult:
    latencies_s: tuple[float, ...]
    errors: int
    duration_s: float
    error_kinds: dict[str, int] = field(default_factory=dict)

    @property
    def completed(self) -> int:
        return len(self.latencies_s)

    @property
    def throughput(self) -> float:
        return self.completed / self.duration_s if self.duration_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.completed,
            "errors": self.errors,
            "error_kinds": dict(self.error_kinds),
            "duration_s": round(self.duration_s, 3),
            "throughput_rps": round(self.throughput, 2),
            "latency_s": {
                "p50": quantile(self.latencies_s, 0.5),
                "p95": quantile(self.latencies_s, 0.95),
                "p99": quantile(self.latencies_s, 0.99),
                "max": max(self.latencies_s) if self.latencies_s else None,
            },
        }


def format_summary(summary: dict[str, Any]) -> str:
    lat = summary["latency_s"]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f} ms"

    line = (f"client: {summary['requests']} requests in {summary['duration_s']:.1f} s "
            f"({summary['throughput_rps']:.1f} req/s), {summary['errors']} errors; "
            f"latency p50 {ms(lat['p50'])}, p95 {ms(lat['p95'])}, p99 {ms(lat['p99'])}, "
            f"max {ms(lat['max'])}")
    if summary.get("error_kinds"):
        kinds = summary["error_kinds"].items()
        line += "\n        errors: " + ", ".join(f"{k} x{n}" for k, n in kinds)
    return line


# --- HTTP/1.1 ------------------------------------------------------------------------

class HttpError(Exception):
    """A non-2xx answer or a broken response."""


class _Connection:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, payload: bytes) -> int:
        """Send one pre-built request; return the status code after reading the whole body.

        A kept-alive connection the server has closed meanwhile (uvicorn closes one idle
        for 5 s) is replaced, and a request that met the close in flight, unanswered, is
        sent again once on a fresh connection, as HTTP clients do: that race is the
        client's, not an error of the service.
        """
        reused = not (self.writer is None or self.writer.is_closing()
                      or self.reader is None or self.reader.at_eof())
        if not reused:
            self.close()
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        try:
            return await self._exchange(payload)
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            unanswered = not isinstance(exc, asyncio.IncompleteReadError) or not exc.partial
            if not (reused and unanswered):
                raise
            self.close()
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            return await self._exchange(payload)

    async def _exchange(self, payload: bytes) -> int:
        assert self.reader is not None and self.writer is not None
        self.writer.write(payload)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise HttpError("malformed status line")
        status = int(parts[1])
        length = None
        chunked = close = False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif name == b"connection" and b"close" in value.lower():
                close = True
        if chunked:
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        elif length is not None:
            await self.reader.readexactly(length)
        else:  # no framing: the body runs to the end of the connection
            await self.reader.read()
            close = True
        if close:
            self.close()
        return status

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def _request_bytes(host: str, port: int, path: str, prompt: str) -> bytes:
    body = json.dumps({"text": prompt}).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


class _Recorder:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.errors: dict[str, int] = {}

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


async def _one(conn: _Connection, payload: bytes, started: float, rec: _Recorder) -> bool:
    """One request; False when the connection failed (the caller should back off)."""
    try:
        status = await asyncio.wait_for(conn.request(payload), _REQUEST_TIMEOUT_S)
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, HttpError,
            ValueError, asyncio.TimeoutError) as exc:
        conn.close()
        rec.error(type(exc).__name__)
        return False
    if 200 <= status < 300:
        rec.latencies.append(time.perf_counter() - started)
    else:
        rec.error(f"HTTP {status}")
    return True


# --- the loops -----------------------------------------------------------------------

async def run_load(url: str, *, duration_s: float = DEFAULT_DURATION_S,
                   concurrency: int | None = None, rate: float | None = None, burst: int = 1,
                   mix: dict[str, float] | None = None, seed: int = 0,
                   progress: bool | None = None) -> LoadResult:
    """Drive ``url`` (``http://host:port[/path]``) for ``duration_s`` seconds."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s!r}")
    if rate is not None and concurrency is not None:
        raise ValueError("choose a closed loop (concurrency) or an open loop (rate), not both")
    if rate is not None and rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate!r}")
    if burst < 1:
        raise ValueError(f"burst must be >= 1, got {burst!r}")
    if rate is None:
        concurrency = DEFAULT_CONCURRENCY if concurrency is None else concurrency
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency!r}")
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != "http" or not parsed.hostname:
        raise ValueError(f"url must be http://host:port[/path], got {url!r}")
    host, port = parsed.hostname, parsed.port or 80
    path = parsed.path if parsed.path not in ("", "/") else DEFAULT_PATH
    payloads = [_request_bytes(host, port, path, p) for p in build_prompts(mix, seed=seed)]
    rec = _Recorder()
    bar = _progress_bar(duration_s, progress)
    start = time.perf_counter()
    deadline = start + duration_s
    ticker = asyncio.get_running_loop().create_task(_tick(bar, rec, start, deadline))
    try:
        if rate is None:
            assert concurrency is not None
            await _closed_loop(host, port, payloads, concurrency, deadline, rec, seed)
        else:
            await _open_loop(host, port, payloads, rate, burst, deadline, rec, seed)
    finally:
        ticker.cancel()
        if bar is not None:
            bar.close()
    return LoadResult(latencies_s=tuple(rec.latencies), errors=sum(rec.errors.values()),
                      duration_s=time.perf_counter() - start, error_kinds=dict(rec.errors))


async def _closed_loop(host: str, port: int, payloads: list[bytes], concurrency: int,
                       deadline: float, rec: _Recorder, seed: int) -> None:
    async def worker(index: int) -> None:
        conn = _Connection(host, port)
        i = index * 7919 + seed
        try:
            while time.perf_counter() < deadline:
                i += 1
                if not await _one(conn, payloads[i % len(payloads)], time.perf_counter(), rec):
                    await asyncio.sleep(_ERROR_BACKOFF_S)  # do not spin on a dead server
        finally:
            conn.close()

    await asyncio.gather(*(worker(n) for n in range(concurrency)))


async def _open_loop(host: str, port: int, payloads: list[bytes], rate: float, burst: int,
                     deadline: float, rec: _Recorder, seed: int) -> None:
    rng = random.Random(seed)
    idle: list[_Connection] = []
    opened = 0
    tasks: set[asyncio.Task[None]] = set()

    async def send(payload: bytes, scheduled: float) -> None:
        nonlocal opened
        if idle:
            conn = idle.pop()
        elif opened < MAX_OPEN_LOOP_CONNECTIONS:
            opened += 1
            conn = _Connection(host, port)
        else:
            rec.error("client connection limit")
            return
        await _one(conn, payload, scheduled, rec)
        if conn.writer is not None:
            idle.append(conn)
        else:
            opened -= 1

    # Groups of `burst` requests arrive together, groups as a Poisson process, so the
    # mean offered load is `rate` whatever the burst size.
    next_at = time.perf_counter()
    i = 0
    while next_at < deadline:
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        for _ in range(burst):
            i += 1
            payload = payloads[i % len(payloads)]
            task = asyncio.get_running_loop().create_task(send(payload, next_at))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        next_at += rng.expovariate(rate / burst)
    if tasks:
        await asyncio.gather(*tasks)
    for conn in idle:
        conn.close()


def _progress_bar(duration_s: float, enabled: bool | None) -> Any:
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a nicety; the figures do not need it
        return None
    return tqdm(total=round(duration_s), unit="s", file=sys.stderr, leave=False,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} s {postfix}")


async def _tick(bar: Any, rec: _Recorder, start: float, deadline: float) -> None:
    if bar is None:
        return
    while True:
        await asyncio.sleep(0.5)
        now = min(time.perf_counter(), deadline)
        bar.n = round(now - start)
        bar.set_postfix_str(f"{len(rec.latencies)} ok, {sum(rec.errors.values())} errors")
        bar.refresh()


# --- command line ----------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inferprof.demo.loadgen",
                                     description="Drive the inferprof demo service.")
    parser.add_argument("url", help="http://host:port[/path] (path defaults to /v1/classify)")
    parser.add_argument("--duration", type=float, default=DEFAULT_DURATION_S, help="seconds")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--concurrency", type=int,
                       help=f"closed loop (default {DEFAULT_CONCURRENCY})")
    group.add_argument("--rate", type=float, help="open loop, requests per second")
    parser.add_argument("--burst", type=int, default=1, help="open loop: requests per arrival")
    parser.add_argument("--mix", type=parse_mix, default=None,
                        help="prompt lengths, e.g. short=0.6,medium=0.3,long=0.1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--latencies-out", metavar="FILE",
                        help="also write every request's latency (seconds), one per line")
    args = parser.parse_args(argv)
    try:
        result = asyncio.run(run_load(args.url, duration_s=args.duration,
                                      concurrency=args.concurrency, rate=args.rate,
                                      burst=args.burst, mix=args.mix, seed=args.seed))
    except ValueError as exc:
        parser.error(str(exc))
    except KeyboardInterrupt:  # Ctrl-C: stop quietly, like any command-line tool
        return 130
    summary = result.summary()
    if args.latencies_out:
        with open(args.latencies_out, "w", encoding="utf-8") as f:
            f.writelines(f"{v:.7f}\n" for v in result.latencies_s)
    print(json.dumps(summary) if args.json else format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
