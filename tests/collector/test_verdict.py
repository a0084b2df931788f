"""Verdict rules (contract §6), directly and through the engine with GPU samples."""

from __future__ import annotations

import pytest

from inferprof import semconv as sc
from inferprof.collector.engine import Engine
from inferprof.collector.verdict import MIN_TRACED_REQUESTS, decide
from tests.collector.synth import FakeClock, TraceBuilder, gpu_metrics

ENOUGH = MIN_TRACED_REQUESTS


@pytest.mark.parametrize(
    "shares,expected",
    [
        (
            {"queue": 0.31, "batch_assembly": 0.07, "compute": 0.30, "unattributed": 0.32},
            sc.VERDICT_BATCHING,
        ),
        (
            {"tokenize": 0.3, "serialize": 0.25, "compute": 0.4, "unattributed": 0.05},
            sc.VERDICT_HOST,
        ),
        ({"h2d": 0.4, "d2h": 0.2, "compute": 0.4}, sc.VERDICT_TRANSFER),
        ({"network": 0.7, "compute": 0.3}, sc.VERDICT_NETWORK),
        ({"unattributed": 0.8, "compute": 0.2}, sc.VERDICT_UNKNOWN),
        ({"my_stage": 0.8, "compute": 0.2}, sc.VERDICT_UNKNOWN),
    ],
)
def test_group_rules(shares, expected):
    verdict = decide(shares, ENOUGH, 10, {})
    assert verdict["bottleneck"] == expected
    assert 0.0 <= verdict["confidence"] <= 1.0
    assert verdict["evidence"]
    if expected == sc.VERDICT_BATCHING:
        assert verdict["evidence"][0] == (
            "38% of p95 latency is spent in pre-batch queuing and batch assembly "
            "(queue 31%, batch_assembly 7%)"
        )
        assert verdict["confidence"] > 0


def test_network_verdict_points_to_the_remote_services_own_breakdown():
    # A Triton-fronted service: the whole Triton call is its `network` stage, which the
    # Triton service's own breakdown splits; the evidence says where to look.
    verdict = decide({"network": 0.92, "tokenize": 0.08}, ENOUGH, 10, {})
    assert verdict["bottleneck"] == sc.VERDICT_NETWORK
    assert verdict["evidence"][0].startswith(
        "92% of p95 latency is spent in calls to remote services")
    assert "service=" in verdict["evidence"][1] and "own breakdown" in verdict["evidence"][1]


def test_not_enough_data_says_how_much_is_needed():
    verdict = decide({"queue": 1.0}, 37, 2, {})
    assert verdict["bottleneck"] == sc.VERDICT_UNKNOWN and verdict["confidence"] == 0
    assert str(MIN_TRACED_REQUESTS) in verdict["evidence"][0] and "37" in verdict["evidence"][0]


def test_compute_without_gpu_samples_is_unknown_with_reason():
    verdict = decide({"compute": 0.71, "queue": 0.29}, ENOUGH, 10, {"samples_received": 0})
    assert verdict["bottleneck"] == sc.VERDICT_UNKNOWN
    assert verdict["evidence"][0].startswith(
        "compute holds 71% of p95 but no GPU samples were received (run `inferprof gpu`")


@pytest.mark.parametrize(
    "gpu,expected",
    [
        (
            {"utilization_during_compute": {"p50": 0.3, "mean": 0.32}, "samples": 50},
            sc.VERDICT_RUNTIME,
        ),
        (
            {"utilization_during_compute": {"p50": 0.9, "mean": 0.9}, "samples": 50},
            sc.VERDICT_KERNEL,
        ),
        (
            {
                "utilization_during_compute": {"p50": 0.9, "mean": 0.9},
                "samples": 50,
                "sm_active_during_compute": {"p50": 0.3, "mean": 0.3},
            },
            sc.VERDICT_KERNEL,
        ),
        (
            {
                "utilization_during_compute": {"p50": 0.9, "mean": 0.9},
                "samples": 50,
                "sm_active_during_compute": {"p50": 0.8, "mean": 0.8},
                "sm_occupancy_during_compute": {"p50": 0.6, "mean": 0.6},
            },
            sc.VERDICT_HARDWARE,
        ),
        (
            {
                "utilization_during_compute": {"p50": 0.9, "mean": 0.9},
                "samples": 50,
                "sm_active_during_compute": {"p50": 0.8, "mean": 0.8},
            },
            sc.VERDICT_KERNEL,  # high SM activity but no occupancy: never "hardware"
        ),
    ],
)
def test_compute_rules_read_gpu_evidence(gpu, expected):
    verdict = decide({"compute": 0.8, "queue": 0.2}, ENOUGH, 20, gpu)
    assert verdict["bottleneck"] == expected
    sm = gpu.get("sm_active_during_compute", {"p50": 1.0})["p50"]
    if expected == sc.VERDICT_KERNEL and sm >= 0.5:
        # kernel for want of evidence: names the missing DCGM figure
        assert any("DCGM" in e for e in verdict["evidence"])


def _compute_bound_engine(
    util: float | None,
    *,
    dcgm: dict | None = None,
    gpu_id: str = "GPU-0",
    sample_host: str = "host-1",
    sample_gpu_id: str = "GPU-0",
):
    clock = FakeClock()
    engine = Engine(clock=clock)
    b = TraceBuilder()
    for i in range(150):
        t = i * 0.2
        req = b.request(t, t + 0.1)
        b.stage(req, "queue", t, t + 0.01)
        b.stage(req, "compute", t + 0.01, t + 0.1, gpu_id=gpu_id, batch_id=f"b{i}")
    engine.ingest_traces(b.export())
    if util is not None:
        samples = [(i * 0.05, util) for i in range(600)]
        engine.ingest_metrics(
            gpu_metrics(samples, host=sample_host, hw_id=sample_gpu_id)
        )
        for metric, value in (dcgm or {}).items():
            engine.ingest_metrics(
                gpu_metrics(
                    [(i * 0.05, value) for i in range(600)],
                    metric=metric,
                    host=sample_host,
                    hw_id=sample_gpu_id,
                )
            )
    clock.tick(5)
    return engine.breakdown("svc", window_s=None)


_BUSY = {
    "utilization_during_compute": {"p50": 0.98, "mean": 0.97},
    "samples": 900,
    "sm_active_during_compute": {"p50": 0.9, "mean": 0.9},
    "sm_occupancy_during_compute": {"p50": 0.7, "mean": 0.7},
}


def test_a_queue_dominated_tail_behind_a_busy_gpu_is_not_batching():
    # §6: batching is the verdict while the GPU is mostly idle. Busy 98% of the time with
    # high SM activity and occupancy, the queue waits for the GPU: hardware.
    verdict = decide({"queue": 0.6, "compute": 0.3, "unattributed": 0.1}, ENOUGH, 20, _BUSY)
    assert verdict["bottleneck"] == sc.VERDICT_HARDWARE
    text = " | ".join(verdict["evidence"])
    assert "60% of p95 latency is spent in pre-batch queuing" in text
    assert "requests queue for the GPU, not for the batcher" in text
    poor = {**_BUSY, "sm_occupancy_during_compute": {"p50": 0.1, "mean": 0.1}}
    assert decide({"queue": 0.6, "compute": 0.4}, ENOUGH, 20, poor)["bottleneck"] == (
        sc.VERDICT_KERNEL)
    # a GPU that is only partly busy leaves the verdict to the batcher
    partly = {**_BUSY, "utilization_during_compute": {"p50": 0.6, "mean": 0.6}}
    verdict = decide({"queue": 0.6, "compute": 0.4}, ENOUGH, 20, partly)
    assert verdict["bottleneck"] == sc.VERDICT_BATCHING
    assert any("GPU utilisation during compute: median 60%" in e for e in verdict["evidence"])


def test_profiling_samples_without_utilization_decide_when_they_can_and_say_why_not():
    busy = {k: v for k, v in _BUSY.items() if k not in ("utilization_during_compute", "samples")}
    busy.update(samples=0, samples_received=1200, profiling_samples=600)
    verdict = decide({"compute": 0.83, "queue": 0.17}, ENOUGH, 20, busy)
    assert verdict["bottleneck"] == sc.VERDICT_HARDWARE  # SMs 90% active: the GPU was busy
    assert any("no hw.gpu.utilization samples joined" in e for e in verdict["evidence"])
    assert not any("high utilisation" in e for e in verdict["evidence"])  # none was received
    idle = {**busy, "sm_active_during_compute": {"p50": 0.2, "mean": 0.2}}
    verdict = decide({"compute": 0.83, "queue": 0.17}, ENOUGH, 20, idle)
    assert verdict["bottleneck"] == sc.VERDICT_UNKNOWN
    why = verdict["evidence"][0]
    assert "SM activity median 20%" in why and "no hw.gpu.utilization samples did" in why
    assert "overlaps" not in why  # the join works: it must not send the user after it


def test_engine_joins_gpu_samples_to_compute_spans():
    doc = _compute_bound_engine(0.25)
    assert doc["gpu"]["utilization_during_compute"] == pytest.approx({"p50": 0.25, "mean": 0.25})
    assert doc["gpu"]["samples"] > 100
    assert doc["verdict"]["bottleneck"] == sc.VERDICT_RUNTIME
    hw = _compute_bound_engine(
        0.95, dcgm={sc.METRIC_DCGM_SM_ACTIVE: 0.9, sc.METRIC_DCGM_SM_OCCUPANCY: 0.5}
    )
    assert hw["verdict"]["bottleneck"] == sc.VERDICT_HARDWARE
    assert hw["verdict"]["confidence"] > 0.5


def test_engine_compute_bound_without_samples_or_with_unjoinable_samples():
    doc = _compute_bound_engine(None)
    assert doc["verdict"]["bottleneck"] == sc.VERDICT_UNKNOWN
    assert "no GPU samples were received" in doc["verdict"]["evidence"][0]
    other = _compute_bound_engine(0.5, gpu_id="GPU-other")
    assert other["gpu"]["samples_received"] == 600 and other["gpu"]["samples"] == 0
    assert "overlaps" in other["verdict"]["evidence"][0]
    assert "inferprof.gpu.id" in other["verdict"]["evidence"][0]
    # compute spans naming no GPU (a CPU-only Triton, a stage without the attribute)
    nameless = _compute_bound_engine(0.5, gpu_id=None)
    assert nameless["gpu"]["compute_spans_with_gpu_id"] == 0
    assert "name no GPU" in nameless["verdict"]["evidence"][0]


def test_device_uuid_joins_across_host_names_short_ids_do_not():
    # Kubernetes: the pod's spans say host.name = the pod, dcgm-exporter says the node.
    uuid = "GPU-5d3f8c2a-9b1e-4c7d-8a6f-0e2b4c6d8f10"
    doc = _compute_bound_engine(0.25, gpu_id=uuid, sample_host="node-7", sample_gpu_id=uuid)
    assert doc["gpu"]["samples"] > 100
    assert doc["verdict"]["bottleneck"] == sc.VERDICT_RUNTIME
    short = _compute_bound_engine(0.25, gpu_id="GPU-0", sample_host="node-7")
    assert short["gpu"]["samples"] == 0
    assert short["verdict"]["bottleneck"] == sc.VERDICT_UNKNOWN
    nil = "GPU-00000000-0000-0000-0000-000000000000"  # a placeholder, not a device
    placeholder = _compute_bound_engine(0.25, gpu_id=nil, sample_host="node-7", sample_gpu_id=nil)
    assert placeholder["gpu"]["samples"] == 0


def test_gpu_samples_without_hw_id_or_finite_value_rejected():
    engine = Engine(clock=FakeClock())
    good = engine.ingest_metrics(gpu_metrics([(0.0, 0.5), (0.1, float("nan"))]))
    assert (good.accepted_spans, good.rejected_spans) == (1, 1)
    anonymous = engine.ingest_metrics(gpu_metrics([(0.2, 0.5)], hw_id=""))
    assert anonymous.rejected_spans == 1 and "hw.id" in anonymous.errors[0]
    ignored = engine.ingest_metrics(gpu_metrics([(0.3, 1.0)], metric="process.cpu.time"))
    assert (ignored.accepted_spans, ignored.rejected_spans) == (0, 0)
    assert engine.stats.gpu_samples_received == 1


@pytest.mark.parametrize("fast", ["GPU-A", "GPU-B"])
def test_gpus_weigh_by_their_compute_time_not_by_their_samplers_rates(fast):
    # Two GPUs run the same compute time, one at 90% utilisation, one at 30%; one sampler
    # reads every 10 ms, the other every 100 ms. Pooled sample by sample, the verdict
    # followed whichever sampler was faster; weighted by the time each sample stands for,
    # it does not depend on the samplers.
    engine = Engine(clock=FakeClock(), settle_s=0.0)
    b = TraceBuilder()
    for i in range(200):
        gpu = "GPU-A" if i % 2 == 0 else "GPU-B"
        req = b.request(i * 0.1, i * 0.1 + 0.09)
        b.stage(req, "compute", i * 0.1, i * 0.1 + 0.09, gpu_id=gpu)
    engine.ingest_traces(b.export())
    for gpu, util in (("GPU-A", 0.9), ("GPU-B", 0.3)):
        period = 0.01 if gpu == fast else 0.1
        n = round(20.0 / period)
        engine.ingest_metrics(
            gpu_metrics([(k * period, util) for k in range(n)], hw_id=gpu)
        )
    engine.clock.tick(5.0)
    engine.advance()
    util = engine.breakdown("svc")["gpu"]["utilization_during_compute"]
    assert util["mean"] == pytest.approx(0.6, abs=0.02)  # equal compute time each


def test_low_occupancy_with_busy_tensor_cores_is_said_next_to_the_kernel_verdict():
    # cuBLAS at peak on an H100 (docs/gpu.md): SM activity 95%, occupancy 14%, tensor
    # activity 92%. §6 says `kernel`; the evidence must show the tensor figure that puts it
    # in its light. Through the engine, from DCGM samples joined to the compute spans.
    doc = _compute_bound_engine(0.95, dcgm={
        sc.METRIC_DCGM_SM_ACTIVE: 0.95, sc.METRIC_DCGM_SM_OCCUPANCY: 0.14,
        sc.METRIC_DCGM_TENSOR_ACTIVE: 0.92})
    assert doc["gpu"]["tensor_active_during_compute"]["p50"] == pytest.approx(0.92)
    assert doc["verdict"]["bottleneck"] == sc.VERDICT_KERNEL
    text = " | ".join(doc["verdict"]["evidence"])
    assert "tensor activity during compute is high (median 92%)" in text
    # idle tensor pipes (a kernel that really is poor): no such line
    poor = _compute_bound_engine(0.95, dcgm={
        sc.METRIC_DCGM_SM_ACTIVE: 0.95, sc.METRIC_DCGM_SM_OCCUPANCY: 0.14,
        sc.METRIC_DCGM_TENSOR_ACTIVE: 0.05})
    assert poor["verdict"]["bottleneck"] == sc.VERDICT_KERNEL
    assert "tensor activity" not in " | ".join(poor["verdict"]["evidence"])


_UUID = "GPU-aaaaaaaa-1111-2222-3333-bbbbbbbbbbbb"


@pytest.mark.parametrize("span_id,sample_id", [
    ("GPU-AAAAAAAA-1111-2222-3333-BBBBBBBBBBBB", _UUID),  # upper case, by hand
    ("aaaaaaaa-1111-2222-3333-bbbbbbbbbbbb", _UUID),      # torch's bare device uuid
    (_UUID, "GPU-AAAAAAAA-1111-2222-3333-BBBBBBBBBBBB"),  # a sampler of one's own
])
def test_a_gpu_uuid_spelt_otherwise_joins_the_samples_of_its_gpu(span_id, sample_id):
    # NVML and dcgm-exporter say GPU-<lower-case uuid>; a service setting inferprof.gpu.id
    # by hand, or a sampler of one's own, may not. The join must not depend on the
    # spelling (and the UUID joins across host names: the pod's spans, the node's samples).
    doc = _compute_bound_engine(0.25, gpu_id=span_id, sample_host="node-7",
                                sample_gpu_id=sample_id)
    assert doc["gpu"]["samples"] > 100
    assert doc["verdict"]["bottleneck"] == sc.VERDICT_RUNTIME


def test_normalize_gpu_id_leaves_short_ids_alone():
    from inferprof.collector.verdict import normalize_gpu_id

    assert normalize_gpu_id("GPU-0") == "GPU-0"
    assert normalize_gpu_id(" mig-AAAAAAAA-1111-2222-3333-BBBBBBBBBBBB ") == (
        "MIG-aaaaaaaa-1111-2222-3333-bbbbbbbbbbbb")


def test_a_gpu_that_ran_no_kernel_during_compute_is_runtime_asking_where_the_work_ran():
    # Utilisation and SM activity 0 over hundreds of readings: nothing ran on the GPU the
    # spans name. §6 still says runtime; the evidence says what that most likely means.
    doc = _compute_bound_engine(0.0, dcgm={sc.METRIC_DCGM_SM_ACTIVE: 0.0},
                                gpu_id=_UUID, sample_gpu_id=_UUID)
    assert doc["gpu"]["compute_gpu_ids"] == [_UUID]
    v = doc["verdict"]
    assert v["bottleneck"] == sc.VERDICT_RUNTIME
    text = " | ".join(v["evidence"])
    assert (f"no kernel ran on GPU {_UUID} during compute (utilisation and SM activity 0% "
            "through 150 compute spans): is the work on the CPU") in text
    assert "idles between kernel launches" not in text
    # NVML without GPM: utilisation alone says so
    doc = _compute_bound_engine(0.0)
    assert "no kernel ran on GPU GPU-0 during compute (utilisation 0% through" in " | ".join(
        doc["verdict"]["evidence"])
    # a launch-bound loop reads 1% (the H200's, docs/gpu.md): kernels ran, between idling
    for util, dcgm in ((0.01, {sc.METRIC_DCGM_SM_ACTIVE: 0.0}),
                       (0.0, {sc.METRIC_DCGM_SM_ACTIVE: 0.02})):
        v = _compute_bound_engine(util, dcgm=dcgm)["verdict"]
        assert v["bottleneck"] == sc.VERDICT_RUNTIME
        text = " | ".join(v["evidence"])
        assert "the GPU idles between kernel launches" in text and "no kernel ran" not in text


def test_dram_activity_is_quoted_beside_hardware_and_kernel_saying_bandwidth_bound():
    # The H200's device-to-device copies: busy, SMs active and full, DRAM 87.5%, no tensor
    # work: hardware, and memory-bandwidth-bound. Through the engine, from DCGM samples.
    copy = {sc.METRIC_DCGM_SM_ACTIVE: 0.98, sc.METRIC_DCGM_SM_OCCUPANCY: 0.79,
            sc.METRIC_DCGM_TENSOR_ACTIVE: 0.0, sc.METRIC_DCGM_DRAM_ACTIVE: 0.875}
    doc = _compute_bound_engine(0.99, dcgm=copy)
    assert doc["gpu"]["dram_active_during_compute"] == pytest.approx(
        {"p50": 0.875, "mean": 0.875})
    v = doc["verdict"]
    assert v["bottleneck"] == sc.VERDICT_HARDWARE
    assert ("DRAM activity during compute: median 88%: the kernels are "
            "memory-bandwidth-bound") in " | ".join(v["evidence"])
    # bf16 products: DRAM 16%, quoted, not called bandwidth-bound; the verdict is §6's
    matmul = {sc.METRIC_DCGM_SM_ACTIVE: 0.96, sc.METRIC_DCGM_SM_OCCUPANCY: 0.14,
              sc.METRIC_DCGM_TENSOR_ACTIVE: 0.93, sc.METRIC_DCGM_DRAM_ACTIVE: 0.16}
    v = _compute_bound_engine(0.99, dcgm=matmul)["verdict"]
    assert v["bottleneck"] == sc.VERDICT_KERNEL
    assert "DRAM activity during compute: median 16%" in v["evidence"]
    # the same figures without DRAM: the same verdicts, and no DRAM words
    for dcgm, verdict in ((copy, sc.VERDICT_HARDWARE), (matmul, sc.VERDICT_KERNEL)):
        without = {k: x for k, x in dcgm.items() if k != sc.METRIC_DCGM_DRAM_ACTIVE}
        doc = _compute_bound_engine(0.99, dcgm=without)
        assert "dram_active_during_compute" not in doc["gpu"]
        assert doc["verdict"]["bottleneck"] == verdict
        assert "DRAM" not in " | ".join(doc["verdict"]["evidence"])
    # a memory-bound kernel with low occupancy: kernel, and bandwidth-bound said
    v = decide({"compute": 0.8, "queue": 0.2}, ENOUGH, 20, {
        "utilization_during_compute": {"p50": 0.95, "mean": 0.95}, "samples": 50,
        "sm_active_during_compute": {"p50": 0.9, "mean": 0.9},
        "sm_occupancy_during_compute": {"p50": 0.1, "mean": 0.1},
        "dram_active_during_compute": {"p50": 0.7, "mean": 0.7}})
    assert v["bottleneck"] == sc.VERDICT_KERNEL
    assert any("median 70%: the kernels are memory-bandwidth-bound" in e for e in v["evidence"])
