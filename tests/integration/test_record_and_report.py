"""Record a live run with ``--forward file://`` and report on it offline: the offline
``inferprof report`` must give the same breakdown the live collector served."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult

from inferprof.cli import main
from inferprof.collector.settings import CollectorSettings
from tests.collector.test_server_fixtures import breakdown, make_requests, running_app


def test_a_recorded_run_reports_the_same_breakdown_offline(tmp_path):
    dump = tmp_path / "run.otlp"
    with running_app(forward=(f"file://{dump}",)) as app:
        exporter = OTLPSpanExporter(endpoint=app.otlp_grpc_endpoint, insecure=True, timeout=10)
        try:
            for _ in range(3):  # several exports append to the same dump
                assert exporter.export(make_requests(40, service="rec")) is SpanExportResult.SUCCESS
        finally:
            exporter.shutdown()
        live = breakdown(app, "rec", window=900).json()
    # app.stop() drained the forwarder: the dump is complete.
    result = CliRunner().invoke(main, ["report", str(dump), "--format", "json"])
    assert result.exit_code == 0, result.output
    offline = json.loads(result.output)
    assert offline["requests"] == live["requests"] == 120
    live_stages = {s["stage"]: s for s in live["stages"]}
    for stage in offline["stages"]:
        assert stage["count"] == live_stages[stage["stage"]]["count"]
        assert stage["p95"] == pytest.approx(live_stages[stage["stage"]]["p95"], rel=0.02)
        assert stage["share_of_p95"] == pytest.approx(
            live_stages[stage["stage"]]["share_of_p95"], abs=0.01
        )


def test_file_destinations_need_a_path():
    with pytest.raises(ValueError, match="forward"):
        CollectorSettings(forward=("file://",))
