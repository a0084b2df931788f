"""The NVML source: readings in the contract's units, per-GPU failures, and the machine
without a GPU (this one: the real nvidia-ml-py finds no libnvidia-ml)."""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
import time
import types

import pynvml
import pytest

from inferprof import semconv as sc
from inferprof.gpu import DisabledSampler, NvmlSource, SourceUnavailable, start_sampler
from inferprof.gpu.nvml import GPM_MIN_INTERVAL_S
from inferprof.instrumentation import device
from tests.gpu import fake_pynvml
from tests.gpu.fake_pynvml import FakeGpu

UUID_A = "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52"
UUID_B = "GPU-e2d9b65e-98cb-5b7a-90f0-e0336573f9e2"


@pytest.fixture
def fake_nvml(monkeypatch):
    def install(gpus, **kw):
        mod = fake_pynvml.build(gpus, **kw)
        monkeypatch.setitem(sys.modules, "pynvml", mod)
        return mod
    return install


def test_reads_every_gpu_in_the_contracts_units(fake_nvml):
    fake_nvml([
        FakeGpu(UUID_A, util=[(37, 12), (90, 40)], memory_total=80 * 2**30,
                memory_used=20 * 2**30, power_mw=312_500, clock_mhz=1_755, temperature_c=61),
        # older nvidia-ml-py releases return the UUID as bytes
        FakeGpu(UUID_B.encode(), util=[(5, 1)]),
    ])
    src = NvmlSource()
    src.open()
    try:
        first = src.read()
        second = src.read()
    finally:
        src.close()
    assert [s.hw_id for s in first] == [UUID_A, UUID_B]
    a = first[0].as_dict()
    assert a == {
        sc.METRIC_GPU_UTILIZATION: pytest.approx(0.37),
        sc.METRIC_DCGM_MEM_COPY_UTIL: pytest.approx(0.12),
        sc.METRIC_GPU_MEMORY_USAGE: 20 * 2**30,
        sc.METRIC_GPU_MEMORY_LIMIT: 80 * 2**30,
        sc.METRIC_GPU_MEMORY_UTILIZATION: pytest.approx(0.25),
        sc.METRIC_GPU_POWER_DRAW: pytest.approx(312.5),
        sc.METRIC_GPU_CLOCK_GRAPHICS: 1755.0,
        sc.METRIC_GPU_TEMPERATURE: 61.0,
    }
    assert all(s.host is None for s in first)  # the sampler's host.name applies
    # each poll reads the driver again: the second reading is the GPU's next figure
    assert second[0].as_dict()[sc.METRIC_GPU_UTILIZATION] == pytest.approx(0.90)
    assert second[0].time_unix_nano >= first[0].time_unix_nano


def test_a_reading_nvml_does_not_support_is_left_out_and_the_rest_kept(fake_nvml):
    fake_nvml([FakeGpu(UUID_A), FakeGpu(UUID_B, unsupported={"nvmlDeviceGetPowerUsage"})])
    src = NvmlSource()
    src.open()
    try:
        for _ in range(2):
            a, b = (s.as_dict() for s in src.read())
            assert sc.METRIC_GPU_POWER_DRAW in a
            assert sc.METRIC_GPU_POWER_DRAW not in b
            assert sc.METRIC_GPU_UTILIZATION in b and sc.METRIC_GPU_TEMPERATURE in b
    finally:
        src.close()


def test_a_poll_fails_only_when_no_gpu_could_be_read(fake_nvml):
    everything = {"nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo",
                  "nvmlDeviceGetPowerUsage", "nvmlDeviceGetClockInfo", "nvmlDeviceGetTemperature"}
    fake_nvml([FakeGpu(UUID_A, lost=everything), FakeGpu(UUID_B)])
    src = NvmlSource()
    src.open()
    assert [s.hw_id for s in src.read()] == [UUID_B]  # the lost GPU does not hide the other
    src.close()
    fake_nvml([FakeGpu(UUID_A, lost=everything)])
    src = NvmlSource()
    src.open()
    with pytest.raises(RuntimeError, match="GPU is lost"):
        src.read()
    src.close()


def test_devices_narrow_the_gpus_by_uuid_or_index(fake_nvml):
    mod = fake_nvml([FakeGpu(UUID_A), FakeGpu(UUID_B)])
    for wanted in ([UUID_B], [1]):
        src = NvmlSource(wanted)
        src.open()
        assert [s.hw_id for s in src.read()] == [UUID_B]
        src.close()
    with pytest.raises(ValueError, match=f"no such GPU.*0={UUID_A}"):
        NvmlSource(["GPU-nope"]).open()
    assert mod.state["initialised"] == 0  # every open was matched by a shutdown


def test_no_gpu_or_no_driver_is_source_unavailable_in_one_line(fake_nvml):
    fake_nvml([])
    with pytest.raises(SourceUnavailable, match="NVML sees no GPU"):
        NvmlSource().open()
    fake_nvml([FakeGpu(UUID_A)], init_error=pynvml.NVMLError_DriverNotLoaded)
    with pytest.raises(SourceUnavailable, match="driver is not loaded"):
        NvmlSource().open()


def test_a_missing_package_is_an_import_error_naming_the_extra_for_both_sources(monkeypatch):
    # the same exception for nvidia-ml-py and prometheus-client, as inferprof's other extras
    from inferprof.gpu import DcgmExporterSource

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'inferprof\[gpu\]'") as missing:
        NvmlSource().open()
    # names the package: `pip install pynvml` would get another, deprecated one
    assert "'pynvml' (package nvidia-ml-py)" in str(missing.value)
    monkeypatch.setitem(sys.modules, "prometheus_client.parser", None)
    with pytest.raises(ImportError, match=r"pip install 'inferprof\[gpu\]'"):
        DcgmExporterSource().open()
    # start_sampler() still turns either into a DisabledSampler
    disabled = start_sampler("nvml")
    assert isinstance(disabled, DisabledSampler) and "inferprof[gpu]" in disabled.reason


@pytest.mark.skipif(fake_pynvml.real_nvml_works(), reason="this machine has a working NVIDIA driver")
def test_real_nvml_without_a_driver_says_so():
    with pytest.raises(SourceUnavailable, match="libnvidia-ml.so.*not found"):
        NvmlSource().open()


@pytest.mark.skipif(fake_pynvml.real_nvml_works(), reason="this machine has a working NVIDIA driver")
def test_start_sampler_without_a_gpu_warns_once_and_returns_a_no_op(caplog, otlp_sink):
    before = {t.name for t in threading.enumerate()}
    with caplog.at_level(logging.DEBUG, logger="inferprof"):
        sampler = start_sampler(endpoint=otlp_sink.endpoint)  # nvml, the default source
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "GPU sampling disabled" in warnings[0].getMessage()
    assert "libnvidia-ml.so" in warnings[0].getMessage()
    assert isinstance(sampler, DisabledSampler) and not sampler.running
    assert sampler.reason == warnings[0].getMessage()
    assert {t.name for t in threading.enumerate()} - before == set()  # no thread started
    sampler.stop()
    assert sampler.flush() and sampler.stats().polls == 0


def test_nvml_uuid_is_the_gpu_id_the_cuda_stages_carry(fake_nvml, monkeypatch):
    """The collector joins hw.id to inferprof.gpu.id: both must spell the UUID the same way.

    torch prints a device's UUID without NVML's ``GPU-`` prefix (``_CUuuid.__str__``:
    ``%02x`` bytes in 8-4-4-4-12 groups); ``device.gpu_uuid`` adds it. The stand-in below
    reproduces that rendering for one GPU.
    """
    bare = UUID_A.removeprefix("GPU-")
    props = types.SimpleNamespace(uuid=type("_CUuuid", (), {"__str__": lambda self: bare})())
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(
        get_device_properties=lambda index: props))
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(device, "_gpu_uuids", {})
    fake_nvml([FakeGpu(UUID_A)])
    src = NvmlSource()
    src.open()
    try:
        assert src.read()[0].hw_id == device.gpu_uuid(0) == UUID_A
    finally:
        src.close()


def test_gpm_gives_sm_activity_and_occupancy_under_the_dcgm_names(fake_nvml, caplog):
    mod = fake_nvml([
        # (SM util, SM occupancy, tensor, DRAM bandwidth) %, per poll: SYNTHETIC
        # this GPU's NVML does not support the tensor metric: left out, the rest kept
        FakeGpu(UUID_A, gpm=[(95.3, 14.1, None, 23.8), (40.0, 60.0, None, 10.0)]),
        FakeGpu(UUID_B),  # an older GPU: no GPM
    ], gpm=True)
    src = NvmlSource()
    with caplog.at_level(logging.INFO, logger="inferprof"):
        src.open()
    try:
        assert src.gpm_gpu_ids == [UUID_A]
        assert any(UUID_B in r.getMessage() and "no NVML GPM" in r.getMessage()
                   for r in caplog.records)
        time.sleep(GPM_MIN_INTERVAL_S)
        first = src.read()
        too_soon = src.read()  # GPM's counters move every ~100 ms: no figures this poll
        time.sleep(GPM_MIN_INTERVAL_S)
        second = src.read()
    finally:
        src.close()
    assert sc.METRIC_DCGM_SM_ACTIVE not in too_soon[0].as_dict()
    assert sc.METRIC_GPU_UTILIZATION in too_soon[0].as_dict()
    a = first[0].as_dict()
    assert a[sc.METRIC_DCGM_SM_ACTIVE] == pytest.approx(0.953)
    assert a[sc.METRIC_DCGM_SM_OCCUPANCY] == pytest.approx(0.141)
    assert a[sc.METRIC_DCGM_DRAM_ACTIVE] == pytest.approx(0.238)
    assert a[sc.METRIC_GPU_UTILIZATION] == pytest.approx(0.0)  # the usual readings too
    # each poll's figures cover the time since the last one; a metric NVML does not
    # support on this GPU is left out
    b = second[0].as_dict()
    assert b[sc.METRIC_DCGM_SM_ACTIVE] == pytest.approx(0.40)
    assert sc.METRIC_DCGM_TENSOR_ACTIVE not in a and sc.METRIC_DCGM_TENSOR_ACTIVE not in b
    assert src.gpm_dropped == 0
    assert not any(k.startswith(sc.METRIC_DCGM_PREFIX + "sm") for k in first[1].as_dict())
    assert mod.state["gpm_samples"] == 0  # both samples freed on close


def test_without_gpm_in_nvidia_ml_py_or_when_turned_off_the_rest_is_read(fake_nvml):
    fake_nvml([FakeGpu(UUID_A, gpm=[(95.0, 14.0, 92.0, 24.0)])], gpm=False)  # no GPM calls
    src = NvmlSource()
    src.open()
    assert src.gpm_gpu_ids == []
    assert sc.METRIC_DCGM_SM_ACTIVE not in src.read()[0].as_dict()
    src.close()
    mod = fake_nvml([FakeGpu(UUID_A, gpm=[(95.0, 14.0, 92.0, 24.0)])], gpm=True)
    src = NvmlSource(gpm=False)
    src.open()
    time.sleep(GPM_MIN_INTERVAL_S)
    assert sc.METRIC_DCGM_SM_ACTIVE not in src.read()[0].as_dict()
    src.close()
    assert mod.state["gpm_samples"] == 0


def test_a_failing_gpm_read_keeps_the_other_readings(fake_nvml):
    fake_nvml([FakeGpu(UUID_A, gpm=[(95.0, 14.0, 92.0, 24.0)], lost={"nvmlGpmMetricsGet"})],
              gpm=True)
    src = NvmlSource()
    src.open()
    try:
        time.sleep(GPM_MIN_INTERVAL_S)
        reading = src.read()[0].as_dict()
    finally:
        src.close()
    assert sc.METRIC_GPU_UTILIZATION in reading and sc.METRIC_DCGM_SM_ACTIVE not in reading


@pytest.fixture
def clock(monkeypatch):
    """A fake monotonic clock for the NVML source and the fake NVML alike; sleeping
    advances it. ``clock[0]``: now."""
    now = [1000.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    monkeypatch.setattr(time, "sleep", sleep)
    return now


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def test_gpm_on_the_default_poll_grid_reads_every_poll(fake_nvml, clock):
    # polls 0.1 s apart come a few microseconds early half of the time: they wait those
    # microseconds rather than take a GPM pair closer than NVML allows
    gpu = FakeGpu(UUID_A, gpm=[(95.0, 14.0, 92.0, 24.0)])
    fake_nvml([gpu], gpm=True)
    src = NvmlSource()
    src.open()
    try:
        with_gpm = 0
        for k in range(1, 21):
            clock[0] = 1000.0 + 0.1 * k - (0.000004 if k % 2 else 0.0)
            with_gpm += sc.METRIC_DCGM_SM_ACTIVE in src.read()[0].as_dict()
    finally:
        src.close()
    assert with_gpm == 20
    assert len(gpu.gpm_sample_times) == 21
    assert min(_gaps(gpu.gpm_sample_times)) > GPM_MIN_INTERVAL_S - 1e-9


def test_a_gpm_pair_is_never_taken_closer_than_nvml_allows(fake_nvml, clock):
    # The H200's bad reading was stamped 98.8 ms after the one before: such a poll now
    # waits for its GPM sample until 100 ms have passed since the last one; a poll much
    # earlier takes no GPM figures and leaves the pair to the next poll.
    gpu = FakeGpu(UUID_A, util=[(99, 100)], gpm=[(98.3, 79.4, 0.0, 87.5)])
    fake_nvml([gpu], gpm=True)
    src = NvmlSource()
    src.open()  # GPM sample at 1000.0
    readings = []
    try:
        for at in (1000.1, 1000.1988, 1000.2992, 1000.35, 1000.4, 1000.5):
            clock[0] = max(clock[0], at)
            readings.append(src.read()[0].as_dict())
    finally:
        src.close()
    has_gpm = [sc.METRIC_DCGM_SM_ACTIVE in r for r in readings]
    assert has_gpm == [True, True, True, False, True, True]
    assert all(r[sc.METRIC_GPU_UTILIZATION] == pytest.approx(0.99) for r in readings)
    # the polls at 1000.1988 and 1000.2992 waited for 1000.2 and 1000.3; the one at
    # 1000.35 took no sample
    assert gpu.gpm_sample_times == pytest.approx([1000.0, 1000.1, 1000.2, 1000.3, 1000.4,
                                                  1000.5])
    assert min(_gaps(gpu.gpm_sample_times)) > GPM_MIN_INTERVAL_S - 1e-9
    assert src.gpm_dropped == 0


def test_a_gpm_pair_with_a_failed_metric_is_dropped_whole_the_rest_kept(fake_nvml, clock):
    # The shape an H200 gave once under a saturating device-to-device copy (tests/gpu/data/
    # h200-nvml.jsonl, t 1795857229.580): utilisation 99%, but SM activity, occupancy and
    # tensor activity 0 and the DRAM metric failed. All four come from one pair of GPM
    # samples: one failing says the pair holds no counter movement, and its zeros are not
    # the GPU's. Readings every 100 ms as recorded; the rows are SYNTHETIC in that shape.
    copy = (98.3, 79.4, 0.0, 87.5)
    gpu = FakeGpu(UUID_A, util=[(99, 100)], gpm=[
        copy, copy, (0.0, 0.0, 0.0, fake_pynvml.Failed()), copy,
        # a non-finite value with NVML_SUCCESS: not trusted either
        (float("nan"), 79.4, 0.0, 87.5),
        # NOT_SUPPORTED from a metric that answered before: the pair, not the GPU
        (98.3, 79.4, 0.0, None), copy])
    fake_nvml([gpu], gpm=True)
    src = NvmlSource()
    src.open()
    readings = []
    try:
        for k in range(1, 8):
            clock[0] = 1000.0 + 0.1 * k
            readings.append(src.read()[0].as_dict())
    finally:
        src.close()
    gpm_names = {sc.METRIC_DCGM_SM_ACTIVE, sc.METRIC_DCGM_SM_OCCUPANCY,
                 sc.METRIC_DCGM_TENSOR_ACTIVE, sc.METRIC_DCGM_DRAM_ACTIVE}
    with_gpm = [gpm_names <= r.keys() for r in readings]
    assert with_gpm == [True, True, False, True, False, False, True]
    for r, kept in zip(readings, with_gpm, strict=True):
        assert kept or not gpm_names & r.keys()  # dropped whole, never in part
        # the reading's other NVML figures are kept either way
        assert r[sc.METRIC_GPU_UTILIZATION] == pytest.approx(0.99)
        assert r[sc.METRIC_GPU_POWER_DRAW] == pytest.approx(71.234)
        if kept:
            assert r[sc.METRIC_DCGM_SM_ACTIVE] == pytest.approx(0.983)
            assert r[sc.METRIC_DCGM_DRAM_ACTIVE] == pytest.approx(0.875)
    assert src.gpm_dropped == 3


def test_gpm_once_reopened_and_switched_off_mid_run(fake_nvml, capsys):
    from inferprof.gpu.sampler import GpuSampler

    gpu = FakeGpu(UUID_A, gpm=[(95.0, 14.0, 92.0, 24.0)])
    mod = fake_nvml([gpu], gpm=True)
    # --once: the one reading carries the GPM figures too
    (once,) = GpuSampler(NvmlSource(), endpoint="http://127.0.0.1:9").read_once()
    assert once.as_dict()[sc.METRIC_DCGM_SM_ACTIVE] == pytest.approx(0.95)
    assert mod.state["gpm_samples"] == 0
    # opened twice: the first GPM samples are freed
    src = NvmlSource()
    src.open()
    src.open()
    assert mod.state["gpm_samples"] == 2
    # NVML stops supporting GPM: the GPU leaves gpm_gpu_ids and its samples are freed
    gpu.unsupported.add("nvmlGpmSampleGet")
    time.sleep(GPM_MIN_INTERVAL_S)
    assert sc.METRIC_DCGM_SM_ACTIVE not in src.read()[0].as_dict()
    assert src.gpm_gpu_ids == [] and mod.state["gpm_samples"] == 0
    assert sc.METRIC_GPU_UTILIZATION in src.read()[0].as_dict()
    src.close()


def test_samples_name_the_gpu_model_as_hw_model(fake_nvml):
    from opentelemetry.sdk.resources import Resource

    from inferprof.gpu.otlp import to_metrics_data

    fake_nvml([FakeGpu(UUID_A), FakeGpu(UUID_B, name="NVIDIA L4"),
               FakeGpu("GPU-00000000-0000-0000-0000-000000000003",
                       unsupported={"nvmlDeviceGetName"})])
    src = NvmlSource()
    src.open()
    try:
        samples = src.read()
    finally:
        src.close()
    assert [s.model for s in samples] == ["NVIDIA H100 80GB HBM3", "NVIDIA L4", None]
    data = to_metrics_data(samples, Resource({}))
    points = {
        dict(p.attributes)[sc.ATTR_HW_ID]: dict(p.attributes).get(sc.ATTR_HW_MODEL)
        for m in data.resource_metrics[0].scope_metrics[0].metrics for p in m.data.data_points
    }
    assert points == {UUID_A: "NVIDIA H100 80GB HBM3", UUID_B: "NVIDIA L4",
                      "GPU-00000000-0000-0000-0000-000000000003": None}


def test_the_sidecar_says_how_many_polls_lost_their_gpm_figures(fake_nvml, monkeypatch):
    from click.testing import CliRunner

    from inferprof.gpu.command import gpu as gpu_command

    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    copy = (98.3, 79.4, 0.0, 87.5)
    fake_nvml([FakeGpu(UUID_A, util=[(99, 100)],
                       gpm=[copy, (0.0, 0.0, 0.0, fake_pynvml.Failed()), copy])], gpm=True)
    # a port nothing listens on: the exports fail, the sampling goes on
    result = CliRunner().invoke(gpu_command, [
        "--source", "nvml", "--interval", "0.1", "--duration", "1",
        "--endpoint", "http://127.0.0.1:9"])
    assert result.exit_code == 0, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.endswith(", GPM figures dropped from 1 poll (a metric failed)"), last
