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


def test_gc_clock_times_each_collection_by_generation():
    import gc

    from inferprof.demo.host import GcClock

    clock = GcClock().install()
    try:
        junk = []
        for _ in range(20_000):  # something for a full collection to traverse
            a, b = [], []
            a.append(b)
            b.append(a)
            junk.append(a)
        before = list(clock.seconds)
        gc.collect(2)
        gc.collect(0)
    finally:
        clock.uninstall()
    assert clock not in gc.callbacks
    assert clock.seconds[2] > before[2]
    assert clock.seconds[0] > before[0]
    after = list(clock.seconds)
    gc.collect(2)  # no longer counted
    assert clock.seconds == after
    del junk
