"""``inferprof gpu`` as a process: one-line errors, a dcgm-exporter that is down, recording
and replaying."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from inferprof import semconv as sc
from tests.gpu.fake_pynvml import real_nvml_works

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-c", "from inferprof.cli import main; main()"]


def _run(*args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "gpu", *args], capture_output=True, text=True, timeout=timeout,
                          check=False, env={**os.environ, **(env or {})})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(real_nvml_works(), reason="this machine has a working NVIDIA driver")
def test_no_gpu_exits_non_zero_with_one_line():
    proc = _run("--duration", "1")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(
        "Error: cannot sample GPUs: no GPU to sample: the NVML library (libnvidia-ml.so) was "
        "not found: no NVIDIA driver on this machine, or it is not mounted into this container."
        " Without a GPU here: --source dcgm-exporter")
    # ... and names the other sources, each of which works without a GPU
    assert "--source replay" in line and "--source synthetic" in line


def test_an_unreachable_dcgm_exporter_is_retried_and_the_process_keeps_running(otlp_sink):
    url = f"http://127.0.0.1:{_free_port()}/metrics"
    proc = _run("--source", "dcgm-exporter", "--dcgm-url", url, "--interval", "0.1",
                "--endpoint", otlp_sink.endpoint, "--duration", "1.5")
    assert proc.returncode == 0, proc.stderr
    polls, failed = map(int, re.search(r"polls (\d+) \((\d+) failed\)", proc.stdout).groups())
    assert polls >= 5 and failed == polls  # it kept polling the whole time
    warnings = [line for line in proc.stderr.splitlines() if "poll failed" in line]
    assert len(warnings) == 1 and "Connection refused" in warnings[0]
    # the URL is in the banner, the poll warning and the --once error
    assert f"source     dcgm-exporter {url}, every 0.1 s" in proc.stdout
    assert f"scraping {url} failed" in warnings[0]
    once = _run("--source", "dcgm-exporter", "--dcgm-url", url, "--once")
    assert once.returncode == 1
    assert once.stderr.strip() == (f"Error: reading the dcgm-exporter source failed: scraping "
                                   f"{url} failed: [Errno 111] Connection refused")
    # without --host-name the samples carry the exporter's label, and the banner says so
    assert "host.name=from the exporter's Hostname or hostname label (else " in proc.stdout


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


def test_the_banner_names_the_real_target_and_the_summary_every_counter(otlp_sink):
    proc = _run("--source", "synthetic", "--gpu", "GPU-a", "--endpoint", otlp_sink.endpoint,
                "--host-name", "svc-host", "--duration", "0.5")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "source     synthetic (1 GPU: GPU-a), every 0.1 s"
    assert lines[1] == f"OTLP       {otlp_sink.endpoint} (grpc), every 1 s, host.name=svc-host"
    assert re.fullmatch(
        r"polls \d+ \(0 failed\), readings (\d+), exported \1 \(\d+ data points; 0 exports "
        r"failed\), dropped 0 \(buffer full\) \+ 0 \(export failed\), buffered 0", lines[-1])


def test_without_an_endpoint_the_banner_names_the_exporters_default():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "",
           "OTEL_EXPORTER_OTLP_TIMEOUT": "0.2"}
    for protocol, url in (("grpc", "http://localhost:4317"),
                          ("http/protobuf", "http://localhost:4318/v1/metrics")):
        proc = _run("--source", "synthetic", "--protocol", protocol, "--export-interval", "60",
                    "--duration", "0.1", env=env)
        assert proc.returncode == 0, proc.stderr
        assert f"OTLP       {url} ({protocol}), every 60 s" in proc.stdout


def test_once_applies_the_host_name_and_validates_the_settings():
    proc = _run("--source", "synthetic", "--once", "--host-name", "svc-host")
    assert proc.returncode == 0, proc.stderr
    (doc,) = [json.loads(x) for x in proc.stdout.splitlines()]
    assert doc["host.name"] == "svc-host"
    assert doc["hw.id"] == "GPU-00000000-0000-0000-0000-000000000000"  # synthetic's default
    proc = _run("--source", "synthetic", "--once", env={"INFERPROF_GPU_HOST_NAME": "env-host"})
    assert json.loads(proc.stdout)["host.name"] == "env-host"
    proc = _run("--source", "synthetic", "--once", "--interval", "-1")
    assert proc.returncode == 2 and "--interval must be a positive number of seconds, got -1" in proc.stderr


@pytest.mark.parametrize("duration", ["-1", "0", "nan"])
def test_a_duration_that_is_not_positive_is_a_usage_error(duration):
    proc = _run("--source", "synthetic", "--duration", duration)
    assert proc.returncode == 2 and "--duration must be a positive number" in proc.stderr


@pytest.mark.parametrize(("source", "args", "flag"), [
    ("replay", ["--gpu", "0"], "--gpu"),
    ("dcgm-exporter", ["--gpu", "0"], "--gpu"),
    ("synthetic", ["--dcgm-url", "http://x:9400/metrics"], "--dcgm-url"),
    ("nvml", ["--dcgm-host-label", "pod"], "--dcgm-host-label"),
    ("nvml", ["--dcgm-field", "X=hw.gpu.utilization"], "--dcgm-field"),
    ("nvml", ["--replay", __file__], "--replay"),
    ("synthetic", ["--no-loop"], "--no-loop"),
    ("nvml", ["--utilization", "0.5"], "--utilization"),
    ("dcgm-exporter", ["--sm-active", "0.5"], "--sm-active"),
    ("replay", ["--sm-occupancy", "0.5", "--replay", __file__], "--sm-occupancy"),
])
def test_an_option_of_another_source_is_a_usage_error(source, args, flag):
    proc = _run("--source", source, *args, "--once")
    assert proc.returncode == 2, proc.stderr
    assert f"Error: {flag} does not apply to the {source} source" in proc.stderr


def test_a_recording_played_without_loop_ends_the_sidecar(tmp_path, otlp_sink):
    path = tmp_path / "rec.jsonl"
    path.write_text("# SYNTHETIC\n" + "".join(
        json.dumps({"t": i * 0.1, "hw.id": "GPU-a", "values": {sc.METRIC_GPU_UTILIZATION: 0.5}})
        + "\n" for i in range(3)))
    proc = _run("--source", "replay", "--replay", str(path), "--no-loop",
                "--endpoint", otlp_sink.endpoint, "--duration", "120", timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "the recording has played (--no-loop)" in proc.stdout
    assert re.search(r"readings 3, exported 3 ", proc.stdout), proc.stdout


def test_otel_sdk_disabled_turns_the_sidecar_off():
    proc = _run("--source", "synthetic", env={"OTEL_SDK_DISABLED": "true"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("GPU sampling is disabled by OTEL_SDK_DISABLED=true: "
                                   "nothing sampled or exported.")


def test_help_names_every_source_default_and_variable():
    proc = _run("--help")
    # click wraps lines, also after a hyphen
    text = re.sub(r"- (?=[a-z0-9])", "-", " ".join(proc.stdout.split()))
    assert "Sample GPUs (nvml, dcgm-exporter; replay or synthetic without one)" in text
    for var in ("INFERPROF_GPU_SOURCE", "INFERPROF_GPU_INTERVAL", "INFERPROF_GPU_EXPORT_INTERVAL",
                "INFERPROF_GPU_HOST_NAME", "INFERPROF_GPU_MAX_QUEUE_SIZE",
                "INFERPROF_GPU_DCGM_URL", "INFERPROF_GPU_REPLAY", "OTEL_SERVICE_NAME",
                "OTEL_SDK_DISABLED"):
        assert var in text, var
    assert "else inferprof-gpu-sampler" in text
    assert "GPU-00000000-0000-0000-0000-000000000000" in text
