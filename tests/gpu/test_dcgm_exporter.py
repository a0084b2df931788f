"""The dcgm-exporter source: a recorded /metrics page scraped from a real HTTP server,
mapped to the contract's names and units; label variants; an exporter that is down."""

from __future__ import annotations

import logging
import re
import socket
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferprof import semconv as sc
from inferprof.gpu import DcgmExporterSource, GpuSampler, parse_exposition
from inferprof.gpu.dcgm_exporter import DCGM_FIELDS

MIB = 1024 * 1024
BUSY = "GPU-15704b32-f531-14ce-0530-1ac21e4b68e6"
IDLE = "GPU-edc718f8-e593-6468-b9f9-563d508366ed"
MIG = "GPU-e2d9b65e-98cb-5b7a-90f0-e0336573f9e2"
NODE = "ip-10-0-180-136.ec2.internal"


def test_a_scrape_maps_every_field_to_the_contract(dcgm_exporter):
    src = DcgmExporterSource(dcgm_exporter.url)
    src.open()
    before = time.time_ns()
    samples = {s.hw_id: s for s in src.read()}
    after = time.time_ns()
    assert set(samples) == {BUSY, IDLE}  # the MIG GPU's instance series are left out
    busy = samples[BUSY]
    assert busy.host == NODE
    assert before <= busy.time_unix_nano <= after
    assert busy.as_dict() == {
        sc.METRIC_GPU_UTILIZATION: pytest.approx(0.87),
        sc.METRIC_DCGM_MEM_COPY_UTIL: pytest.approx(0.41),
        sc.METRIC_GPU_MEMORY_USAGE: 20534 * MIB,
        # FB_USED + FB_FREE + FB_RESERVED: the reservation is not in FB_USED when exported
        sc.METRIC_GPU_MEMORY_LIMIT: (20534 + 60371 + 610) * MIB,
        sc.METRIC_GPU_MEMORY_UTILIZATION: pytest.approx(20534 / (20534 + 60371 + 610)),
        sc.METRIC_GPU_POWER_DRAW: pytest.approx(512.344),
        sc.METRIC_GPU_CLOCK_GRAPHICS: 1980.0,
        sc.METRIC_GPU_TEMPERATURE: 58.0,
        sc.METRIC_DCGM_SM_ACTIVE: pytest.approx(0.884102),
        sc.METRIC_DCGM_SM_OCCUPANCY: pytest.approx(0.412778),
        sc.METRIC_DCGM_TENSOR_ACTIVE: pytest.approx(0.633912),
        sc.METRIC_DCGM_DRAM_ACTIVE: pytest.approx(0.507734),
    }
    idle = samples[IDLE].as_dict()
    assert idle[sc.METRIC_GPU_UTILIZATION] == 0.0 and idle[sc.METRIC_GPU_MEMORY_USAGE] == 0.0
    assert sc.METRIC_DCGM_SM_OCCUPANCY not in idle  # DCGM's blank value is not a reading
    assert dcgm_exporter.scrapes == 1


def _series(name: str, value: str, **labels: str) -> str:
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{name}{{{body}}} {value}\n"


def test_host_label_variants():
    old = _series("DCGM_FI_DEV_GPU_UTIL", "50", gpu="0", UUID="GPU-a", Hostname="n1")
    renamed = _series("DCGM_FI_DEV_GPU_UTIL", "50", gpu="0", UUID="GPU-a", hostname="n1")
    podded = _series("DCGM_FI_DEV_GPU_UTIL", "50", gpu="0", UUID="GPU-a", Hostname="n1",
                     container="triton", namespace="default", pod="triton-84d57987c9-kks4k")
    # dcgm-exporter up to 4.5 says Hostname, 4.6.0-4.8.3 renamed it hostname
    assert parse_exposition(old, now_ns=1)[0].host == "n1"
    assert parse_exposition(renamed, now_ns=1)[0].host == "n1"
    # with Kubernetes pod mapping, the pod's name is the host.name of that pod's spans
    assert parse_exposition(podded, now_ns=1, host_label="pod")[0].host == (
        "triton-84d57987c9-kks4k")
    # a GPU no pod holds has no pod label: the node's name, not the scraper's own
    idle = _series("DCGM_FI_DEV_GPU_UTIL", "0", gpu="1", UUID="GPU-b", Hostname="n1")
    assert parse_exposition(idle, now_ns=1, host_label="pod")[0].host == "n1"
    # a series without any host label: the sampler's own host.name applies
    no_host = _series("DCGM_FI_DEV_GPU_UTIL", "50", gpu="0", UUID="GPU-a")
    assert parse_exposition(no_host, now_ns=1)[0].host is None


def test_series_timestamps_and_shared_gpus():
    # an exposition with timestamps (milliseconds) keeps them; a GPU time-shared by two
    # pods appears twice with one value: one reading
    text = (_series("DCGM_FI_DEV_GPU_UTIL", "30 1700000000123", UUID="GPU-a", pod="p1")
            + _series("DCGM_FI_DEV_GPU_UTIL", "30 1700000000123", UUID="GPU-a", pod="p2"))
    (sample,) = parse_exposition(text, now_ns=5)
    assert sample.time_unix_nano == 1_700_000_000_123_000_000
    assert sample.as_dict() == {sc.METRIC_GPU_UTILIZATION: pytest.approx(0.3)}


def test_renamed_fields_can_be_mapped():
    text = _series("DCGM_FI_DEV_GPU_UTIL_RATIO", "0.62", UUID="GPU-a")  # a made-up new name
    assert parse_exposition(text, now_ns=1) == []
    src = DcgmExporterSource(
        "http://127.0.0.1:9400/metrics",
        fields={"DCGM_FI_DEV_GPU_UTIL_RATIO": (sc.METRIC_GPU_UTILIZATION, 1.0)})
    (sample,) = parse_exposition(text, now_ns=1, fields=src.fields)
    assert sample.as_dict() == {sc.METRIC_GPU_UTILIZATION: pytest.approx(0.62)}
    with pytest.raises(ValueError, match="contract GPU metric"):
        DcgmExporterSource(fields={"X": ("hw.gpu.nope", 1.0)})
    with pytest.raises(ValueError, match="http"):
        DcgmExporterSource("localhost:9400")


_gpu = st.fixed_dictionaries({
    "util": st.integers(0, 100),
    "used": st.integers(0, 200_000),
    "free": st.integers(0, 200_000),
    "power": st.floats(0, 2_000, allow_nan=False),
    "sm": st.floats(0, 1, allow_nan=False),
    "host_key": st.sampled_from(["Hostname", "hostname"]),
})


@settings(max_examples=60, deadline=None)
@given(st.lists(_gpu, min_size=1, max_size=8))
def test_parse_recovers_any_page_in_contract_units(gpus):
    text = ""
    for i, g in enumerate(gpus):
        labels = {"gpu": str(i), "UUID": f"GPU-{i:08d}", g["host_key"]: f"h{i}"}
        for name, value in (("DCGM_FI_DEV_GPU_UTIL", g["util"]), ("DCGM_FI_DEV_FB_USED", g["used"]),
                            ("DCGM_FI_DEV_FB_FREE", g["free"]),
                            ("DCGM_FI_DEV_POWER_USAGE", f"{g['power']:f}"),
                            ("DCGM_FI_PROF_SM_ACTIVE", f"{g['sm']:f}")):
            text += _series(name, str(value), **labels)
    got = {s.hw_id: s for s in parse_exposition(text, now_ns=7)}
    assert len(got) == len(gpus)
    for i, g in enumerate(gpus):
        s = got[f"GPU-{i:08d}"]
        v = s.as_dict()
        assert s.host == f"h{i}" and s.time_unix_nano == 7
        assert v[sc.METRIC_GPU_UTILIZATION] == pytest.approx(g["util"] / 100)
        assert 0.0 <= v[sc.METRIC_GPU_UTILIZATION] <= 1.0
        assert v[sc.METRIC_GPU_MEMORY_USAGE] == g["used"] * MIB
        assert v[sc.METRIC_GPU_MEMORY_LIMIT] == (g["used"] + g["free"]) * MIB
        if g["used"] + g["free"]:
            assert v[sc.METRIC_GPU_MEMORY_UTILIZATION] == pytest.approx(
                g["used"] / (g["used"] + g["free"]))
        assert v[sc.METRIC_GPU_POWER_DRAW] == pytest.approx(g["power"], abs=1e-6)
        assert v[sc.METRIC_DCGM_SM_ACTIVE] == pytest.approx(g["sm"], abs=1e-6)


def test_default_counters_without_profiling_fields_warn_about_the_verdict(caplog):
    from tests.gpu.conftest import MetricsServer

    page = "".join(_series(n, "40", UUID="GPU-a", Hostname="n") for n in DCGM_FIELDS
                   if not n.startswith("DCGM_FI_PROF_"))
    server = MetricsServer(page).start()
    try:
        src = DcgmExporterSource(server.url)
        src.open()
        with caplog.at_level(logging.WARNING, logger="inferprof.gpu"):
            src.read()
            src.read()
    finally:
        server.stop()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "'hardware'" in said[0] and "SM_OCCUPANCY" in said[0]


def test_an_exporter_that_is_down_is_retried_counted_and_picked_up(otlp_sink, caplog):
    from tests.gpu.conftest import DCGM_PAGE, MetricsServer

    server = MetricsServer(DCGM_PAGE).start()
    server.status = 503  # dcgm-exporter still starting
    sampler = GpuSampler(DcgmExporterSource(server.url), interval=0.05, export_interval=0.1,
                         endpoint=otlp_sink.endpoint, protocol="grpc")
    try:
        with caplog.at_level(logging.WARNING, logger="inferprof.gpu"):
            sampler.start()
            deadline = time.monotonic() + 10
            while sampler.stats().poll_errors < 5 and time.monotonic() < deadline:
                time.sleep(0.02)
        assert sampler.running and sampler.stats().poll_errors >= 5
        failures = [r for r in caplog.records if "poll failed" in r.getMessage()]
        assert len(failures) == 1  # rate-limited: not one line per poll
        server.status = 200
        assert otlp_sink.wait_for(lambda s: len(s.metric_requests) > 0, timeout=10)
        assert sampler.stats().samples >= 2
    finally:
        sampler.stop()
        server.stop()
    exported = {dp.attributes[0].value.string_value
                for req in otlp_sink.metric_requests for rm in req.resource_metrics
                for sm in rm.scope_metrics for m in sm.metrics for dp in m.gauge.data_points}
    assert exported == {BUSY, IDLE}
    assert MIG not in exported


def test_a_failed_scrape_names_the_url():
    from tests.gpu.conftest import MetricsServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{sock.getsockname()[1]}/metrics"
    with pytest.raises(OSError, match=f"scraping {re.escape(down)} failed: .*refused"):
        DcgmExporterSource(down).read()
    server = MetricsServer("").start()
    server.status = 503
    try:
        with pytest.raises(OSError, match=f"scraping {re.escape(server.url)} failed: HTTP 503"):
            DcgmExporterSource(server.url).read()
    finally:
        server.stop()


@pytest.mark.parametrize("page,why", [
    ("", "an empty page"),
    ("# HELP node_load1 1m load average.\n# TYPE node_load1 gauge\nnode_load1 0.5\n",
     "other metrics only"),  # node-exporter on the port by mistake
])
def test_a_page_without_dcgm_series_is_said_once(caplog, page, why):
    from tests.gpu.conftest import MetricsServer

    server = MetricsServer(page).start()
    try:
        src = DcgmExporterSource(server.url)
        src.open()
        with caplog.at_level(logging.WARNING, logger="inferprof.gpu"):
            for _ in range(3):
                assert src.read() == []
    finally:
        server.stop()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "serves no DCGM series" in said[0] and why in said[0]


def test_a_host_label_no_series_carries_is_said(caplog):
    from tests.gpu.conftest import MetricsServer

    page = _series("DCGM_FI_DEV_GPU_UTIL", "50", gpu="0", UUID="GPU-a", Hostname="n1", pod="p")
    server = MetricsServer(page).start()
    try:
        with caplog.at_level(logging.WARNING, logger="inferprof.gpu"):
            (good,) = DcgmExporterSource(server.url, host_label="pod").read()
            (typo,) = DcgmExporterSource(server.url, host_label="Pod").read()
            # a label that merely ends in the name (exported_pod) does not count as it
            server.body = _series("DCGM_FI_DEV_GPU_UTIL", "5", UUID="GPU-b", Hostname="n1",
                                  exported_pod="q")
            (other,) = DcgmExporterSource(server.url, host_label="pod").read()
    finally:
        server.stop()
    assert good.host == "p"
    assert typo.host == other.host == "n1"  # the exporter's Hostname, as the warning says
    said = [r.getMessage() for r in caplog.records if "host label" in r.getMessage()]
    assert len(said) == 2 and "'Pod'" in said[0] and "case sensitive" in said[0]
    assert "keep the exporter's Hostname label" in said[0]


def test_the_model_name_label_is_the_samples_hw_model():
    text = _series("DCGM_FI_DEV_POWER_USAGE", "300", gpu="0", UUID="GPU-a", Hostname="n1",
                   modelName="NVIDIA H100 80GB HBM3")
    (sample,) = parse_exposition(text, now_ns=1)
    assert sample.model == "NVIDIA H100 80GB HBM3"
    bare = _series("DCGM_FI_DEV_POWER_USAGE", "300", gpu="0", UUID="GPU-a", Hostname="n1")
    assert parse_exposition(bare, now_ns=1)[0].model is None
