"""What a queue waits for (``collector/queueing.py``): the batcher or the batches ahead.

Synthetic traces of a simulated dynamic batcher with one worker: requests queue, a batch
forms when full or when its first member has waited ``delay``, and runs once the worker is
free. The same stage shares come from two different bottlenecks; the verdict must tell
them apart.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from inferprof import semconv as sc
from inferprof.collector.engine import Engine
from inferprof.collector.queueing import _covered, behind_batches
from tests.collector.synth import FakeClock, TraceBuilder, gpu_metrics

GPU = "GPU-0"


def _simulate(arrivals, max_size, delay, work):
    """Batches as (start, member indices) of one worker; ``work`` seconds each."""
    batches, i, free, n = [], 0, 0.0, len(arrivals)
    while i < n:
        last = min(i + max_size, n) - 1
        full_at = arrivals[last] if last - i + 1 == max_size else math.inf
        start = max(min(full_at, arrivals[i] + delay), free)
        members = [k for k in range(i, last + 1) if arrivals[k] <= start]
        batches.append((start, members))
        free = start + work
        i += len(members)
    return batches


_SIZE = object()


def _traces(b, arrivals, batches, *, compute, h2d=0.0, keep=lambda k: True, weight=None,
            prefix="b", size=_SIZE, attrs=True, reported=None):
    """``size``: the batch.size to send (default: the batch's); ``prefix=None``: no batch
    id; ``attrs=False``: bare stage spans (no attribute but the stage); ``reported``:
    ``f(k, queued seconds)`` -> the ``inferprof.queue.behind_batches_s`` request ``k``'s
    batcher reports (None: none)."""
    for n, (start, members) in enumerate(batches):
        for k in members:
            if not keep(k):
                continue
            t0 = arrivals[k]
            end = start + h2d + compute + 0.0002
            req = b.request(t0, end, weight=weight)
            said = reported(k, start - t0) if reported is not None else None
            b.stage(req, sc.STAGE_QUEUE, t0, start,
                    **({} if said is None else {sc.ATTR_QUEUE_BEHIND_BATCHES_S: said}))
            batch = {
                "batch_id": None if prefix is None else f"{prefix}{n}",
                "batch_size": len(members) if size is _SIZE else size,
                "gpu_id": GPU,
            } if attrs else {}
            if h2d:
                b.stage(req, sc.STAGE_H2D, start, start + h2d,
                        **{k: v for k, v in batch.items() if k != "gpu_id"})
            b.stage(req, sc.STAGE_COMPUTE, start + h2d, start + h2d + compute, **batch)


def _fold_in_parts(engine, clock, arrivals, batches, parts, *, compute, tick):
    """The batches' traces ingested in ``parts`` goes, ``tick`` seconds apart, each folded
    before the next."""
    size = -(-len(batches) // parts)
    for part in range(parts):
        b = TraceBuilder()
        _traces(b, arrivals, batches[part * size:(part + 1) * size], compute=compute,
                prefix=f"p{part}-")
        engine.ingest_traces(b.export())
        clock.tick(tick)
        engine.flush()


def _breakdown(builders, util=None, span_s=10.0):
    clock = FakeClock()
    engine = Engine(clock=clock)
    for b in builders:
        engine.ingest_traces(b.export())
    if util is not None:
        engine.ingest_metrics(gpu_metrics([(i * 0.05, util) for i in range(int(span_s / 0.05))],
                                          hw_id=GPU))
    clock.tick(5)
    return engine.breakdown("svc", window_s=None)


def _worker_bound(**kw):
    """400 requests/s into a worker that serves 200/s (batches of 4, 20 ms each)."""
    arrivals = [i * 0.0025 for i in range(300)]
    b = TraceBuilder()
    _traces(b, arrivals, _simulate(arrivals, 4, 0.005, 0.020), compute=0.020, **kw)
    return b


def _batcher_bound():
    """A request every 30 ms, each held 20 ms for company that never comes; 5 ms of work."""
    arrivals = [i * 0.030 for i in range(300)]
    b = TraceBuilder()
    _traces(b, arrivals, _simulate(arrivals, 8, 0.020, 0.005), compute=0.005)
    return b


def test_covered_length_matches_a_brute_force_union():
    rng = np.random.default_rng(7)
    for _ in range(100):
        n = int(rng.integers(1, 30))
        starts = rng.uniform(0, 100, n)
        ends = starts + rng.exponential(5, n)
        at = rng.uniform(-10, 120, 40)
        grid = np.linspace(-10, 120, 130_001)
        inside = ((grid[:, None] >= starts) & (grid[:, None] < ends)).any(axis=1)
        expected = np.interp(at, grid, np.cumsum(inside) * (grid[1] - grid[0]))
        assert _covered(starts, ends, at) == pytest.approx(expected, abs=0.01)


def test_behind_batches_counts_only_the_queue_time_of_the_same_instance():
    queue = np.array([[1.0, 0.0, 10.0, 1.0], [1.0, 20.0, 30.0, 3.0], [2.0, 0.0, 10.0, 1.0]])
    work = np.array([[1.0, 5.0, 15.0], [1.0, 5.0, 15.0], [2.0, 20.0, 30.0]])
    doc = behind_batches(queue, work, 0.0)
    # instance 1: 5 of 10 s (weight 1) and 0 of 10 s (weight 3); instance 2: 0 of 10 s
    assert doc["behind_batches"] == pytest.approx(5 / 50)
    assert doc["batch_coverage"] == 1.0
    # half of the batch work estimated from the members is in the traces: scaled up
    doc = behind_batches(queue, work, 40.0)
    assert doc["batch_coverage"] == pytest.approx(0.5)
    assert doc["behind_batches"] == pytest.approx(2 * 5 / 50)
    assert doc["behind_batches_seen"] == pytest.approx(5 / 50)
    assert behind_batches(queue[:0], work, 0.0) is None
    assert behind_batches(queue, work[:0], 0.0) is None


def test_a_queue_behind_busy_batches_is_decided_by_what_makes_the_batches_slow():
    doc = _breakdown([_worker_bound()], util=0.2)
    shares = {s["stage"]: s["share_of_p95"] for s in doc["stages"]}
    assert shares[sc.STAGE_QUEUE] > 0.8  # the stage shares alone say "batching"
    assert doc["queue"]["behind_batches"] > 0.95
    verdict = doc["verdict"]
    # the GPU idles during compute: the batches are slow for want of launches
    assert verdict["bottleneck"] == sc.VERDICT_RUNTIME, verdict
    assert any("requests wait for the model, not for the batcher" in e
               for e in verdict["evidence"])
    # no GPU samples: compute is the limit, and the verdict says it cannot say why
    verdict = _breakdown([_worker_bound()])["verdict"]
    assert verdict["bottleneck"] == sc.VERDICT_UNKNOWN
    assert verdict["evidence"][0].startswith("the queue (")
    assert "waits behind compute but no GPU samples were received" in verdict["evidence"][0]


def test_a_queue_behind_transfer_bound_batches_says_transfer():
    arrivals = [i * 0.0025 for i in range(300)]
    b = TraceBuilder()
    _traces(b, arrivals, _simulate(arrivals, 4, 0.005, 0.020), compute=0.004, h2d=0.016)
    verdict = _breakdown([b], util=0.2)["verdict"]
    assert verdict["bottleneck"] == sc.VERDICT_TRANSFER, verdict


def test_a_queue_waiting_for_the_batcher_is_batching_however_busy_the_gpu_computes():
    # The GPU is 98% busy while it computes, but the queue waits while the worker idles:
    # shortening the batcher's delay is the fix, not the GPU.
    doc = _breakdown([_batcher_bound()], util=0.98)
    assert doc["queue"]["behind_batches"] < 0.05
    verdict = doc["verdict"]
    assert verdict["bottleneck"] == sc.VERDICT_BATCHING, verdict
    assert any("requests wait for the batcher" in e for e in verdict["evidence"])


def test_sampled_traces_scale_up_for_the_batches_they_do_not_show():
    full = _breakdown([_worker_bound()])["queue"]
    # one request in ten traced, each standing for ten (a 10% head sampler)
    sampled = _breakdown([_worker_bound(keep=lambda k: k % 10 == 0, weight=10.0)])["queue"]
    assert sampled["batch_coverage"] < 0.5  # most batches have no traced member
    assert sampled["behind_batches_seen"] < 0.7 * full["behind_batches"]
    assert sampled["behind_batches"] == pytest.approx(full["behind_batches"], abs=0.1)


@pytest.mark.parametrize("instance,behind", [("i-2", False), ("i-1", True)])
def test_batches_of_another_instance_do_not_hold_up_this_ones_queue(instance, behind):
    quiet = _batcher_bound()  # instance i-1
    arrivals = [i * 0.030 for i in range(300)]
    busy = TraceBuilder(instance=instance)
    # a replica computing back to back the whole time, with no queue of its own
    _traces(busy, arrivals, [(a, [k]) for k, a in enumerate(arrivals)], compute=0.030,
            prefix="other")
    doc = _breakdown([quiet, busy], util=0.5)
    assert (doc["queue"]["behind_batches"] > 0.95) is behind
    assert (doc["queue"]["behind_batches"] < 0.05) is not behind


def test_a_busy_series_keeps_a_bounded_sample_that_still_agrees_with_itself():
    # 3,000 requests folded in four goes: past the first 1,000 queue spans of a time
    # slice, its queue spans, work windows and work estimate all stop together
    arrivals = [i * 0.0025 for i in range(3000)]
    batches = _simulate(arrivals, 4, 0.005, 0.009)  # 444 req/s served: a short queue
    clock = FakeClock()
    engine = Engine(clock=clock)
    _fold_in_parts(engine, clock, arrivals, batches, 4, compute=0.009, tick=2.1)
    doc = engine.breakdown("svc", window_s=None)
    assert doc["requests"] == 3000
    queue = doc["queue"]
    assert queue["batch_coverage"] > 0.95  # what was kept describes the same stretch of time
    assert queue["behind_batches"] == pytest.approx(queue["behind_batches_seen"])


def test_replicas_with_the_same_batch_ids_keep_their_own_batches():
    # per-process batch counters (b0, b1, ...) and no service.instance.id: host.name tells
    # the replicas apart; host-2's batches are not repeats of host-1's
    arrivals = [i * 0.030 for i in range(300)]
    idle = TraceBuilder(host="host-1", instance="")
    _traces(idle, arrivals, _simulate(arrivals, 8, 0.020, 0.005), compute=0.005)
    busy = _worker_bound()
    busy.resource[sc.RESOURCE_HOST_NAME] = "host-2"
    busy.resource[sc.RESOURCE_SERVICE_INSTANCE_ID] = ""
    both = _breakdown([idle, busy])["queue"]
    assert both["batch_coverage"] > 0.99
    assert both["behind_batches"] > 0.9  # host-2's long queue dominates the queue time


@pytest.mark.parametrize("prefix,size", [(None, _SIZE), (None, None), ("b", True)])
def test_copies_of_a_batch_span_without_id_or_size_do_not_inflate_the_estimate(prefix, size):
    # each member carries a copy of its batch's compute span: without a batch id they are
    # not counted as work once per member (which made the coverage 1/batch size)
    arrivals = [i * 0.030 for i in range(300)]
    b = TraceBuilder()
    _traces(b, arrivals, _simulate(arrivals, 4, 0.050, 0.005), compute=0.005, prefix=prefix,
            size=size)
    queue = _breakdown([b])["queue"]
    assert queue["batch_coverage"] > 0.99
    assert queue["behind_batches"] == pytest.approx(queue["behind_batches_seen"])


def test_bare_work_spans_still_count_as_work():
    # a plain inferprof.stage("compute") with no batch and no attribute: one worker, a queue
    arrivals = [i * 0.0025 for i in range(300)]
    b = TraceBuilder()
    _traces(b, arrivals, _simulate(arrivals, 4, 0.005, 0.020), compute=0.020, attrs=False)
    doc = _breakdown([b])
    assert doc["queue"]["behind_batches"] > 0.95
    assert doc["verdict"]["bottleneck"] == sc.VERDICT_UNKNOWN  # compute-bound, no GPU samples


def test_a_cached_figure_follows_batches_folded_into_the_next_slice():
    # requests whose queues nothing overlaps ...
    clock = FakeClock()
    engine = Engine(clock=clock)
    first = TraceBuilder()
    for i in range(100):
        t = i * 0.1
        req = first.request(t, t + 0.085)
        first.stage(req, sc.STAGE_QUEUE, t, t + 0.08)
        first.stage(req, sc.STAGE_COMPUTE, t + 0.08, t + 0.085, batch_id=f"a{i}", batch_size=1)
    engine.ingest_traces(first.export())
    clock.tick(5)
    assert engine.breakdown("svc", window_s=None)["queue"]["behind_batches"] == 0.0
    # ... then, folded a slice later, batches that ran during 60 of each queue's 80 ms
    second = TraceBuilder()
    for i in range(100):
        t = i * 0.1
        req = second.request(t, t + 0.07)
        second.stage(req, sc.STAGE_QUEUE, t, t + 0.01)
        second.stage(req, sc.STAGE_COMPUTE, t + 0.01, t + 0.07, batch_id=f"b{i}", batch_size=1)
    # into the next time slice, not one further (batches are compared with the queue
    # spans of their own slice and the two beside it)
    clock.tick((math.floor(clock() / engine.slice_s) + 1) * engine.slice_s - clock() + 0.5)
    engine.ingest_traces(second.export())
    clock.tick(3)
    queue = engine.breakdown("svc", window_s=None)["queue"]
    assert len(engine._slices) == 2
    assert queue["behind_batches"] == pytest.approx(6.0 / 9.0, abs=0.01)


def test_a_tail_of_requests_that_left_the_queue_still_waits_behind_the_batches():
    # the tail: requests cancelled after 1 s in the queue of a worker busy all along; they
    # have no batch work of their own, and the verdict must not call their wait batching
    b = TraceBuilder()
    for k in range(500):
        t = k * 0.020
        req = b.request(t, t + 0.0201)
        b.stage(req, sc.STAGE_QUEUE, t, t)
        b.stage(req, sc.STAGE_COMPUTE, t, t + 0.020, batch_id=f"b{k}", batch_size=1, gpu_id=GPU)
    for k in range(40):
        t = 1.0 + k * 0.2
        req = b.request(t, t + 1.0)
        b.stage(req, sc.STAGE_QUEUE, t, t + 1.0, **{sc.ATTR_CANCELLED: True})
    doc = _breakdown([b], util=0.2)
    assert doc["queue"]["behind_batches"] > 0.95
    verdict = doc["verdict"]
    assert verdict["bottleneck"] == sc.VERDICT_RUNTIME, verdict
    assert any("left the queue before a batch took them" in e for e in verdict["evidence"])
    assert not any("wait for the batcher" in e for e in verdict["evidence"])


def test_the_offline_engine_keeps_every_queue_span():
    # inferprof report (unlimited retention) folds in chunks when its input is large: the
    # later chunks count too
    clock = FakeClock()
    engine = Engine(clock=clock, retention_s=math.inf)
    arrivals = [i * 0.030 for i in range(1500)]
    idle = TraceBuilder()
    _traces(idle, arrivals, _simulate(arrivals, 8, 0.020, 0.005), compute=0.005, prefix="i")
    engine.ingest_traces(idle.export())
    engine.flush()
    busy = _worker_bound()
    engine.ingest_traces(busy.export())
    engine.flush()
    queue = engine.breakdown("svc", window_s=None)["queue"]
    # 300 busy requests queue ~0.3 s each, 1,500 idle ones 20 ms: most queue time is busy
    assert queue["behind_batches"] > 0.5


def test_union_matches_a_brute_force_and_closes_the_shortest_gaps_past_its_cap():
    from inferprof.collector.queueing import union

    rng = np.random.default_rng(3)
    starts = rng.uniform(0, 100, 300)
    work = np.stack([rng.integers(0, 2, 300).astype(float), starts,
                     starts + rng.exponential(0.2, 300)], axis=1)
    merged = union(work)
    for inst in (0.0, 1.0):
        w, m = work[work[:, 0] == inst], merged[merged[:, 0] == inst]
        at = np.linspace(-1, 102, 500)
        assert _covered(m[:, 1], m[:, 2], at) == pytest.approx(_covered(w[:, 1], w[:, 2], at))
        assert (m[1:, 1] > m[:-1, 2]).all()  # disjoint and sorted
    capped = union(work, 40)
    assert capped.shape[0] == 40
    busy = lambda u: float(np.sum(u[:, 2] - u[:, 1]))
    # closing gaps only adds busy time, and as little as closing the shortest gaps can
    gaps = np.sort(np.concatenate([np.diff(np.ravel(merged[merged[:, 0] == i][:, 1:]))[1::2]
                                   for i in (0.0, 1.0)]))
    assert busy(capped) == pytest.approx(busy(merged) + gaps[: merged.shape[0] - 40].sum())


def test_a_busy_series_past_the_caps_agrees_with_the_offline_figure():
    # 2,000 requests/s into a worker serving 1,600/s, folded in 16 goes: the live
    # engine samples its queue spans and keeps the union of its batches; what it says must
    # agree with the offline engine, which keeps everything
    # (2 s time slices, four folds each: a queue span reaches back into the slice before)
    arrivals = [i * 0.0005 for i in range(16000)]
    batches = _simulate(arrivals, 8, 0.002, 0.005)
    figures = []
    for retention in (300.0, math.inf):
        clock = FakeClock()
        engine = Engine(clock=clock, retention_s=retention, slice_s=2.0)
        _fold_in_parts(engine, clock, arrivals, batches, 16, compute=0.005, tick=0.5)
        figures.append(engine.breakdown("svc", window_s=None)["queue"])
    live, offline = figures
    assert offline["behind_batches"] > 0.9
    assert live["behind_batches"] == pytest.approx(offline["behind_batches"], abs=0.03)
    assert live["batch_coverage"] == 1.0


# --- what the batcher reports: inferprof.queue.behind_batches_s --------------------------

def _reported(said, **kw):
    """Worker-bound traces (the work windows cover ~all queue time) whose batcher says
    ``said(k, queued)`` instead."""
    arrivals = [i * 0.0025 for i in range(300)]
    b = TraceBuilder()
    _traces(b, arrivals, _simulate(arrivals, 4, 0.005, 0.020), compute=0.020,
            reported=said, **kw)
    return b


def test_a_figure_the_batcher_reports_wins_over_the_overlap_with_work():
    # Say every slot had been free (concurrent batches): the overlap would say ~1.
    doc = _breakdown([_reported(lambda k, q: 0.0)], util=0.98)
    assert doc["queue"]["behind_batches"] == 0.0
    assert doc["queue"]["reported_by_batcher"] == 1.0
    assert doc["verdict"]["bottleneck"] == sc.VERDICT_BATCHING
    assert _breakdown([_worker_bound()])["queue"]["behind_batches"] > 0.9  # unreported
    half = _breakdown([_reported(lambda k, q: q / 2)])["queue"]
    assert half["behind_batches"] == pytest.approx(0.5, abs=1e-6)
    # a figure past the span's own length counts as the whole wait, not more
    assert _breakdown([_reported(lambda k, q: 10.0)])["queue"]["behind_batches"] == 1.0


def test_reported_figures_are_weighted_and_need_no_coverage():
    full = _breakdown([_reported(lambda k, q: q * (k % 3) / 2)])["queue"]
    # one request in ten traced, weight 10: nothing to scale, the figures are per request
    sampled = _breakdown([_reported(lambda k, q: q * (k % 3) / 2,
                                    keep=lambda k: k % 10 == 0, weight=10.0)])["queue"]
    assert sampled["batch_coverage"] == 1.0
    assert sampled["behind_batches"] == pytest.approx(full["behind_batches"], abs=0.1)


def test_reported_and_unreported_spans_add_up_by_queue_time():
    # even requests reported 0, odd ones not (compared with the work windows: ~all)
    mixed = _breakdown([_reported(lambda k, q: 0.0 if k % 2 == 0 else None)])["queue"]
    assert 0.3 < mixed["behind_batches"] < 0.7
    assert 0.3 < mixed["reported_by_batcher"] < 0.7


def test_a_batcher_reporting_without_any_work_span_still_gets_a_queue_section():
    b = TraceBuilder()
    for k in range(50):
        t0 = k * 0.01
        req = b.request(t0, t0 + 0.03)
        b.stage(req, sc.STAGE_QUEUE, t0, t0 + 0.02, **{sc.ATTR_QUEUE_BEHIND_BATCHES_S: 0.015})
        b.stage(req, sc.STAGE_POSTPROCESS, t0 + 0.02, t0 + 0.03)
    queue = _breakdown([b])["queue"]
    assert queue["behind_batches"] == pytest.approx(0.75)
    assert queue["reported_by_batcher"] == 1.0


@pytest.mark.parametrize("bad", ["0.5", True, float("nan"), -1.0, float("inf")])
def test_a_malformed_report_is_ignored_and_the_span_compared_with_the_work(bad):
    doc = _breakdown([_reported(lambda k, q: bad)])
    assert doc["queue"]["reported_by_batcher"] == 0.0
    assert doc["queue"]["behind_batches"] > 0.9


def test_a_real_batcher_with_free_slots_is_not_read_as_waiting_behind_batches():
    """The case the overlap cannot tell: four slots, each request held for the 100 ms delay
    while the batch before (80 ms of h2d, compute and d2h) runs: batches overlap much of
    the queue time, yet nobody waited for a slot. (Long enough that a loaded machine's
    late wake-ups, a few ms each, do not turn the tail's queue time into transfers.)"""
    import asyncio
    import time

    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    import inferprof
    from tests.instrumentation.helpers import captured

    def model(xs):  # 80 ms of work in three stages: no one group outweighs the queue
        with inferprof.stage("h2d"):
            time.sleep(0.03)
        with inferprof.stage("compute"):
            time.sleep(0.02)
        with inferprof.stage("d2h"):
            time.sleep(0.03)
        return xs

    async def serve():
        async with inferprof.DynamicBatcher(
            model, max_batch_size=64, max_delay_ms=100, max_concurrent_batches=4,
            model_name="m",
        ) as batcher:
            async def one(i):
                async with inferprof.request(model="m"):
                    return await batcher.submit(i)

            tasks = []
            for i in range(150):
                tasks.append(asyncio.create_task(one(i)))
                await asyncio.sleep(0.006)
            await asyncio.gather(*tasks)

    with captured() as cap:
        asyncio.run(serve())
        spans = cap.spans()
    exports = [encode_spans(spans)]
    stripped = encode_spans(spans)  # as a batcher that reports nothing would send them
    for rs in stripped.resource_spans:
        for ss in rs.scope_spans:
            for span in ss.spans:
                keep = [kv for kv in span.attributes
                        if kv.key != sc.ATTR_QUEUE_BEHIND_BATCHES_S]
                del span.attributes[:]
                span.attributes.extend(keep)

    def queue_of(export):
        clock = FakeClock()
        engine = Engine(clock=clock)
        engine.ingest_traces(export)
        clock.tick(5)
        (service,) = [s["service"] for s in engine.services()]
        return engine.breakdown(service, window_s=None)

    measured, overlapped = queue_of(exports[0]), queue_of(stripped)
    assert measured["queue"]["reported_by_batcher"] == 1.0
    assert measured["queue"]["behind_batches"] < 0.1
    # what the overlap alone says: much of the queue behind batches (about half on a quiet
    # machine; less where a loaded one stretches the sleeps between the stages)
    assert overlapped["queue"]["behind_batches"] > 0.25
    assert measured["verdict"]["bottleneck"] == sc.VERDICT_BATCHING


def test_a_reported_figure_counts_at_most_its_own_span():
    b = TraceBuilder()
    for k in range(40):
        t0 = k * 0.1
        req = b.request(t0, t0 + 0.03)
        said = {sc.ATTR_QUEUE_BEHIND_BATCHES_S: 10.0} if k % 2 == 0 else {}
        b.stage(req, sc.STAGE_QUEUE, t0, t0 + 0.02, **said)
        b.stage(req, sc.STAGE_COMPUTE, t0 + 0.02, t0 + 0.03, batch_id=f"b{k}", batch_size=1)
    queue = _breakdown([b])["queue"]
    # half the queue time reported whole (10 s clipped to 20 ms), half behind nothing
    assert queue["behind_batches"] == pytest.approx(0.5)
    assert queue["reported_by_batcher"] == pytest.approx(0.5)
