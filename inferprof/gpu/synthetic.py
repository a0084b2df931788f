"""Invented GPU samples at fixed figures, for trying the pipeline end to end without a GPU or
a recording. NOT live GPU data: the samples carry ``inferprof.gpu.source = "synthetic"``
and the sampler says so when it starts.

Every poll yields one reading per ``gpu_ids`` entry: ``utilization`` (and, when given, the
DCGM ``sm_active`` / ``sm_occupancy`` ratios, so the collector can reach every verdict),
80 GiB of memory, 30% used, and power, clock and temperature that follow utilisation.
Give ``gpu_ids`` the ``inferprof.gpu.id`` your spans carry (for a service without a GPU,
``inferprof.batching.EventDevice(factory, gpu_id=...)`` sets one), or the samples join
nothing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from inferprof import semconv as sc
from inferprof.gpu.records import GpuSample

DEFAULT_INTERVAL_S = 0.1
DEFAULT_GPU_ID = "GPU-00000000-0000-0000-0000-000000000000"
_MEMORY_LIMIT = 80.0 * 1024**3


def _ratio(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be a ratio in [0, 1], got {value!r}")
    return float(value)


class SyntheticSource:
    """Constant invented readings (see the module docstring)."""

    name = sc.GPU_SOURCE_SYNTHETIC
    default_interval = DEFAULT_INTERVAL_S

    def __init__(
        self,
        gpu_ids: Sequence[str] = (DEFAULT_GPU_ID,),
        *,
        utilization: float = 0.5,
        sm_active: float | None = None,
        sm_occupancy: float | None = None,
    ) -> None:
        if isinstance(gpu_ids, str) or not gpu_ids or not all(
                isinstance(g, str) and g for g in gpu_ids):
            raise ValueError(f"gpu_ids must be a non-empty sequence of ids, got {gpu_ids!r}")
        util = _ratio("utilization", utilization)
        assert util is not None
        values = [
            (sc.METRIC_GPU_UTILIZATION, util),
            (sc.METRIC_GPU_MEMORY_USAGE, _MEMORY_LIMIT * 0.3),
            (sc.METRIC_GPU_MEMORY_LIMIT, _MEMORY_LIMIT),
            (sc.METRIC_GPU_MEMORY_UTILIZATION, 0.3),
            (sc.METRIC_GPU_POWER_DRAW, 70.0 + 630.0 * util),
            (sc.METRIC_GPU_CLOCK_GRAPHICS, 1980.0),
            (sc.METRIC_GPU_TEMPERATURE, 35.0 + 40.0 * util),
        ]
        for name, metric, value in (("sm_active", sc.METRIC_DCGM_SM_ACTIVE, sm_active),
                                    ("sm_occupancy", sc.METRIC_DCGM_SM_OCCUPANCY, sm_occupancy)):
            ratio = _ratio(name, value)
            if ratio is not None:
                values.append((metric, ratio))
        self.gpu_ids = tuple(gpu_ids)
        self._values = tuple(values)

    def open(self) -> None:
        pass

    def read(self) -> list[GpuSample]:
        now = time.time_ns()
        return [GpuSample(now, gpu, self._values) for gpu in self.gpu_ids]

    def close(self) -> None:
        pass


__all__ = ["DEFAULT_GPU_ID", "SyntheticSource"]
