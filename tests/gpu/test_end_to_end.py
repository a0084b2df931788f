"""End to end: a real ``inferprof collect``, compute spans sent to it over OTLP/HTTP, and the
``inferprof gpu`` sidecar replaying a recording into it; the collector's JSON API shows the
samples received, joined to the compute spans of the right GPU, and the verdict they give.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest

from inferprof import semconv as sc
from inferprof.gpu import GpuSample, write_samples
from inferprof.instrumentation import config as instr_config
from tests.collector.synth import TraceBuilder
from tests.gpu.conftest import start_gpu_sidecar
from tests.integration.test_collector_cli import _start, _stop

pytestmark = pytest.mark.integration

GPU_A = "GPU-15704b32-f531-14ce-0530-1ac21e4b68e6"  # idles between launches: runtime
GPU_B = "GPU-edc718f8-e593-6468-b9f9-563d508366ed"  # saturated, SMs busy: hardware
REQUESTS = 150  # the verdict needs 100 traced requests


def _recording(path) -> None:
    """SYNTHETIC recording: 60 s of both GPUs, a reading every 50 ms, no host.name (the
    sidecar's own applies)."""
    samples = []
    for i in range(1200):
        t = i * 50_000_000
        samples.append(GpuSample(t, GPU_A, ((sc.METRIC_GPU_UTILIZATION, 0.25),
                                            (sc.METRIC_GPU_POWER_DRAW, 180.0))))
        samples.append(GpuSample(t, GPU_B, ((sc.METRIC_GPU_UTILIZATION, 0.95),
                                            (sc.METRIC_DCGM_SM_ACTIVE, 0.9),
                                            (sc.METRIC_DCGM_SM_OCCUPANCY, 0.6))))
    with open(path, "w") as fh:
        fh.write("# SYNTHETIC recording for tests/gpu/test_end_to_end.py\n")
        write_samples(samples, fh)


def _spans(service: str, gpu: str, host: str, base: float):
    """REQUESTS compute-bound requests (1 ms queue, 9 ms compute on ``gpu``), 12 ms apart,
    from ``base`` (unix seconds)."""
    b = TraceBuilder(service, host=host, base_unix=base)
    for i in range(REQUESTS):
        t = i * 0.012
        req = b.request(t, t + 0.010)
        b.stage(req, sc.STAGE_QUEUE, t, t + 0.001)
        b.stage(req, sc.STAGE_COMPUTE, t + 0.001, t + 0.010, gpu_id=gpu, batch_id=f"{service}-{i}",
                batch_size=1)
    return b.export()


def test_replayed_gpu_samples_reach_the_collector_and_decide_the_verdict(tmp_path):
    recording = tmp_path / "gpus.jsonl"
    _recording(recording)
    # the host.name the instrumented service puts on its spans (configure()'s rule); the
    # sidecar, started without --host-name on this machine, must use the same
    host = instr_config.resource(None, None).attributes[sc.RESOURCE_HOST_NAME]
    collector, urls = _start(["--grpc-port", "0", "--http-port", "0", "--api-port", "0",
                              "--settle-s", "0.1"])
    sidecar = None
    try:
        assert set(urls) == {"OTLP/gRPC", "OTLP/HTTP", "API"}
        sidecar = start_gpu_sidecar(
            "--source", "replay", "--replay", str(recording), "--interval",
            "0.05", "--export-interval", "0.2", "--endpoint", urls["OTLP/gRPC"])
        banner = {}
        while len(banner) < 2:
            line = sidecar.stdout.readline()
            assert line, banner
            if line.startswith(("source ", "OTLP ")):
                banner[line.split()[0]] = line
        # playback started before the banner: samples are due from now on
        started = time.time()
        assert banner["source"].startswith("source     replay"), banner
        assert f"host.name={host}" in banner["OTLP"], banner
        # compute spans inside the replayed time, sent once the samples have been played
        base = started + 0.1
        time.sleep(max(0.0, base + REQUESTS * 0.012 + 0.5 - time.time()))
        for service, gpu in (("svc-a", GPU_A), ("svc-b", GPU_B)):
            r = httpx.post(f"{urls['OTLP/HTTP']}/v1/traces",
                           content=_spans(service, gpu, host, base).SerializeToString(),
                           headers={"content-type": "application/x-protobuf"}, timeout=10)
            assert r.status_code == 200, r.text

        def breakdown(service: str) -> dict:
            deadline = time.monotonic() + 20
            while True:
                r = httpx.get(f"{urls['API']}/api/v1/breakdown", params={"service": service})
                doc = r.json() if r.status_code == 200 else {}
                if doc.get("requests") == REQUESTS:  # the samples arrived before the spans
                    return doc
                assert time.monotonic() < deadline, doc
                time.sleep(0.2)

        a, b = breakdown("svc-a"), breakdown("svc-b")
    finally:
        if sidecar is not None:
            sidecar.terminate()
            out, _ = sidecar.communicate(timeout=20)
        code, log = _stop(collector)
    assert sidecar.returncode == 0, out
    assert code == 0, log

    # received, and joined to the compute spans of each service's own GPU
    assert a["gpu"]["samples_received"] > 0 and b["gpu"]["samples_received"] > 0
    # the compute spans cover 1.8 s, readings are 50 ms apart: ~36 of them join, per GPU
    assert a["gpu"]["samples"] >= 30 and b["gpu"]["samples"] >= 30
    assert a["gpu"]["utilization_during_compute"] == {"p50": 0.25, "mean": pytest.approx(0.25)}
    assert b["gpu"]["utilization_during_compute"] == {"p50": 0.95, "mean": pytest.approx(0.95)}
    assert b["gpu"]["sm_active_during_compute"]["p50"] == 0.9
    assert b["gpu"]["sm_occupancy_during_compute"]["p50"] == 0.6
    assert "sm_active_during_compute" not in a["gpu"]
    # and the verdicts rest on them
    assert a["verdict"]["bottleneck"] == sc.VERDICT_RUNTIME
    assert b["verdict"]["bottleneck"] == sc.VERDICT_HARDWARE
    assert any(re.search(r"25%", e) for e in a["verdict"]["evidence"]), a["verdict"]
    # the sidecar exported everything it read and said so when it stopped
    assert re.search(r"dropped 0 \(buffer full\) \+ 0 \(export failed\), buffered 0$",
                     out.strip()), out
