"""``inferprof demo --workload llm`` end to end: collector, LLM service, streaming load."""

import json
import re

import pytest
from click.testing import CliRunner

from inferprof import semconv
from inferprof.cli import main

pytestmark = pytest.mark.integration

# A tiny model and a KV cache of 32 blocks x 16 tokens (the longest prompt and output fit): 8 streams cannot all fit, so the
# engine evicts, whatever the machine's speed.
SHORT = ["demo", "--workload", "llm", "--duration", "4", "--concurrency", "8",
         "--model-size", "tiny", "--kv-blocks", "32"]


def test_llm_demo_json_has_client_engine_and_collector_figures():
    result = CliRunner().invoke(main, [*SHORT, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout[result.stdout.index("{"):])
    client, engine, breakdown = doc["client"], doc["engine"], doc["breakdown"]
    assert doc["settings"]["workload"] == "llm" and doc["settings"]["kv_blocks"] == 32
    assert client["errors"] == 0 and client["requests"] > 5, client["error_kinds"]
    assert client["output_tokens"] >= 8 * client["requests"]  # the shortest class is 8
    for key in ("ttft_s", "itl_s", "tpot_s"):
        q = client[key]
        assert 0 < q["p50"] <= q["p95"] <= q["p99"] <= q["max"]
    assert engine["evictions"] > 0
    # Every output token is sampled by a decode step or by the end of a prefill run (one
    # per request, one more per eviction).
    runs = client["requests"] + engine["evictions"]
    assert client["output_tokens"] - runs <= engine["decode_tokens"] <= client["output_tokens"]
    assert engine["kv_blocks"] == 32
    # Full mode: the collector saw the requests the client completed (a few may be missing
    # when the exporter is starved of CPU, never extra ones), with their host stages.
    seen = breakdown["requests"]
    assert 0.9 * client["requests"] <= seen <= client["requests"] + 8, (seen, client)
    stages = {s["stage"] for s in breakdown["stages"]}
    assert {semconv.STAGE_RECEIVE, semconv.STAGE_TOKENIZE, semconv.STAGE_QUEUE,
            semconv.STAGE_PREFILL, semconv.STAGE_DECODE, semconv.STAGE_PREEMPTED} <= stages
    # The generation section: every request generating, evictions seen as preemptions,
    # the KV-cache usage from the step spans, and the server's TTFT inside the client's
    # (test_demo_llm_traces.py matches them request by request).
    gen = breakdown["generation"]
    assert gen["requests"] == seen
    assert 0 < gen["preempted_requests"] <= engine["evictions"]
    assert gen["kv_cache"]["usage_p95"] > 0.5
    assert 0 < gen["ttft"]["p50"] <= client["ttft_s"]["p50"] * 1.02
    assert 0 < gen["ttft"]["p95"] <= client["ttft_s"]["p95"] * 1.02
    # Streams waiting for a KV cache too small for them: the definite verdict.
    assert gen["verdict"]["bottleneck"] == semconv.VERDICT_KV_CACHE, gen["verdict"]


def test_llm_demo_prints_client_figures_engine_counts_and_a_verdict():
    result = CliRunner().invoke(
        main, [*SHORT, "--trace-url", "http://jaeger:16686/trace/{trace_id}"],
        catch_exceptions=False)
    assert result.exit_code == 0, result.output
    out = result.output
    # --trace-url: the slow traces listed are links
    listed = out[out.index("slowest traces (ms):"):]
    assert re.search(r"http://jaeger:16686/trace/[0-9a-f]{32}\b", listed)
    assert "  trace " not in listed
    assert "client:" in out and "tokens/s" in out
    for figure in ("ttft", "itl", "tpot"):
        assert f"        {figure} " in out
    assert "engine:" in out and "evictions" in out
    assert f"generation verdict: {semconv.VERDICT_KV_CACHE}" in out


def test_llm_demo_options_are_checked():
    runner = CliRunner()
    result = runner.invoke(main, ["demo", "--kv-blocks", "8"])
    assert result.exit_code != 0 and "need --workload llm" in result.output
    result = runner.invoke(main, ["demo", "--workload", "llm", "--mode", "otel"])
    assert result.exit_code != 0 and "--mode" in result.output
    result = runner.invoke(main, ["demo", "--workload", "llm", "--model-size", "large"])
    assert result.exit_code != 0 and "--model-size" in result.output
    result = runner.invoke(main, ["demo", "--workload", "llm", "--output-mix", "huge=1"])
    assert result.exit_code != 0 and "--output-mix" in result.output
    assert "bad output mix entry 'huge=1'" in result.output
    result = runner.invoke(main, ["demo", "--workload", "llm", "--trace-url", "http://j/"])
    assert result.exit_code == 2 and "{trace_id}" in result.output
