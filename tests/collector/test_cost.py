"""Cost per request per stage: GPU-seconds, energy and money against exact computation."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from inferprof import semconv as sc
from inferprof.cli import main
from inferprof.collector.cost import member_share, parse_prices
from inferprof.collector.engine import Engine
from inferprof.collector.metrics import EngineCollector
from inferprof.collector.settings import CollectorSettings
from inferprof.report.dump import write_pb
from inferprof.report.render import format_table
from tests.collector.synth import BASE_UNIX, FakeClock, TraceBuilder, gpu_metrics

PROMPT = sc.ATTR_TOKENS_PROMPT
#: power samples every 0.1 s, p(t) = 100 + 200 t watts
POWER = [(0.05 + 0.1 * i, 100.0 + 200.0 * (0.05 + 0.1 * i)) for i in range(30)]
PERIOD = 0.1


def _workload(base_unix: float = BASE_UNIX, one_model: bool = False):
    """Three batches and a lone request, on two GPUs, across models a and b.

    * batch A (links encoding, GPU-0): compute [0.1, 0.3] over members of 10, 30 and 60
      prompt tokens, 100 effective tokens (split by tokens); h2d [0.08, 0.1], size 3 (evenly);
      the 10- and 30-token members are model a, the 60-token one model b;
    * batch B (children encoding, GPU-1): compute [1.0, 1.1], size 2, no tokens: evenly,
      one member of each model;
    * request C (model a): its own compute [2.0, 2.05] on GPU-0, no batch: all of it.
    Returns the export and the exact GPU-seconds per (model, stage) summed, the requests
    per model and the compute windows (gpu, start, end). ``one_model``: every request is
    model a (which series a batch's compute window joins the GPU samples for depends on
    the member folded first; with one model, there is no choice).
    """
    b = TraceBuilder(base_unix=base_unix)
    other = "a" if one_model else "b"
    a1 = b.request(0.0, 0.4, model="a", **{PROMPT: 10})
    a2 = b.request(0.0, 0.4, model="a", **{PROMPT: 30})
    b1 = b.request(0.0, 0.4, model=other, **{PROMPT: 60})
    batch = [a1, a2, b1]
    for m in batch:
        b.stage(m, "queue", 0.0, 0.08)
    b.stage(None, "h2d", 0.08, 0.1, links=batch, batch_id="A", batch_size=3)
    b.stage(None, "compute", 0.1, 0.3, links=batch, batch_id="A", batch_size=3,
            effective=100, padded=120, gpu_id="GPU-0")
    for model in ("a", other):
        m = b.request(0.9, 1.2, model=model)
        b.stage(m, "compute", 1.0, 1.1, batch_id="B", batch_size=2, gpu_id="GPU-1")
    c = b.request(1.95, 2.1, model="a")
    b.stage(c, "compute", 2.0, 2.05, gpu_id="GPU-0")
    truth = {
        ("a", "compute"): 0.2 * 0.1 + 0.2 * 0.3 + 0.1 / 2 + 0.05,
        ("a", "h2d"): 0.02 / 3 * 2,
        ("b", "compute"): 0.2 * 0.6 + 0.1 / 2,
        ("b", "h2d"): 0.02 / 3,
    }
    requests = {"a": 4, "b": 2}
    windows = [("GPU-0", 0.1, 0.3), ("GPU-1", 1.0, 1.1), ("GPU-0", 2.0, 2.05)]
    if one_model:
        truth = {("a", st): truth[("a", st)] + truth[("b", st)] for st in ("compute", "h2d")}
        requests = {"a": 6}
    return b.export(), truth, requests, windows


def _engine(prices=(), power=True, models=(None, None), one_model=False) -> Engine:
    engine = Engine(settle_s=0, clock=FakeClock(), retention_s=math.inf,
                    gpu_hour_prices=prices)
    export, *_ = _workload(one_model=one_model)
    engine.ingest_traces(export)
    if power:
        for gpu, model in zip(("GPU-0", "GPU-1"), models, strict=True):
            engine.ingest_metrics(gpu_metrics(POWER, metric=sc.METRIC_GPU_POWER_DRAW,
                                              hw_id=gpu, model=model))
    engine.flush()
    return engine


def _mean_power(windows) -> float:
    """The join of the GPU evidence: a sample at t joins a window [s, e] of its GPU when
    s < t < e + period; each sample counts once, weighted by its period (equal here)."""
    joined = []
    for gpu in ("GPU-0", "GPU-1"):
        mine = [(s, e) for g, s, e in windows if g == gpu]
        joined += [p for t, p in POWER if any(s < t < e + PERIOD for s, e in mine)]
    return sum(joined) / len(joined)


def _stages(doc) -> dict:
    return {st["stage"]: st for st in doc["cost"]["stages"]}


@pytest.mark.parametrize("model", ["a", "b"])
def test_gpu_seconds_per_request_split_by_tokens_evenly_or_whole(model):
    _, truth, requests, _ = _workload()
    doc = _engine().breakdown("svc", model, None)
    stages = _stages(doc)
    assert set(stages) == {"h2d", "compute"}  # work stages only
    for stage in ("compute", "h2d"):
        expected = truth[(model, stage)] / requests[model]
        assert stages[stage]["gpu_seconds_per_request"] == pytest.approx(expected, abs=1e-12)
    total = sum(truth[(model, s)] for s in ("compute", "h2d")) / requests[model]
    assert doc["cost"]["gpu_seconds_per_request"] == pytest.approx(total, abs=1e-12)


def test_energy_per_request_from_the_power_drawn_during_compute():
    model = "a"
    _, truth, requests, windows = _workload(one_model=True)
    doc = _engine(one_model=True).breakdown("svc", model, None)
    watts = _mean_power(windows)
    assert doc["cost"]["power_watts_during_compute"]["mean"] == pytest.approx(watts)
    compute = _stages(doc)["compute"]
    assert compute["energy_joules_per_request"] == pytest.approx(
        truth[(model, "compute")] / requests[model] * watts)
    assert _stages(doc)["h2d"]["energy_joules_per_request"] is None  # no power joined
    assert doc["cost"]["energy_joules_per_request"] == pytest.approx(
        compute["energy_joules_per_request"])


def test_no_power_samples_no_energy_and_no_price_no_money():
    doc = _engine(power=False).breakdown("svc", "a", None)
    assert doc["cost"]["energy_joules_per_request"] is None
    assert doc["cost"]["power_watts_during_compute"] is None
    assert doc["cost"]["cost_per_request"] is None
    assert all(st["cost_per_request"] is None for st in doc["cost"]["stages"])


def test_money_prices_each_gpu_by_its_model_weighted_by_compute_time():
    _, truth, requests, _ = _workload(one_model=True)
    engine = _engine(prices=parse_prices(["H100=4.0", "1.0"]), models=("H100", "L4"),
                     one_model=True)
    doc = engine.breakdown("svc", "a", None)
    # a's windows: 0.2 s and 0.05 s on GPU-0 (H100: 4.0), 0.1 s on GPU-1 (L4: no price
    # of its own, the default 1.0)
    price = (0.25 * 4.0 + 0.1 * 1.0) / 0.35
    assert doc["cost"]["gpu_hour_price"] == pytest.approx(price)
    for stage, st in _stages(doc).items():
        assert st["cost_per_request"] == pytest.approx(
            truth[("a", stage)] / requests["a"] * price / 3600)
    # without a price for other GPUs, only the H100's windows are priced
    only = _engine(prices=parse_prices(["H100=4.0"]), models=("H100", "L4"), one_model=True)
    assert only.breakdown("svc", "a", None)["cost"]["gpu_hour_price"] == pytest.approx(4.0)


def test_cost_padding_and_gpu_figures_on_metrics():
    engine = _engine(prices=(("", 2.0),), one_model=True)
    engine.ingest_metrics(gpu_metrics([(0.15, 0.5), (0.25, 0.7)]))
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, window_s=1e9))
    samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            samples[(s.name, s.labels.get("model"), s.labels.get("stage"))] = s.value
    doc = engine.breakdown("svc", "a", None)
    for st in doc["cost"]["stages"]:
        key = ("a", st["stage"])
        assert samples[(sc.PROM_STAGE_GPU_SECONDS, *key)] == pytest.approx(
            st["gpu_seconds_per_request"])
        assert samples[(sc.PROM_STAGE_COST, *key)] == pytest.approx(st["cost_per_request"])
    assert samples[(sc.PROM_STAGE_ENERGY, "a", "compute")] == pytest.approx(
        _stages(doc)["compute"]["energy_joules_per_request"])
    assert (sc.PROM_STAGE_ENERGY, "a", "h2d") not in samples
    assert samples[(sc.PROM_PADDING_WASTE, "a", None)] == pytest.approx(
        doc["padding"]["waste_ratio"])
    assert samples[(sc.PROM_GPU_UTILIZATION_DURING_COMPUTE, "a", None)] == pytest.approx(
        doc["gpu"]["utilization_during_compute"]["mean"])
    assert samples[(sc.PROM_GPU_POWER_DURING_COMPUTE, "a", None)] == pytest.approx(
        doc["cost"]["power_watts_during_compute"]["mean"])


def test_member_share_and_price_parsing():
    assert member_share(30, 100, 3) == 0.3
    assert member_share(300, 100, 3) == 1.0  # a member's tokens past the batch's: all of it
    assert member_share(0, 100, 4) == 0.25
    assert member_share(30, None, 4) == 0.25
    assert member_share(0, None, True) == 1.0  # a bool is no batch size
    assert member_share(0, None, None) == 1.0
    assert parse_prices(["2.5", "NVIDIA H100 80GB HBM3=4"]) == (
        ("", 2.5), ("NVIDIA H100 80GB HBM3", 4.0))
    for bad in ("cheap", "-1", "=3", "H100=nan"):
        with pytest.raises(ValueError, match="MODEL=PRICE"):
            parse_prices([bad])


def test_gpu_hour_price_setting_flag_env_and_config(tmp_path):
    env = {"INFERPROF_COLLECTOR_GPU_HOUR_PRICES": "H100=4,1.5"}
    assert CollectorSettings.from_env(environ=env).gpu_hour_prices == (("H100", 4.0), ("", 1.5))
    config = tmp_path / "c.toml"
    config.write_text('[collector]\ngpu-hour-prices = {H100 = 4.0, "" = 1.0}\n')
    assert CollectorSettings.from_env(config=config, environ={}).engine_kwargs()[
        "gpu_hour_prices"] == (("H100", 4.0), ("", 1.0))
    with pytest.raises(ValueError, match="gpu_hour_prices"):
        CollectorSettings(gpu_hour_prices=(("H100", -1.0),))
    out = CliRunner().invoke(main, ["collect", "--gpu-hour-price", "lots"])
    assert out.exit_code == 2 and "MODEL=PRICE" in out.output


def test_report_shows_the_cost(tmp_path):
    export, truth, *_ = _workload()
    dump = tmp_path / "d.pb"
    write_pb(dump, [export, gpu_metrics(POWER, metric=sc.METRIC_GPU_POWER_DRAW),
                    gpu_metrics(POWER, metric=sc.METRIC_GPU_POWER_DRAW, hw_id="GPU-1")])
    runner = CliRunner()
    out = runner.invoke(main, ["report", str(dump), "--model", "a", "--format", "json",
                               "--gpu-hour-price", "3.6"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    compute = _stages(doc)["compute"]
    assert compute["cost_per_request"] == pytest.approx(truth[("a", "compute")] / 4 / 1000)
    table = format_table(doc)
    assert "cost per request: GPU" in table and "per GPU-hour" in table and " J " in table


def test_each_example_carries_its_own_share_of_its_batches():
    export, *_ = _workload()
    engine = Engine(settle_s=0, clock=FakeClock(), retention_s=math.inf)
    engine.ingest_traces(export)
    engine.flush()
    examples = {}
    for model in ("a", "b"):
        for ex in engine.breakdown("svc", model, None)["examples"]:
            examples[ex["trace_id"]] = ex.get("gpu_seconds")
    # batch A's members: by tokens (10, 30, 60 of 100) of 0.2 s; h2d evenly (3)
    by_share = sorted(
        (g for g in examples.values() if g and "h2d" in g), key=lambda g: g["compute"])
    assert [g["compute"] for g in by_share] == pytest.approx([0.02, 0.06, 0.12])
    assert all(g["h2d"] == pytest.approx(0.02 / 3) for g in by_share)
    # batch B's: evenly (2) of 0.1 s; C: all of its 0.05 s
    others = sorted(g["compute"] for g in examples.values() if g and "h2d" not in g)
    assert others == pytest.approx([0.05, 0.05, 0.05])
