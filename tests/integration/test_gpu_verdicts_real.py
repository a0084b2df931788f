"""End to end on a REAL GPU: torch work on CUDA behind the dynamic batcher, the ``inferprof
gpu`` sidecar reading NVML, a real ``inferprof collect``; the verdicts must name the
bottleneck each service was built to have.

CI machines have no GPU: there this module is skipped, and the same path is covered with
replayed samples in ``tests/gpu/test_end_to_end.py`` (and real H200 readings replayed in
``tests/gpu/test_recorded_h200.py``). It is run on a GPU machine when one is lent, alone or
with the other GPU checks by ``bash scripts/gpu-checks OUTDIR`` (docs/gpu.md, "Checked on a
real GPU", says what it saw on an H100 and an H200):

    python3 -m pytest -q tests/integration/test_gpu_verdicts_real.py

Three services, one collector:

* ``busy-gpu``: every request runs ~8 ms of matrix products alone (batches of one) and 24
  clients wait their turn: the queue holds the tail, behind the batches ahead, while the
  GPU hardly rests: ``kernel`` or ``hardware`` (SM activity and occupancy from NVML's GPM
  on Hopper and later decide; without them, ``kernel``), not ``batching``.
* ``batch-wait``: tiny compute, but the batcher waits up to 40 ms for 32 requests that 4
  clients never send: the queue holds the tail while the worker and the GPU idle:
  ``batching``.
* ``launch-bound``: compute is 120 tiny kernels, each waited for by the host, which sleeps
  between them; 2 clients queue behind each other's batches. The GPU idles between
  launches: ``runtime``.

What the first run on an H100 showed (2026-11-24), before the collector read what queues
wait for: ``busy-gpu`` was called ``batching`` (queue 96% of p95, GPU 88% busy during
compute, under the 90% then needed) and ``launch-bound`` too (queue 51%, compute 48%).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import httpx
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device (covered with replayed samples in tests/gpu/test_end_to_end.py)",
                allow_module_level=True)
pynvml = pytest.importorskip("pynvml")

import inferprof
from inferprof import semconv as sc
from tests.integration.test_collector_cli import _start, _stop

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-c", "from inferprof.cli import main; main()"]
REQUESTS = 400
DEVICE = "cuda:0"


def _scenarios():
    a = torch.randn(4096, 4096, device=DEVICE)
    x = torch.zeros(1024, device=DEVICE)
    one = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    one[0].record()
    for _ in range(10):
        a @ a
    one[1].record()
    one[1].synchronize()
    reps = max(1, round(8.0 / (one[0].elapsed_time(one[1]) / 10)))  # ~8 ms of GPU work

    def matmuls(items):
        with inferprof.stage("compute", device=DEVICE):
            for _ in range(reps):
                y = a @ a
        with inferprof.stage("d2h", device=DEVICE):
            y[0, :4].cpu()
        return items

    def tiny(items):
        with inferprof.stage("compute", device=DEVICE):
            x.add_(1.0)
        with inferprof.stage("d2h", device=DEVICE):
            x[:4].cpu()
        return items

    def launches(items):
        with inferprof.stage("compute", device=DEVICE):
            for _ in range(120):
                x.add_(1.0)
                torch.cuda.synchronize()
                time.sleep(0.0002)
        with inferprof.stage("d2h", device=DEVICE):
            x[:4].cpu()
        return items

    return {
        # service: (batch fn, max_batch_size, max_delay_ms, clients)
        "busy-gpu": (matmuls, 1, 1, 24),
        "batch-wait": (tiny, 32, 40, 4),
        "launch-bound": (launches, 1, 1, 2),
    }


async def _drive(fn, max_batch_size, max_delay_ms, clients) -> None:
    async with inferprof.DynamicBatcher(fn, max_batch_size=max_batch_size,
                                        max_delay_ms=max_delay_ms) as batcher:
        left = REQUESTS

        async def client():
            nonlocal left
            while left > 0:
                left -= 1
                async with inferprof.request():
                    await batcher.submit(left)

        await asyncio.gather(*(client() for _ in range(clients)))


def _shares(doc: dict) -> dict[str, float]:
    return {s["stage"]: s["share_of_p95"] for s in doc["stages"]}


def test_real_gpu_samples_decide_real_verdicts():
    collector, urls = _start(["--grpc-port", "0", "--http-port", "0", "--api-port", "0",
                              "--settle-s", "0.2"])
    sidecar = None
    try:
        assert set(urls) == {"OTLP/gRPC", "OTLP/HTTP", "API"}
        sidecar = subprocess.Popen(
            [*CLI, "gpu", "--source", "nvml", "--interval", "0.05", "--export-interval", "0.2",
             "--endpoint", urls["OTLP/gRPC"]],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")})
        line = sidecar.stdout.readline()
        assert line.startswith("source     nvml"), line
        docs = {}
        for service, (fn, size, delay, clients) in _scenarios().items():
            inferprof.configure(service_name=service, endpoint=urls["OTLP/gRPC"],
                                protocol="grpc", mode=sc.MODE_FULL)
            asyncio.run(_drive(fn, size, delay, clients))
            inferprof.shutdown()  # flushes this service's spans
        time.sleep(0.5)  # the sidecar's last readings: exported every 0.2 s
        for service in ("busy-gpu", "batch-wait", "launch-bound"):
            deadline = time.monotonic() + 30
            while True:
                r = httpx.get(f"{urls['API']}/api/v1/breakdown", params={"service": service})
                doc = r.json() if r.status_code == 200 else {}
                if doc.get("requests") == REQUESTS and doc.get("gpu", {}).get("samples"):
                    break
                assert time.monotonic() < deadline, (service, r.status_code, doc)
                time.sleep(0.3)
            docs[service] = doc
    finally:
        if sidecar is not None:
            sidecar.terminate()
            sidecar.communicate(timeout=20)
        code, log = _stop(collector)
    assert code == 0, log
    for service, doc in docs.items():
        print(service, doc["verdict"], doc["gpu"], doc["queue"], _shares(doc))

    busy, wait, launch = docs["busy-gpu"], docs["batch-wait"], docs["launch-bound"]
    assert busy["gpu"]["utilization_during_compute"]["p50"] >= 0.5
    assert _shares(busy)[sc.STAGE_QUEUE] > 0.5
    assert busy["queue"]["behind_batches"] > 0.5  # 0.83 on an H100: gaps between batches
    if "sm_occupancy_during_compute" in busy["gpu"]:  # NVML GPM (Hopper and later)
        # SM figures decide: kernel (busy but poorly used) or hardware
        assert busy["verdict"]["bottleneck"] in (sc.VERDICT_KERNEL, sc.VERDICT_HARDWARE)
        assert busy["gpu"]["sm_active_during_compute"]["p50"] >= 0.5
    else:
        assert busy["verdict"]["bottleneck"] == sc.VERDICT_KERNEL, busy["verdict"]
    assert any("wait for the model" in e for e in busy["verdict"]["evidence"])

    assert wait["gpu"]["utilization_during_compute"]["p50"] < 0.5
    assert _shares(wait)[sc.STAGE_QUEUE] > 0.5
    assert wait["queue"]["behind_batches"] < 0.2
    assert wait["verdict"]["bottleneck"] == sc.VERDICT_BATCHING, wait["verdict"]

    assert launch["gpu"]["utilization_during_compute"]["p50"] < 0.5
    assert launch["queue"]["behind_batches"] > 0.5
    assert launch["verdict"]["bottleneck"] == sc.VERDICT_RUNTIME, launch["verdict"]
