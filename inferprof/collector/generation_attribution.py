"""Where a generating request's time went: its itl gaps by cause, and the verdict.

``gap_causes`` splits each inter-token gap of one request between §7's causes, from the
request's own ``preempted`` spans and its engine's step spans (contract §14):

* time in the request's ``preempted`` spans, and in its own ``prefill`` spans after its
  first token (the recomputation after an eviction), is ``preempted``, before anything else;
* time in an engine step with P prefill and N decode tokens is ``prefill_interference``
  for P/(P+N) of it and ``decode`` for the rest (a step with neither count: ``decode``);
* the rest of the gap is ``host`` when a step of the engine overlaps the gap, else
  ``unattributed``; with no step spans for the engine at all, all of it but ``preempted``.

Work is vectorised per request: one sorted set of breakpoints (gap bounds, step and
preemption bounds), one class per elementary segment, cumulative sums read at the gap
bounds. Steps of one engine are assumed not to overlap each other (an engine runs one
step at a time); where they do, a segment belongs to the step that started last.

``decide`` is the generation verdict (§7 classes ``kv_cache`` and ``scheduling``, else §6's).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from inferprof import semconv as sc

#: Cause columns, in ``semconv.ITL_CAUSES`` order.
DECODE, PREFILL, PREEMPTED, HOST, UNATTRIBUTED = range(5)
N_CAUSES = 5
#: ``kv_cache.usage_p95`` at or above this is "nearly full" (§14).
KV_NEARLY_FULL = 0.9
#: Fewest generating requests for a generation verdict of its own.
MIN_REQUESTS = 10
#: Generating requests at which the confidence stops growing with the data.
FULL_CONFIDENCE_REQUESTS = 100


def gap_causes(
    offsets: np.ndarray,
    tokens: np.ndarray | None,
    preempted: np.ndarray,
    steps: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The itl values, their multiplicities and their causes of one request.

    ``offsets``: emit times (seconds from the request's start, non-decreasing);
    ``tokens``: tokens per chunk (None: 1 each); ``preempted``: (n, 2) intervals in the
    same seconds (eviction and recomputation); ``steps``: (start, end, prefill tokens,
    decode tokens) of the engine's steps near the request, sorted by start, in the same
    seconds (None: the engine has no step spans). Returns per gap ``g/k``, ``k`` and a
    (gaps, 5) array of seconds per cause (rows sum to ``g``).
    """
    a = offsets[:-1]
    b = offsets[1:]
    gap = b - a
    k = np.ones(gap.size) if tokens is None else np.maximum(tokens[1:], 1).astype(np.float64)
    causes = np.zeros((gap.size, N_CAUSES))
    if gap.size == 0:
        return gap, k, causes
    lo, hi = offsets[0], offsets[-1]
    points = [offsets]
    if preempted.size:
        points.append(np.clip(preempted.ravel(), lo, hi))
    if steps is not None and steps[0].size:
        points.append(np.clip(steps[0], lo, hi))
        points.append(np.clip(steps[1], lo, hi))
    bp = np.unique(np.concatenate(points))
    seg = np.diff(bp)
    mid = (bp[:-1] + bp[1:]) * 0.5
    in_pre = _inside(mid, preempted[:, 0], preempted[:, 1]) if preempted.size else None
    parts = np.zeros((seg.size, N_CAUSES))
    rest = seg.copy()
    if in_pre is not None:
        parts[:, PREEMPTED] = np.where(in_pre, seg, 0.0)
        rest[in_pre] = 0.0
    has_steps = steps is not None and steps[0].size > 0
    if steps is not None and has_steps:
        st_s, st_e, p, n = steps
        idx = np.searchsorted(st_s, mid, side="right") - 1
        ok = idx >= 0
        in_step = np.zeros(mid.size, bool)
        in_step[ok] = mid[ok] < st_e[idx[ok]]
        tot = p + n
        frac = np.divide(p, tot, out=np.zeros_like(tot, dtype=np.float64), where=tot > 0)
        f = np.where(in_step, frac[np.where(ok, idx, 0)], 0.0)
        stepped = np.where(in_step, rest, 0.0)
        parts[:, PREFILL] = stepped * f
        parts[:, DECODE] = stepped - parts[:, PREFILL]
        rest = rest - stepped
    cum = np.vstack([np.zeros((1, N_CAUSES)), np.cumsum(parts, axis=0)])
    cum_rest = np.concatenate([[0.0], np.cumsum(rest)])
    ia = np.searchsorted(bp, a)
    ib = np.searchsorted(bp, b)
    causes = cum[ib] - cum[ia]
    other = cum_rest[ib] - cum_rest[ia]
    if has_steps:
        # Steps overlapping each gap: started before its end, ended after its start.
        overlapping = np.searchsorted(st_s, b, side="left") - np.searchsorted(
            np.maximum.accumulate(st_e), a, side="right"
        )
        host = overlapping > 0
    else:
        host = np.zeros(gap.size, bool)
    causes[:, HOST] += np.where(host, other, 0.0)
    causes[:, UNATTRIBUTED] += np.where(host, 0.0, other)
    return gap / k, k, causes


def _inside(t: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    idx = np.searchsorted(s, t, side="right") - 1
    out = np.zeros(t.size, bool)
    ok = idx >= 0
    out[ok] = t[ok] < np.maximum.accumulate(e)[idx[ok]]
    return out


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def decide(gen: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    """The ``generation.verdict`` from the section's figures and §6's verdict ``base``."""
    requests = gen.get("requests") or 0
    if requests < MIN_REQUESTS:
        return {
            "bottleneck": sc.VERDICT_UNKNOWN,
            "confidence": 0.0,
            "evidence": [
                (
                    f"not enough data: a generation verdict needs at least {MIN_REQUESTS} "
                    f"generating requests, there are {requests}"
                )
            ],
        }
    ttft_shares = {s["stage"]: s["share_of_p95"] for s in gen["ttft"].get("stages", ())}
    itl_shares = {c["cause"]: c["share_of_p95"] for c in gen["itl"].get("causes", ())}
    kv = (gen.get("kv_cache") or {}).get("usage_p95")
    preempted = gen.get("preempted_requests") or 0
    ttft_top = _top(ttft_shares, merge={sc.STAGE_QUEUE, sc.STAGE_PREEMPTED})
    itl_top = _top(itl_shares)
    kv_pressure = (kv is not None and kv >= KV_NEARLY_FULL) or preempted > 0
    candidates: list[_Candidate] = []
    if kv_pressure:
        kv_candidate = _kv_cache_candidate(ttft_shares, itl_shares, ttft_top, itl_top, kv,
                                           preempted)
        if kv_candidate is not None:
            candidates.append(kv_candidate)
    if itl_top == sc.ITL_CAUSE_PREFILL_INTERFERENCE:
        candidates.append(_scheduling_candidate(itl_shares))
    if not candidates:
        evidence = [f"§6 verdict of the same window: {e}" for e in base.get("evidence", ())]
        if ttft_shares:
            evidence.append(f"TTFT tail: largest stage {_top(ttft_shares)}")
        if itl_shares:
            evidence.append(f"ITL tail: largest cause {itl_top}")
        return {
            "bottleneck": base.get("bottleneck", sc.VERDICT_UNKNOWN),
            "confidence": base.get("confidence", 0.0),
            "evidence": evidence,
        }
    candidates.sort(key=lambda c: -c[0])
    share, name, evidence = candidates[0]
    if len(candidates) > 1:
        evidence = [*evidence, f"also {candidates[1][1]}: {candidates[1][2][0]}"]
    # As §6's: more data and a larger tail share, more confidence.
    confidence = min(1.0, requests / FULL_CONFIDENCE_REQUESTS) * (0.5 + 0.5 * min(1.0, share))
    return {"bottleneck": name, "confidence": round(confidence, 3), "evidence": evidence}


_Candidate = tuple[float, str, list[str]]


def _kv_cache_candidate(
    ttft_shares: Mapping[str, float], itl_shares: Mapping[str, float], ttft_top: str | None,
    itl_top: str | None, kv: float | None, preempted: int,
) -> _Candidate | None:
    """``kv_cache`` under KV-cache pressure, when the TTFT tail is waiting for admission
    or the ITL tail is time evicted; its share and evidence. None otherwise."""
    waiting_top = ttft_top == "waiting"
    evicted_top = itl_top == sc.ITL_CAUSE_PREEMPTED
    if not (waiting_top or evicted_top):
        return None
    waiting = ttft_shares.get(sc.STAGE_QUEUE, 0.0) + ttft_shares.get(sc.STAGE_PREEMPTED, 0.0)
    share = max(
        waiting if waiting_top else 0.0,
        itl_shares.get(sc.ITL_CAUSE_PREEMPTED, 0.0) if evicted_top else 0.0,
    )
    evidence = []
    if waiting_top:
        queue = ttft_shares.get(sc.STAGE_QUEUE, 0.0)
        evicted = ttft_shares.get(sc.STAGE_PREEMPTED, 0.0)
        evidence.append(
            f"{_pct(waiting)} of p95 TTFT is waiting for KV-cache admission (queue "
            f"{_pct(queue)}, preempted {_pct(evicted)})"
        )
    if evicted_top:
        evidence.append(
            f"{_pct(itl_shares[sc.ITL_CAUSE_PREEMPTED])} of the slowest inter-token gaps "
            "is time evicted from the KV cache"
        )
    if kv is not None:
        evidence.append(f"KV-cache usage p95 {_pct(kv)}")
    if preempted:
        evidence.append(f"{preempted} requests evicted and recomputed (preempted)")
    return share, sc.VERDICT_KV_CACHE, evidence


def _scheduling_candidate(itl_shares: Mapping[str, float]) -> _Candidate:
    """``scheduling``: the ITL tail is other requests' prefill in the same steps."""
    share = itl_shares[sc.ITL_CAUSE_PREFILL_INTERFERENCE]
    return (
        share,
        sc.VERDICT_SCHEDULING,
        [
            (
                f"{_pct(share)} of the slowest inter-token gaps is other requests' "
                "prefill in the same engine steps: smaller prefill chunks or "
                "prefill/decode disaggregation shorten it"
            ),
            (
                f"decode {_pct(itl_shares.get(sc.ITL_CAUSE_DECODE, 0.0))}, host "
                f"{_pct(itl_shares.get(sc.ITL_CAUSE_HOST, 0.0))} of those gaps"
            ),
        ],
    )


def _top(shares: Mapping[str, float], merge: set[str] | None = None) -> str | None:
    """The largest entry of ``shares``; with ``merge``, those entries count as one,
    ``"waiting"``."""
    groups: dict[str, float] = {}
    for name, v in shares.items():
        key = "waiting" if merge and name in merge else name
        groups[key] = groups.get(key, 0.0) + v
    if not groups:
        return None
    return max(groups.items(), key=lambda kv: kv[1])[0]


def ttft_stage_order(names: Sequence[str]) -> list[str]:
    """Stages in the contract's order, custom ones after, ``unattributed`` last."""
    order = {name: i for i, name in enumerate(sc.CANONICAL_STAGES)}
    body = sorted((n for n in names if n != sc.STAGE_UNATTRIBUTED),
                  key=lambda s: (order.get(s, len(order)), s))
    return [*body, sc.STAGE_UNATTRIBUTED] if sc.STAGE_UNATTRIBUTED in names else body


__all__ = ["KV_NEARLY_FULL", "MIN_REQUESTS", "N_CAUSES", "decide", "gap_causes",
           "ttft_stage_order"]
