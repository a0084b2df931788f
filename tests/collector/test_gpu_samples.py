"""GPU samples leave the retention exactly, at a cost per prune that does not grow with
how many series are retained."""

from __future__ import annotations

import statistics
import time

from inferprof.collector.gpu_samples import MAX_SAMPLES_PER_SERIES, GpuSamples


def _filled(n_series: int, t: float) -> GpuSamples:
    samples = GpuSamples(max_samples=10**7, max_hosts=10**6)
    for i in range(n_series):
        samples.add(f"host{i // 8}", f"gpu{i % 8}", "hw.gpu.utilization", t, 0.5, t, 0.0)
    return samples


def test_prune_removes_what_is_older_in_and_out_of_time_order():
    samples = GpuSamples()
    now = 1000.0
    for t in (10.0, 11.0, 12.0, 13.0):  # in time order
        samples.add("h", "gpu0", "hw.gpu.utilization", t, t, now, 0.0)
    for t in (13.0, 10.0, 12.0, 11.0):  # out of order: the earliest sample is not first
        samples.add("h", "gpu1", "hw.gpu.utilization", t, t, now, 0.0)
    samples.add("h", "gpu2", "hw.gpu.utilization", 5.0, 1.0, now, 0.0)
    assert samples.total == 9
    samples.prune(11.5)
    assert samples.total == 4
    assert samples.count() == 4
    assert samples._data[("h", "gpu0", "hw.gpu.utilization")] == ([12.0, 13.0], [12.0, 13.0])
    assert samples._data[("h", "gpu1", "hw.gpu.utilization")] == ([13.0, 12.0], [13.0, 12.0])
    assert ("h", "gpu2", "hw.gpu.utilization") not in samples._data  # the series went
    samples.add("h", "gpu1", "hw.gpu.utilization", 11.9, 0.0, now, 0.0)  # earlier again
    samples.prune(12.5)
    assert samples._data[("h", "gpu1", "hw.gpu.utilization")] == ([13.0], [13.0])
    samples.prune(14.0)
    assert samples.total == 0 and not samples._data and not samples._hosts


def test_a_full_series_drops_its_oldest_and_prunes_from_there():
    samples = GpuSamples(max_samples=10**7)
    for i in range(MAX_SAMPLES_PER_SERIES + 1):
        samples.add("h", "gpu0", "hw.gpu.utilization", float(i), 0.0, 1e9, 0.0)
    cut = MAX_SAMPLES_PER_SERIES // 10
    assert samples.total == MAX_SAMPLES_PER_SERIES + 1 - cut
    samples.prune(cut + 10.0)
    assert samples.total == MAX_SAMPLES_PER_SERIES + 1 - cut - 10
    assert samples.count() == samples.total


def test_prune_cost_does_not_grow_with_the_series_retained():
    # Nothing due: a prune must not look at every series. A scan of every series, as the
    # engine ran once a second under its lock, costs about 100x more at 100k than at 1k.
    small, large = _filled(1_000, 100.0), _filled(100_000, 100.0)
    took: dict[str, list[float]] = {"small": [], "large": []}
    for _ in range(10):
        for name, samples in (("small", small), ("large", large)):
            started = time.perf_counter()
            for _ in range(20):
                samples.prune(50.0)
            took[name].append(time.perf_counter() - started)
    assert large.total == 100_000
    ratio = statistics.median(took["large"]) / statistics.median(took["small"])
    assert ratio < 10, took
