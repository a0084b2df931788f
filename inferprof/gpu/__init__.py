"""GPU samplers: NVML and dcgm-exporter readings, shipped as OTLP metrics (contract §4).

In a serving process, next to ``inferprof.configure()``::

    import inferprof, inferprof.gpu
    inferprof.configure(service_name="my-model")
    sampler = inferprof.gpu.start_sampler()        # NVML; a no-op (one warning) without a GPU
    ...
    sampler.stop()

As a sidecar: ``inferprof gpu --source nvml|dcgm-exporter --endpoint http://collector:4317``.

Every reading is one OTLP gauge data point per metric with its own ``time_unix_nano``,
``hw.id`` = the GPU's UUID and resource ``host.name`` = the service's, which is what the
collector joins to the ``compute`` spans' ``inferprof.gpu.id``. ``replay`` and
``synthetic`` sources stand in for a GPU where there is none (tests, trying the pipeline)
and are labelled as such (resource ``inferprof.gpu.source``). See ``docs/gpu.md``.

Optional stacks are imported only by the source that needs them: nvidia-ml-py (``pynvml``)
by ``NvmlSource``, prometheus-client's parser by ``DcgmExporterSource``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "start_sampler": "inferprof.gpu.sampler",
    "GpuSampler": "inferprof.gpu.sampler",
    "DisabledSampler": "inferprof.gpu.sampler",
    "SamplerSettings": "inferprof.gpu.sampler",
    "GpuSample": "inferprof.gpu.records",
    "SamplerStats": "inferprof.gpu.records",
    "Source": "inferprof.gpu.records",
    "SourceUnavailable": "inferprof.gpu.records",
    "NvmlSource": "inferprof.gpu.nvml",
    "DcgmExporterSource": "inferprof.gpu.dcgm_exporter",
    "parse_exposition": "inferprof.gpu.dcgm_exporter",
    "ReplaySource": "inferprof.gpu.replay",
    "read_samples": "inferprof.gpu.replay",
    "write_samples": "inferprof.gpu.replay",
    "SyntheticSource": "inferprof.gpu.synthetic",
}

__all__ = [
    "DcgmExporterSource",
    "DisabledSampler",
    "GpuSample",
    "GpuSampler",
    "NvmlSource",
    "ReplaySource",
    "SamplerSettings",
    "SamplerStats",
    "Source",
    "SourceUnavailable",
    "SyntheticSource",
    "parse_exposition",
    "read_samples",
    "start_sampler",
    "write_samples",
]

if TYPE_CHECKING:  # pragma: no cover
    from inferprof.gpu.dcgm_exporter import DcgmExporterSource, parse_exposition
    from inferprof.gpu.nvml import NvmlSource
    from inferprof.gpu.records import GpuSample, SamplerStats, Source, SourceUnavailable
    from inferprof.gpu.replay import ReplaySource, read_samples, write_samples
    from inferprof.gpu.sampler import DisabledSampler, GpuSampler, SamplerSettings, start_sampler
    from inferprof.gpu.synthetic import SyntheticSource


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'inferprof.gpu' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
