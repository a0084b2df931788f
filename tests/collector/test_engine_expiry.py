"""What the engine holds expires at a cost per entry that does not grow with how much it
holds, and no single call on the ingest path works off an unbounded backlog."""

from __future__ import annotations

import math
import statistics
import time

from inferprof import semconv as sc
from inferprof.collector.assembly import DEFAULT_ADVANCE_BUDGET
from inferprof.collector.engine import Engine
from tests.collector.synth import FakeClock, TraceBuilder, bulk_export

TIMEOUT_S = 60.0
LINKS_PER_SPAN = 1000


class _SteadyLinks:
    """An engine holding ``retained`` link index entries (batch spans whose members
    never arrive), spread over the trace timeout; each ``step`` adds ``chunk`` new ones,
    moves the clock so that as many expire, and returns the seconds ``advance`` took."""

    def __init__(self, retained: int, chunk: int) -> None:
        self.clock = FakeClock()
        self.engine = Engine(
            clock=self.clock, trace_timeout_s=TIMEOUT_S, max_pending_spans=4 * retained + 10**6
        )
        self.chunk = chunk
        self.dt = TIMEOUT_S * chunk / retained
        for _ in range(retained // chunk):
            self._add()
            self.clock.tick(self.dt)
            self.engine.advance()

    def _add(self) -> None:
        self.engine.ingest_traces(
            bulk_export(self.chunk // LINKS_PER_SPAN, links_per_span=LINKS_PER_SPAN)
        )

    def step(self) -> float:
        self._add()
        self.clock.tick(self.dt)
        started = time.perf_counter()
        self.engine.advance()
        return time.perf_counter() - started


def test_expiry_cost_per_entry_stays_flat_from_10k_to_1m_retained():
    # Steady state: as many entries expire as arrive. The two engines take turns, so the
    # machine's noise falls on both; medians of 20 steps each. Expiry from the front of
    # a plain dict cost O(entries removed since its last resize) per entry: about 10x
    # more per entry at 1M than at 10k, and growing with every step.
    chunk = 10_000
    small = _SteadyLinks(10_000, chunk)
    large = _SteadyLinks(1_000_000, chunk)
    assert large.engine.pending_spans() == 1_000_000  # a linked span: once per link
    per_entry: dict[str, list[float]] = {"small": [], "large": []}
    for _ in range(20):
        per_entry["small"].append(small.step() / chunk)
        per_entry["large"].append(large.step() / chunk)
    dropped = large.engine.stats.spans_dropped[sc.DROP_ORPHAN_STAGE]
    assert dropped == 20 * chunk  # every expired link was counted
    ratio = statistics.median(per_entry["large"]) / statistics.median(per_entry["small"])
    assert ratio < 3.0, (ratio, per_entry)


def test_one_ingest_works_off_a_bounded_share_of_an_expiry_backlog():
    clock = FakeClock()
    engine = Engine(clock=clock, trace_timeout_s=TIMEOUT_S, max_pending_spans=10**6)
    # 200 batch spans of 1000 links each, all expiring at the same moment.
    for _ in range(10):
        engine.ingest_traces(bulk_export(20, links_per_span=LINKS_PER_SPAN))
    # and 100,000 stage spans of traces whose request span never comes
    engine.ingest_traces(bulk_export(100_000))
    held = 200 * LINKS_PER_SPAN + 100_000
    assert engine.pending_spans() == held
    clock.tick(TIMEOUT_S + 1)
    b = TraceBuilder()
    b.sequential(0.0, [("compute", 0.01)])
    engine.ingest_traces(b.export())  # the ingest path: one share of the backlog only
    dropped = sum(engine.stats.spans_dropped.values())
    assert 0 < dropped <= DEFAULT_ADVANCE_BUDGET + LINKS_PER_SPAN
    assert engine.pending_spans() > held // 2
    engine.advance()  # the advancing thread works off the rest
    stats = engine.stats
    assert stats.pending_spans == 2  # the fresh request, not settled yet
    assert stats.spans_dropped[sc.DROP_INCOMPLETE_TRACE] == 100_000
    assert stats.spans_dropped[sc.DROP_ORPHAN_STAGE] == 200 * LINKS_PER_SPAN


def test_flush_with_a_deadline_drops_and_counts_what_it_could_not_fold():
    clock = FakeClock()
    engine = Engine(clock=clock, max_pending_spans=10**6)
    b = TraceBuilder()
    for i in range(30_000):
        b.sequential(i * 1e-3, [("queue", 0.01), ("compute", 0.02)])
    engine.ingest_traces(b.export())
    engine.ingest_traces(bulk_export(5, links_per_span=LINKS_PER_SPAN))
    held = engine.pending_spans()
    assert held == 90_000 + 5 * LINKS_PER_SPAN
    engine.flush(timeout_s=0.0)  # one share, then the deadline has passed
    stats = engine.stats
    assert stats.pending_spans == 0 and stats.pending_traces == 0
    shutdown = stats.spans_dropped[sc.DROP_SHUTDOWN]
    folded = 3 * engine.breakdown("svc", window_s=None)["requests"]
    assert shutdown > 0 and folded > 0
    assert folded + shutdown == held


def test_flush_without_a_deadline_folds_everything():
    clock = FakeClock()
    engine = Engine(clock=clock, max_pending_spans=10**6)
    b = TraceBuilder()
    for i in range(30_000):
        b.sequential(i * 1e-3, [("queue", 0.01), ("compute", 0.02)])
    engine.ingest_traces(b.export())
    engine.flush()
    assert engine.pending_spans() == 0
    assert engine.breakdown("svc", window_s=None)["requests"] == 30_000
    assert sc.DROP_SHUTDOWN not in engine.stats.spans_dropped


def test_gpu_samples_prune_keeps_exactly_the_samples_in_the_retention():
    # A sampler's series arrives in time order (its old samples are cut from the front);
    # one out of order is rewritten; one wholly old goes with its GPU.
    from inferprof.collector.gpu_samples import GpuSamples

    g = GpuSamples(max_gpus_per_host=3)
    now = 1_000.0
    for t in range(100):
        g.add("h", "GPU-0", "util", float(t), float(t), now, -math.inf)
    for t in (50, 10, 90, 5, 70, 40):
        g.add("h", "GPU-1", "util", float(t), float(t), now, -math.inf)
    for t in range(10):
        g.add("h", "GPU-2", "util", float(t), float(t), now, -math.inf)
    g.prune(40.0)
    assert g.total == g.count() == 60 + 4
    assert g.count(since=60.0) == 40 + 2
    g.prune(40.0)  # nothing more to cut
    assert g.total == 64
    # GPU-2 left: a fourth GPU fits again on the host
    assert g.add("h", "GPU-3", "util", 500.0, 1.0, now, -math.inf) is None
    g.prune(1_000.0)
    assert g.total == g.count() == 0
