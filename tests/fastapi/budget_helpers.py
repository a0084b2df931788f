"""The timing budget of the untimed-counting tests: a real ``TimingBudget`` on a clock the
test moves, so which requests it times depends on the test's requests alone."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import inferprof
from inferprof.instrumentation.sampling import TimingBudget
from tests.instrumentation.helpers import captured


class BudgetClock:
    """Moved by the test, and by ``step`` at each reading: the budget reads it once a
    request, so ``step`` sets a steady request rate (1 / step a second; 0: frozen)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.step = 0.0

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def install_budget(rt: Any, rate: float = 100) -> BudgetClock:
    """Give the runtime ``rt`` a timing budget of ``rate`` a second on a clock of its own;
    the clock, for the test to move."""
    clock = BudgetClock()
    rt.timing_budget = TimingBudget(rate, clock=clock)
    return clock


@contextmanager
def budgeted_capture(exporter: Any, sample_rate: float, untimed_stages: bool = False
                     ) -> Iterator[tuple[Any, Any, BudgetClock]]:
    """``captured()`` in production mode exporting summaries to ``exporter`` (exported at
    shutdown only), the runtime given a timing budget of 100 a second on a clock the test
    moves: ``(capture, runtime, clock)``. Untimed requests are only counted, unless
    ``untimed_stages`` (then summarised with their stages)."""
    with captured(mode="production", max_timed_rate=100, sample_rate=sample_rate,
                  summary_exporter=exporter, summary_interval_s=3600,
                  untimed_stages=untimed_stages) as cap:
        rt = inferprof._config.active_runtime()
        yield cap, rt, install_budget(rt)
