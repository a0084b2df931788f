"""Device-stage timing: kept importable here; it lives in ``inferprof.instrumentation.device``
(the instrumentation times device stages whether or not a batcher is used)."""

from inferprof.instrumentation.device import (
    DeviceTiming,
    EventDevice,
    begin_device_stage,
    gpu_uuid,
    parse_cuda_device,
    resolve_stages,
)

__all__ = [
    "DeviceTiming", "EventDevice", "begin_device_stage", "gpu_uuid", "parse_cuda_device",
    "resolve_stages",
]
