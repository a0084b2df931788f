import asyncio
import json
import random

import pytest

from inferprof.demo import loadgen
from inferprof.demo.loadgen import LoadResult, build_prompts, parse_mix, quantile, run_load


def test_nearest_rank_quantiles_on_a_known_set():
    values = list(range(1, 101))
    random.Random(1).shuffle(values)
    assert quantile(values, 0.5) == 50
    assert quantile(values, 0.95) == 95
    assert quantile(values, 0.99) == 99
    assert quantile(values, 1.0) == 100
    assert quantile(values, 0.0) == 1
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    # 10 values: p95 needs ceil(9.5) = 10th value
    assert quantile(list(range(10)), 0.95) == 9


def test_quantile_of_nothing_is_none_and_bad_q_is_rejected():
    assert quantile([], 0.5) is None
    with pytest.raises(ValueError):
        quantile([1.0], 1.5)


def test_summary_reports_throughput_and_quantiles():
    r = LoadResult(latencies_s=tuple(i / 1000 for i in range(1, 201)), errors=3, duration_s=2.0)
    s = r.summary()
    assert s["requests"] == 200 and s["errors"] == 3
    assert s["throughput_rps"] == 100.0
    assert s["latency_s"]["p50"] == 0.1 and s["latency_s"]["p99"] == 0.198
    assert "100.0 req/s" in loadgen.format_summary(s)
    empty = LoadResult(latencies_s=(), errors=0, duration_s=1.0).summary()
    assert empty["latency_s"]["p95"] is None
    assert "p95 -" in loadgen.format_summary(empty)


def test_one_mix_parser_serves_the_prompt_and_the_output_classes():
    from inferprof.demo.llm.loadgen import OUTPUT_CLASSES, parse_output_mix

    assert parse_mix("a=2, b=1", {"a": (1, 1), "b": (2, 2)}) == {"a": 2.0, "b": 1.0}
    assert parse_output_mix("long=1,short=3") == {"long": 1.0, "short": 3.0}
    # each mix names itself and its own classes in what it refuses
    with pytest.raises(ValueError, match=r"^bad output mix entry 'huge=1': .* short, medium, long$"):
        parse_output_mix("huge=1")
    with pytest.raises(ValueError, match=r"^output mix weights must be finite"):
        parse_output_mix("short=0")
    with pytest.raises(ValueError, match=r"^bad mix entry 'huge=1': .* short, medium, long$"):
        parse_mix("huge=1")
    with pytest.raises(ValueError, match=r"^mix weights must be finite"):
        parse_mix("short=nan")
    with pytest.raises(ValueError, match="bad mix entry 'c=1'"):
        parse_mix("c=1", {"a": (1, 1)})
    assert set(OUTPUT_CLASSES) == {"short", "medium", "long"}


def test_mix_parsing_and_prompt_lengths_follow_the_weights():
    assert parse_mix("short=1,long=0.5") == {"short": 1.0, "long": 0.5}
    for bad in ("tiny=1", "short", "short=-1", "short=0"):
        with pytest.raises(ValueError):
            parse_mix(bad)
    short = build_prompts({"short": 1.0}, count=50)
    long = build_prompts({"long": 1.0}, count=50)
    assert max(len(p) for p in short) < min(len(p) for p in long) * 2
    assert sum(map(len, long)) > 4 * sum(map(len, short))


class _Server:
    """A tiny HTTP/1.1 server: keep-alive, Content-Length or chunked bodies, optional 500s."""

    def __init__(self, chunked=False, fail_every=0, delay=0.0, keep_alive_s=None):
        self.chunked, self.fail_every, self.delay = chunked, fail_every, delay
        #: close a connection idle this long, as uvicorn does (timeout_keep_alive, 5 s)
        self.keep_alive_s = keep_alive_s
        self.requests = []
        self.connections = 0

    async def handle(self, reader, writer):
        self.connections += 1
        try:
            while True:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"),
                                                  self.keep_alive_s)
                except asyncio.TimeoutError:
                    return  # idle too long: closed by the server
                length = int(next(ln for ln in head.split(b"\r\n")
                                  if ln.lower().startswith(b"content-length")).split(b":")[1])
                body = json.loads(await reader.readexactly(length))
                self.requests.append(body)
                if self.delay:
                    await asyncio.sleep(self.delay)
                failing = self.fail_every and len(self.requests) % self.fail_every == 0
                status = 500 if failing else 200
                payload = b'{"ok": true}'
                if self.chunked:
                    writer.write(b"HTTP/1.1 %d X\r\nTransfer-Encoding: chunked\r\n\r\n" % status
                                 + b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload))
                else:
                    writer.write(b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n%s"
                                 % (status, len(payload), payload))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc):
        self.server.close()
        await self.server.wait_closed()


@pytest.mark.parametrize("chunked", [False, True])
async def test_closed_loop_keeps_connections_alive_and_counts_errors(chunked):
    async with _Server(chunked=chunked, fail_every=10) as srv:
        result = await run_load(f"http://127.0.0.1:{srv.port}", duration_s=0.5, concurrency=4,
                                progress=False)
    total = result.completed + result.errors
    assert total == len(srv.requests) > 20
    assert result.error_kinds == {"HTTP 500": len(srv.requests) // 10}
    assert srv.connections == 4  # keep-alive: one connection per client
    assert all(isinstance(r["text"], str) and r["text"] for r in srv.requests)


async def test_open_loop_offers_the_requested_rate_and_measures_from_arrival():
    async with _Server(delay=0.02) as srv:
        result = await run_load(f"http://127.0.0.1:{srv.port}/x", duration_s=1.0, rate=200,
                                progress=False, seed=3)
    assert 120 < result.completed < 300  # Poisson, mean 200 in one second
    assert result.errors == 0
    assert quantile(result.latencies_s, 0.5) >= 0.02


async def test_open_loop_reconnects_when_the_server_closed_an_idle_connection():
    # Bursts open several connections; between bursts most sit idle past the server's
    # keep-alive timeout and are closed by it. Reusing one is the client's problem, not
    # an error of the service: HTTP clients reconnect, and so must the load generator.
    async with _Server(keep_alive_s=0.05) as srv:
        result = await run_load(f"http://127.0.0.1:{srv.port}/x", duration_s=1.5, rate=40,
                                burst=8, progress=False, seed=1)
    assert result.completed > 20
    assert result.errors == 0, result.error_kinds
    assert srv.connections > 8  # idle connections were closed and replaced


async def test_dead_server_is_reported_not_raised():
    async with _Server() as srv:
        port = srv.port
    result = await run_load(f"http://127.0.0.1:{port}", duration_s=0.3, concurrency=2,
                            progress=False)
    assert result.completed == 0
    assert result.errors > 0 and "ConnectionRefusedError" in result.error_kinds
    assert result.errors < 100  # backs off instead of spinning


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError):
        asyncio.run(run_load("ftp://x", duration_s=1))
    with pytest.raises(ValueError):
        asyncio.run(run_load("http://127.0.0.1:1", duration_s=1, rate=5, concurrency=2))
    with pytest.raises(ValueError):
        asyncio.run(run_load("http://127.0.0.1:1", duration_s=0))


async def test_progress_bar_reports_on_stderr(capsys):
    async with _Server() as srv:
        result = await run_load(f"http://127.0.0.1:{srv.port}", duration_s=1.2, concurrency=2,
                                progress=True)
    err = capsys.readouterr().err
    assert result.completed > 0
    assert " ok, 0 errors" in err
