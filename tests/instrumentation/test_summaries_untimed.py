"""Requests production mode's timing budget leaves untimed, counted in the summaries
(contract §15, "Requests not timed"), and the mark on timed requests whose untimed
siblings are counted ("The mark on timed requests").

Checked against exact computation from the entries handed to the summaries: the exported
counts, buckets, sums and extremes of every data point."""

from __future__ import annotations

import math
import random
import threading
from collections import Counter, defaultdict

from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from inferprof import semconv
from inferprof.instrumentation.accounting import Stats
from inferprof.instrumentation.summaries import Summaries
from inferprof.timing import DEFAULT_SUMMARY_SCALE, exp_index
from tests.instrumentation.test_summaries import MemoryExporter, decode

MS = 1_000_000
T0 = 10**18
_SCOPE = InstrumentationScope(semconv.INSTRUMENTATION_SCOPE)
_REQ = semconv.METRIC_SUMMARY_REQUEST_DURATION
_MARK = semconv.ATTR_SUMMARY_UNTIMED_COUNTED


def _points(exporter, name) -> list:
    return [p for data in exporter.exports for rm in data.resource_metrics
            for sm in rm.scope_metrics for m in sm.metrics if m.name == name
            for p in m.data.data_points]


def _timed(i: int, model: str | None, mark: bool, error: bool = False,
           weight: float = 2.0) -> tuple:
    start = T0 + i * MS
    end = start + MS + 1000 * i
    return (start, end, error, model, weight, ("compute", start, end), mark)


def test_the_mark_splits_request_duration_points_only():
    exporter = MemoryExporter()
    stats = Stats()
    s = Summaries(exporter, None, _SCOPE, stats, interval_s=3600)
    entries = [_timed(i, "m", mark=i % 3 == 0, error=i % 5 == 0) for i in range(60)]
    for e in entries:
        assert s.add(e)
    s.close(10)
    got = decode(exporter.exports)
    want: Counter = Counter()
    for e in entries:
        attrs = {semconv.ATTR_MODEL_NAME: "m", semconv.ATTR_SAMPLE_WEIGHT: 2.0}
        if e[2]:
            attrs[semconv.ATTR_REQUEST_ERROR] = True
        if e[6]:
            attrs[_MARK] = True
        want[tuple(sorted(attrs.items()))] += 1
    assert {k: d["count"] for k, d in got[_REQ].items()} == dict(want)
    # stage and tail points: one per (model, weight, stage), the mark plays no part
    for name in (semconv.METRIC_SUMMARY_STAGE_DURATION, semconv.METRIC_SUMMARY_STAGE_TAIL):
        for p in _points(exporter, name):
            assert _MARK not in p.attributes
    stages = {dict(k)[semconv.ATTR_STAGE]: d["count"]
              for k, d in got[semconv.METRIC_SUMMARY_STAGE_DURATION].items()}
    assert stages == {"compute": 60, "unattributed": 60}


def _untimed(i: int, rng: random.Random) -> tuple:
    start = T0 + i * MS
    ns = 0 if i % 41 == 0 else rng.randrange(1, 50_000) * rng.choice((1, 1_000, 100_000))
    model = rng.choice(("m", "n", None, 7))  # 7: not a string, read as "7"
    return (start, start + ns, rng.random() < 0.2, model)


def test_untimed_requests_fold_into_their_metric_exactly():
    rng = random.Random(3)
    exporter = MemoryExporter()
    stats = Stats()
    s = Summaries(exporter, None, _SCOPE, stats, interval_s=3600)
    entries = [_untimed(i, rng) for i in range(3000)]
    for part in (entries[:1000], entries[1000:]):  # two folds, one export
        for e in part:
            assert s.add_untimed(e)
        s._fold()
    assert s.add(_timed(0, "m", mark=True))  # in the same export
    s.close(10)
    assert stats.untimed_counted == 3000 and stats.summarised == 1
    assert not stats.summary_dropped and stats.summary_exports == 1
    (data,) = exporter.exports
    (scope_metrics,) = data.resource_metrics[0].scope_metrics
    assert {m.name for m in scope_metrics.metrics} == {
        _REQ, semconv.METRIC_SUMMARY_STAGE_DURATION, semconv.METRIC_SUMMARY_STAGE_TAIL,
        semconv.METRIC_SUMMARY_REQUEST_UNTIMED}
    (untimed,) = [m for m in scope_metrics.metrics
                  if m.name == semconv.METRIC_SUMMARY_REQUEST_UNTIMED]
    assert untimed.unit == "s"
    want: dict = defaultdict(list)
    for start, end, error, model in entries:
        attrs = {} if model is None else {semconv.ATTR_MODEL_NAME: str(model)}
        if error:
            attrs[semconv.ATTR_REQUEST_ERROR] = True
        want[tuple(sorted(attrs.items()))].append((end - start) * 1e-9)
    points = {tuple(sorted(p.attributes.items())): p for p in untimed.data.data_points}
    assert set(points) == set(want)
    got = decode(exporter.exports)[semconv.METRIC_SUMMARY_REQUEST_UNTIMED]
    for key, values in want.items():
        p, d = points[key], got[key]
        assert p.scale == DEFAULT_SUMMARY_SCALE
        assert semconv.ATTR_SAMPLE_WEIGHT not in p.attributes
        assert d["count"] == len(values)
        assert d["zero"] == sum(v == 0 for v in values)
        assert d["buckets"] == Counter(
            (DEFAULT_SUMMARY_SCALE, int(i)) for i in exp_index([v for v in values if v > 0]))
        assert math.isclose(p.sum, math.fsum(values), rel_tol=1e-12)
        assert p.min == min(values) and p.max == max(values)


def test_a_full_untimed_buffer_drops_and_counts_and_close_exports_the_rest():
    release = threading.Event()
    exporter = MemoryExporter(block=release)
    stats = Stats()
    s = Summaries(exporter, None, _SCOPE, stats, interval_s=0.01, max_pending=10)
    rng = random.Random(1)
    try:
        assert s.add_untimed(_untimed(1, rng))
        assert exporter.called.wait(10)  # the export thread is now stuck in export()
        added = sum(s.add_untimed(_untimed(i, rng)) for i in range(2, 27))
        assert added == 10 and stats.summary_dropped == 15 and stats.untimed_counted == 11
    finally:
        release.set()
        s.close(10)
    assert not s.add_untimed(_untimed(99, rng))  # closed: dropped, counted
    assert stats.summary_dropped == 16
    got = decode(exporter.exports)
    assert set(got) == {semconv.METRIC_SUMMARY_REQUEST_UNTIMED}  # no timed request
    assert sum(d["count"] for d in got[semconv.METRIC_SUMMARY_REQUEST_UNTIMED].values()) == 11


def test_untimed_data_points_past_the_key_bound_are_dropped_and_counted():
    # one timed request takes 4 data points (duration, stage, unattributed, tail): room
    # for 2 untimed ones, (m, ok) and (m, error); a third model's are dropped
    exporter = MemoryExporter()
    stats = Stats()
    s = Summaries(exporter, None, _SCOPE, stats, interval_s=3600, max_keys=6)
    assert s.add(_timed(0, "m", mark=True))
    entries = [(T0, T0 + MS * (i + 1), i % 2 == 0, "m" if i < 6 else "z") for i in range(9)]
    for e in entries:
        assert s.add_untimed(e)
    s.close(10)
    assert stats.summary_dropped == 3
    got = decode(exporter.exports)[semconv.METRIC_SUMMARY_REQUEST_UNTIMED]
    assert {k: d["count"] for k, d in got.items()} == {
        ((semconv.ATTR_MODEL_NAME, "m"),): 3,
        ((semconv.ATTR_MODEL_NAME, "m"), (semconv.ATTR_REQUEST_ERROR, True)): 3}


def test_untimed_requests_waiting_when_close_gives_up_count_as_dropped():
    release = threading.Event()
    exporter = MemoryExporter(block=release)
    stats = Stats()
    s = Summaries(exporter, None, _SCOPE, stats, interval_s=0.01)
    try:
        assert s.add_untimed((T0, T0 + MS, False, "m"))
        assert exporter.called.wait(10)  # the export thread is stuck in export()
        for i in range(5):
            assert s.add_untimed((T0, T0 + MS * (i + 2), False, "m"))
        s.close(0.05)
        assert stats.summary_dropped == 6  # the one in the export and the five waiting
    finally:
        release.set()
