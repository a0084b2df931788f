"""GPU samples from NVML, the NVIDIA driver's management library (``nvidia-ml-py``).

Per GPU and poll: utilisation (``nvmlDeviceGetUtilizationRates``: the percent of the
driver's last sample period, between 1/6 s and 1 s depending on the product, in which a
kernel ran -> ratio), memory-controller busy share, memory used and size
(``nvmlDeviceGetMemoryInfo``, bytes), power (``nvmlDeviceGetPowerUsage``, mW -> W), the
graphics clock (MHz) and the core temperature (Cel). ``hw.id`` is the GPU's UUID as NVML
reports it (``GPU-<8-4-4-4-12 lower-case hex>``), which is what ``inferprof.gpu.id`` on the
service's CUDA stages holds (``inferprof.instrumentation.device.gpu_uuid``), so the collector can
join the two.

SM activity, SM occupancy, tensor-pipe and DRAM-bandwidth activity come from NVML's GPU
Performance Monitoring (GPM) API where the GPU has it (Hopper and later data-centre GPUs;
``nvmlGpmQueryDeviceSupport``): the same hardware counters DCGM's profiling module reads,
sent under the DCGM profiling names (``inferprof.gpu.dcgm.sm_active`` ...). Each is the
share of the time between two GPM samples, taken at least ``GPM_MIN_INTERVAL_S`` apart as
NVML's documentation asks; when one of them fails, the pair is not trusted and none of
its figures is sent (``NvmlSource.gpm_dropped`` counts such polls). Without GPM (older
GPUs, older drivers or nvidia-ml-py) there are none, and the collector's verdict never
says ``hardware`` (docs/gpu.md).

Readings NVML reports as not supported on a GPU (power on some boards, utilisation on a
MIG-enabled GPU) are left out for that GPU from then on; other per-field errors skip the
field for that poll. NVML ignores ``CUDA_VISIBLE_DEVICES``: every GPU the driver exposes to
this process (its container) is sampled unless ``devices`` narrows it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from inferprof import semconv as sc
from inferprof._optional import require
from inferprof.gpu.records import GpuSample, RateLimitedLog, SourceUnavailable

_logger = logging.getLogger(__name__)

#: Poll interval when none is configured. NVML refreshes utilisation once per sample period
#: (1/6 s on recent data-centre GPUs, up to 1 s on older ones): polling every 0.1 s sees
#: every refresh, and compute spans of tens of milliseconds still get a sample close by.
#: Cost: six NVML calls per GPU per poll, tens of microseconds each.
DEFAULT_INTERVAL_S = 0.1

_WHY = {
    "NVMLError_LibraryNotFound": "the NVML library (libnvidia-ml.so) was not found: no NVIDIA "
    "driver on this machine, or it is not mounted into this container",
    "NVMLError_DriverNotLoaded": "the NVIDIA driver is not loaded",
    "NVMLError_NoPermission": "no permission to open the GPU devices",
    "NVMLError_LibRmVersionMismatch": "the NVML library and the loaded driver have different "
    "versions (a driver upgrade needs a reboot)",
}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


#: NVML GPM metrics and the DCGM profiling metric each stands for (percent -> ratio).
_GPM_METRICS = (
    ("NVML_GPM_METRIC_SM_UTIL", sc.METRIC_DCGM_SM_ACTIVE),
    ("NVML_GPM_METRIC_SM_OCCUPANCY", sc.METRIC_DCGM_SM_OCCUPANCY),
    ("NVML_GPM_METRIC_ANY_TENSOR_UTIL", sc.METRIC_DCGM_TENSOR_ACTIVE),
    ("NVML_GPM_METRIC_DRAM_BW_UTIL", sc.METRIC_DCGM_DRAM_ACTIVE),
)


#: NVML's GPM documentation: the interval between the two ``nvmlGpmSampleGet()`` calls of a
#: pair "should be greater than 100ms due to the internal sample refresh rate". Closer, the
#: pair may hold the same counters: SM activity, occupancy and tensor activity then read 0
#: and DRAM bandwidth fails, whatever the load (docs/gpu.md, GPM). No GPM sample is taken
#: closer than this to the last one (start to start).
GPM_MIN_INTERVAL_S = 0.1
#: A poll this much early or less waits for GPM_MIN_INTERVAL_S to pass before its GPM sample
#: (polls on the sampler's 0.1 s grid come a few microseconds early half of the time, or
#: right after a late one); one earlier takes no GPM figures and the next poll's cover the
#: whole time since the last GPM sample.
_GPM_MAX_WAIT_S = 0.005


class _Gpm:
    """GPM on one GPU: two samples, the metrics computed between the last GPM sample and
    this one, taken at least GPM_MIN_INTERVAL_S apart.

    All the metrics of one poll come from the same two samples, so a metric that fails
    (a return other than NVML_SUCCESS, or a value that is not finite) says the pair is not
    to be trusted, and the poll's GPM figures are all dropped (``read`` returns None):
    unless NVML says the metric is not supported and it never answered on this GPU, in
    which case it is only left out."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nvml = nvml
        self._handle = handle
        self._ids = [getattr(nvml, name) for name, _ in _GPM_METRICS]
        #: metrics that have answered on this GPU: one of them failing condemns the pair
        self._answered: set[str] = set()
        self._prev = nvml.nvmlGpmSampleAlloc()
        try:
            self._cur = nvml.nvmlGpmSampleAlloc()
            self._taken = time.monotonic()
            nvml.nvmlGpmSampleGet(handle, self._prev)
        except BaseException:
            self.close()
            raise

    def read(self) -> list[tuple[str, float]] | None:
        """The figures since the last GPM sample: [] when too soon to take one, None when
        the pair was taken but its figures are not to be trusted (dropped)."""
        wait = GPM_MIN_INTERVAL_S - (time.monotonic() - self._taken)
        if wait > _GPM_MAX_WAIT_S:
            return []
        if wait > 0:
            time.sleep(wait)
        nvml = self._nvml
        taken = time.monotonic()
        nvml.nvmlGpmSampleGet(self._handle, self._cur)
        self._taken = taken
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(self._ids)
        request.sample1 = self._prev
        request.sample2 = self._cur
        for i, metric_id in enumerate(self._ids):
            request.metrics[i].metricId = metric_id
        # The next poll's figures start from this sample, whatever happens below.
        self._prev, self._cur = self._cur, self._prev
        nvml.nvmlGpmMetricsGet(request)
        out = []
        for i, (_, metric) in enumerate(_GPM_METRICS):
            m = request.metrics[i]
            if m.nvmlReturn == nvml.NVML_SUCCESS and math.isfinite(m.value):
                out.append((metric, min(1.0, max(0.0, m.value / 100.0))))
            elif m.nvmlReturn != nvml.NVML_ERROR_NOT_SUPPORTED or metric in self._answered:
                return None
        self._answered.update(metric for metric, _ in out)
        return out

    def close(self) -> None:
        for sample in (getattr(self, "_prev", None), getattr(self, "_cur", None)):
            if sample is not None:
                try:
                    self._nvml.nvmlGpmSampleFree(sample)
                except Exception:  # closing never raises
                    _logger.debug("nvmlGpmSampleFree failed", exc_info=True)
        self._prev = self._cur = None


class NvmlSource:
    """Reads every GPU (or ``devices``: UUIDs or NVML indices) through NVML; ``gpm``: also
    the GPM profiling metrics where the GPU has them."""

    name = sc.GPU_SOURCE_NVML
    default_interval = DEFAULT_INTERVAL_S

    def __init__(self, devices: Sequence[str | int] | None = None, *, gpm: bool = True) -> None:
        if devices is not None and (isinstance(devices, (str, bytes)) or not all(
                isinstance(d, (str, int)) and not isinstance(d, bool) for d in devices)):
            raise ValueError(f"devices must be a sequence of GPU UUIDs or indices, got {devices!r}")
        self._wanted = None if devices is None else list(devices)
        self._use_gpm = bool(gpm)
        self._gpm: dict[str, _Gpm] = {}
        self._nvml: Any = None
        self._gpus: list[tuple[Any, str]] = []  # (handle, uuid)
        self._names: dict[str, str] = {}  # uuid -> model name (hw.model)
        # uuid -> readers switched off because NVML said "not supported" on that GPU
        self._unsupported: dict[str, set[str]] = {}
        self._errors = RateLimitedLog(_logger, "NVML reads")
        self._gpm_dropped = 0

    @property
    def gpu_ids(self) -> list[str]:
        return [uuid for _, uuid in self._gpus]

    def open(self) -> None:
        if self._nvml is not None:  # opened again: start over, nothing left allocated
            self.close()
        # nvidia-ml-py missing: ImportError naming inferprof[gpu], as for every optional stack
        nvml = require("pynvml", "gpu")
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            why = _WHY.get(type(exc).__name__, f"NVML could not start ({exc})")
            raise SourceUnavailable(f"no GPU to sample: {why}") from None
        try:
            count = nvml.nvmlDeviceGetCount()
            gpus = []
            for index in range(count):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                gpus.append((index, handle, _text(nvml.nvmlDeviceGetUUID(handle))))
        except nvml.NVMLError as exc:
            self._shutdown(nvml)
            raise SourceUnavailable(f"NVML could not list the GPUs: {exc}") from None
        if not gpus:
            self._shutdown(nvml)
            raise SourceUnavailable("no GPU to sample: NVML sees no GPU on this machine")
        if self._wanted is not None:
            chosen = [g for g in gpus if g[0] in self._wanted or g[2] in self._wanted]
            missing = [w for w in self._wanted if not any(w in (g[0], g[2]) for g in gpus)]
            if missing:
                self._shutdown(nvml)
                known = ", ".join(f"{i}={u}" for i, _, u in gpus)
                raise ValueError(f"no such GPU: {missing} (NVML sees {known})")
            gpus = chosen
        self._nvml = nvml
        self._gpus = [(handle, uuid) for _, handle, uuid in gpus]
        self._names = {}
        for handle, uuid in self._gpus:
            # the model name prices the GPU's time (collector cost); optional
            with contextlib.suppress(nvml.NVMLError):
                self._names[uuid] = _text(nvml.nvmlDeviceGetName(handle))
        self._unsupported = {uuid: set() for _, uuid in self._gpus}
        self._gpm = {}
        if self._use_gpm:
            for handle, uuid in self._gpus:
                self._open_gpm(nvml, handle, uuid)

    def _open_gpm(self, nvml: Any, handle: Any, uuid: str) -> None:
        try:
            supported = nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice
            if supported:
                self._gpm[uuid] = _Gpm(nvml, handle)
        except (AttributeError, nvml.NVMLError) as exc:  # no GPM in this nvidia-ml-py/driver
            _logger.info("NVML GPM (SM activity, occupancy) not available on GPU %s: %s", uuid,
                         exc or type(exc).__name__)
            return
        if not supported:
            _logger.info("GPU %s has no NVML GPM (SM activity, occupancy): Hopper or later "
                         "needed; use dcgm-exporter's profiling fields for them", uuid)

    @property
    def gpm_gpu_ids(self) -> list[str]:
        """GPUs whose SM activity and occupancy are read through GPM."""
        return list(self._gpm)

    @property
    def gpm_dropped(self) -> int:
        """Polls whose GPM figures were dropped, one per GPU, since this source was made: a
        GPM metric failed, so none of that pair's figures is trusted (the other readings
        of the poll are kept)."""
        return self._gpm_dropped

    @property
    def first_read_delay_s(self) -> float:
        """How long after open() a read first carries every figure (GPM's: one interval)."""
        return GPM_MIN_INTERVAL_S if self._gpm else 0.0

    def read(self) -> list[GpuSample]:
        nvml = self._nvml
        if nvml is None:
            raise RuntimeError("NvmlSource.read() before open()")
        samples = []
        failed: list[str] = []
        for handle, uuid in self._gpus:
            values: list[tuple[str, float]] = []
            off = self._unsupported[uuid]
            gpm = self._gpm.get(uuid)
            readers = _READERS
            if gpm is not None:
                def read_gpm(_n: Any, _h: Any, g: _Gpm = gpm, u: str = uuid) -> Any:
                    figures = g.read()
                    if figures is None:
                        self._gpm_dropped += 1
                        _logger.debug("GPU %s: GPM figures of this poll dropped (a metric "
                                      "failed: the pair is not to be trusted)", u)
                        return []
                    return figures

                readers = (*_READERS, ("gpm", read_gpm))
            for reader_name, reader in readers:
                if reader_name in off:
                    continue
                try:
                    values.extend(reader(nvml, handle))
                except nvml.NVMLError as exc:
                    if getattr(exc, "value", None) == nvml.NVML_ERROR_NOT_SUPPORTED:
                        off.add(reader_name)
                        if reader_name == "gpm":
                            self._gpm.pop(uuid).close()
                        _logger.info("NVML does not report %s on GPU %s; left out", reader_name,
                                     uuid)
                    else:
                        failed.append(f"{uuid} {reader_name}: {exc}")
            if values:
                samples.append(
                    GpuSample(time.time_ns(), uuid, tuple(values), model=self._names.get(uuid)))
        if failed:
            if not samples:
                raise RuntimeError("NVML reads failed: " + "; ".join(failed))
            self._errors.failure("NVML reads failed: %s", "; ".join(failed))
        else:
            self._errors.success()
        return samples

    def close(self) -> None:
        nvml, self._nvml = self._nvml, None
        gpm, self._gpm = self._gpm, {}
        for one in gpm.values():
            one.close()
        if nvml is not None:
            self._shutdown(nvml)

    @staticmethod
    def _shutdown(nvml: Any) -> None:
        try:
            nvml.nvmlShutdown()
        except Exception:  # closing never raises
            _logger.debug("nvmlShutdown failed", exc_info=True)


def _utilization(nvml: Any, handle: Any) -> list[tuple[str, float]]:
    rates = nvml.nvmlDeviceGetUtilizationRates(handle)
    return [(sc.METRIC_GPU_UTILIZATION, rates.gpu / 100.0),
            (sc.METRIC_DCGM_MEM_COPY_UTIL, rates.memory / 100.0)]


def _memory(nvml: Any, handle: Any) -> list[tuple[str, float]]:
    info = nvml.nvmlDeviceGetMemoryInfo(handle)
    out = [(sc.METRIC_GPU_MEMORY_USAGE, float(info.used)),
           (sc.METRIC_GPU_MEMORY_LIMIT, float(info.total))]
    if info.total > 0:
        out.append((sc.METRIC_GPU_MEMORY_UTILIZATION, info.used / info.total))
    return out


def _power(nvml: Any, handle: Any) -> list[tuple[str, float]]:
    return [(sc.METRIC_GPU_POWER_DRAW, nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)]


def _clock(nvml: Any, handle: Any) -> list[tuple[str, float]]:
    mhz = nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_GRAPHICS)
    return [(sc.METRIC_GPU_CLOCK_GRAPHICS, float(mhz))]


def _temperature(nvml: Any, handle: Any) -> list[tuple[str, float]]:
    celsius = nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
    return [(sc.METRIC_GPU_TEMPERATURE, float(celsius))]


# A reading is stamped after its GPU's calls: all of them take tens of microseconds, a
# thousandth of the poll interval.
_READERS: tuple[tuple[str, Callable[[Any, Any], list[tuple[str, float]]]], ...] = (
    ("utilization", _utilization),
    ("memory", _memory),
    ("power", _power),
    ("clock", _clock),
    ("temperature", _temperature),
)

__all__ = ["DEFAULT_INTERVAL_S", "GPM_MIN_INTERVAL_S", "NvmlSource"]
