"""How many requests production mode's timing budget times, against the rate it is set to.

    python3 benchmarks/timing_budget_share.py [--rate 344] [--batch 16] [--seconds 4]
                                              [--seeds 20]

The real ``TimingBudget`` (``inferprof.instrumentation.sampling``) on a simulated clock, a
summarised route at the defaults (``max_timed_rate`` 100, ``max_timed_rate_summarised``
10): requests arrive ``--batch`` at a time (a dynamic batcher's bursts) at ``--rate`` a
second on average (each gap drawn uniformly between half and one and a half times the
mean), after an idle spell of each length in the table. Each request is timed with the
share the budget gives it; the table gives the share of requests timed and the requests
timed a second, and their ratio to the rate set (the baseline: what the budget promises),
the mean over seeds.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inferprof.instrumentation.sampling import TimingBudget  # noqa: E402

RATE, SUMMARISED_RATE = 100.0, 10.0


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run(rate: float, batch: int, seconds: float, idle: float, seed: int) -> tuple[int, int]:
    """(requests timed, requests) over ``seconds`` of load after ``idle`` seconds idle."""
    rng = random.Random(seed)
    clock = _Clock()
    budget = TimingBudget(RATE, clock=clock, summarised_rate=SUMMARISED_RATE)
    budget.summarised("/r", True)
    clock.now += 1.0
    budget.share("/r")  # the mark applies from the next period
    clock.now += idle
    timed = n = 0
    end = clock.now + seconds
    while clock.now < end:
        for _ in range(batch):
            timed += rng.random() < budget.share("/r")
            n += 1
        clock.now += batch / rate * rng.uniform(0.5, 1.5)
    return timed, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=344.0, help="requests a second")
    ap.add_argument("--batch", type=int, default=16, help="requests arriving at once")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--seeds", type=int, default=20)
    args = ap.parse_args()
    print(f"{args.rate:g} requests a second, {args.batch} at a time, {args.seconds:g} s; "
          f"summarised route, rate set {SUMMARISED_RATE:g} a second; mean of {args.seeds} "
          "seeds\n")
    print("| idle before (s) | timed | timed a second | x the rate set |")
    print("|---:|---:|---:|---:|")
    for idle in (0.0, 2.0, 8.0):
        runs = [run(args.rate, args.batch, args.seconds, idle, s) for s in range(args.seeds)]
        share = sum(t / n for t, n in runs) / len(runs)
        per_s = sum(t for t, _ in runs) / len(runs) / args.seconds
        print(f"| {idle:g} | {share:.2%} | {per_s:.1f} | {per_s / SUMMARISED_RATE:.2f} |")


if __name__ == "__main__":
    main()
