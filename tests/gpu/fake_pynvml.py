"""A stand-in for nvidia-ml-py's ``pynvml`` module, for machines without an NVIDIA driver.

It stands in for the hardware library only: the functions play back SYNTHETIC readings in
the shapes and units NVML returns them (percent utilisation in a struct with ``.gpu`` /
``.memory``, memory in bytes, power in milliwatts, clock in MHz, temperature in degrees
Celsius, UUID as ``GPU-<8-4-4-4-12 lower-case hex>``), while the exception classes and
constants are the real module's, so the code under test meets the real error types.

    nvml = fake_pynvml.build([FakeGpu("GPU-...", util=[(37, 12), (90, 40)]), ...])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
"""

from __future__ import annotations

import time
import types
from dataclasses import dataclass, field

import pynvml as real


@dataclass
class FakeGpu:
    uuid: str | bytes
    #: (gpu %, memory %) per call of nvmlDeviceGetUtilizationRates, the last one repeats
    util: list[tuple[int, int]] = field(default_factory=lambda: [(0, 0)])
    memory_total: int = 85_520_809_984  # an H100 80GB HBM3's nvmlMemory_t.total
    memory_used: int = 1_043_267_584
    power_mw: int = 71_234
    clock_mhz: int = 1_980
    temperature_c: int = 33
    #: nvmlDeviceGetName's answer (bytes, as older nvidia-ml-py gives it, or str)
    name: str | bytes = b"NVIDIA H100 80GB HBM3"
    #: NVML function names that raise NVMLError_NotSupported on this GPU
    unsupported: set[str] = field(default_factory=set)
    #: NVML function names that raise NVMLError_GpuIsLost on this GPU
    lost: set[str] = field(default_factory=set)
    calls: int = 0
    #: GPM (Hopper and later): None for a GPU without it, else per nvmlGpmMetricsGet call
    #: the percentages of (SM util, SM occupancy, any tensor util, DRAM bandwidth util), the
    #: last one repeating; None for a metric NVML answers NVML_ERROR_NOT_SUPPORTED, a
    #: Failed(code) for one it answers with that error return
    gpm: list[tuple[float | Failed | None, ...]] | None = None
    gpm_calls: int = 0
    #: time.monotonic() at each nvmlGpmSampleGet on this GPU
    gpm_sample_times: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Failed:
    """A GPM metric NVML answers with this error in its ``nvmlReturn`` (value 0)."""

    code: int = real.NVML_ERROR_UNKNOWN


def build(gpus: list[FakeGpu], *, init_error: type[real.NVMLError] | None = None,
          gpm: bool = False) -> types.ModuleType:
    """``gpm``: the module has the GPM functions (nvidia-ml-py 11.525 and later); each
    GPU then has GPM when its ``FakeGpu.gpm`` is set."""
    mod = types.ModuleType("pynvml")
    for name in dir(real):
        if name.startswith(("NVMLError", "NVML_")):
            setattr(mod, name, getattr(real, name))
    state = {"initialised": 0}

    def check(gpu: FakeGpu, fn: str) -> None:
        if not state["initialised"]:
            raise real.NVMLError_Uninitialized()
        if fn in gpu.unsupported:
            raise real.NVMLError_NotSupported()
        if fn in gpu.lost:
            raise real.NVMLError_GpuIsLost()

    def nvmlInit() -> None:
        if init_error is not None:
            raise init_error()
        state["initialised"] += 1

    def nvmlShutdown() -> None:
        if not state["initialised"]:
            raise real.NVMLError_Uninitialized()
        state["initialised"] -= 1

    def nvmlDeviceGetCount() -> int:
        return len(gpus)

    def nvmlDeviceGetHandleByIndex(index: int) -> FakeGpu:
        return gpus[index]

    def nvmlDeviceGetUUID(gpu: FakeGpu) -> str | bytes:
        return gpu.uuid

    def nvmlDeviceGetName(gpu: FakeGpu) -> str | bytes:
        check(gpu, "nvmlDeviceGetName")
        return gpu.name

    def nvmlDeviceGetUtilizationRates(gpu: FakeGpu):
        check(gpu, "nvmlDeviceGetUtilizationRates")
        gpu_pct, mem_pct = gpu.util[min(gpu.calls, len(gpu.util) - 1)]
        gpu.calls += 1
        return real.c_nvmlUtilization_t(gpu=gpu_pct, memory=mem_pct)

    def nvmlDeviceGetMemoryInfo(gpu: FakeGpu, version=None):
        check(gpu, "nvmlDeviceGetMemoryInfo")
        return real.c_nvmlMemory_t(total=gpu.memory_total, free=gpu.memory_total - gpu.memory_used,
                                   used=gpu.memory_used)

    def nvmlDeviceGetPowerUsage(gpu: FakeGpu) -> int:
        check(gpu, "nvmlDeviceGetPowerUsage")
        return gpu.power_mw

    def nvmlDeviceGetClockInfo(gpu: FakeGpu, clock_type: int) -> int:
        check(gpu, "nvmlDeviceGetClockInfo")
        assert clock_type == real.NVML_CLOCK_GRAPHICS
        return gpu.clock_mhz

    def nvmlDeviceGetTemperature(gpu: FakeGpu, sensor: int) -> int:
        check(gpu, "nvmlDeviceGetTemperature")
        assert sensor == real.NVML_TEMPERATURE_GPU
        return gpu.temperature_c

    for fn in (nvmlInit, nvmlShutdown, nvmlDeviceGetCount, nvmlDeviceGetHandleByIndex,
               nvmlDeviceGetUUID, nvmlDeviceGetName, nvmlDeviceGetUtilizationRates, nvmlDeviceGetMemoryInfo,
               nvmlDeviceGetPowerUsage, nvmlDeviceGetClockInfo, nvmlDeviceGetTemperature):
        setattr(mod, fn.__name__, fn)
    mod.state = state  # tests read whether NVML was shut down again
    if gpm:
        _add_gpm(mod, check, state)
    return mod


class _Sample:
    """A GPM sample handle: which GPU it was last taken on."""

    def __init__(self) -> None:
        self.gpu: FakeGpu | None = None


class _Metric:
    def __init__(self) -> None:
        self.metricId = 0
        self.nvmlReturn = -1
        self.value = float("nan")


class _MetricsGet:
    """nvmlGpmMetricsGet_t's fields, as a plain object (the real one is a ctypes struct
    whose samples must be real NVML handles)."""

    def __init__(self) -> None:
        self.version = 0
        self.numMetrics = 0
        self.sample1: _Sample | None = None
        self.sample2: _Sample | None = None
        self.metrics = [_Metric() for _ in range(real.NVML_GPM_METRIC_MAX)]


_GPM_ORDER = (real.NVML_GPM_METRIC_SM_UTIL, real.NVML_GPM_METRIC_SM_OCCUPANCY,
              real.NVML_GPM_METRIC_ANY_TENSOR_UTIL, real.NVML_GPM_METRIC_DRAM_BW_UTIL)


def _add_gpm(mod: types.ModuleType, check, state: dict) -> None:
    """The GPM calls NvmlSource makes, with SYNTHETIC percentages from FakeGpu.gpm."""
    state["gpm_samples"] = 0  # allocated and not freed

    def nvmlGpmQueryDeviceSupport(gpu: FakeGpu):
        check(gpu, "nvmlGpmQueryDeviceSupport")
        return types.SimpleNamespace(version=1, isSupportedDevice=int(gpu.gpm is not None))

    def nvmlGpmSampleAlloc() -> _Sample:
        state["gpm_samples"] += 1
        return _Sample()

    def nvmlGpmSampleFree(sample: _Sample) -> None:
        state["gpm_samples"] -= 1

    def nvmlGpmSampleGet(gpu: FakeGpu, sample: _Sample) -> None:
        check(gpu, "nvmlGpmSampleGet")
        gpu.gpm_sample_times.append(time.monotonic())
        sample.gpu = gpu

    def nvmlGpmMetricsGet(request: _MetricsGet) -> _MetricsGet:
        gpu = request.sample2.gpu
        assert request.version == real.NVML_GPM_METRICS_GET_VERSION
        assert request.sample1 is not request.sample2 and request.sample1.gpu is gpu
        check(gpu, "nvmlGpmMetricsGet")
        row = gpu.gpm[min(gpu.gpm_calls, len(gpu.gpm) - 1)]
        gpu.gpm_calls += 1
        for m in request.metrics[: request.numMetrics]:
            value = row[_GPM_ORDER.index(m.metricId)]
            if value is None:
                m.nvmlReturn, m.value = real.NVML_ERROR_NOT_SUPPORTED, 0.0
            elif isinstance(value, Failed):
                m.nvmlReturn, m.value = value.code, 0.0
            else:
                m.nvmlReturn, m.value = real.NVML_SUCCESS, value
        return request

    for fn in (nvmlGpmQueryDeviceSupport, nvmlGpmSampleAlloc, nvmlGpmSampleFree,
               nvmlGpmSampleGet, nvmlGpmMetricsGet):
        setattr(mod, fn.__name__, fn)
    mod.c_nvmlGpmMetricsGet_t = _MetricsGet
    mod.NVML_GPM_METRICS_GET_VERSION = real.NVML_GPM_METRICS_GET_VERSION


def real_nvml_works() -> bool:
    """Whether the real NVML initialises here (an NVIDIA driver and GPU): the tests of the
    no-GPU path run only where it does not."""
    try:
        real.nvmlInit()
    except real.NVMLError:
        return False
    real.nvmlShutdown()
    return True
