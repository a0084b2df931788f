"""``inferprof gpu`` as a process: one-line errors, a dcgm-exporter that is down, recording
and replaying."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pynvml
import pytest

from inferprof import semconv as sc

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-c", "from inferprof.cli import main; main()"]


def _run(*args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "gpu", *args], capture_output=True, text=True, timeout=timeout,
                          check=False, env={**os.environ, **(env or {})})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nvml_works() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.mark.skipif(_nvml_works(), reason="this machine has a working NVIDIA driver")
def test_no_gpu_exits_non_zero_with_one_line():
    proc = _run("--duration", "1")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "Error: cannot sample GPUs: no GPU to sample: the NVML library (libnvidia-ml.so) was "
        "not found: no NVIDIA driver on this machine, or it is not mounted into this container")


def test_an_unreachable_dcgm_exporter_is_retried_and_the_process_keeps_running(otlp_sink):
    proc = _run("--source", "dcgm-exporter", "--dcgm-url",
                f"http://127.0.0.1:{_free_port()}/metrics", "--interval", "0.1",
                "--endpoint", otlp_sink.endpoint, "--duration", "1.5")
    assert proc.returncode == 0, proc.stderr
    polls, failed = map(int, re.search(r"polls (\d+) \((\d+) failed\)", proc.stdout).groups())
    assert polls >= 5 and failed == polls  # it kept polling the whole time
    warnings = [line for line in proc.stderr.splitlines() if "poll failed" in line]
    assert len(warnings) == 1 and "Connection refused" in warnings[0]


def test_bad_usage_is_a_usage_error():
    proc = _run("--source", "replay")
    assert proc.returncode == 2 and "needs --replay FILE" in proc.stderr
    proc = _run("--source", "dcgm-exporter", "--dcgm-field", "DCGM_FI_X=hw.gpu.nope")
    assert proc.returncode == 2 and "SERIES=METRIC" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_record_then_replay_once(tmp_path, otlp_sink):
    path = tmp_path / "rec.jsonl"
    proc = _run("--source", "synthetic", "--gpu", "GPU-a", "--gpu", "GPU-b", "--utilization",
                "0.3", "--interval", "0.1", "--endpoint", otlp_sink.endpoint,
                "--record", str(path), "--duration", "0.5")
    assert proc.returncode == 0, proc.stderr
    assert "NOT live GPU data" in proc.stderr  # synthetic says what it is
    lines = path.read_text().splitlines()
    assert len(lines) >= 4 and {json.loads(x)["hw.id"] for x in lines} == {"GPU-a", "GPU-b"}
    once = _run("--source", "replay", "--replay", str(path), "--once")
    assert once.returncode == 0, once.stderr
    first = [json.loads(x) for x in once.stdout.splitlines()]
    assert {d["hw.id"] for d in first} == {"GPU-a", "GPU-b"}
    assert all(d["values"][sc.METRIC_GPU_UTILIZATION] == 0.3 for d in first)
