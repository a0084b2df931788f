"""The sampler inside a serving process: where its samples go, what a dead or hung endpoint
does to it (nothing the application notices), and its settings."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

import inferprof
from inferprof import semconv as sc
from inferprof.gpu import (
    DisabledSampler,
    GpuSample,
    GpuSampler,
    SyntheticSource,
    start_sampler,
)

GPU_METRICS = {sc.METRIC_GPU_UTILIZATION, sc.METRIC_GPU_POWER_DRAW}


def _gpu_resources(sink) -> list[dict]:
    """Resource attributes of every ResourceMetrics holding GPU metrics."""
    out = []
    for req in sink.metric_requests:
        for rm in req.resource_metrics:
            names = {m.name for sm in rm.scope_metrics for m in sm.metrics}
            if names & GPU_METRICS:
                out.append({kv.key: kv.value.string_value for kv in rm.resource.attributes})
    return out


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("inferprof-gpu")}


def test_start_sampler_next_to_configure_ships_where_configure_sends_metrics(otlp_sink):
    inferprof.configure(service_name="svc", endpoint=otlp_sink.endpoint,
                        resource_attributes={sc.RESOURCE_HOST_NAME: "node-7"})
    sampler = start_sampler("synthetic", interval=0.05, export_interval=0.1)  # no endpoint
    try:
        assert sampler.running
        assert otlp_sink.wait_for(lambda s: _gpu_resources(s), timeout=10)
    finally:
        sampler.stop()
        inferprof.shutdown()  # while the receiver is still up
    res = _gpu_resources(otlp_sink)[0]
    # the service's host.name (the join key) and service.name, and what produced them
    assert res[sc.RESOURCE_HOST_NAME] == "node-7"
    assert res[sc.RESOURCE_SERVICE_NAME] == "svc"
    assert res[sc.RESOURCE_GPU_SOURCE] == sc.GPU_SOURCE_SYNTHETIC
    assert not _threads()


def test_inferprof_shutdown_stops_the_samplers_and_exports_what_they_hold(otlp_sink):
    inferprof.configure(service_name="svc", endpoint=otlp_sink.endpoint)
    # exports every 60 s: only the stop's final export can ship these readings
    sampler = start_sampler("synthetic", interval=0.05, export_interval=60)
    time.sleep(0.5)
    assert sampler.running and sampler.stats().exported_samples == 0
    inferprof.shutdown()
    assert not sampler.running
    assert not _threads()
    stats = sampler.stats()
    assert stats.exported_samples >= 5 and stats.buffered == 0
    assert otlp_sink.wait_for(lambda s: _gpu_resources(s), timeout=5)


def test_a_hung_endpoint_never_blocks_polling_buffer_stays_bounded_stop_is_bounded():
    # Accepts connections (the kernel's backlog) and never answers: each export waits for
    # the exporter's own timeout (10 s).
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)
    port = hung.getsockname()[1]
    try:
        sampler = GpuSampler(SyntheticSource(), interval=0.01, export_interval=0.05,
                             max_queue_size=20, endpoint=f"http://127.0.0.1:{port}",
                             protocol="http/protobuf")
        sampler.start()
        time.sleep(1.0)
        stats = sampler.stats()
        assert stats.polls >= 30  # polling went on while the export hung
        assert stats.buffered <= 20 and stats.dropped_buffer_full > 0
        assert stats.exported_samples == 0
        started = time.monotonic()
        sampler.stop(timeout=1.0)
        # the bound: the timeout, half a second to abort the export, and scheduling slack
        assert time.monotonic() - started < 2.5
        assert not sampler.running
        assert sampler.stats().buffered == 0
    finally:
        hung.close()


def test_failed_exports_are_counted_and_their_readings_dropped(monkeypatch, caplog):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "0.5")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sampler = GpuSampler(SyntheticSource(), interval=0.05, export_interval=60,
                         endpoint=f"http://127.0.0.1:{port}", protocol="http/protobuf")
    sampler.start()
    try:
        time.sleep(0.3)
        with caplog.at_level(logging.WARNING, logger="inferprof.gpu"):
            assert sampler.flush(timeout=5) is False
        stats = sampler.stats()
        assert stats.export_failures >= 1 and stats.dropped_export_failed >= 1
        assert stats.exported_samples == 0
        assert any("export of" in r.getMessage() for r in caplog.records)
    finally:
        sampler.stop(timeout=2)


class _Flaky:
    """A source whose reads fail on demand (a stand-in for a driver or exporter error)."""

    name = sc.GPU_SOURCE_SYNTHETIC
    default_interval = 0.01

    def __init__(self) -> None:
        self.fail = True
        self.closed = False

    def open(self) -> None:
        pass

    def read(self) -> list[GpuSample]:
        if self.fail:
            raise OSError("driver said no")
        return [GpuSample(time.time_ns(), "GPU-a", ((sc.METRIC_GPU_UTILIZATION, 0.5),))]

    def close(self) -> None:
        self.closed = True


def test_failed_polls_are_counted_logged_once_and_recovery_is_said(otlp_sink, caplog):
    src = _Flaky()
    sampler = GpuSampler(src, export_interval=0.1, endpoint=otlp_sink.endpoint)
    with caplog.at_level(logging.INFO, logger="inferprof.gpu"):
        sampler.start()
        time.sleep(0.3)
        assert sampler.stats().poll_errors >= 10 and sampler.running
        src.fail = False
        time.sleep(0.2)
        sampler.stop()
    said = [r.getMessage() for r in caplog.records if "driver said no" in r.getMessage()]
    assert len(said) == 1
    assert any("recovered after" in r.getMessage() for r in caplog.records)
    assert sampler.stats().exported_samples > 0
    assert src.closed and not _threads()


def test_bad_arguments_raise_and_bad_environment_is_logged_and_defaulted(monkeypatch, caplog):
    for bad in (0, -1.0, float("nan"), "1", True):
        with pytest.raises(ValueError, match="interval"):
            GpuSampler(SyntheticSource(), interval=bad)
    with pytest.raises(ValueError, match="source must be one of"):
        start_sampler("cuda")
    with pytest.raises(ValueError, match="replay"):
        start_sampler("replay")  # names no recording
    # another source's option is a mistake, as in the CLI (it was ignored in silence)
    with pytest.raises(ValueError, match="dcgm_url applies to the 'dcgm-exporter' source only"):
        start_sampler("synthetic", dcgm_url="http://127.0.0.1:9400/metrics")
    with pytest.raises(ValueError, match="replay applies to the 'replay' source only"):
        start_sampler(SyntheticSource(), replay="gpu.jsonl")
    with pytest.raises(ValueError, match="endpoint"):
        GpuSampler(SyntheticSource(), endpoint="collector:4317")
    monkeypatch.setenv("INFERPROF_GPU_INTERVAL", "fast")
    monkeypatch.setenv("INFERPROF_GPU_EXPORT_INTERVAL", "-3")
    with caplog.at_level(logging.WARNING):
        settings = GpuSampler(SyntheticSource()).settings
    assert settings.interval == SyntheticSource.default_interval
    assert settings.export_interval == 1.0
    assert sum("ignoring INFERPROF_GPU_" in r.getMessage() for r in caplog.records) == 2


def test_environment_names_the_source_and_the_host(monkeypatch, tmp_path, otlp_sink):
    monkeypatch.setenv("INFERPROF_GPU_SOURCE", "synthetic")
    monkeypatch.setenv("INFERPROF_GPU_HOST_NAME", "gpu-node-3")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp_sink.endpoint)
    sampler = start_sampler(interval=0.05, export_interval=0.1)
    try:
        assert sampler.settings.source == sc.GPU_SOURCE_SYNTHETIC
        assert sampler.settings.endpoint == otlp_sink.endpoint
        assert otlp_sink.wait_for(lambda s: _gpu_resources(s), timeout=10)
    finally:
        sampler.stop()
    assert _gpu_resources(otlp_sink)[0][sc.RESOURCE_HOST_NAME] == "gpu-node-3"


def test_inferprof_off_means_no_sampling(monkeypatch):
    monkeypatch.setenv("INFERPROF_MODE", "off")
    sampler = start_sampler("synthetic")
    assert isinstance(sampler, DisabledSampler) and not _threads()


def test_disabled_sampler_says_why_in_its_repr_and_does_nothing(monkeypatch):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    sampler = start_sampler("synthetic")
    assert isinstance(sampler, DisabledSampler)
    assert repr(sampler) == f"DisabledSampler(reason={sampler.reason!r})"
    assert sampler.reason.startswith("GPU sampling is off")
    assert sampler.flush() is True and sampler.stats().polls == 0
    assert not sampler.running and not sampler.exhausted
    sampler.stop()


def test_without_an_endpoint_the_settings_name_the_exporters_real_default(monkeypatch):
    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
                "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"):
        monkeypatch.delenv(var, raising=False)
    grpc = GpuSampler(SyntheticSource()).settings
    assert (grpc.protocol, grpc.endpoint) == ("grpc", "http://localhost:4317")
    http = GpuSampler(SyntheticSource(), protocol="http/protobuf").settings
    assert (http.protocol, http.endpoint) == ("http/protobuf", "http://localhost:4318/v1/metrics")
    # what the SDK's exporters really use when given no endpoint
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    assert OTLPMetricExporter()._endpoint == http.endpoint


def test_read_once_applies_the_host_name_the_exports_would_carry(tmp_path):
    from inferprof.gpu import ReplaySource, write_samples

    path = tmp_path / "rec.jsonl"
    with open(path, "w") as fh:
        write_samples([GpuSample(0, "GPU-a", ((sc.METRIC_GPU_UTILIZATION, 0.5),), "rec-host"),
                       GpuSample(0, "GPU-b", ((sc.METRIC_GPU_UTILIZATION, 0.5),))], fh)
    plain = GpuSampler(ReplaySource(path), host_name=None)
    assert [s.host for s in plain.read_once()] == ["rec-host", plain.settings.host_name]
    forced = GpuSampler(ReplaySource(path), host_name="svc-host")
    assert [s.host for s in forced.read_once()] == ["svc-host", "svc-host"]
    assert not _threads()


def test_a_recording_without_loop_ends_polling_and_everything_is_exported(tmp_path):
    from opentelemetry.sdk.metrics.export import MetricExportResult

    from inferprof.gpu import ReplaySource, write_samples

    class MemoryExporter:
        def __init__(self) -> None:
            self.exported = []

        def export(self, data, timeout_millis=None):
            self.exported.append(data)
            return MetricExportResult.SUCCESS

        def shutdown(self, timeout_millis=None):
            pass

    path = tmp_path / "rec.jsonl"
    with open(path, "w") as fh:
        write_samples([GpuSample(i * 50_000_000, "GPU-a", ((sc.METRIC_GPU_UTILIZATION, 0.5),))
                       for i in range(4)], fh)
    exporter = MemoryExporter()
    sampler = GpuSampler(ReplaySource(path, loop=False), interval=0.02, export_interval=10,
                         exporter=exporter).start()
    try:
        deadline = time.monotonic() + 10
        while not sampler.exhausted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sampler.exhausted
        polls = sampler.stats().polls
        time.sleep(0.1)
        assert sampler.stats().polls == polls  # no more polling
    finally:
        sampler.stop()
    stats = sampler.stats()
    assert (stats.samples, stats.exported_samples, stats.dropped_export_failed) == (4, 4, 0)


def test_the_documented_gpu_id_snippet_puts_the_uuid_on_the_compute_span(cap):
    from inferprof.semconv import ATTR_GPU_ID

    gpu_uuid = "GPU-604ac76c-1111-2222-3333-444455556666"
    with inferprof.request(), inferprof.stage("compute", **{ATTR_GPU_ID: gpu_uuid}):
        pass
    (compute,) = cap.stages("compute")
    assert compute.attributes[ATTR_GPU_ID] == gpu_uuid
