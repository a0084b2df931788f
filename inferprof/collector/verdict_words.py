"""The words of the bottleneck verdict's evidence (contract §6), apart from its rules.

``verdict`` decides; this module says why, one function per sentence, so the rules read
as rules and the wording can change without touching a decision.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inferprof import semconv as sc


def pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def not_enough(needed: int, traced: int) -> str:
    return (f"not enough data: a verdict needs at least {needed} traced "
            f"requests in this breakdown, there are {traced}")


NOTHING_TO_ATTRIBUTE = "no request in this breakdown has any latency to attribute"


def unattributed(share: float) -> str:
    return (f"{pct(share)} of p95 latency is covered by no stage span; instrument the "
            "missing stages (spans with inferprof.stage) to attribute it")


def custom_stage(share: float, stage: str) -> str:
    return (f"{pct(share)} of p95 latency is in custom stage {stage!r}, which the "
            "verdict rules do not classify")


def headline(share: float, words: str, parts: str) -> str:
    return f"{pct(share)} of p95 latency is spent in {words} ({parts})"


def next_groups(ranked: list[tuple[str, float]]) -> list[str]:
    """``next: ...``, the runners-up (empty when there are none)."""
    words = "; ".join(f"{g.removeprefix('other:')} {pct(v)}" for g, v in ranked if v > 0)
    return [f"next: {words}"] if words else []


def utilisation(util: Mapping[str, Any], samples: int) -> str:
    return (f"GPU utilisation during compute: median {pct(util['p50'])}, mean "
            f"{pct(util['mean'])} over {samples} samples")


def waits_behind_batches(behind: float, coverage: float) -> str:
    estimated = (
        f" (estimated: the traces show {pct(coverage)} of the batch work)" if coverage < 1.0
        else ""
    )
    return (f"{pct(behind)} of queue time passed while earlier batches were being "
            f"processed{estimated}: requests wait for the model, not for the batcher")


LEFT_BEFORE_A_BATCH = "; the slowest requests left the queue before a batch took them"


def queue_behind_compute(share: float) -> str:
    return f"the queue ({pct(share)} of p95) waits behind compute"


def gpu_busy(busy: float) -> str:
    return (f"the GPU is busy during compute (utilisation at or above {pct(busy)}): "
            "requests queue for the GPU, not for the batcher")


NETWORK_IS_REMOTE = (
    "a remote service's time (a Triton call, say) counts as network here: its "
    "own breakdown (service=<its service.name>) splits it, when its spans "
    "reach this collector"
)


def waits_for_batcher(behind: float) -> str:
    return (f"{pct(behind)} of queue time passed while earlier batches were being "
            "processed: requests wait for the batcher (its delay, or a batch to fill), "
            "not for the model")


def compute_holds(share: float) -> str:
    return f"compute holds {pct(share)} of p95"


def sm_means_busy(sm: Mapping[str, Any]) -> str:
    return (f"no {sc.METRIC_GPU_UTILIZATION} samples joined, but SM activity during "
            f"compute (median {pct(sm['p50'])}) means the GPU was busy")


def no_utilisation(lead: str, sm: Mapping[str, Any] | None, occ: Mapping[str, Any] | None) -> str:
    figures = ", ".join(
        f"{name} median {pct(v['p50'])}"
        for name, v in (("SM activity", sm), ("SM occupancy", occ))
        if v is not None
    )
    return (f"{lead}; DCGM profiling samples joined its compute spans ({figures}) but "
            f"no {sc.METRIC_GPU_UTILIZATION} samples did, and without them an idle GPU "
            "(runtime) cannot be told apart from a busy, poorly used one (kernel): "
            "export GPU utilisation too (DCGM_FI_DEV_GPU_UTIL, or NVML)")


def no_samples(lead: str) -> str:
    return (f"{lead} but no GPU samples were received (run `inferprof gpu` beside a "
            "GPU service; for a model on the CPU, compute itself is the bottleneck)")


def no_gpu_id(lead: str, received: int) -> str:
    return (f"{lead} but its compute spans name no GPU (inferprof.gpu.id), so none of "
            f"the {received} GPU samples received can be joined to them")


def no_overlap(lead: str, received: int) -> str:
    return (f"{lead} but none of the {received} GPU samples received overlaps its "
            "compute spans (they join on hw.id = inferprof.gpu.id: a GPU UUID, GPU-..., "
            "joins whatever the host names; a short id only with equal host.name)")


def idles_between_launches(low: float) -> str:
    return (f"utilisation below {pct(low)}: the GPU idles between kernel "
            "launches (look at fusion, CUDA graphs, host synchronisation)")


def no_kernel_ran(gpus: list[str], spans: int, sm_known: bool) -> str:
    where = ("GPU " + gpus[0] if len(gpus) == 1 else
             "GPUs " + ", ".join(gpus) if gpus else "the GPU")
    read = "utilisation and SM activity" if sm_known else "utilisation"
    return (f"no kernel ran on {where} during compute ({read} 0% through {spans} compute "
            "spans): is the work on the CPU, or on another GPU than the one the spans' "
            "inferprof.gpu.id names (CUDA_VISIBLE_DEVICES renumbers devices)?")


NO_PROFILING = (
    "no SM activity or occupancy figures (DCGM profiling) were received, so a "
    "hardware limit cannot be told apart from inefficient kernels"
)


def sm_activity(sm: Mapping[str, Any]) -> str:
    return f"SM activity during compute: median {pct(sm['p50'])}"


def sm_occupancy(occ: Mapping[str, Any]) -> str:
    return f"SM occupancy during compute: median {pct(occ['p50'])}"


def used_poorly(low: list[str]) -> str:
    return f"the GPU is busy but with low {' and '.join(low)}: the kernels use it poorly"


def tensor_near_peak(tensor: Mapping[str, Any]) -> str:
    return (f"but tensor activity during compute is high (median {pct(tensor['p50'])}): "
            "matrix-product kernels run with low occupancy by design, so this may be a "
            "GPU near its peak rather than a poor kernel (docs/gpu.md)")


def missing_profiling(missing: str) -> str:
    return (f"no {missing} figures (DCGM profiling) were received, so a hardware limit "
            "cannot be told apart from inefficient kernels")


def gpu_is_the_limit(said_sm: bool) -> str:
    return ("high SM activity and occupancy" if said_sm else
            "high utilisation, SM activity and occupancy") + ": the GPU itself is the limit"


def dram_activity(dram: Mapping[str, Any], high: float) -> str:
    said = f"DRAM activity during compute: median {pct(dram['p50'])}"
    if dram["p50"] >= high:
        return (said + ": the kernels are memory-bandwidth-bound (the memory interface, not "
                "the SMs' arithmetic, sets their pace)")
    return said
