"""What a GPU source produces and what a sampler reports about itself.

A :class:`GpuSample` is one reading of one GPU at one instant: the contract §4 metrics the
source could read, already in the contract's units (ratios 0..1, bytes, watts, MHz,
degrees Celsius). Every source (NVML, dcgm-exporter, replay, synthetic) yields these, and
the sampler ships each one as its own OTLP data point with its own ``time_unix_nano``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from inferprof import semconv as sc

#: Contract metric -> (unit, description), for the OTLP ``Metric`` fields. Only these names
#: are shipped; a source producing anything else is a bug caught by ``GpuSample``.
METRICS: Mapping[str, tuple[str, str]] = {
    sc.METRIC_GPU_UTILIZATION: (
        "1", "Share of the driver's last sample period in which a kernel was running."),
    sc.METRIC_GPU_MEMORY_UTILIZATION: ("1", "GPU memory used over GPU memory size."),
    sc.METRIC_GPU_MEMORY_USAGE: ("By", "GPU memory used."),
    sc.METRIC_GPU_MEMORY_LIMIT: ("By", "GPU memory size."),
    sc.METRIC_GPU_POWER_DRAW: ("W", "Power drawn by the GPU."),
    sc.METRIC_GPU_CLOCK_GRAPHICS: ("MHz", "Graphics (SM) clock."),
    sc.METRIC_GPU_TEMPERATURE: ("Cel", "GPU core temperature."),
    sc.METRIC_DCGM_MEM_COPY_UTIL: (
        "1", ("Share of the driver's last sample period in which device memory was read "
              "or written (NVML utilization.memory, DCGM_FI_DEV_MEM_COPY_UTIL).")),
    sc.METRIC_DCGM_SM_ACTIVE: ("1", "DCGM_FI_PROF_SM_ACTIVE: cycles an SM had a warp assigned."),
    sc.METRIC_DCGM_SM_OCCUPANCY: (
        "1", "DCGM_FI_PROF_SM_OCCUPANCY: resident warps over the SM's maximum."),
    sc.METRIC_DCGM_TENSOR_ACTIVE: (
        "1", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE: cycles the tensor pipe was active."),
    sc.METRIC_DCGM_DRAM_ACTIVE: (
        "1", "DCGM_FI_PROF_DRAM_ACTIVE: cycles the memory interface was active."),
}


class SourceUnavailable(RuntimeError):
    """The source cannot run on this machine (no driver, no GPU, no NVML library): the
    message says which, in one line. A Python package that is not installed (nvidia-ml-py,
    prometheus-client) is an ``ImportError`` naming ``inferprof[gpu]`` instead. Not raised
    for transient failures (an unreachable dcgm-exporter): those fail a ``read()`` and the
    sampler retries."""


@dataclass(frozen=True)
class GpuSample:
    """One reading of one GPU.

    ``values`` holds (contract metric, value) pairs in the contract's units. ``host`` is
    the ``host.name`` the reading belongs to when the source knows it (dcgm-exporter's
    ``Hostname`` label, a recording's host), else None: the sampler's own host name.
    ``model``: the GPU's model name (``hw.model``, e.g. "NVIDIA H100 80GB HBM3") when the
    source knows it; the collector prices GPU time by it.
    """

    time_unix_nano: int
    hw_id: str
    values: tuple[tuple[str, float], ...]
    host: str | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        if not self.hw_id:
            raise ValueError("a GPU sample needs a hw.id")
        for name, _ in self.values:
            if name not in METRICS:
                raise ValueError(f"{name!r} is not a GPU metric of the contract")

    def as_dict(self) -> dict[str, float]:
        return dict(self.values)


@runtime_checkable
class Source(Protocol):
    """What the sampler polls. ``open()`` raises :class:`SourceUnavailable` when the source
    cannot work here at all; ``read()`` may raise anything on a failed poll (the sampler
    logs, counts and polls again); ``close()`` never raises.

    Optional: a source that can run out (a recording played without looping) has an
    ``exhausted`` attribute that turns True once it has nothing more to give; the sampler
    then stops polling it."""

    #: one of ``semconv.GPU_SOURCES`` (the ``inferprof.gpu.source`` resource attribute)
    name: str
    #: poll interval used when none is configured, seconds
    default_interval: float

    def open(self) -> None: ...

    def read(self) -> list[GpuSample]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class SamplerStats:
    """Counters of one sampler since it started (a snapshot)."""

    #: polls of the source, failed ones included
    polls: int = 0
    #: polls that raised (source unreachable, driver error)
    poll_errors: int = 0
    #: GPU readings taken (one per GPU per successful poll)
    samples: int = 0
    #: readings dropped because the buffer was full (the exporter was slow or down);
    #: the oldest go first
    dropped_buffer_full: int = 0
    #: readings dropped because their export failed
    dropped_export_failed: int = 0
    #: readings and OTLP data points exported successfully
    exported_samples: int = 0
    exported_points: int = 0
    #: export calls that failed
    export_failures: int = 0
    #: readings waiting in the buffer now
    buffered: int = 0


class RateLimitedLog:
    """Logs the first of a run of failures at WARNING, then at most one line per
    ``every_s`` seconds saying how many more there were: a sampler polling ten times a
    second against a dead endpoint must not write ten log lines a second. The first
    success after a run logs one INFO line."""

    def __init__(self, logger: logging.Logger, what: str, every_s: float = 60.0) -> None:
        self._logger = logger
        self._what = what
        self._every = every_s
        self._next = 0.0
        self._suppressed = 0
        self._failures = 0

    def failure(self, msg: str, *args: object) -> None:
        self._failures += 1
        now = time.monotonic()
        if now < self._next:
            self._suppressed += 1
            return
        if self._suppressed:
            msg = f"{msg} ({self._suppressed} more failures since the last message)"
        self._suppressed = 0
        self._next = now + self._every
        self._logger.warning(msg, *args)

    def success(self) -> None:
        if self._failures:
            self._logger.info("%s recovered after %d failures", self._what, self._failures)
            self._failures = self._suppressed = 0
            self._next = 0.0


__all__ = ["METRICS", "GpuSample", "RateLimitedLog", "SamplerStats", "Source", "SourceUnavailable"]
