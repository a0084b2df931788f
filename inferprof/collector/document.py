"""A breakdown document (contract §5) from the slices of a window: quantiles, shares of
the tail, stage rows, the verdict, examples, cost and the generation section."""

from __future__ import annotations

import numpy as np

from inferprof import semconv as sc
from inferprof.collector import cost as _cost
from inferprof.collector.attribution import (
    COL_BITS,
    stage_row,
    tail_shares,
)
from inferprof.collector.layout import (
    _E2E,
    _Q_LOCAL,
    _UNATTRIBUTED,
)
from inferprof.collector.queueing import combine, partial
from inferprof.collector.sketch import (
    KEY_BITS,
    TimeSlice,
    concat_reduce,
    gather,
    rank_index,
    split_groups,
)
from inferprof.collector.verdict import decide, gpu_evidence


class DocumentPart:
    """Part of :class:`~inferprof.collector.engine.Engine` (a mixin: it reads the
    engine's state)."""

    def _queue_partial(self, sl: TimeSlice, sid: int) -> tuple:
        """``queueing.partial`` of one slice's queue spans of one series, against the
        work windows of that slice and its neighbours (a queue waits behind batches
        folded a little earlier or later); cached until one of the three changes."""
        near = [self._slices.get(sl.index + d) for d in (-1, 0, 1)]
        versions = tuple(n.queue_version.get(sid, 0) if n is not None else -1 for n in near)
        cached = sl.queue_cache.get(sid)
        if cached is not None and cached[0] == versions:
            return cached[1]
        work = [n.work[sid] for n in near if n is not None and sid in n.work]
        queue = sl.queue.get(sid)
        result = partial(
            queue[:, :5] if queue is not None else np.empty((0, 5)),
            np.concatenate(work) if work else np.empty((0, 3)),
            sl.work_seen.get(sid, 0.0),
            sl.work_estimate.get(sid, 0.0),
        )
        sl.queue_cache[sid] = (versions, result)
        return result

    def _document(self, service, model, window_s, sids, slices, since) -> dict:
        q_parts, t_parts, padding, errors, compute, partials = self._gather(slices, sids)
        per_stage = split_groups(*concat_reduce(q_parts))

        requests, latency, p95_key = self._quantiles(per_stage, _E2E)
        e2e_keys = {}
        if _E2E in per_stage:
            k, w = per_stage[_E2E]
            cum = np.cumsum(w)
            e2e_keys = {q: int(k[rank_index(cum, q)]) for q in (0.5, 0.99)}
        if t_parts:
            t_codes = np.concatenate([p[0] for p in t_parts])
            t_vals = np.concatenate([p[1] for p in t_parts])
        else:
            t_codes, t_vals = np.empty(0, np.int64), np.empty(0)
        names = self._stage_names
        shares, tail_traced, _ = tail_shares(t_codes, t_vals, p95_key or 0, names)
        shares.pop("", None)
        _, traced, _ = tail_shares(t_codes, t_vals, 0, ())
        # Extension: the same attribution above p50 and p99 (report's stacked chart).
        shares50 = tail_shares(t_codes, t_vals, e2e_keys.get(0.5, 0), names)[0]
        shares99 = tail_shares(t_codes, t_vals, e2e_keys.get(0.99, 0), names)[0]

        order = {name: i for i, name in enumerate(sc.CANONICAL_STAGES)}
        stages = self._stage_rows(per_stage, order, shares, shares50, shares99)
        gpu = gpu_evidence(self._gpu, compute, since)
        # The slowest end to end, then per stage in the stages' order.
        examples = self._examples.document(
            [sl.index for sl in slices],
            sids,
            names,
            lambda s: (s == sc.STAGE_UNATTRIBUTED, order.get(s, len(order)), s),
        )
        cost = _cost.section(
            {names[c]: v for c, v in self._cost.totals([sl.index for sl in slices], sids).items()},
            requests,
            sc.COMPUTE_STAGES.__contains__,
            self._gpu.during(sc.METRIC_GPU_POWER_DRAW, compute),
            self._cost.price(self.gpu_hour_prices, compute),
            lambda s: (order.get(s, len(order)), s),
        )
        eff, pad, batches = padding
        doc = {
            "service": service,
            "model": model,
            # What the document covers: a window longer than the retention covers only
            # what is retained (None: everything retained, the offline report's case).
            "window_s": (
                None if window_s is None else float(min(window_s, self.retention_s))
            ),
            "requests": round(requests),
            "errors": round(errors),
            "traced_requests": int(traced),
            "latency": latency,
            "stages": stages,
            "gpu": gpu,
            "queue": combine(partials),
            "padding": {
                "effective_tokens": eff,
                "padded_tokens": pad,
                "waste_ratio": (1.0 - eff / pad) if pad else None,
                "batches": batches,
            },
        }
        doc["verdict"] = decide(shares, int(traced), int(tail_traced), gpu, doc["queue"])
        doc["examples"] = examples
        generation = self._gen.section(sids, [sl.index for sl in slices], doc["verdict"])
        if generation is not None:
            doc["generation"] = generation
        if cost is not None:
            doc["cost"] = cost
        return doc

    def _gather(self, slices: list[TimeSlice], sids: list[int]) -> tuple:
        """What the slices hold for the series ``sids``: quantile and tail parts, padding
        counts, errors, compute windows and queue partials."""
        q_parts: list = []
        t_parts: list = []
        padding = [0, 0, 0]
        errors = 0.0
        compute: list[tuple[str, str, float, float]] = []
        partials = []
        for sl in slices:
            q_parts.extend(gather(sl.quantile_store(), sids, _Q_LOCAL))
            t_parts.extend(gather(sl.tail_store(), sids, KEY_BITS + COL_BITS))
            for sid in sids:
                errors += sl.errors.get(sid, 0.0)
                acc = sl.padding.get(sid)
                if acc:
                    for i in range(3):
                        padding[i] += acc[i]
                compute.extend(sl.compute.get(sid, ()))
                if sid in sl.queue_version:
                    partials.append(self._queue_partial(sl, sid))
        return q_parts, t_parts, padding, errors, compute, partials

    def _quantiles(self, per_stage: dict, stage: int
                   ) -> tuple[float, dict[str, float | None], int | None]:
        """A stage's (weighted count, p50/p95/p99, the p95's sketch key)."""
        if stage not in per_stage:
            return 0.0, {"p50": None, "p95": None, "p99": None}, None
        k, w = per_stage[stage]
        cum = np.cumsum(w)
        values = self.mapping.value(k)
        idx = [rank_index(cum, q) for q in sc.QUANTILES]
        return (
            float(cum[-1]),
            {name: float(values[i])
             for name, i in zip(("p50", "p95", "p99"), idx, strict=False)},
            int(k[idx[1]]),
        )

    def _stage_rows(self, per_stage: dict, order: dict[str, int], shares: dict,
                    shares50: dict, shares99: dict) -> list[dict]:
        """The breakdown's ``stages``: canonical order, custom stages after, then
        ``unattributed`` when there is any."""
        names = self._stage_names
        present = [names[i] for i in per_stage if i not in (_E2E, _UNATTRIBUTED)]
        present.sort(key=lambda s: (order.get(s, len(order)), s))
        stages = []
        for name in [*present, sc.STAGE_UNATTRIBUTED]:
            idx = self._stage_index[name]
            count, qs, _ = self._quantiles(per_stage, idx)
            if name == sc.STAGE_UNATTRIBUTED and idx not in per_stage:
                continue
            stages.append(stage_row(name, count, qs, shares, shares50, shares99))
        return stages
