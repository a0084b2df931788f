"""The demo process's host side: kept heap memory, page faults, CPU per thread."""

import threading
import time

import numpy as np
import pytest

from inferprof.demo import host


def test_freed_activations_are_reused_without_page_faults():
    if not host.retain_freed_memory():
        pytest.skip("this C library has no mallopt (not glibc)")
    size = 8 * 1024 * 1024 // 4  # 8 MiB of float32: above glibc's default mmap threshold
    np.ones(size, dtype=np.float32).sum()  # the heap grows to hold it once
    before = host.minor_faults()
    for _ in range(20):
        np.ones(size, dtype=np.float32).sum()  # every page written, then freed
    faults = host.minor_faults() - before
    # Handed back to the kernel each time, the pages fault in again on every allocation
    # (measured: ~470 faults here with glibc's defaults, huge pages making it fewer than
    # 20 x 2048); kept, none do.
    assert faults < 20


def test_retain_freed_memory_rejects_nonsense():
    with pytest.raises(ValueError):
        host.retain_freed_memory(trim_threshold=0)


def test_thread_cpu_is_reported_by_thread_name():
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    worker = threading.Thread(target=spin, name="spinner-3")
    worker.start()
    time.sleep(0.3)
    stats = host.thread_cpu_seconds()
    stop.set()
    worker.join()
    assert stats.get("spinner", 0.0) >= 0.05  # digits dropped from the name
    assert "MainThread" in stats
