"""GPU samples as OTLP metrics: one data point per sample, each with its own time."""

from __future__ import annotations

import itertools

from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.sdk.resources import Resource

from inferprof import semconv as sc
from inferprof.gpu import GpuSample, GpuSampler, ReplaySource, write_samples
from inferprof.gpu.otlp import to_metrics_data

U = sc.METRIC_GPU_UTILIZATION
P = sc.METRIC_GPU_POWER_DRAW


def _points(request):
    """(host.name, source, metric, unit, hw.id, time, value) of every data point."""
    out = []
    for rm in request.resource_metrics:
        res = {kv.key: kv.value.string_value for kv in rm.resource.attributes}
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                assert m.WhichOneof("data") == "gauge"
                for dp in m.gauge.data_points:
                    attrs = {kv.key: kv.value.string_value for kv in dp.attributes}
                    out.append((res[sc.RESOURCE_HOST_NAME], res.get(sc.RESOURCE_GPU_SOURCE),
                                m.name, m.unit, attrs[sc.ATTR_HW_ID], dp.time_unix_nano,
                                dp.as_double))
    return out


def test_every_sample_is_its_own_data_point_with_its_own_time():
    samples = [GpuSample(1_000 + i, "GPU-a", ((U, i / 10), (P, 100.0 + i))) for i in range(5)]
    samples.append(GpuSample(2_000, "GPU-b", ((U, 0.9),), host="other-node"))
    request = encode_metrics(to_metrics_data(samples, Resource({sc.RESOURCE_HOST_NAME: "me"})))
    points = _points(request)
    assert len(points) == 11
    util_a = [(t, v) for host, _, name, _, hw, t, v in points if name == U and hw == "GPU-a"]
    assert util_a == [(1_000 + i, i / 10) for i in range(5)]  # five points, five times
    assert {(host, hw) for host, _, _, _, hw, _, _ in points} == {
        ("me", "GPU-a"), ("other-node", "GPU-b")}  # a sample's own host wins
    assert {(name, unit) for _, _, name, unit, *_ in points} == {(U, "1"), (P, "W")}


def test_the_sampler_ships_each_reading_with_its_time_to_a_real_receiver(otlp_sink, tmp_path):
    # SYNTHETIC recording: 10 readings of two GPUs, 50 ms apart
    recording = [GpuSample(i * 50_000_000, f"GPU-{i % 2}", ((U, i / 20),)) for i in range(10)]
    path = tmp_path / "rec.jsonl"
    with open(path, "w") as fh:
        write_samples(recording, fh)
    sampler = GpuSampler(ReplaySource(path, loop=False), interval=0.02, export_interval=0.1,
                         endpoint=otlp_sink.endpoint, protocol="grpc", host_name="node-1")
    sampler.start()
    try:
        assert otlp_sink.wait_for(
            lambda s: sum(len(_points(r)) for r in s.metric_requests) >= 10, timeout=10)
    finally:
        sampler.stop()
    points = [p for r in otlp_sink.metric_requests for p in _points(r)]
    assert {p[:4] for p in points} == {("node-1", sc.GPU_SOURCE_REPLAY, U, "1")}
    times = [t for *_, t, _ in points]
    assert len(points) == 10 and len(set(times)) == 10
    # the recording's spacing survives the trip: 50 ms between consecutive readings
    ordered = sorted(zip(times, (hw for *_, hw, _, _ in points), (v for *_, v in points)))
    assert [b[0] - a[0] for a, b in itertools.pairwise(ordered)] == [50_000_000] * 9
    assert [(hw, v) for _, hw, v in ordered] == [(f"GPU-{i % 2}", i / 20) for i in range(10)]
    stats = sampler.stats()
    assert (stats.samples, stats.exported_samples, stats.exported_points) == (10, 10, 10)
