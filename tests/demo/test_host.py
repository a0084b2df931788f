"""What the demo reports of its own process: page faults and CPU per thread."""

import threading
import time

from inferprof.demo import host


def test_minor_faults_count_pages_touched_for_the_first_time():
    import mmap

    before = host.minor_faults()
    region = mmap.mmap(-1, 64 * 4096)
    for page in range(64):
        region[page * 4096] = 1  # each first write maps a fresh page
    region.close()
    assert host.minor_faults() - before >= 64


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
