"""The breakdown's ``examples``: the slowest traced requests, and links to their traces."""

from __future__ import annotations

import json
import math
import random

import pytest
from click.testing import CliRunner

from inferprof import semconv as sc
from inferprof.cli import main
from inferprof.collector.engine import Engine
from inferprof.collector.examples import DEFAULT_TOP, check_template, link, with_links
from inferprof.collector.settings import CollectorSettings
from inferprof.report.dump import write_pb
from inferprof.report.render import format_table, write_html
from tests.collector.synth import FakeClock, TraceBuilder
from tests.collector.test_server_fixtures import breakdown, make_requests, running_app

JAEGER = "http://localhost:16686/trace/{trace_id}"
GRAFANA = (
    'http://localhost:3000/explore?left={"datasource":"jaeger","queries":'
    '[{"queryType":"traceql","query":"{trace_id}"}]}'
)


def _requests(n: int = 200, seed: int = 1):
    """``n`` requests (queue, compute, a tail gap) with random durations; returns the
    export and, per request, (trace id hex, e2e, {stage: seconds})."""
    rng = random.Random(seed)
    b = TraceBuilder()
    truth = []
    for i in range(n):
        q, c, gap = rng.uniform(0.001, 0.05), rng.uniform(0.01, 0.03), rng.uniform(0, 0.002)
        ref, e2e = b.sequential(i * 0.1, [("queue", q), ("compute", c)], tail_gap=gap)
        truth.append((ref.trace_id.hex(), e2e, {"queue": q, "compute": c, "unattributed": gap}))
    return b.export(), truth


def _doc(export, clock=None, window_s=None) -> dict:
    engine = Engine(settle_s=0, clock=clock or FakeClock(), retention_s=math.inf)
    engine.ingest_traces(export)
    engine.flush()
    return engine.breakdown("svc", "m", window_s)


def test_examples_name_the_slowest_requests_with_their_exact_split():
    export, truth = _requests()
    doc = _doc(export)
    slowest = [ex for ex in doc["examples"] if ex["slowest"] == "latency"]
    expected = sorted(truth, key=lambda t: -t[1])[:DEFAULT_TOP]
    assert [ex["trace_id"] for ex in slowest] == [t[0] for t in expected]
    for ex, (_, e2e, split) in zip(slowest, expected, strict=True):
        assert ex["latency"] == pytest.approx(e2e, abs=1e-9)
        assert ex["seconds"] == ex["latency"]
        assert ex["stages"].keys() == split.keys()
        for stage, seconds in split.items():
            assert ex["stages"][stage] == pytest.approx(seconds, abs=2e-9)
        # The split is the §6 partition: it sums to the request's end-to-end time.
        assert sum(ex["stages"].values()) == pytest.approx(ex["latency"], abs=1e-9)


def test_examples_name_the_slowest_request_of_each_stage():
    export, truth = _requests()
    doc = _doc(export)
    per_stage = {ex["slowest"]: ex for ex in doc["examples"] if ex["slowest"] != "latency"}
    assert list(per_stage) == ["queue", "compute", "unattributed"]  # the stages' order
    for stage, ex in per_stage.items():
        best = max(truth, key=lambda t: t[2][stage])
        assert ex["trace_id"] == best[0]
        assert ex["seconds"] == pytest.approx(best[2][stage], abs=2e-9)


def test_examples_follow_the_window():
    clock = FakeClock()
    engine = Engine(settle_s=0, clock=clock, windows_s=(60.0, 600.0))
    b = TraceBuilder()
    old, _ = b.sequential(0.0, [("queue", 0.9), ("compute", 0.05)])
    engine.ingest_traces(b.export())
    engine.flush()
    b.spans.clear()
    clock.tick(300)
    new, _ = b.sequential(300.0, [("queue", 0.01), ("compute", 0.05)])
    engine.ingest_traces(b.export())
    engine.flush()
    recent = engine.breakdown("svc", "m", 60.0)["examples"]
    assert {ex["trace_id"] for ex in recent} == {new.trace_id.hex()}
    longer = engine.breakdown("svc", "m", 600.0)["examples"]
    assert longer[0]["trace_id"] == old.trace_id.hex()  # slowest first
    clock.tick(700)  # past the retention: the old slice and its examples are gone
    engine.advance()
    assert engine.breakdown("svc", "m", 600.0)["examples"] == []


def test_examples_keep_bounded_memory_per_slice_and_series():
    engine = Engine(settle_s=0, clock=FakeClock())
    b = TraceBuilder()
    for i in range(3000):
        b.sequential(i * 0.001, [("queue", 0.001 + (i % 97) * 1e-4), ("compute", 0.01)])
    engine.ingest_traces(b.export())
    engine.flush()
    kept = [k for per_slice in engine._examples._slices.values() for k in per_slice.values()]
    assert len(kept) == 1
    assert len(kept[0].slowest) == DEFAULT_TOP
    stages = ("queue", "compute", "unattributed")
    assert set(kept[0].stages) == {engine._stage_index[s] for s in stages}


def test_examples_attribute_a_linked_batch_stage_to_its_member():
    b = TraceBuilder()
    members = [b.request(0.0, 0.1 + 0.1 * i) for i in range(3)]
    for req in members:
        b.stage(req, "queue", 0.0, 0.02)
    b.stage(None, "compute", 0.02, 0.09, links=members, batch_id="b1", batch_size=3)
    doc = _doc(b.export())
    compute = next(ex for ex in doc["examples"] if ex["slowest"] == "compute")
    assert compute["seconds"] == pytest.approx(0.07)
    assert compute["stages"]["compute"] == pytest.approx(0.07)
    assert doc["examples"][0]["trace_id"] == members[2].trace_id.hex()


def test_trace_url_templates():
    tid = "0af7651916cd43dd8448eb211c80319c"
    assert link(JAEGER, tid) == f"http://localhost:16686/trace/{tid}"
    # Other braces (Grafana Explore's JSON) are left as they are.
    assert link(GRAFANA, tid).endswith(f'"query":"{tid}"}}]}}')
    assert check_template(None) is None
    with pytest.raises(ValueError, match=r"\{trace_id\}"):
        check_template("http://localhost:16686/trace/")
    doc = {"examples": [{"trace_id": tid}]}
    assert with_links(doc, JAEGER)["examples"][0]["url"].endswith(tid)
    assert "url" not in doc["examples"][0]  # not modified in place
    assert with_links(doc, None) is doc


def test_table_and_html_list_the_examples_with_links(tmp_path):
    export, truth = _requests()
    doc = with_links(_doc(export), JAEGER)
    slowest = max(truth, key=lambda t: t[1])[0]
    table = format_table(doc)
    assert f"http://localhost:16686/trace/{slowest}" in table
    assert "slowest traces" in table
    page = tmp_path / "r.html"
    write_html([doc], page)
    assert f'<a href="http://localhost:16686/trace/{slowest}">{slowest}</a>' in page.read_text()
    plain = format_table(_doc(export))
    assert f"trace {slowest}" in plain


def test_report_command_links_examples(tmp_path):
    export, truth = _requests()
    dump = tmp_path / "d.pb"
    write_pb(dump, [export])
    slowest = max(truth, key=lambda t: t[1])[0]
    runner = CliRunner()
    out = runner.invoke(main, ["report", str(dump), "--format", "json", "--trace-url", JAEGER])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["examples"][0]["url"] == f"http://localhost:16686/trace/{slowest}"
    bad = runner.invoke(main, ["report", str(dump), "--trace-url", "http://jaeger/trace/"])
    assert bad.exit_code == 2
    assert "{trace_id}" in bad.output


def test_trace_url_setting_is_validated_and_read_from_the_environment():
    with pytest.raises(ValueError, match="trace_id"):
        CollectorSettings(trace_url="http://jaeger/")
    env = {"INFERPROF_COLLECTOR_TRACE_URL": JAEGER}
    assert CollectorSettings.from_env(environ=env).trace_url == JAEGER


@pytest.mark.parametrize("template", [None, JAEGER])
def test_collector_api_serves_examples(template):
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    spans = make_requests(40, slow_every=10)
    slow = {format(s.context.trace_id, "032x") for s in spans
            if s.name == sc.span_name(sc.STAGE_QUEUE) and s.end_time - s.start_time > 50e6}
    with running_app(trace_url=template) as app:
        OTLPSpanExporter(endpoint=f"{app.otlp_http_endpoint}/v1/traces").export(spans)
        doc = breakdown(app).json()
    examples = doc["examples"]
    slowest = [ex["trace_id"] for ex in examples if ex["slowest"] == "latency"]
    assert len(slow) == 4 and set(slowest[:4]) == slow
    assert next(ex for ex in examples if ex["slowest"] == "queue")["trace_id"] in slow
    for ex in examples:
        if template:
            assert ex["url"] == f"http://localhost:16686/trace/{ex['trace_id']}"
        else:
            assert "url" not in ex


def test_offline_examples_hold_one_set_however_long_the_recording():
    clock = FakeClock()
    engine = Engine(settle_s=0, clock=clock, retention_s=math.inf)
    b = TraceBuilder()
    truth = []
    for i in range(100):  # one fold per 10 s slice
        ref, e2e = b.sequential(i * 10.0, [("queue", 0.001 * (1 + (i * 37) % 100))])
        truth.append((e2e, ref.trace_id.hex()))
        engine.ingest_traces(b.export())
        b.spans.clear()
        engine.flush()
        clock.tick(10)
    assert len(engine._examples._slices) == 1
    doc = engine.breakdown("svc", "m", None)
    slowest = [ex["trace_id"] for ex in doc["examples"] if ex["slowest"] == "latency"]
    assert slowest == [tid for _, tid in sorted(truth, reverse=True)[:DEFAULT_TOP]]
