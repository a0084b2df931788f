"""NVML's GPM on a real GPU under a saturating load (part of scripts/gpu-checks).

1. The NVML source as the sidecar polls it (0.1 s grid, 20 s) while another process copies
   1 GiB device to device back to back: polls, polls with GPM figures, polls whose GPM
   figures were dropped (``NvmlSource.gpm_dropped``), and GPM readings of SM activity under
   50% while utilisation is 90% or more (a pair without counter movement that got through).
2. Raw GPM sample pairs (``nvmlGpmSampleGet`` twice, ``nvmlGpmMetricsGet``) at 50, 90, 99,
   100 and 110 ms apart under the same load: per spacing, each metric's ``nvmlReturn``
   values and how many pairs read SM activity 0, so docs/gpu.md can say what a pair too
   close returns.

    python3 scripts/gpm_probe.py [GPU_INDEX]

Exits 1 when part 1 saw such a reading or no GPM figure at all, 2 without GPM on the GPU.
"""

from __future__ import annotations

import collections
import subprocess
import sys
import time

import pynvml as nv

from inferprof import semconv as sc
from inferprof.gpu.nvml import NvmlSource

LOAD = """
import sys, time, torch
torch.cuda.set_device(int(sys.argv[2]))
src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
dst = torch.empty_like(src)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    for _ in range(20):
        dst.copy_(src)
    torch.cuda.synchronize()
"""
POLL_S = 0.1
POLLS = 200
GAPS_S = (0.05, 0.09, 0.099, 0.1, 0.11)
PAIRS = 12
METRICS = (("SM_UTIL", "NVML_GPM_METRIC_SM_UTIL"), ("SM_OCC", "NVML_GPM_METRIC_SM_OCCUPANCY"),
           ("TENSOR", "NVML_GPM_METRIC_ANY_TENSOR_UTIL"), ("DRAM", "NVML_GPM_METRIC_DRAM_BW_UTIL"))


def wait_for_load(index: int, timeout_s: float = 30.0) -> float:
    """Seconds until utilisation reads 90% or more (the load process has started)."""
    nv.nvmlInit()
    try:
        handle = nv.nvmlDeviceGetHandleByIndex(index)
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if nv.nvmlDeviceGetUtilizationRates(handle).gpu >= 90:
                return time.monotonic() - t0
            time.sleep(0.2)
        raise SystemExit("the copy load never brought utilisation to 90%")
    finally:
        nv.nvmlShutdown()


def source_on_the_grid(index: int) -> int:
    src = NvmlSource(devices=[index])
    src.open()
    if not src.gpm_gpu_ids:
        src.close()
        print("part 1: this GPU has no GPM")
        return 2
    polls = with_gpm = suspicious = 0
    sm_values = []
    next_at = time.monotonic() + src.first_read_delay_s
    try:
        for _ in range(POLLS):
            time.sleep(max(0.0, next_at - time.monotonic()))
            next_at += POLL_S
            (reading,) = src.read()
            values = reading.as_dict()
            polls += 1
            sm = values.get(sc.METRIC_DCGM_SM_ACTIVE)
            if sm is None:
                continue
            with_gpm += 1
            sm_values.append(sm)
            if values.get(sc.METRIC_GPU_UTILIZATION, 0.0) >= 0.9 and sm < 0.5:
                suspicious += 1
                print(f"  SUSPICIOUS t={reading.time_unix_nano / 1e9:.3f} {values}")
    finally:
        src.close()
    print(f"part 1 (NvmlSource, {POLL_S:g} s grid, 1 GiB copies): polls {polls}, with GPM "
          f"{with_gpm}, GPM dropped {src.gpm_dropped}, SM activity < 50% at utilisation "
          f">= 90%: {suspicious}; SM activity min {min(sm_values, default=float('nan')):.4f} "
          f"median {sorted(sm_values)[len(sm_values) // 2] if sm_values else float('nan'):.4f}")
    return 1 if suspicious or not with_gpm else 0


def raw_pairs(index: int) -> None:
    nv.nvmlInit()
    try:
        handle = nv.nvmlDeviceGetHandleByIndex(index)
        ids = [getattr(nv, name) for _, name in METRICS]
        s1, s2 = nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()
        try:
            for gap in GAPS_S:
                returns = {label: collections.Counter() for label, _ in METRICS}
                sm_zero = 0
                spacing = []
                for _ in range(PAIRS):
                    t0 = time.monotonic()
                    nv.nvmlGpmSampleGet(handle, s1)
                    time.sleep(max(0.0, t0 + gap - time.monotonic()))
                    t1 = time.monotonic()
                    nv.nvmlGpmSampleGet(handle, s2)
                    spacing.append(t1 - t0)
                    request = nv.c_nvmlGpmMetricsGet_t()
                    request.version = nv.NVML_GPM_METRICS_GET_VERSION
                    request.numMetrics = len(ids)
                    request.sample1, request.sample2 = s1, s2
                    for i, metric_id in enumerate(ids):
                        request.metrics[i].metricId = metric_id
                    nv.nvmlGpmMetricsGet(request)
                    for i, (label, _) in enumerate(METRICS):
                        m = request.metrics[i]
                        returns[label][m.nvmlReturn] += 1
                    if request.metrics[0].nvmlReturn == nv.NVML_SUCCESS and (
                            request.metrics[0].value == 0.0):
                        sm_zero += 1
                    time.sleep(0.12)  # the next pair starts clear of this one
                print(f"part 2: pairs {gap * 1000:.0f} ms apart (measured "
                      f"{min(spacing) * 1000:.2f}-{max(spacing) * 1000:.2f} ms), {PAIRS} pairs: "
                      f"SM activity 0 in {sm_zero}; nvmlReturn per metric "
                      + "; ".join(f"{label} {dict(c)}" for label, c in returns.items()))
        finally:
            nv.nvmlGpmSampleFree(s1)
            nv.nvmlGpmSampleFree(s2)
    finally:
        nv.nvmlShutdown()


def main() -> int:
    index = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    load = subprocess.Popen([sys.executable, "-c", LOAD, "90", str(index)])
    try:
        print(f"load running after {wait_for_load(index):.1f} s")
        rc = source_on_the_grid(index)
        if rc != 2:
            raw_pairs(index)
        return rc
    finally:
        load.terminate()
        load.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
