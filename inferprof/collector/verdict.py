"""The bottleneck verdict (contract §6) and the GPU evidence it reads.

The rules read the layers top-down, cheapest explanation first. Stage shares of p95 are
grouped (``semconv.BATCHING_STAGES``, ``HOST_STAGES``, ``TRANSFER_STAGES``,
``NETWORK_STAGES``, ``COMPUTE_STAGES``); the group holding the largest share names the
verdict. ``unattributed`` time and custom stages are groups too: when one of them is the
largest, the verdict is ``unknown`` and the evidence says what to instrument.

Compute-bound cases are split by the GPU samples that fall inside the compute spans'
windows: median ``hw.gpu.utilization`` below ``LOW_UTILIZATION`` -> ``runtime`` (the GPU
idles between launches; with a mean below ``NO_KERNEL_UTILIZATION`` no kernel ran on it at
all, and the evidence asks whether the work is on the CPU or the spans name another GPU);
otherwise, median SM activity below ``LOW_SM_ACTIVE`` or SM
occupancy below ``LOW_SM_OCCUPANCY`` (DCGM profiling) -> ``kernel``; both received and
high -> ``hardware``; either missing (NVML only) -> ``kernel``, naming the missing
evidence: ``hardware`` is never said without both figures. DRAM activity, when received,
is quoted beside ``kernel`` and ``hardware`` (memory-bandwidth-bound from
``HIGH_DRAM_ACTIVE`` on) without changing either.

Two readings beyond the contract's words: the batching group wins only while the GPU is
not busy (median utilisation during compute below ``BUSY_UTILIZATION``; §6 says "GPU
mostly idle"), else the queue waits for the GPU and the compute rules past ``runtime``
decide; and without utilisation samples, SM activity of at least ``LOW_UTILIZATION``
stands for a busy GPU (lower cannot tell ``runtime`` from ``kernel``: ``unknown``).

``confidence`` (0..1) is the product of
* a sample-size factor ``min(1, tail_requests / FULL_CONFIDENCE_TAIL)`` — how many
  traced requests the tail (>= p95) rests on;
* a margin factor ``0.5 + 0.5 * (top - runner_up) / top`` of the group shares — 1 when
  one group holds all of the tail, 0.5 when two groups tie;
* for compute-derived verdicts, a GPU factor ``min(1, samples / FULL_CONFIDENCE_SAMPLES)``,
  times 0.7 when ``kernel`` is said for want of occupancy figures.
``unknown`` has confidence 0.

GPU samples (contract §4) are kept per GPU (``hw.id``) and metric with their timestamps
(``gpu_samples.GpuSamples``). A utilisation sample taken at ``t`` describes the sampling period
before it, so it is
joined to a compute span ``[s, e]`` when ``s < t < e + period`` (``period`` = the median
gap between that GPU's samples): compute spans are often shorter than the sampling
period and a strict "inside" rule would match nothing. Each joined sample weighs by that period
(the GPU time it stands for) in the medians and means, so GPUs weigh by their compute time
whatever their samplers' rates.

Samples join on (``host.name``, ``hw.id``) as §4 says, with one allowance: an ``hw.id``
that is an NVIDIA GPU or MIG UUID names one device in the world, so it joins whatever
``host.name`` each side carries. In Kubernetes a pod's spans carry the pod's host name
and dcgm-exporter's samples the node's; short ids (``GPU-0``, replayed or hand-made) still
need equal host names.
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import numpy as np

from inferprof import semconv as sc
from inferprof.collector import verdict_words as words

MIN_TRACED_REQUESTS = 100
FULL_CONFIDENCE_TAIL = 20
FULL_CONFIDENCE_SAMPLES = 10
LOW_UTILIZATION = 0.5
#: A queue-dominated tail is ``batching`` only while the GPU is mostly idle (§6); at or above
#: this median utilisation during compute the queue waits for the GPU instead.
BUSY_UTILIZATION = 0.9
#: A queue-dominated tail whose queue time passes mostly (at least this share) while
#: earlier batches are processed waits for the model, not for the batcher.
BEHIND_BATCHES = 0.5
LOW_SM_ACTIVE = 0.5
LOW_SM_OCCUPANCY = 0.25
#: Tensor-pipe activity at which a low-occupancy `kernel` verdict says the matrix units
#: are busy (cuBLAS at peak on an H100 read 92%).
HIGH_TENSOR_ACTIVE = 0.5
#: DRAM activity (share of time the memory interface moves data) at which the `kernel` and
#: `hardware` evidence calls the work memory-bandwidth-bound: between what matrix products
#: read (compute-bound) and what device-to-device copies read (bandwidth-bound by
#: construction), docs/gpu.md.
HIGH_DRAM_ACTIVE = 0.6
#: Mean utilisation during compute below which no kernel ran on the joined GPUs at all:
#: utilisation comes in whole percent, and a GPU running even one small kernel per sample
#: period reads 1% or more, so a mean under half a percent is readings of 0 (nearly) all
#: through. The `runtime` evidence then asks where the work ran instead.
NO_KERNEL_UTILIZATION = 0.005
#: GPU ids the ``gpu`` section lists at most (``compute_gpu_ids``).
MAX_LISTED_GPUS = 8

GPU_METRICS = frozenset(
    {
        sc.METRIC_GPU_UTILIZATION,
        sc.METRIC_GPU_MEMORY_UTILIZATION,
        sc.METRIC_GPU_MEMORY_USAGE,
        sc.METRIC_GPU_MEMORY_LIMIT,
        sc.METRIC_GPU_POWER_DRAW,
        sc.METRIC_GPU_CLOCK_GRAPHICS,
        sc.METRIC_GPU_TEMPERATURE,
    }
)

_GROUPS = (
    (sc.VERDICT_BATCHING, sc.BATCHING_STAGES, "pre-batch queuing and batch assembly"),
    (sc.VERDICT_HOST, sc.HOST_STAGES, "host-side processing"),
    (sc.VERDICT_TRANSFER, sc.TRANSFER_STAGES, "host-device copies"),
    (sc.VERDICT_NETWORK, sc.NETWORK_STAGES, "calls to remote services (the wire and the server)"),
    ("compute", sc.COMPUTE_STAGES, "model execution"),
)
_GROUP_OF = {stage: name for name, stages, _ in _GROUPS for stage in stages}
_WORDS = {name: words for name, _, words in _GROUPS}


#: NVML's and DCGM's GPU / MIG instance UUIDs (``GPU-8-4-4-4-12 hex``): unique per device.
_DEVICE_UUID = re.compile(
    r"(?:GPU|MIG)-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
)

_NIL_UUID = "00000000-0000-0000-0000-000000000000"
_ANY_UUID = re.compile(
    r"(?:(GPU|MIG)-)?([0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12})",
    re.IGNORECASE,
)


@functools.lru_cache(maxsize=4096)
def normalize_gpu_id(hw_id: str) -> str:
    """One spelling per device, so both sides of the join agree: NVML and dcgm-exporter
    say ``GPU-<lower-case uuid>``, while a hand-set ``inferprof.gpu.id`` may be upper case
    or the bare UUID (``torch.cuda.get_device_properties(i).uuid``). Other ids as given."""
    hw_id = hw_id.strip()
    m = _ANY_UUID.fullmatch(hw_id)
    if m is None:
        return hw_id
    return f"{(m.group(1) or 'GPU').upper()}-{m.group(2).lower()}"


def is_device_uuid(hw_id: str) -> bool:
    """Whether ``hw_id`` names one GPU in the world (joins across host names). The nil
    UUID is a placeholder (``inferprof.gpu.SyntheticSource``'s default), not a device."""
    return _DEVICE_UUID.fullmatch(hw_id) is not None and not hw_id.endswith(_NIL_UUID)


def is_gpu_metric(name: str) -> bool:
    return name in GPU_METRICS or name.startswith(sc.METRIC_DCGM_PREFIX)


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _summary(values: np.ndarray, weights: np.ndarray) -> dict | None:
    """Median and mean of ``values``, each weighted by the GPU time it stands for."""
    if values.size == 0:
        return None
    order = np.argsort(values, kind="stable")
    v, w = values[order], weights[order]
    cum = np.cumsum(w)
    median = float(v[int(np.searchsorted(cum, 0.5 * cum[-1], side="left"))])
    return {"p50": median, "mean": float(np.average(v, weights=w))}


def gpu_evidence(
    samples: Any, intervals: list[tuple[str, str, float, float]], since: float | None
) -> dict:
    """The breakdown's ``gpu`` section from ``samples`` (a ``gpu_samples.GpuSamples``)."""
    util, util_w = samples.during(sc.METRIC_GPU_UTILIZATION, intervals)
    section: dict = {
        "utilization_during_compute": _summary(util, util_w),
        "samples": int(util.size),
        "samples_received": samples.count(since),
        # compute spans (batch spans once) naming their GPU: none, and no sample can join
        "compute_spans_with_gpu_id": len(intervals),
        "compute_gpu_ids": sorted({normalize_gpu_id(gpu) for _, gpu, _, _ in intervals})[
            :MAX_LISTED_GPUS],
    }
    for name, metric in (
        ("sm_active_during_compute", sc.METRIC_DCGM_SM_ACTIVE),
        ("sm_occupancy_during_compute", sc.METRIC_DCGM_SM_OCCUPANCY),
        ("tensor_active_during_compute", sc.METRIC_DCGM_TENSOR_ACTIVE),
        ("dram_active_during_compute", sc.METRIC_DCGM_DRAM_ACTIVE),
    ):
        values, weights = samples.during(metric, intervals)
        summary = _summary(values, weights)
        if summary is not None:
            section[name] = summary
            if name == "sm_active_during_compute":
                section["profiling_samples"] = int(values.size)
    return section


def decide(
    shares: Mapping[str, float],
    traced: int,
    tail_traced: int,
    gpu: Mapping,
    queue: Mapping | None = None,
) -> dict:
    """The ``verdict`` section from stage shares of p95, the ``gpu`` section and the
    ``queue`` section (``queueing.behind_batches``; None: not known)."""
    if traced < MIN_TRACED_REQUESTS:
        return _unknown(words.not_enough(MIN_TRACED_REQUESTS, traced))
    groups, members = _group(shares)
    if not groups:
        return _unknown(words.NOTHING_TO_ATTRIBUTE)
    # Largest share first; ties go to the cheaper explanation (the order of _GROUPS).
    order = {name: i for i, (name, _, _) in enumerate(_GROUPS)}
    ranked = sorted(groups.items(), key=lambda kv: (-kv[1], order.get(kv[0], len(order))))
    top, top_share = ranked[0]
    runner_up = ranked[1][1] if len(ranked) > 1 else 0.0
    margin = (top_share - runner_up) / top_share if top_share > 0 else 0.0
    confidence = min(1.0, tail_traced / FULL_CONFIDENCE_TAIL) * (0.5 + 0.5 * margin)
    rest = words.next_groups(ranked[1:4])
    if top == sc.STAGE_UNATTRIBUTED:
        return _unknown(words.unattributed(top_share), *rest)
    if top.startswith("other:"):
        return _unknown(words.custom_stage(top_share, top[6:]), *rest)
    parts = ", ".join(f"{s} {words.pct(v)}"
                      for s, v in sorted(members[top], key=lambda kv: -kv[1]))
    case = _Case(words.headline(top_share, _WORDS[top], parts), top_share, confidence, gpu,
                 rest)
    behind = queue.get("behind_batches") if queue else None
    if top == sc.VERDICT_BATCHING and behind is not None and behind >= BEHIND_BATCHES:
        assert queue is not None
        return _behind_batches(case, groups, behind, queue["batch_coverage"])
    util = gpu.get("utilization_during_compute")
    if top == sc.VERDICT_BATCHING and behind is None and util and util["p50"] >= BUSY_UTILIZATION:
        return _busy_gpu_queue(case)
    if top != "compute":
        return _named_group(case, top, behind)
    return _compute_rules([case.headline], words.compute_holds(top_share), confidence, gpu,
                          rest)


class _Case:
    """What every rule past the grouping reads: the headline, the top group's share, the
    confidence so far, the ``gpu`` section and the runners-up."""

    __slots__ = ("confidence", "gpu", "headline", "rest", "share")

    def __init__(self, headline: str, share: float, confidence: float, gpu: Mapping,
                 rest: list[str]) -> None:
        self.headline = headline
        self.share = share
        self.confidence = confidence
        self.gpu = gpu
        self.rest = rest

    def utilisation(self) -> str | None:
        util = self.gpu.get("utilization_during_compute")
        return words.utilisation(util, self.gpu.get("samples", 0)) if util else None


def _group(shares: Mapping[str, float]) -> tuple[dict[str, float],
                                                  dict[str, list[tuple[str, float]]]]:
    """Stage shares summed per verdict group (``other:<stage>`` for a custom stage), and
    each group's stages."""
    groups: dict[str, float] = defaultdict(float)
    members: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for stage, share in shares.items():
        if stage == sc.STAGE_UNATTRIBUTED:
            group = sc.STAGE_UNATTRIBUTED
        else:
            group = _GROUP_OF.get(stage, "other:" + stage)
        groups[group] += share
        members[group].append((stage, share))
    return groups, members


def _behind_batches(case: _Case, groups: Mapping[str, float], behind: float,
                    coverage: float) -> dict:
    """The queue waits for the batches ahead of it, not for the batcher: what makes those
    batches slow is the bottleneck (transfers or compute, whichever is larger)."""
    work = max(
        (g for g in (sc.VERDICT_TRANSFER, "compute") if groups.get(g, 0.0) > 0),
        key=lambda g: groups[g],
        default=None,
    )
    waits = words.waits_behind_batches(behind, coverage)
    if work == sc.VERDICT_TRANSFER:
        evidence = [case.headline, waits, *case.rest]
        util_words = case.utilisation()
        if util_words:
            evidence.append(util_words)
        return _verdict(sc.VERDICT_TRANSFER, case.confidence, evidence)
    if work is None:
        # The tail holds no batch work of its own (requests that timed out or were
        # cancelled in the queue): the batches they waited behind are mostly compute.
        waits += words.LEFT_BEFORE_A_BATCH
    return _compute_rules([case.headline, waits], words.queue_behind_compute(case.share),
                          case.confidence, case.gpu, case.rest)


def _busy_gpu_queue(case: _Case) -> dict:
    """Not known what the queue waits for (no batch work in the traces). §6's batching
    verdict is for a GPU mostly idle while requests wait; busy nearly all the time, the
    GPU is likely what they wait for: the compute rules say why."""
    gpu = case.gpu
    gpu_factor = min(1.0, gpu.get("samples", 0) / FULL_CONFIDENCE_SAMPLES)
    evidence = [case.headline, case.utilisation() or "", words.gpu_busy(BUSY_UTILIZATION)]
    return _gpu_limit(
        evidence,
        case.confidence * gpu_factor,
        gpu.get("sm_active_during_compute"),
        gpu.get("sm_occupancy_during_compute"),
        case.rest,
        tensor=gpu.get("tensor_active_during_compute"),
        dram=gpu.get("dram_active_during_compute"),
    )


def _named_group(case: _Case, top: str, behind: float | None) -> dict:
    """A group other than compute names the verdict itself."""
    evidence = [case.headline, *case.rest]
    if top == sc.VERDICT_NETWORK:
        evidence.insert(1, words.NETWORK_IS_REMOTE)
    if top == sc.VERDICT_BATCHING and behind is not None:
        evidence.insert(1, words.waits_for_batcher(behind))
    util_words = case.utilisation()
    if util_words:
        evidence.append(util_words)
    return _verdict(top, case.confidence, evidence)


def _compute_rules(
    evidence: list[str], lead: str, confidence: float, gpu: Mapping, rest: list[str]
) -> dict:
    """§6's compute rules: ``runtime``, ``kernel`` or ``hardware`` from the GPU samples
    joined to the compute spans, ``unknown`` (saying why) without them. ``lead`` names
    what is compute-bound, for the ``unknown`` evidence."""
    util = gpu.get("utilization_during_compute")
    sm = gpu.get("sm_active_during_compute")
    occ = gpu.get("sm_occupancy_during_compute")
    if not util:
        if sm is not None and sm["p50"] >= LOW_UTILIZATION:
            # No utilisation samples (a DCGM profiling-only field set), but SMs this
            # active mean a busy GPU: utilisation is at least as high.
            gpu_factor = min(1.0, gpu.get("profiling_samples", 0) / FULL_CONFIDENCE_SAMPLES)
            return _gpu_limit([*evidence, words.sm_means_busy(sm)], confidence * gpu_factor,
                              sm, occ, rest, said_sm=True,
                              tensor=gpu.get("tensor_active_during_compute"),
                              dram=gpu.get("dram_active_during_compute"))
        return _unknown(_why_no_utilisation(lead, gpu, sm, occ), *evidence, *rest)
    gpu_factor = min(1.0, gpu.get("samples", 0) / FULL_CONFIDENCE_SAMPLES)
    evidence = [*evidence, words.utilisation(util, gpu.get("samples", 0))]
    if util["p50"] < LOW_UTILIZATION:
        if util["mean"] < NO_KERNEL_UTILIZATION and (
                sm is None or sm["mean"] < NO_KERNEL_UTILIZATION):
            evidence.append(words.no_kernel_ran(gpu.get("compute_gpu_ids") or [],
                                                gpu.get("compute_spans_with_gpu_id", 0),
                                                sm_known=sm is not None))
        else:
            evidence.append(words.idles_between_launches(LOW_UTILIZATION))
        return _verdict(sc.VERDICT_RUNTIME, confidence * gpu_factor, evidence + rest)
    return _gpu_limit(evidence, confidence * gpu_factor, sm, occ, rest,
                      tensor=gpu.get("tensor_active_during_compute"),
                      dram=gpu.get("dram_active_during_compute"))


def _why_no_utilisation(lead: str, gpu: Mapping, sm: Mapping | None,
                        occ: Mapping | None) -> str:
    """Why the compute rules cannot decide without utilisation samples."""
    received = gpu.get("samples_received", 0)
    if sm is not None or occ is not None:
        return words.no_utilisation(lead, sm, occ)
    if not received:
        return words.no_samples(lead)
    if not gpu.get("compute_spans_with_gpu_id", 1):
        return words.no_gpu_id(lead, received)
    return words.no_overlap(lead, received)


def _gpu_limit(
    evidence: list[str],
    confidence: float,
    sm: Mapping | None,
    occ: Mapping | None,
    rest: list[str],
    said_sm: bool = False,
    tensor: Mapping | None = None,
    dram: Mapping | None = None,
) -> dict:
    """``kernel`` or ``hardware`` for a GPU that is busy (§6's compute rules past
    ``runtime``), from SM activity and occupancy; ``said_sm``: the evidence quotes SM
    activity already; ``tensor``: tensor-pipe activity during compute, quoted where §6's
    occupancy rule says ``kernel`` for matrix units running near their peak; ``dram``:
    DRAM activity during compute, quoted beside either verdict (it changes neither)."""
    memory = [words.dram_activity(dram, HIGH_DRAM_ACTIVE)] if dram is not None else []
    if sm is None and occ is None:
        evidence.append(words.NO_PROFILING)
        return _verdict(sc.VERDICT_KERNEL, confidence * 0.7, evidence + memory + rest)
    low = []
    if sm is not None:
        if not said_sm:
            evidence.append(words.sm_activity(sm))
        if sm["p50"] < LOW_SM_ACTIVE:
            low.append("SM activity")
    if occ is not None:
        evidence.append(words.sm_occupancy(occ))
        if occ["p50"] < LOW_SM_OCCUPANCY:
            low.append("occupancy")
    if low:
        evidence.append(words.used_poorly(low))
        if low == ["occupancy"] and tensor is not None and tensor["p50"] >= HIGH_TENSOR_ACTIVE:
            # Matrix-product kernels keep few warps per SM by design (docs/gpu.md): §6
            # says `kernel`, but the tensor cores are near their peak.
            evidence.append(words.tensor_near_peak(tensor))
        return _verdict(sc.VERDICT_KERNEL, confidence, evidence + memory + rest)
    if sm is None or occ is None:
        evidence.append(words.missing_profiling("SM activity" if sm is None else "SM occupancy"))
        return _verdict(sc.VERDICT_KERNEL, confidence * 0.7, evidence + memory + rest)
    evidence.append(words.gpu_is_the_limit(said_sm))
    return _verdict(sc.VERDICT_HARDWARE, confidence, evidence + memory + rest)


def _verdict(bottleneck: str, confidence: float, evidence: list[str]) -> dict:
    return {
        "bottleneck": bottleneck,
        "confidence": round(max(0.0, min(1.0, confidence)), 3),
        "evidence": evidence,
    }


def _unknown(*evidence: str) -> dict:
    return _verdict(sc.VERDICT_UNKNOWN, 0.0, list(evidence))


__all__ = ["MIN_TRACED_REQUESTS", "decide", "gpu_evidence", "is_gpu_metric"]
