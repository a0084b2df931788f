"""``inferprof demo`` end to end: collector, service under uvicorn, load generator, table."""

import json
import re
import sys

import pytest
from click.testing import CliRunner

from inferprof import semconv
from inferprof.cli import main
from inferprof.demo.command import command_name, next_steps

pytestmark = pytest.mark.integration

DEMO_STAGES = (
    semconv.STAGE_RECEIVE, semconv.STAGE_TOKENIZE, semconv.STAGE_QUEUE,
    semconv.STAGE_BATCH_ASSEMBLY, semconv.STAGE_H2D, semconv.STAGE_COMPUTE, semconv.STAGE_D2H,
    semconv.STAGE_POSTPROCESS, semconv.STAGE_SERIALIZE,
)


def test_demo_prints_client_figures_and_the_collectors_stage_table():
    result = CliRunner().invoke(main, ["demo", "--duration", "3", "--concurrency", "24",
                                       "--model-size", "tiny"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "client:" in out and "req/s" in out and "p99" in out
    table = out[out.index("stage"):]
    for stage in (*DEMO_STAGES, semconv.STAGE_UNATTRIBUTED):
        assert f"\n{stage} " in table, f"no row for {stage}"
    assert "share of p95" in table
    assert "verdict:" in table
    assert any(f"verdict: {v}" in table for v in semconv.VERDICTS)


def test_the_default_load_ends_with_a_definite_verdict_and_next_steps():
    # Only the duration differs from what a new user runs.
    result = CliRunner().invoke(main, ["demo", "--duration", "4"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "open loop, 50 req/s" in out
    assert "verdict: batching" in out, out
    assert "requests wait for the batcher" in out
    nxt = out[out.index("\nwhat to try next:"):]
    assert "instrument your own service" in nxt
    assert "inferprof report" in nxt and "--forward" in nxt


def test_next_steps_name_the_command_as_it_can_be_run_again(tmp_path):
    # The README's first command runs .venv/bin/inferprof without activating the venv:
    # "inferprof report ..." would be "command not found".
    exe = tmp_path / "bin" / "inferprof"
    exe.parent.mkdir()
    exe.write_text("")
    assert command_name(".venv/bin/inferprof", None) == ".venv/bin/inferprof"
    assert command_name(str(exe), "/usr/local/bin/inferprof") == str(exe)
    assert command_name(str(exe), str(exe)) == "inferprof"
    assert command_name("/usr/bin/pytest", None) == "inferprof"
    steps = "\n".join(next_steps(".venv/bin/inferprof"))
    assert ".venv/bin/inferprof report /tmp/run.otlp" in steps
    assert ".venv/bin/inferprof demo --forward otlp-grpc://" in steps


JAEGER = "http://localhost:16686/trace/{trace_id}"


def test_demo_json_matches_what_the_client_saw():
    result = CliRunner().invoke(main, ["demo", "--duration", "2", "--concurrency", "16",
                                       "--model-size", "tiny", "--json", "--trace-url", JAEGER],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout[result.stdout.index("{"):])
    client, breakdown = doc["client"], doc["breakdown"]
    assert client["errors"] == 0 and client["requests"] > 50
    # Full mode traces every request and the collector folds every trace it receives. The
    # service's exporter drops rather than blocks when starved of CPU (telemetry never slows
    # serving), so on a loaded CI machine a few traces may be missing - never extra ones.
    seen = breakdown["requests"]
    assert 0.9 * client["requests"] <= seen <= client["requests"], (seen, client)
    stages = {s["stage"]: s for s in breakdown["stages"]}
    assert set(DEMO_STAGES) <= set(stages)
    assert all(stages[s]["count"] == seen for s in DEMO_STAGES)
    assert sum(s["share_of_p95"] for s in breakdown["stages"]) == pytest.approx(1.0, abs=0.01)
    assert breakdown["padding"]["padded_tokens"] >= breakdown["padding"]["effective_tokens"] > 0
    assert breakdown["verdict"]["bottleneck"] in semconv.VERDICTS
    # --trace-url: each slow trace listed carries its link, as the collector's API gives it
    examples = breakdown["examples"]
    assert examples
    for ex in examples:
        assert ex["url"] == f"http://localhost:16686/trace/{ex['trace_id']}"


def test_demo_prints_its_slow_traces_as_links():
    result = CliRunner().invoke(main, ["demo", "--duration", "1", "--concurrency", "8",
                                       "--model-size", "tiny", "--trace-url", JAEGER],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    listed = result.output[result.output.index("slowest traces (ms):"):]
    links = re.findall(r"http://localhost:16686/trace/([0-9a-f]{32})\b", listed)
    assert links and "  trace " not in listed
    bad = CliRunner().invoke(main, ["demo", "--trace-url", "http://localhost:16686/trace/"])
    assert bad.exit_code == 2 and "{trace_id}" in bad.output


def test_demo_rejects_both_loops():
    result = CliRunner().invoke(main, ["demo", "--concurrency", "2", "--rate", "5"])
    assert result.exit_code != 0
    assert "not both" in result.output


def test_demo_forwards_every_span_to_another_otlp_backend(otlp_sink):
    # What a user does to see the demo's traces in Jaeger: --forward otlp-grpc://jaeger:4317
    # (with a header, as a collector that wants a token needs; and a service name of theirs).
    result = CliRunner().invoke(main, ["demo", "--duration", "1", "--concurrency", "4",
                                       "--model-size", "tiny", "--json",
                                       "--forward", f"otlp-grpc://127.0.0.1:{otlp_sink.port}",
                                       "--forward-header", "authorization=Bearer t0ken",
                                       "--service-name", "my-demo"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout[result.stdout.index("{"):])
    assert doc["breakdown"]["service"] == "my-demo"
    requests = doc["breakdown"]["requests"]  # what the collector received
    assert requests > 0
    assert otlp_sink.metadata and all(
        m.get("authorization") == "Bearer t0ken" for m in otlp_sink.metadata)
    assert {r.get("service.name") for r, _ in otlp_sink.spans()} == {"my-demo"}

    def stage_spans(sink):
        return [s for _, s in sink.spans()
                if any(kv.key == semconv.ATTR_STAGE for kv in s.attributes)]

    # Everything the collector received was forwarded: every stage of each of those requests.
    assert otlp_sink.wait_for(lambda s: len(stage_spans(s)) >= 9 * requests, timeout=15)


def test_demo_rejects_a_forward_header_without_forward_and_an_empty_service_name():
    result = CliRunner().invoke(main, ["demo", "--forward-header", "a=b"])
    assert result.exit_code != 0 and "--forward-header needs --forward" in result.output
    result = CliRunner().invoke(main, ["demo", "--service-name", " "])
    assert result.exit_code != 0 and "--service-name" in result.output


def test_demo_rejects_a_bad_forward_url():
    result = CliRunner().invoke(main, ["demo", "--forward", "bogus"])
    assert result.exit_code != 0
    assert "forward" in result.output


def test_a_missing_demo_extra_is_named_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed
    result = CliRunner().invoke(main, ["demo", "--duration", "1"])
    assert result.exit_code == 1
    assert "pip install 'inferprof[demo]'" in result.output
    assert "Traceback" not in result.output
