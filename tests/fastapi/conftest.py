from __future__ import annotations

import pytest

from inferprof.fastapi import exchange, middleware
from inferprof.instrumentation import stage as stage_module
from tests.instrumentation.test_summaries import FakeClock


@pytest.fixture
def clock(monkeypatch):
    """The nanosecond clock of stages and the middleware, moved by the test."""
    c = FakeClock()
    monkeypatch.setattr(stage_module, "_time_ns", c)
    monkeypatch.setattr(middleware, "_time_ns", c)
    monkeypatch.setattr(exchange, "_time_ns", c)
    return c
