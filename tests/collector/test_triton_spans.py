"""Triton's own spans (scope ``triton-server``) translated into stages of the Triton service:
queue/h2d/compute/d2h from the events of each request's model and compute spans."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, generate_latest

from inferprof import semconv as sc
from inferprof.collector import command
from inferprof.collector.engine import Engine
from inferprof.collector.metrics import EngineCollector
from inferprof.collector.settings import ENV_TRITON_SPANS, CollectorSettings
from tests.collector.synth import FakeClock, TraceBuilder

TRITON = "triton-server"
# Durations of one Triton request's phases (s): queueing dominates.
QUEUE, H2D, COMPUTE, D2H = 0.030, 0.002, 0.010, 0.001


def _stages(doc: dict) -> dict:
    return {s["stage"]: s for s in doc["stages"]}


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 0.01 * b  # the sketches' documented bound


def _front_and_triton(n: int, *, base_unix: float | None = None):
    """``n`` front-end requests (service "front") each calling Triton once; Triton's three
    spans a child of the call's network stage. Returns (front builder, triton builder)."""
    kw = {} if base_unix is None else {"base_unix": base_unix}
    front = TraceBuilder("front", **kw)
    triton = TraceBuilder("triton", scope=TRITON, **kw)
    for i in range(n):
        t = i * 1.0
        req = front.request(t, t + 0.060, model="embedder")
        front.stage(req, "receive", t, t + 0.001)
        net = front.stage(req, "network", t + 0.002, t + 0.058)
        t0 = t + 0.003  # Triton's request starts
        q = t0 + 0.001
        c = (q + QUEUE, q + QUEUE + H2D, q + QUEUE + H2D + COMPUTE, q + QUEUE + H2D + COMPUTE + D2H)
        triton.triton_request(net, t0, c[3] + 0.002, queue_start=q, compute=c)
    return front, triton


def _engine(*exports, **kw) -> Engine:
    clock = FakeClock()
    engine = Engine(clock=clock, **kw)
    for export in exports:
        engine.ingest_traces(export)
    clock.tick(10.0)
    engine.advance()
    return engine


def test_triton_requests_get_queue_h2d_compute_d2h_and_a_verdict():
    front, triton = _front_and_triton(120)
    engine = _engine(front.export(), triton.export())
    assert sorted(s["service"] for s in engine.services()) == ["front", "triton"]
    doc = engine.breakdown("triton")
    assert doc["requests"] == 120 and doc["model"] == "double"
    stages = _stages(doc)
    assert set(stages) == {"queue", "h2d", "compute", "d2h", sc.STAGE_UNATTRIBUTED}
    for name, d in (("queue", QUEUE), ("h2d", H2D), ("compute", COMPUTE), ("d2h", D2H)):
        assert stages[name]["count"] == 120
        assert _close(stages[name]["p50"], d), (name, stages[name]["p50"])
    # what is left of InferRequest: 1 ms before QUEUE_START, 2 ms after COMPUTE_END
    assert _close(stages[sc.STAGE_UNATTRIBUTED]["p50"], 0.003)
    assert _close(doc["latency"]["p50"], QUEUE + H2D + COMPUTE + D2H + 0.003)
    assert doc["verdict"]["bottleneck"] == "batching"
    assert engine.stats.triton_requests_partial == 0


def test_front_end_breakdown_is_the_same_with_or_without_the_translation():
    front, triton = _front_and_triton(20)
    exports = [front.export(), triton.export()]
    on = _engine(*exports)
    off = _engine(*exports, triton_spans=False)
    assert on.breakdown("front") == off.breakdown("front")
    assert [s["service"] for s in off.services()] == ["front"]  # off: as before
    assert off.breakdown("triton") is None


def test_spans_split_over_exports_in_the_order_triton_sends_them():
    # Triton's batch processor exports children as they end: model and compute spans can
    # come in one export, their InferRequest in the next.
    triton = TraceBuilder("triton", scope=TRITON)
    triton.triton_request(None, 0.0, 0.050, queue_start=0.001, compute=(0.011, 0.012, 0.042, 0.043))
    request, model, compute = triton.spans
    engine = _engine(triton.export([model, compute]), triton.export([request]))
    stages = _stages(engine.breakdown("triton"))
    assert _close(stages["queue"]["p50"], 0.010) and _close(stages["compute"]["p50"], 0.030)
    assert _close(stages["h2d"]["p50"], 0.001) and _close(stages["d2h"]["p50"], 0.001)


def test_a_missing_event_leaves_out_only_the_stages_it_bounds():
    triton = TraceBuilder("triton", scope=TRITON)
    names = ("COMPUTE_START", "COMPUTE_OUTPUT_START", "COMPUTE_END")  # no COMPUTE_INPUT_END
    triton.triton_request(
        None,
        0.0,
        0.050,
        queue_start=0.001,
        compute_events=list(zip(names, (0.011, 0.042, 0.043))),
    )
    engine = _engine(triton.export())
    stages = _stages(engine.breakdown("triton"))
    assert set(stages) == {"queue", "d2h", sc.STAGE_UNATTRIBUTED}
    assert _close(stages["queue"]["p50"], 0.010) and _close(stages["d2h"]["p50"], 0.001)
    assert engine.stats.triton_requests_partial == 1
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    scraped = generate_latest(registry).decode()
    assert f"{sc.PROM_TRITON_REQUESTS_PARTIAL} 1.0" in scraped.splitlines()


@pytest.mark.parametrize(
    "case",
    ["queue_after_compute_start", "repeated_event", "compute_outside_request", "no_queue_event"],
)
def test_bad_events_never_make_negative_or_outside_stages(case):
    triton = TraceBuilder("triton", scope=TRITON)
    compute = (0.011, 0.012, 0.042, 0.043)
    kw: dict = {"queue_start": 0.001, "compute": compute}
    if case == "queue_after_compute_start":
        kw["queue_start"] = 0.020
    elif case == "repeated_event":
        names = (
            "COMPUTE_START",
            "COMPUTE_INPUT_END",
            "COMPUTE_INPUT_END",
            "COMPUTE_OUTPUT_START",
            "COMPUTE_END",
        )
        kw["compute_events"] = list(zip(names, (0.011, 0.012, 0.013, 0.042, 0.043)))
    elif case == "compute_outside_request":
        kw["compute"] = (0.011, 0.012, 0.042, 0.070)  # COMPUTE_END after InferRequest ends
    else:
        kw["model_events"] = [("REQUEST_START", 0.0001), ("REQUEST_END", 0.049)]
    triton.triton_request(None, 0.0, 0.050, **kw)
    engine = _engine(triton.export())
    doc = engine.breakdown("triton")
    assert doc["requests"] == 1
    stages = _stages(doc)
    expected = {
        "queue_after_compute_start": {"h2d", "compute", "d2h"},
        "repeated_event": {"queue", "d2h"},
        "compute_outside_request": {"queue", "h2d", "compute"},
        "no_queue_event": {"h2d", "compute", "d2h"},
    }[case]
    assert set(stages) - {sc.STAGE_UNATTRIBUTED} == expected
    for s in stages.values():
        assert 0 <= s["p50"] <= doc["latency"]["p50"] * 1.01
    assert engine.stats.triton_requests_partial == 1


def test_ensemble_counts_once_with_no_compute_stage_of_its_own():
    # An ensemble: its model span has no compute child; each composing model's model span
    # (and compute) sits below it. Not split, and the steps are not requests of their own.
    triton = TraceBuilder("triton", scope=TRITON)
    spans = triton.triton_request(None, 0.0, 0.100, model="pipeline")
    for k, t in enumerate((0.010, 0.050)):
        step = triton.span(
            f"step{k}",
            t,
            t + 0.030,
            parent=spans["model"],
            kind=2,
            attrs={"triton.model_name": f"step{k}"},
            events=[("QUEUE_START", t)],
        )
        triton.span(
            "compute",
            t + 0.001,
            t + 0.029,
            parent=step,
            kind=2,
            events=[("COMPUTE_START", t + 0.001), ("COMPUTE_END", t + 0.029)],
        )
    engine = _engine(triton.export())
    doc = engine.breakdown("triton")
    assert doc["requests"] == 1 and doc["model"] == "pipeline"
    assert set(_stages(doc)) == {sc.STAGE_UNATTRIBUTED}
    assert [s["models"] for s in engine.services()] == [["pipeline"]]
    assert engine.stats.triton_requests_partial == 1


def test_inferrequest_without_a_model_span_is_not_a_request():
    triton = TraceBuilder("triton", scope=TRITON)
    triton.span("InferRequest", 0.0, 0.010, kind=2, events=[("HTTP_RECV_START", 0.0)])
    engine = _engine(triton.export())
    assert engine.services() == []
    assert engine.stats.spans_ignored == 1


def test_same_shapes_outside_tritons_scope_are_untouched():
    # Another service whose spans happen to be named and evented like Triton's.
    other = TraceBuilder("lookalike", scope="my-tracer")
    other.triton_request(None, 0.0, 0.050, queue_start=0.001, compute=(0.011, 0.012, 0.042, 0.043))
    unscoped = TraceBuilder("lookalike2")
    unscoped.triton_request(
        None, 0.0, 0.050, queue_start=0.001, compute=(0.011, 0.012, 0.042, 0.043)
    )
    engine = _engine(other.export(), unscoped.export())
    assert engine.services() == []
    assert engine.stats.spans_ignored == 6


def test_triton_scope_spans_with_inferprof_stages_are_left_as_they_are():
    # A span of Triton's scope that carries inferprof.stage is a stage span like any other.
    triton = TraceBuilder("triton", scope=TRITON)
    spans = triton.triton_request(None, 0.0, 0.050, compute=(0.011, 0.012, 0.042, 0.043))
    triton.stage(spans["request"], "serialize", 0.045, 0.049)
    engine = _engine(triton.export())
    doc = engine.breakdown("triton")
    # the request has an inferprof stage of its own: not translated
    assert set(_stages(doc)) == {"serialize", sc.STAGE_UNATTRIBUTED}


def test_switch_resolves_flag_env_file_and_validates(tmp_path, caplog):
    assert CollectorSettings().triton_spans is True
    assert CollectorSettings().engine_kwargs()["triton_spans"] is True
    assert CollectorSettings.from_env(environ={ENV_TRITON_SPANS: "off"}).triton_spans is False
    assert CollectorSettings.from_env(environ={ENV_TRITON_SPANS: "bogus"}).triton_spans is True
    assert "INFERPROF_COLLECTOR_TRITON_SPANS" in caplog.text
    cfg = tmp_path / "c.toml"
    cfg.write_text("triton-spans = false\n")
    assert CollectorSettings.from_env(config=cfg, environ={}).triton_spans is False
    assert (
        CollectorSettings.from_env(config=cfg, environ={}, triton_spans=True).triton_spans is True
    )
    with pytest.raises(ValueError, match="triton_spans"):
        CollectorSettings(triton_spans="no")
    with pytest.raises(TypeError, match="triton_spans"):
        Engine(triton_spans=1)
    help_text = CliRunner().invoke(command.collect, ["--help"]).output
    assert "--triton-spans / --no-triton-spans" in help_text
