"""``inferprof report`` on OTLP files: table, JSON (= the engine's breakdown), HTML."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from inferprof import semconv as sc
from inferprof.cli import main
from inferprof.collector.engine import Engine
from inferprof.report.dump import write_json_lines, write_pb
from inferprof.report.render import format_table
from tests.collector.synth import FakeClock, TraceBuilder, gpu_metrics

STAGES = [
    ("receive", 0.001),
    ("tokenize", 0.002),
    ("queue", None),
    ("compute", 0.015),
    ("serialize", 0.001),
]


def _exports(service: str = "svc", model: str = "m", n: int = 150):
    b = TraceBuilder(service)
    out = []
    for i in range(n):
        t = i * 0.05
        req = b.request(t, t + 0.0005 + sum(d or 0.001 + 0.0004 * (i % 100) for _, d in STAGES),
                        model=model)
        for stage, d in STAGES:
            d = d if d is not None else 0.001 + 0.0004 * (i % 100)
            b.stage(req, stage, t, t + d, gpu_id="GPU-0" if stage == "compute" else None)
            t += d
        if i % 50 == 49:
            out.append(b.export())
    if b.spans:
        out.append(b.export())
    return out


@pytest.fixture
def files(tmp_path):
    exports = _exports()
    jsonl = tmp_path / "otel.jsonl"
    write_json_lines(jsonl, exports)
    pb = tmp_path / "dump.pb"
    write_pb(pb, exports + [GPU])
    return exports, jsonl, pb


#: Synthetic GPU samples (clearly not from a device) covering every compute window.
GPU = gpu_metrics([(i * 0.05, 0.3 + 0.2 * (i % 3)) for i in range(160)])


def _engine_doc(exports, metrics=()) -> dict:
    engine = Engine(clock=FakeClock(), retention_s=math.inf)
    for req in exports:
        engine.ingest_traces(req)
    for req in metrics:
        engine.ingest_metrics(req)
    engine.flush()
    return engine.breakdown("svc", "m", window_s=None)


def test_table_lists_every_stage_e2e_and_verdict(files):
    _, jsonl, _ = files
    result = CliRunner().invoke(main, ["report", str(jsonl)])
    assert result.exit_code == 0, result.output
    out = result.output
    for stage, _ in STAGES:
        assert f"\n{stage} " in out
    assert "\nunattributed " in out and "\nend-to-end " in out
    assert "share of p95" in out
    assert "verdict: batching" in out
    assert "% of p95 latency is spent in pre-batch queuing" in out


def test_json_equals_engine_breakdown_for_both_formats(files):
    exports, jsonl, pb = files
    docs = {}
    for path, expected in ((jsonl, _engine_doc(exports)), (pb, _engine_doc(exports, [GPU]))):
        result = CliRunner().invoke(main, ["report", str(path), "--format", "json"])
        assert result.exit_code == 0, result.output
        docs[path] = json.loads(result.output)
        assert docs[path] == json.loads(json.dumps(expected))
    # the GPU samples in the proto dump reached the report and were joined to compute
    with_gpu = docs[pb]["gpu"]
    assert with_gpu["samples_received"] == 160
    util = with_gpu["utilization_during_compute"]
    assert with_gpu["samples"] > 0
    assert 0.3 <= util["p50"] <= 0.7 and 0.3 <= util["mean"] <= 0.7
    assert docs[jsonl]["gpu"]["utilization_during_compute"] is None


def test_several_services_give_a_list_and_filters_select(tmp_path):
    path = tmp_path / "two.jsonl"
    write_json_lines(path, _exports("a", "m1", 20) + _exports("b", "m2", 20))
    runner = CliRunner()
    docs = json.loads(runner.invoke(main, ["report", str(path), "--format", "json"]).output)
    assert [(d["service"], d["model"]) for d in docs] == [("a", "m1"), ("b", "m2")]
    one = json.loads(
        runner.invoke(main, ["report", str(path), "--format", "json", "--service", "b"]).output
    )
    assert one["service"] == "b" and one["requests"] == 20
    missing = runner.invoke(main, ["report", str(path), "--service", "nope"])
    assert missing.exit_code == 1 and "no requests of service 'nope'" in missing.output


def test_html_is_self_contained_with_svg_charts(files, tmp_path):
    _, jsonl, _ = files
    out = tmp_path / "report.html"
    result = CliRunner().invoke(main, ["report", str(jsonl), "--html", str(out)])
    assert result.exit_code == 0, result.output
    page = out.read_text()
    assert page.count("<svg") >= 2
    assert "Bottleneck: batching" in page
    assert "GPU utilisation during compute" not in page  # no samples in this file
    for external in (
        'src="http',
        'href="http',
        "<link",
        "@import",
        "url(http",
    ):  # no external assets
        assert external not in page
    assert "<script" not in page


def test_malformed_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "xyz"}]}]}]}\n')
    result = CliRunner().invoke(main, ["report", str(bad)])
    assert result.exit_code == 1
    assert "bad.jsonl:1" in result.output and "hex" in result.output


def test_format_table_of_empty_document():
    doc = {
        "service": "s",
        "model": "",
        "window_s": 60.0,
        "requests": 0,
        "latency": {"p50": None, "p95": None, "p99": None},
        "stages": [],
        "gpu": {},
        "padding": {},
        "verdict": {
            "bottleneck": sc.VERDICT_UNKNOWN,
            "confidence": 0.0,
            "evidence": ["not enough data"],
        },
    }
    text = format_table(doc)
    assert "last 60 s" in text and "verdict: unknown" in text and "not enough data" in text


def test_padding_and_gpu_lines_in_table_and_html(tmp_path):
    b = TraceBuilder()
    for i in range(120):
        req = b.request(i, i + 0.1)
        b.stage(req, "queue", i, i + 0.02)
        b.stage(
            req,
            "compute",
            i + 0.02,
            i + 0.1,
            batch_id=f"b{i}",
            effective=75,
            padded=100,
            gpu_id="GPU-0",
        )
    path = tmp_path / "gpu.pb"
    write_pb(path, [b.export(), gpu_metrics([(i * 0.05, 0.3) for i in range(2400)])])
    out = tmp_path / "gpu.html"
    result = CliRunner().invoke(main, ["report", str(path), "--html", str(out)])
    assert result.exit_code == 0, result.output
    assert (
        "padding: 25.0% of padded tokens are padding (9000 effective / 12000 padded, 120 batches)"
        in result.output
    )
    assert "GPU utilisation during compute: median 30.0%" in result.output
    # one request at a time: its queue never waits behind another's batch
    assert "queue: 0.0% of queue time passed while earlier batches were being processed\n" in (
        result.output)
    assert "verdict: runtime" in result.output
    page = out.read_text()
    assert "padding: 25.0%" in page and "GPU utilisation during compute" in page
    assert "queue: 0.0% of queue time" in page


def test_progress_bar_on_stderr_and_same_spans_in_two_files_count_once(files):
    _, jsonl, pb = files
    result = CliRunner().invoke(
        main, ["report", str(jsonl), str(pb), "--format", "json", "--progress"]
    )
    assert result.exit_code == 0, result.output
    assert "reading" in result.stderr  # tqdm, on stderr only
    doc = json.loads(result.stdout)
    assert doc["requests"] == 150  # the second file repeats the first's spans: duplicates


@pytest.mark.parametrize("fmt", ["jsonl", "pb"])
def test_tritons_own_spans_give_the_triton_service_its_stages_offline(tmp_path, fmt):
    # The spans Triton exports itself (scope triton-server), as a capture holds them.
    triton = TraceBuilder("triton", scope="triton-server")
    for i in range(120):  # past the verdict's 100-request minimum
        t = i * 0.1
        triton.triton_request(None, t, t + 0.050, queue_start=t + 0.001,
                              compute=(t + 0.031, t + 0.033, t + 0.043, t + 0.044))
    path = tmp_path / f"triton.{fmt}"
    (write_json_lines if fmt == "jsonl" else write_pb)(path, [triton.export()])
    out = CliRunner().invoke(main, ["report", str(path), "--format", "json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert (doc["service"], doc["model"], doc["requests"]) == ("triton", "double", 120)
    stages = {s["stage"]: s["p50"] for s in doc["stages"]}
    assert {"queue", "h2d", "compute", "d2h"} <= set(stages)
    assert math.isclose(stages["queue"], 0.030, rel_tol=0.011)
    assert math.isclose(stages["compute"], 0.010, rel_tol=0.011)
    assert doc["verdict"]["bottleneck"] == sc.VERDICT_BATCHING  # Triton's queue: 60% of it


def test_offline_report_keeps_stage_names_past_the_collectors_default_cap(tmp_path):
    # The collector tracks 64 stage names by default to keep /metrics small; a report has no
    # /metrics and keeps every name the columns allow.
    from inferprof.collector.attribution import DEFAULT_MAX_STAGES
    from inferprof.report.command import build_documents

    b = TraceBuilder()
    n = DEFAULT_MAX_STAGES + 16
    for i in range(n):
        req = b.request(float(i), i + 0.1)
        b.stage(req, f"step_{i:02d}", i + 0.0, i + 0.09)
    path = tmp_path / "many.jsonl"
    write_json_lines(path, [b.export()])
    (doc,) = build_documents([path])
    custom = {s["stage"] for s in doc["stages"] if s["stage"].startswith("step_")}
    assert len(custom) == n


def test_report_says_which_spans_it_dropped(tmp_path):
    # Spans the engine drops (here: stage names past the columns) are named on stderr,
    # as the collector counts them, instead of vanishing into `unattributed` silently.
    from inferprof.collector.attribution import MAX_MAX_STAGES

    b = TraceBuilder()
    n = MAX_MAX_STAGES + 5  # more names than any engine tracks
    for i in range(n):
        req = b.request(float(i), i + 0.1)
        b.stage(req, f"item_{i:04d}", i + 0.0, i + 0.09)
    path = tmp_path / "too_many.jsonl"
    write_json_lines(path, [b.export()])
    result = CliRunner().invoke(main, ["report", str(path)])
    assert result.exit_code == 0, result.output
    assert "dropped spans" in result.stderr and "too_many_stages" in result.stderr


def test_the_queue_line_says_where_its_figure_came_from():
    from inferprof.report.render import format_table

    def line(queue):
        doc = {"service": "s", "model": "m", "window_s": None, "requests": 1,
               "latency": {"p50": 0.1, "p95": 0.2, "p99": 0.3},
               "stages": [], "queue": queue,
               "verdict": {"bottleneck": "batching", "confidence": 0.5, "evidence": []}}
        (q,) = [x for x in format_table(doc).splitlines() if x.startswith("queue:")]
        return q

    measured = {"behind_batches": 0.9, "batch_coverage": 1.0, "reported_by_batcher": 1.0}
    assert line(measured).endswith("processed (measured by the batcher)")
    half = {"behind_batches": 0.6, "batch_coverage": 0.5, "reported_by_batcher": 0.5}
    assert line(half).endswith("(estimated: the traces show 50.0% of the batch work)"
                               " (50.0% of the queue time measured by the batcher)")
    overlap = {"behind_batches": 0.6, "batch_coverage": 1.0, "reported_by_batcher": 0.0}
    assert line(overlap).endswith("were being processed")


def test_failed_requests_get_a_line_of_their_own():
    from inferprof.report.render import format_table

    doc = {"service": "s", "model": "m", "window_s": None, "requests": 200, "errors": 30,
           "latency": {"p50": 0.1, "p95": 0.2, "p99": 0.3}, "stages": [],
           "verdict": {"bottleneck": "batching", "confidence": 0.5, "evidence": []}}
    assert ("errors: 30 of 200 requests failed (15.0%; status ERROR, e.g. HTTP 5xx): their "
            "times are in every figure here") in format_table(doc)
    assert "errors:" not in format_table({**doc, "errors": 0})
