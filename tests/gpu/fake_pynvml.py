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
    #: NVML function names that raise NVMLError_NotSupported on this GPU
    unsupported: set[str] = field(default_factory=set)
    #: NVML function names that raise NVMLError_GpuIsLost on this GPU
    lost: set[str] = field(default_factory=set)
    calls: int = 0


def build(gpus: list[FakeGpu], *, init_error: type[real.NVMLError] | None = None
          ) -> types.ModuleType:
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
               nvmlDeviceGetUUID, nvmlDeviceGetUtilizationRates, nvmlDeviceGetMemoryInfo,
               nvmlDeviceGetPowerUsage, nvmlDeviceGetClockInfo, nvmlDeviceGetTemperature):
        setattr(mod, fn.__name__, fn)
    mod.state = state  # tests read whether NVML was shut down again
    return mod


def real_nvml_works() -> bool:
    """Whether the real NVML initialises here (an NVIDIA driver and GPU): the tests of the
    no-GPU path run only where it does not."""
    try:
        real.nvmlInit()
    except real.NVMLError:
        return False
    real.nvmlShutdown()
    return True
