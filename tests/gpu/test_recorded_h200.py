"""Real Hopper readings through production's path: the RECORDED H200 readings of
``tests/gpu/data/h200-nvml.jsonl`` (idle, bf16 matrix products, device-to-device copies)
played by the ``inferprof gpu --source replay`` sidecar into a real ``inferprof collect``,
and compute spans of three services placed in the recording's idle, matmul and copy phases,
shifted as playback shifts the readings. The collector's GPU figures during each service's
compute must follow its phase, and the verdicts must be what contract §6 says for them.
"""

from __future__ import annotations

import itertools
import json
import re
import statistics
import time

import httpx
import pytest

from inferprof import semconv as sc
from inferprof.collector import verdict
from tests.collector.synth import TraceBuilder
from tests.gpu.conftest import DATA, start_gpu_sidecar
from tests.integration.test_collector_cli import _start, _stop

pytestmark = pytest.mark.integration

RECORDING = DATA / "h200-nvml.jsonl"
GPU = "GPU-8f2f6ba6-ce88-fd95-6f08-d2d1f1ecfb4a"  # the recording's H200
REQUESTS = 150  # the verdict needs 100 traced requests
#: Compute spans keep this far from a phase's edges: the recording's figures follow a change
#: of load up to about 0.3 s late.
EDGE_S = 0.5
U = sc.METRIC_GPU_UTILIZATION
SM = sc.METRIC_DCGM_SM_ACTIVE
OCC = sc.METRIC_DCGM_SM_OCCUPANCY
TENSOR = sc.METRIC_DCGM_TENSOR_ACTIVE
DRAM = sc.METRIC_DCGM_DRAM_ACTIVE
#: breakdown field of each metric's figures during compute
FIELDS = {U: "utilization_during_compute", SM: "sm_active_during_compute",
          OCC: "sm_occupancy_during_compute", TENSOR: "tensor_active_during_compute",
          DRAM: "dram_active_during_compute"}


def _phases() -> dict[str, tuple[float, float]]:
    """The recording's phases from its header (``# phase NAME START END ...``): the first of
    each name."""
    phases: dict[str, tuple[float, float]] = {}
    for line in RECORDING.read_text().splitlines():
        m = re.match(r"# phase (\w+) ([\d.]+) ([\d.]+) ", line)
        if m:
            phases.setdefault(m.group(1), (float(m.group(2)), float(m.group(3))))
    return phases


def _readings(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def _spans(service: str, start: float, end: float):
    """REQUESTS compute-bound requests (1 ms queue, 9 ms compute on the H200) spread evenly
    over [start, end] (unix seconds); their compute windows, for the expectations."""
    b = TraceBuilder(service, host="h200-node", base_unix=start)
    step = (end - start - 0.010) / (REQUESTS - 1)
    windows = []
    for i in range(REQUESTS):
        t = i * step
        req = b.request(t, t + 0.010)
        b.stage(req, sc.STAGE_QUEUE, t, t + 0.001)
        b.stage(req, sc.STAGE_COMPUTE, t + 0.001, t + 0.010, gpu_id=GPU,
                batch_id=f"{service}-{i}", batch_size=1)
        windows.append((b.ns(t + 0.001) / 1e9, b.ns(t + 0.010) / 1e9))
    return b.export(), windows


def _joined(played: list[dict], metric: str, windows) -> list[float]:
    """The played readings of ``metric`` the collector must join to the compute windows,
    found here from the file: a reading at t describes the sampling period before it, so it
    joins [s, e] when s < t < e + the series' median gap (docs/gpu.md), once however many
    windows it joins."""
    series = [(r["t"], r["values"][metric]) for r in played if metric in r["values"]]
    period = statistics.median(b[0] - a[0] for a, b in itertools.pairwise(series))
    return [v for t, v in series if any(s < t < e + period for s, e in windows)]


def test_the_h200_recording_gives_each_phase_its_figures_and_verdict(tmp_path):
    phases = _phases()
    assert set(phases) == {"idle", "matmul", "copy"}, phases
    recorded = _readings(RECORDING)
    assert len(recorded) == 261 and {r["hw.id"] for r in recorded} == {GPU}
    played_file = tmp_path / "played.jsonl"
    collector, urls = _start(["--grpc-port", "0", "--http-port", "0", "--api-port", "0",
                              "--settle-s", "0.1"])
    sidecar = None
    try:
        assert set(urls) == {"OTLP/gRPC", "OTLP/HTTP", "API"}
        # the whole recording once (26 s), recording what it plays with the played times
        sidecar = start_gpu_sidecar(
            "--source", "replay", "--replay", str(RECORDING), "--no-loop",
            "--interval", "0.05", "--export-interval", "0.5", "--endpoint",
            urls["OTLP/gRPC"], "--record", str(played_file))
        out, _ = sidecar.communicate(timeout=90)
        assert sidecar.returncode == 0, out
        assert "the recording has played (--no-loop)" in out, out

        # Played as recorded: same readings, same spacing, from one shift.
        played = _readings(played_file)
        assert [(r["hw.id"], r["values"]) for r in played] == [
            (r["hw.id"], r["values"]) for r in recorded]
        shift = played[0]["t"] - recorded[0]["t"]
        assert [p["t"] - r["t"] for p, r in zip(played, recorded, strict=True)] == [
            pytest.approx(shift, abs=2e-6)] * len(recorded)

        # One service per phase, its compute spans inside the phase as played.
        services = {"h200-idle": "idle", "h200-matmul": "matmul", "h200-copy": "copy"}
        windows = {}
        for service, phase in services.items():
            start, end = (t + shift for t in phases[phase])
            request, windows[service] = _spans(service, start + EDGE_S, end - EDGE_S)
            r = httpx.post(f"{urls['OTLP/HTTP']}/v1/traces",
                           content=request.SerializeToString(),
                           headers={"content-type": "application/x-protobuf"}, timeout=10)
            assert r.status_code == 200, r.text

        def breakdown(service: str) -> dict:
            deadline = time.monotonic() + 20
            while True:
                r = httpx.get(f"{urls['API']}/api/v1/breakdown",
                              params={"service": service, "window": 300}, timeout=10)
                doc = r.json() if r.status_code == 200 else {}
                if doc.get("requests") == REQUESTS:
                    return doc
                assert time.monotonic() < deadline, doc
                time.sleep(0.2)

        docs = {service: breakdown(service) for service in services}
    finally:
        if sidecar is not None and sidecar.poll() is None:
            sidecar.kill()
            sidecar.communicate()
        code, log = _stop(collector)
    assert code == 0, log

    # The sidecar exported every reading it played, each metric as a data point.
    points = sum(len(r["values"]) for r in recorded)
    assert re.search(rf"readings 261, exported 261 \({points} data points; 0 exports failed\), "
                     r"dropped 0 \(buffer full\) \+ 0 \(export failed\), buffered 0$",
                     out.strip()), out

    gpu = {service: doc["gpu"] for service, doc in docs.items()}
    for service, doc in docs.items():  # shown with -s
        print(service, doc["verdict"], doc["gpu"])
    for service, g in gpu.items():
        # every data point reached the collector ...
        assert g["samples_received"] == points, g
        assert g["compute_spans_with_gpu_id"] == REQUESTS
        # ... and the readings inside this service's compute windows are the ones joined,
        # though the spans' host.name is not the sidecar's (an NVML UUID joins any host)
        for metric, field in FIELDS.items():
            joined = _joined(played, metric, windows[service])
            assert len(joined) >= 35, (service, metric)  # ~4.5 s of readings 0.1 s apart
            figure = g[field]
            assert figure["mean"] == pytest.approx(statistics.fmean(joined), abs=1e-9)
            assert statistics.median_low(joined) <= figure["p50"] <= statistics.median_high(
                joined), (service, metric, figure)
            count = {U: "samples", SM: "profiling_samples"}.get(metric)
            if count:
                assert g[count] == len(joined), (service, metric)

    # What real Hopper readings give in each phase.
    idle, matmul, copy = gpu["h200-idle"], gpu["h200-matmul"], gpu["h200-copy"]
    assert idle["utilization_during_compute"] == {"p50": 0.0, "mean": 0.0}
    assert idle["sm_active_during_compute"]["p50"] == 0.0
    assert idle["tensor_active_during_compute"]["p50"] == 0.0
    # bf16 products: busy, SMs active, tensor pipes near peak, few warps resident
    assert matmul["utilization_during_compute"]["p50"] >= 0.99
    assert matmul["sm_active_during_compute"]["p50"] >= 0.95
    assert 0.1 < matmul["sm_occupancy_during_compute"]["p50"] < verdict.LOW_SM_OCCUPANCY
    assert matmul["tensor_active_during_compute"]["p50"] >= 0.9
    # copies: busy, SMs active and full of warps, no tensor work
    assert copy["utilization_during_compute"]["p50"] >= 0.99
    assert copy["sm_active_during_compute"]["p50"] >= 0.95
    assert copy["sm_occupancy_during_compute"]["p50"] >= 0.75
    assert copy["tensor_active_during_compute"]["p50"] == 0.0
    # DRAM: copies keep the memory interface busy, products far less
    assert copy["dram_active_during_compute"]["p50"] >= 0.85
    assert matmul["dram_active_during_compute"]["p50"] < 0.25
    assert idle["dram_active_during_compute"]["p50"] < 0.01
    # One copy-phase GPM reading is 0 (a pair taken before the counters moved, see the
    # recording's header): the mean shows it, the median does not.
    assert copy["sm_active_during_compute"]["mean"] < copy["sm_active_during_compute"]["p50"]

    # The verdicts, as contract §6 words them. Compute holds the tail in all three (90% of
    # each request), so the GPU samples inside the compute windows decide:
    for doc in docs.values():
        shares = {s["stage"]: s["share_of_p95"] for s in doc["stages"]}
        assert shares[sc.STAGE_COMPUTE] > 0.8, shares
    # low utilisation -> runtime; utilisation and SM activity 0 all through: no kernel ran
    v = docs["h200-idle"]["verdict"]
    assert v["bottleneck"] == sc.VERDICT_RUNTIME, v
    assert any("median 0%" in e and "utilisation" in e for e in v["evidence"]), v
    assert any(e.startswith(f"no kernel ran on GPU {GPU} during compute (utilisation and SM "
                            "activity 0% through 150 compute spans): is the work on the CPU")
               for e in v["evidence"]), v
    # high utilisation with low occupancy -> kernel, saying the tensor cores are near peak
    # (cuBLAS at full speed keeps few warps per SM: docs/gpu.md)
    v = docs["h200-matmul"]["verdict"]
    assert v["bottleneck"] == sc.VERDICT_KERNEL, v
    assert any("SM occupancy during compute: median 14%" in e for e in v["evidence"]), v
    assert any("low occupancy" in e for e in v["evidence"]), v
    assert any(e.startswith("but tensor activity during compute is high (median 93%)")
               for e in v["evidence"]), v
    assert "DRAM activity during compute: median 16%" in v["evidence"], v
    # high utilisation, SM activity and occupancy -> hardware
    v = docs["h200-copy"]["verdict"]
    assert v["bottleneck"] == sc.VERDICT_HARDWARE, v
    assert any("the GPU itself is the limit" in e for e in v["evidence"]), v
    assert any("SM occupancy during compute: median 79%" in e for e in v["evidence"]), v
    # ... and the copies are memory-bandwidth-bound
    assert any(e.startswith("DRAM activity during compute: median 88%: the kernels are "
                            "memory-bandwidth-bound") for e in v["evidence"]), v
    # 150 requests, 45 readings or more each: full confidence but for the stage margin
    for doc in docs.values():
        assert doc["verdict"]["confidence"] > 0.8, doc["verdict"]
