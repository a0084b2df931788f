"""What a request costs, per stage: GPU-seconds, energy and money.

**GPU-seconds.** A work span (``h2d``, a compute stage, ``d2h``) is device time of the
batch it ran. Each member request is charged a share of its duration
(``member_share``):

* by tokens where they are known: the member's ``inferprof.tokens.prompt`` (its request
  span) over the span's ``inferprof.tokens.effective`` (the batch's real tokens), at most 1;
* evenly otherwise: 1 / ``inferprof.batch.size``;
* the whole duration for a span with neither (a request's own work, or Triton's derived
  stages, which carry no batch size).

A generating request whose engine sends step spans is charged its tokens' share of each
step within its own ``prefill``/``decode`` spans instead (``GenerationFold.device_shares``).

A request's GPU-seconds in a stage are the sum over its spans of that stage; a window's
figure per request is the mean over its requests, each weighted by its sampling weight.

**Energy.** Joules per request in a compute stage = its GPU-seconds there times the mean
power the GPU drew during the series' compute windows: the ``hw.gpu.power.draw`` samples
joined to those windows as the utilisation is (``GpuSamples.during``: inside a window or
within one sampling period after it, each sample weighted by its period). Transfer stages
get none: no power sample is joined to them.

**Money.** GPU-seconds times a price per GPU-hour / 3600: the price of each compute
window's GPU model (``hw.model`` on its samples) where one is given for that model, else
the price given without a model, averaged over the windows by their duration; with no
compute window naming a GPU, the price without a model.

Limits, stated in docs/concepts.md: the split charges a batch's whole device time to its
members, padding included; the shares of a batch's untraced members are charged to no
traced request (the weights scale the traced ones up); a mean power over all compute
windows is applied to every request; idle GPU time between batches is nobody's.

Memory: per (time slice, series) one float per stage.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

#: GPU models remembered (host, GPU id -> hw.model), at most.
MAX_GPU_MODELS = 10_000
_SECONDS_PER_HOUR = 3600.0


def member_share(tokens: int, effective: Any, size: Any) -> float:
    """A member's share of its batch's work span: by tokens where the member's
    (``tokens`` > 0) and the batch's (``effective``) are known, else 1/``size``, else 1."""
    if tokens > 0 and type(effective) is int and effective > 0:
        return min(1.0, tokens / effective)
    if type(size) is int and size > 0:
        return 1.0 / size
    return 1.0


def valid_price(price: Any) -> bool:
    return (
        isinstance(price, (int, float)) and not isinstance(price, bool)
        and math.isfinite(price) and price >= 0
    )


def parse_prices(items: Iterable[str]) -> tuple[tuple[str, float], ...]:
    """``MODEL=PRICE`` or ``PRICE`` items (a price per GPU-hour, for GPUs whose samples
    name that ``hw.model``, or for every other GPU) as (model or "", price) pairs;
    ``ValueError`` naming the item otherwise."""
    out: dict[str, float] = {}
    for item in items:
        model, sep, value = str(item).rpartition("=")
        model = model.strip() if sep else ""
        try:
            price = float(value)
        except ValueError:
            price = math.nan
        if not valid_price(price) or (sep and not model):
            raise ValueError(
                f"a GPU-hour price is PRICE or MODEL=PRICE with PRICE a number >= 0 "
                f"(e.g. 2.5 or 'NVIDIA H100 80GB HBM3=4.0'), got {item!r}"
            )
        out[model] = price
    return tuple(out.items())


class CostStore:
    """Per (slice, series, stage column), the weighted sum of the requests' GPU-seconds;
    not thread-safe (the engine locks)."""

    def __init__(self) -> None:
        self._slices: dict[int, dict[int, dict[int, float]]] = {}
        #: (host, GPU id) -> its samples' hw.model
        self.gpu_models: dict[tuple[str, str], str] = {}

    def add(
        self, index: int, series: np.ndarray, weight: np.ndarray, device: np.ndarray,
        columns: np.ndarray, keep: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """Fold one batch of finalised requests' work spans: ``device`` rows (request,
        stage number, seconds, share), ``columns`` each row's stage column, ``keep`` the
        rows whose column is tracked. Returns each request's GPU-seconds per stage as
        (request, stage column, seconds) arrays (None: none)."""
        if not keep.any():
            return None
        rows = device[keep, 0].astype(np.int64)
        cols = columns[keep]
        own = device[keep, 2] * device[keep, 3]
        value = weight[rows] * own
        sid = series[rows]
        code = (sid << 20) | cols
        uniq, inv = np.unique(code, return_inverse=True)
        sums = np.bincount(inv, weights=value, minlength=uniq.size)
        per_series = self._slices.setdefault(index, {})
        for c, v in zip(uniq.tolist(), sums.tolist(), strict=True):
            stages = per_series.setdefault(c >> 20, defaultdict(float))
            stages[c & ((1 << 20) - 1)] += v
        per_request, inv = np.unique((rows << 20) | cols, return_inverse=True)
        seconds = np.bincount(inv, weights=own, minlength=per_request.size)
        return per_request >> 20, per_request & ((1 << 20) - 1), seconds

    def prune(self, oldest: int) -> None:
        for idx in [i for i in self._slices if i < oldest]:
            del self._slices[idx]

    def forget_series(self, sid: int) -> None:
        for per_series in self._slices.values():
            per_series.pop(sid, None)

    def totals(self, indices: Iterable[int], sids: Sequence[int]) -> dict[int, float]:
        """Stage column -> weighted GPU-seconds over slices ``indices`` and ``sids``."""
        out: dict[int, float] = defaultdict(float)
        for idx in indices:
            per_series = self._slices.get(idx)
            if not per_series:
                continue
            for sid in sids:
                for col, v in per_series.get(sid, {}).items():
                    out[col] += v
        return out

    def model_of(self, host: str, gpu: str, model: str) -> None:
        """Remember the ``hw.model`` a GPU's samples name."""
        key = (host, gpu)
        if key in self.gpu_models or len(self.gpu_models) < MAX_GPU_MODELS:
            self.gpu_models[key] = model

    def price(
        self, prices: Mapping[str, float], windows: Sequence[tuple[str, str, float, float]]
    ) -> float | None:
        """The price per GPU-hour of these compute windows: each window's GPU model's
        price (else the price without a model), averaged by duration; None where none
        applies."""
        if not prices:
            return None
        default = prices.get("")
        if not windows:
            return default
        total = priced = 0.0
        for host, gpu, s, e in windows:
            model = self.gpu_models.get((host, gpu))
            if model is None:  # a GPU UUID names one device, whatever the host
                model = next((m for (_, g), m in self.gpu_models.items() if g == gpu), None)
            p = prices.get(model, default) if model is not None else default
            if p is not None and e > s:
                total += (e - s) * p
                priced += e - s
        return total / priced if priced > 0 else default


def section(
    per_stage: Mapping[str, float],
    requests: float,
    compute_stage: Callable[[str], bool],
    power: tuple[np.ndarray, np.ndarray],
    price: float | None,
    order: Callable[[str], Any],
) -> dict[str, Any] | None:
    """The breakdown's ``cost`` section: ``per_stage`` (stage -> weighted GPU-seconds),
    ``requests`` (weighted), ``power`` (samples joined to the compute windows and their
    weights), ``price`` per GPU-hour. None when the window holds no work span."""
    if not per_stage or not requests > 0:
        return None
    values, weights = power
    watts = float(np.average(values, weights=weights)) if values.size else None
    stages = []
    totals = {"gpu_seconds": 0.0, "energy": 0.0, "money": 0.0}
    for name in sorted(per_stage, key=order):
        gpu_s = per_stage[name] / requests
        energy = gpu_s * watts if watts is not None and compute_stage(name) else None
        money = gpu_s * price / _SECONDS_PER_HOUR if price is not None else None
        totals["gpu_seconds"] += gpu_s
        totals["energy"] += energy or 0.0
        totals["money"] += money or 0.0
        stages.append({
            "stage": name,
            "gpu_seconds_per_request": gpu_s,
            "energy_joules_per_request": energy,
            "cost_per_request": money,
        })
    return {
        "gpu_seconds_per_request": totals["gpu_seconds"],
        "energy_joules_per_request": totals["energy"] if watts is not None else None,
        "cost_per_request": totals["money"] if price is not None else None,
        "power_watts_during_compute": (
            None if watts is None else {"mean": watts, "samples": int(values.size)}
        ),
        "gpu_hour_price": price,
        "stages": stages,
    }


__all__ = [
    "MAX_GPU_MODELS", "CostStore", "member_share", "parse_prices", "section", "valid_price",
]
