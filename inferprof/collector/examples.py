"""Slow-request examples: the traces behind a breakdown's tail.

The quantile sketches say how slow the tail is; an example says which request was slow,
so a user can open its trace. Per (time slice, series) the engine keeps

* the ``top`` slowest requests end to end, and
* per stage (``unattributed`` included), the request that spent the longest in it,

each with its trace id, end-to-end seconds, its exclusive time per stage (the
partition of §6: it sums to the end-to-end time) and its GPU-seconds per device stage
(``cost.py``: its share of its batches' device time). Memory is bounded: at most
``top`` + (distinct stage names) entries per slice and series, each a few hundred bytes,
whatever the request rate. A window's examples are the slowest over its slices. With
``collapse`` (the offline report, which keeps every slice), all slices share one set, so
a long recording holds no more than a short one.

Only traced requests can be examples (a sampled-out request has no trace to open), and
an example is what was slowest among them: with a tail-biased sampler that is the real
tail; with uniform sampling at rate r, the slowest of a 1/r share of the requests.

``link(template, trace_id)`` turns a trace id into a URL: the template's ``{trace_id}``
is replaced by the 32-digit hex id; nothing else in it is interpreted, so Grafana
Explore URLs, whose JSON holds other braces, can be used as they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

#: Slowest requests end to end kept per (slice, series), and listed per breakdown.
DEFAULT_TOP = 5
#: What a trace-URL template must contain.
TRACE_ID_PLACEHOLDER = "{trace_id}"
#: ``Example.slowest`` of the end-to-end examples (a stage name for the others).
SLOWEST_LATENCY = "latency"

# An example: (seconds it was slowest by, end-to-end seconds, trace id, split, GPU
# split), where split is a tuple of (stage column, exclusive seconds) and GPU split one
# of (stage column, GPU-seconds). Tuples: a slice holds few of them.
_Example = tuple[
    float, float, bytes, tuple[tuple[int, float], ...], tuple[tuple[int, float], ...]
]


def check_template(template: str | None) -> str | None:
    """``template`` if it is a usable trace-URL template (None passes); ``ValueError``
    naming the placeholder otherwise."""
    if template is None:
        return None
    if not isinstance(template, str) or TRACE_ID_PLACEHOLDER not in template:
        raise ValueError(
            f"trace URL template must contain {TRACE_ID_PLACEHOLDER}, e.g. "
            f"http://localhost:16686/trace/{TRACE_ID_PLACEHOLDER} (Jaeger), got {template!r}"
        )
    return template


def link(template: str, trace_id: str) -> str:
    """The URL of one trace: ``template`` with ``{trace_id}`` replaced."""
    return template.replace(TRACE_ID_PLACEHOLDER, trace_id)


def with_links(doc: dict[str, Any], template: str | None) -> dict[str, Any]:
    """``doc`` (a breakdown document) with a ``url`` on each of its examples when
    ``template`` is set; the document itself is not modified."""
    if not template or not doc.get("examples"):
        return doc
    out = dict(doc)
    out["examples"] = [{**ex, "url": link(template, ex["trace_id"])} for ex in doc["examples"]]
    return out



def _by_request(rows: set[int], req: np.ndarray, col: np.ndarray,
                value: np.ndarray) -> dict[int, list[tuple[int, float]]]:
    """The ``(column, value)`` pairs of each request in ``rows``, in array order, from
    per-pair arrays ``req``, ``col``, ``value`` (every row present, maybe empty)."""
    out: dict[int, list[tuple[int, float]]] = {r: [] for r in rows}
    mask = np.isin(req, np.fromiter(rows, np.int64, len(rows)))
    for r, c, v in zip(req[mask].tolist(), col[mask].tolist(), value[mask].tolist(),
                       strict=True):
        out[r].append((c, v))
    return out

class _Kept:
    __slots__ = ("slowest", "stages")

    def __init__(self) -> None:
        self.slowest: list[_Example] = []  # descending, at most ``top``
        self.stages: dict[int, _Example] = {}  # stage column -> its slowest request


class ExampleStore:
    """The examples of every retained slice; not thread-safe (the engine locks)."""

    def __init__(self, top: int = DEFAULT_TOP, *, collapse: bool = False) -> None:
        if not isinstance(top, int) or isinstance(top, bool) or top < 1:
            raise ValueError(f"top must be a positive integer, got {top!r}")
        self.top = top
        self.collapse = collapse
        self._slices: dict[int, dict[int, _Kept]] = {}

    def add(
        self,
        index: int,
        series: np.ndarray,
        trace_ids: Sequence[bytes],
        e2e: np.ndarray,
        pair_req: np.ndarray,
        pair_stage: np.ndarray,
        pair_time: np.ndarray,
        pair_excl: np.ndarray,
        gpu_seconds: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """Offer the requests of one fold to slice ``index``.

        Per request ``i``: ``series[i]``, ``trace_ids[i]``, ``e2e[i]``; per (request,
        stage) pair: request index, stage column, stage time and exclusive time;
        ``gpu_seconds``: (request, stage column, GPU-seconds) arrays. Only the few
        candidates numpy picks (the ``top`` slowest per series, the slowest per (series,
        stage)) reach Python.
        """
        n = e2e.size
        if not n or len(trace_ids) < n:
            return
        kept_slice = self._slices.setdefault(0 if self.collapse else index, {})
        # Ties go to the smaller trace id, so that the examples do not depend on the
        # order requests arrived or were folded in.
        ids = np.frombuffer(b"".join(trace_ids[:n]), ">u8")
        if ids.size != 2 * n:  # not 16-byte ids (the assembler drops those): no ties broken
            ids = np.zeros(2 * n, ">u8")
        hi, lo = ids[0::2], ids[1::2]
        # The `top` slowest of each series: sort by series, then slowest first.
        order = np.lexsort((lo, hi, -e2e, series))
        s_sorted = series[order]
        starts = np.flatnonzero(np.r_[True, s_sorted[1:] != s_sorted[:-1]])
        position = np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))
        top_rows = order[position < self.top]
        # The slowest request of each (series, stage).
        stage_rows = np.empty(0, np.int64)
        if pair_req.size:
            code = series[pair_req] * (int(pair_stage.max()) + 1) + pair_stage
            p_order = np.lexsort((lo[pair_req], hi[pair_req], -pair_time, code))
            c_sorted = code[p_order]
            first = p_order[np.flatnonzero(np.r_[True, c_sorted[1:] != c_sorted[:-1]])]
            stage_rows = first
        # Exclusive split of each candidate request.
        rows = set(top_rows.tolist()) | set(pair_req[stage_rows].tolist())
        split = _by_request(rows, pair_req, pair_stage, pair_excl)
        gpu = (_by_request(rows, *gpu_seconds) if gpu_seconds is not None
               else {r: [] for r in rows})
        top = self.top
        e2e_l = e2e.tolist()
        for r in top_rows.tolist():
            kept = kept_slice.get(int(series[r]))
            if kept is None:
                kept = kept_slice[int(series[r])] = _Kept()
            ex: _Example = (e2e_l[r], e2e_l[r], trace_ids[r], tuple(split[r]), tuple(gpu[r]))
            if len(kept.slowest) < top or _rank(ex) < _rank(kept.slowest[-1]):
                kept.slowest.append(ex)
                kept.slowest.sort(key=_rank)
                del kept.slowest[top:]
        for p in stage_rows.tolist():
            r = int(pair_req[p])
            stage = int(pair_stage[p])
            seconds = float(pair_time[p])
            kept = kept_slice.get(int(series[r]))
            if kept is None:
                kept = kept_slice[int(series[r])] = _Kept()
            ex = (seconds, e2e_l[r], trace_ids[r], tuple(split[r]), tuple(gpu[r]))
            old = kept.stages.get(stage)
            if old is None or _rank(ex) < _rank(old):
                kept.stages[stage] = ex

    def prune(self, oldest: int) -> None:
        """Forget the slices before index ``oldest``."""
        for idx in [i for i in self._slices if i < oldest]:
            del self._slices[idx]

    def forget_series(self, sid: int) -> None:
        """Forget a series whose slot is given to another (service, model)."""
        for kept in self._slices.values():
            kept.pop(sid, None)

    def document(
        self, indices: Iterable[int], sids: Iterable[int], names: Sequence[str], order: Any
    ) -> list[dict[str, Any]]:
        """The ``examples`` list of a breakdown over slices ``indices`` and series
        ``sids``: the ``top`` slowest end to end, then the slowest of each stage (in
        ``order``, a sort key of stage names). ``names``: stage column -> name."""
        sids = list(sids)
        if self.collapse:
            indices = [0] if any(True for _ in indices) else []
        slowest: list[_Example] = []
        per_stage: dict[int, _Example] = {}
        for idx in indices:
            kept_slice = self._slices.get(idx)
            if not kept_slice:
                continue
            for sid in sids:
                kept = kept_slice.get(sid)
                if kept is None:
                    continue
                slowest.extend(kept.slowest)
                for stage, ex in kept.stages.items():
                    old = per_stage.get(stage)
                    if old is None or _rank(ex) < _rank(old):
                        per_stage[stage] = ex
        slowest.sort(key=_rank)
        out = [_entry(ex, SLOWEST_LATENCY, names, order) for ex in slowest[: self.top]]
        for stage in sorted(per_stage, key=lambda c: order(names[c])):
            if per_stage[stage][0] > 0:  # a stage (unattributed) no request spent time in
                out.append(_entry(per_stage[stage], names[stage], names, order))
        return out


def _rank(ex: _Example) -> tuple[float, bytes]:
    """Sort key, best first: the slowest, then the smaller trace id."""
    return (-ex[0], ex[2])


def _entry(
    ex: _Example, slowest: str, names: Sequence[str], order: Any
) -> dict[str, Any]:
    seconds, e2e, trace_id, split, gpu = ex
    stages = sorted(((names[c], t) for c, t in split), key=lambda item: order(item[0]))
    entry = {
        "trace_id": trace_id.hex(),
        "slowest": slowest,
        "seconds": seconds,
        "latency": e2e,
        "stages": dict(stages),
    }
    if gpu:
        entry["gpu_seconds"] = dict(
            sorted(((names[c], t) for c, t in gpu), key=lambda item: order(item[0])))
    return entry


__all__ = [
    "DEFAULT_TOP",
    "SLOWEST_LATENCY",
    "TRACE_ID_PLACEHOLDER",
    "ExampleStore",
    "check_template",
    "link",
    "with_links",
]
