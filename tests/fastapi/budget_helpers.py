"""The timing budget of the untimed-counting tests: a real ``TimingBudget`` on a clock the
test moves, so which requests it times depends on the test's requests alone."""

from __future__ import annotations

from typing import Any

from inferprof.instrumentation.sampling import TimingBudget


class BudgetClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def install_budget(rt: Any, rate: float = 100) -> BudgetClock:
    """Give the runtime ``rt`` a timing budget of ``rate`` a second on a clock of its own;
    the clock, for the test to move."""
    clock = BudgetClock()
    rt.timing_budget = TimingBudget(rate, clock=clock)
    return clock
