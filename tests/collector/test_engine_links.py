"""Batch spans' links (encoding ``links``) are bounded: per span by ``max_links_per_span``,
and in all by the pending-span cap, each link counting as one pending span."""

from __future__ import annotations

import pytest

from inferprof import semconv as sc
from inferprof.collector.engine import Engine, Overloaded
from tests.collector.synth import (
    FakeClock,
    Ref,
    TraceBuilder,
    bulk_export,
    new_span_id,
    new_trace_id,
)


def test_links_beyond_the_cap_are_dropped_counted_and_reported():
    clock = FakeClock()
    engine = Engine(clock=clock, max_links_per_span=100)
    b = TraceBuilder()
    members = [Ref(new_trace_id(), new_span_id()) for _ in range(250)]
    b.stage(None, "compute", 0.01, 0.09, links=members, batch_id="b1", batch_size=250)
    result = engine.ingest_traces(b.export())
    assert result.accepted_spans == 1 and result.rejected_spans == 0
    assert "250 links, only the first 100 read" in result.errors[0]
    assert engine.stats.spans_dropped[sc.DROP_TOO_MANY_LINKS] == 150
    assert engine.pending_spans() == 100  # one per member kept
    # The first member has the batch's stage; the last one, beyond the cap, does not.
    for ref in (members[0], members[-1]):
        b.span("POST /infer", 0.0, 0.1, trace_id=ref.trace_id, span_id=ref.span_id,
               kind=2, attrs={sc.ATTR_MODEL_NAME: "m"})
    engine.ingest_traces(b.export())
    clock.tick(5.0)
    doc = engine.breakdown("svc")
    assert doc["requests"] == 2
    assert next(s for s in doc["stages"] if s["stage"] == "compute")["count"] == 1


def test_each_link_counts_against_the_pending_cap():
    clock = FakeClock()
    engine = Engine(clock=clock, max_pending_spans=3000, share_pending_cap=False)
    for _ in range(3):
        engine.ingest_traces(bulk_export(1, links_per_span=1000))
    assert engine.pending_spans() == 3000
    with pytest.raises(Overloaded):
        engine.ingest_traces(bulk_export(1, links_per_span=1000))
    assert engine.pending_spans() == 3000
    # Expired, they free the room they took, every link counted.
    clock.tick(61.0)
    engine.advance()
    assert engine.pending_spans() == 0
    assert engine.stats.spans_dropped[sc.DROP_ORPHAN_STAGE] == 3000
    engine.ingest_traces(bulk_export(1, links_per_span=1000))
    assert engine.pending_spans() == 1000


def test_max_links_per_span_is_validated():
    with pytest.raises(ValueError, match="max_links_per_span"):
        Engine(max_links_per_span=0)


def test_links_to_one_member_trace_are_capped_like_its_spans():
    # Batch spans each linking the same member: the index entries naming one trace are
    # folded with it in one share of work, so they are capped like the trace's own spans.
    clock = FakeClock()
    engine = Engine(clock=clock, max_spans_per_trace=100, share_pending_cap=False)
    member = Ref(new_trace_id(), new_span_id())
    other = Ref(new_trace_id(), new_span_id())
    b = TraceBuilder()
    for i in range(250):
        b.stage(None, "compute", 0.01, 0.09, links=[member], batch_id=f"b{i}", batch_size=1)
    result = engine.ingest_traces(b.export())
    assert (result.accepted_spans, result.rejected_spans) == (100, 150)
    assert "max_spans_per_trace" in result.errors[0]
    # A span linking a full member and another one keeps the other.
    b.stage(None, "compute", 0.01, 0.09, links=[member, other], batch_id="b", batch_size=2)
    result = engine.ingest_traces(b.export())
    assert (result.accepted_spans, result.rejected_spans) == (1, 0)
    assert engine.stats.spans_dropped[sc.DROP_TRACE_TOO_LARGE] == 151
    assert engine.pending_spans() == 101
    for ref in (member, other):
        b.span("POST /infer", 0.0, 0.1, trace_id=ref.trace_id, span_id=ref.span_id,
               kind=2, attrs={sc.ATTR_MODEL_NAME: "m"})
    engine.ingest_traces(b.export())
    clock.tick(5.0)
    doc = engine.breakdown("svc")
    assert doc["requests"] == 2
    assert engine.pending_spans() == 0

    def batches(tag: str) -> object:
        b = TraceBuilder()
        for i in range(100):
            b.stage(None, "compute", 0.01, 0.09, links=[member], batch_id=f"{tag}{i}",
                    batch_size=1)
        return b.export()

    # Folded, the member has room again; expired, its late entries free it too.
    assert engine.ingest_traces(batches("c")).accepted_spans == 100
    clock.tick(61.0)
    engine.advance()
    assert engine.pending_spans() == 0
    assert engine.stats.spans_dropped[sc.DROP_LATE] == 100
    assert engine.ingest_traces(batches("d")).accepted_spans == 100
