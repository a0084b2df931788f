"""A batch's stages in its members' summaries (contract §15): each member's summary holds
the batch stage spans its trace would hold when it ends (``children``: those ended by
then; ``links``: all, one still open ending at ``OPEN_END``), whether the batch is still
open, closed with a stage still running, or closed with every stage ended (then built
once and shared by the members), and a stage entered after the batch closed counts for
the members that end after it."""

from __future__ import annotations

import contextvars

import pytest

import inferprof
from inferprof import semconv
from inferprof.instrumentation.active import active_runtime
from inferprof.instrumentation.device import EventDevice
from inferprof.instrumentation.summaries import OPEN_END
from tests.instrumentation.helpers import captured
from tests.instrumentation.test_device import SyntheticEvent, SyntheticStream
from tests.instrumentation.test_summaries import MemoryExporter, clock  # noqa: F401

US = 1_000


class Member:
    """A request in a context of its own (as a task or a thread would run it), enqueued
    for a batch."""

    def __init__(self, model: str | None) -> None:
        self.ctx = contextvars.Context()
        self.scope = inferprof.request(model=model) if model else inferprof.request()
        self.handle = self.ctx.run(self._open)

    def _open(self):
        self.scope.__enter__()
        return inferprof.enqueue()

    def end(self) -> None:
        self.ctx.run(self.scope.__exit__, None, None, None)


def _spans(*stages) -> tuple:
    return tuple(x for st in stages for x in (st.name, st.start, st.end))


@pytest.mark.parametrize("model_on", ["request", "batch"])
@pytest.mark.parametrize("encoding", ["children", "links"])
def test_each_member_summarises_the_batch_stages_its_trace_holds(clock, encoding,  # noqa: F811
                                                                  model_on):
    with captured(mode="production", max_timed_rate=0, sample_rate=1.0,
                  batch_encoding=encoding, summary_exporter=MemoryExporter(),
                  summary_interval_s=3600):
        rt = active_runtime()
        members = [Member("m" if model_on == "request" else None) for _ in range(4)]
        clock.tick(50 * US)
        batch_ctx = None
        with inferprof.batch([m.handle for m in members],
                             model="m" if model_on == "batch" else None) as b:
            record = b.record
            with b.stage("batch_assembly"):
                clock.tick(100 * US)
            compute = b.stage("compute")
            compute.__enter__()
            clock.tick(200 * US)
            members[0].end()  # the batch open, its compute stage running
            clock.tick(10 * US)
            compute.__exit__(None, None, None)
            batch_ctx = contextvars.copy_context()  # a task started inside the batch
            d2h = b.stage("d2h")
            other = contextvars.Context()  # (from another thread or task)
            other.run(d2h.__enter__)
            clock.tick(30 * US)
        assert record.closed
        members[1].end()  # closed, d2h still running
        assert record.summary_spans is None  # not final: not kept
        clock.tick(5 * US)
        other.run(d2h.__exit__, None, None, None)
        members[2].end()  # closed, every stage ended: built once, kept on the batch
        kept = record.summary_spans
        clock.tick(5 * US)
        # A task that inherited the batch's scope enters a stage after the batch closed:
        # the member ending after it has it in its summary, as in its trace.
        extra = inferprof.stage("postprocess")
        batch_ctx.run(extra.__enter__)
        clock.tick(7 * US)
        batch_ctx.run(extra.__exit__, None, None, None)
        members[3].end()
        entries = list(rt.summaries._pending)
        inferprof.shutdown()
    assert len(entries) == 4
    assert all(e[3] == "m" for e in entries)  # the model, from the request or the batch
    stages = record.stages
    assert [st.name for st in stages] == ["batch_assembly", "compute", "d2h", "postprocess"]
    assembly, comp, d2h_rec, late = stages
    own = [(semconv.STAGE_QUEUE, m.handle.start, m.handle.end) for m in members]
    got = [e[5] for e in entries]
    if encoding == "children":  # the stages ended by the member's end
        first = _spans(assembly)
        second = _spans(assembly, comp)
    else:  # all, one still running ending at OPEN_END (the collector clips it)
        first = (*_spans(assembly), "compute", comp.start, OPEN_END)
        second = (*_spans(assembly, comp), "d2h", d2h_rec.start, OPEN_END)
    assert got[0] == own[0] + first
    assert got[1] == own[1] + second
    assert got[2] == own[2] + _spans(assembly, comp, d2h_rec)
    assert got[3] == own[3] + _spans(assembly, comp, d2h_rec, late)
    if model_on == "request":  # (else the stages are read for the model anyway: no copy)
        assert kept == _spans(assembly, comp, d2h_rec)
        assert record.summary_spans == _spans(assembly, comp, d2h_rec, late)


def test_a_member_ending_before_its_batch_closes_leaves_no_device_times_unresolved():
    # A device stage's times are rewritten from its events when the batch closes: a
    # member that ended before has the host times (as its trace would), the members
    # ending after it the device's, not a copy of the first one's.
    stream = SyntheticStream()
    dev = EventDevice(lambda: SyntheticEvent(stream))
    with captured(mode="production", max_timed_rate=0, sample_rate=1.0,
                  summary_exporter=MemoryExporter(), summary_interval_s=3600):
        rt = active_runtime()
        members = [Member("m") for _ in range(3)]
        with inferprof.batch([m.handle for m in members]) as b:
            record = b.record
            with b.stage("compute", device=dev):
                stream.launch(30)  # returns at once, as a kernel launch does
            (compute,) = record.stages
            host = (compute.start, compute.end)
            members[0].end()
        members[1].end()
        members[2].end()
        entries = list(rt.summaries._pending)
        inferprof.shutdown()
    device = (compute.start, compute.end)
    assert device[1] - device[0] > 20 * 1_000_000 > host[1] - host[0]
    batch_part = [e[5][3:] for e in entries]  # (after the member's queue stage)
    assert batch_part[0] == ("compute", *host)
    assert batch_part[1] == batch_part[2] == ("compute", *device)
