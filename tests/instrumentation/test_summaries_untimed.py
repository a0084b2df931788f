"""Requests production mode's timing budget leaves untimed, counted in the summaries
(contract §15, "Requests not timed"), and the mark on timed requests whose untimed
siblings are counted ("The mark on timed requests").

Checked against exact computation from the entries handed to the summaries: the exported
counts, buckets, sums and extremes of every data point."""

from __future__ import annotations

from collections import Counter

from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from inferprof import semconv
from inferprof.instrumentation.accounting import Stats
from inferprof.instrumentation.summaries import Summaries
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
