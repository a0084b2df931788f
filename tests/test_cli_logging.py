"""The long-running commands' logging: OpenTelemetry exporter failure lines are limited."""

from __future__ import annotations

import logging

from inferprof.cli import ExporterLogLimit


def _record(name: str, msg: str, level: int = logging.ERROR) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, None, None)


def test_exporter_failures_pass_once_a_period_saying_how_many_were_held():
    # The SDK's exporter logs each failed attempt (~20 lines a minute with the collector
    # down, measured in a walkthrough): the first passes, then one per period.
    now = [0.0]
    limit = ExporterLogLimit(period_s=60, clock=lambda: now[0])
    name = "opentelemetry.exporter.otlp.proto.grpc.exporter"
    passed = []
    for _ in range(20):  # every 3 s for a minute
        record = _record(name, "Failed to export metrics")
        if limit.filter(record):
            passed.append(record.getMessage())
        now[0] += 3.0
    record = _record(name, "Failed to export metrics")
    assert limit.filter(record)
    passed.append(record.getMessage())
    assert passed == ["Failed to export metrics",
                      "Failed to export metrics (19 more like it since the last one shown)"]
    # levels are counted apart; other loggers are never held back
    assert limit.filter(_record(name, "Transient error", logging.WARNING))
    for _ in range(5):
        assert limit.filter(_record("inferprof.gpu.sampler", "export failed"))
