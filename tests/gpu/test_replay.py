"""Recorded and synthetic samples: the recording format, playback timing, looping."""

from __future__ import annotations

import itertools
import time

import pytest

from inferprof import semconv as sc
from inferprof.gpu import GpuSample, ReplaySource, SyntheticSource, read_samples, write_samples

U = sc.METRIC_GPU_UTILIZATION


def _recording(tmp_path, samples, header="# SYNTHETIC recording for tests\n"):
    path = tmp_path / "gpu.jsonl"
    with open(path, "w") as fh:
        fh.write(header)
        write_samples(samples, fh)
    return path


def test_write_then_read_gives_the_same_readings(tmp_path):
    samples = [GpuSample(1_700_000_000_000_000_000 + i * 50_000_000, f"GPU-{i % 2}",
                         ((U, i / 10), (sc.METRIC_GPU_POWER_DRAW, 100.0 + i)),
                         "node-1" if i % 2 else None) for i in range(6)]
    records = read_samples(_recording(tmp_path, samples))
    assert [(hw, host, values) for _, hw, host, values in records] == [
        (s.hw_id, s.host, s.values) for s in samples]
    # seconds as a float: microseconds survive
    assert [t * 1e9 for t, *_ in records] == [
        pytest.approx(s.time_unix_nano, abs=1_000) for s in samples]


def test_playback_keeps_the_recorded_spacing_from_the_start(tmp_path):
    # 3 readings 0.2 s apart, recorded long ago
    path = _recording(tmp_path, [GpuSample(1_000_000_000 + i * 200_000_000, "GPU-a",
                                           ((U, 0.1 * (i + 1)),)) for i in range(3)])
    src = ReplaySource(path, loop=False)
    before = time.time_ns()
    src.open()
    played = src.read()
    t0 = played[0].time_unix_nano
    assert before <= t0 <= time.time_ns()  # stamped from now, not from when it was recorded
    assert all(s.time_unix_nano <= time.time_ns() for s in played)  # nothing before its time
    time.sleep(0.45)
    played += src.read()
    assert [s.time_unix_nano - t0 for s in played] == [0, 200_000_000, 400_000_000]
    assert [s.as_dict()[U] for s in played] == [pytest.approx(v) for v in (0.1, 0.2, 0.3)]
    time.sleep(0.25)
    assert src.read() == []  # no loop: the recording is over


def test_playback_loops_one_median_gap_after_the_end(tmp_path):
    path = _recording(tmp_path, [GpuSample(i * 100_000_000, "GPU-a", ((U, 0.5),))
                                 for i in range(2)])
    src = ReplaySource(path)  # loops by default
    src.open()
    time.sleep(0.45)  # past two passes of 0.2 s
    times = [s.time_unix_nano for s in src.read()]
    assert len(times) >= 5 and times[-1] <= time.time_ns()
    assert {b - a for a, b in itertools.pairwise(times)} == {100_000_000}


@pytest.mark.parametrize(("line", "why"), [
    ("not json", "not JSON"),
    ('{"t": 1, "values": {"hw.gpu.utilization": 0.1}}', "'hw.id'"),
    ('{"t": "x", "hw.id": "GPU-a", "values": {"hw.gpu.utilization": 0.1}}', "'t'"),
    ('{"t": 1, "hw.id": "GPU-a", "values": {"gpu.util": 0.1}}', "not a GPU metric"),
    ('{"t": 1, "hw.id": "GPU-a", "values": {"hw.gpu.utilization": "high"}}', "must be a number"),
    ('{"t": 1, "hw.id": "GPU-a", "values": {}}', "'values'"),
])
def test_a_malformed_recording_names_the_line(tmp_path, line, why):
    path = tmp_path / "bad.jsonl"
    path.write_text('# header\n{"t": 0, "hw.id": "GPU-a", "values": {"hw.gpu.utilization": 0}}\n'
                    + line + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:3: .*{why}"):
        ReplaySource(path).open()
    path.write_text("# only comments\n\n")
    with pytest.raises(ValueError, match="no GPU readings"):
        read_samples(path)


def test_synthetic_readings_are_constant_and_carry_dcgm_ratios_when_asked():
    src = SyntheticSource(["GPU-x", "GPU-y"], utilization=0.3, sm_active=0.8, sm_occupancy=0.4)
    src.open()
    a, b = src.read()
    assert (a.hw_id, b.hw_id) == ("GPU-x", "GPU-y")
    v = a.as_dict()
    assert (v[U], v[sc.METRIC_DCGM_SM_ACTIVE], v[sc.METRIC_DCGM_SM_OCCUPANCY]) == (0.3, 0.8, 0.4)
    assert sc.METRIC_DCGM_SM_ACTIVE not in SyntheticSource().read()[0].as_dict()
    with pytest.raises(ValueError, match="utilization"):
        SyntheticSource(utilization=30)
    with pytest.raises(ValueError, match="gpu_ids"):
        SyntheticSource("GPU-x")
