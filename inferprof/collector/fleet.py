"""Fleet tables: what N collectors export so that Prometheus sums them into one breakdown.

Each collector sees a disjoint share of the requests (trace-ID routing). Quantiles and
``share_of_p95`` do not add up across collectors, but the sketch buckets they are read
from do: a bucket's weight over the whole fleet is the sum of its weights on each
collector. So every collector exports, as cumulative counters since it started, per
(service, model):

* per stage (``unattributed`` included) and end to end, the weight of each bucket of the
  quantile sketch (``sketch.KeyMapping``, the collector's relative accuracy), as a
  classic Prometheus histogram whose ``le`` bounds are the buckets' upper bounds;
* per end-to-end bucket, the weighted stage exclusive time, end-to-end time and traced
  request count of the requests in it: the tail-attribution table of
  ``attribution.py``, from which ``share_of_p95`` follows at any quantile after summing.
  Every bucket from the fastest request's up to ``+Inf`` is exposed, zeros included:
  Prometheus's ``rate()`` misses what a series holds at its first scrape, so a bucket
  born when a slow request first reaches it would lose that request, and the slow
  requests are the ones ``share_of_p95`` is about.

Summed by ``le`` across collectors (PromQL ``sum by (le)``, over ``increase()`` for a
window), these are exactly the tables one collector fed all the data would hold: the
quantiles and shares read from them (``document``) are that collector's to the rounding
of float sums, for values inside the exported range.

Cost and range: classic histograms sum correctly only when every collector exposes the
same ``le`` set, so each (series, stage) present exposes every bucket from
``FLEET_MIN_S`` to ``FLEET_MAX_S`` (plus ``le="0.0"`` for zero-length stages and
``+Inf``): about ``ln(FLEET_MAX_S / FLEET_MIN_S) / ln(gamma)`` series, 1,383 at the
default accuracy (0.005). Values below ``FLEET_MIN_S`` count in its bucket, values above
``FLEET_MAX_S`` only in ``+Inf``: their quantiles read as the range's ends. The tail
tables are per-bucket counters, which sum correctly whatever range each collector
exposes; starting at each collector's fastest request, they cost ``(stages + 2) *
ln(FLEET_MAX_S / fastest) / ln(gamma)`` series.

What does not merge this way stays per collector: GPU samples joined to compute spans,
queue-behind-batches, padding, examples, generation figures, cost. A fleet document
leaves them empty, and the verdict reads stage shares only (a compute-bound tail says
``unknown`` for want of GPU evidence, as it does on one collector without samples).

The collector serves these on ``GET /metrics/fleet`` (``FleetExposition``), a scrape of
their own, with ``--fleet-metrics``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from inferprof import semconv as sc
from inferprof.collector.attribution import (
    COL_BITS,
    COL_E2E,
    COL_MASK,
    COL_STAGE0,
    COL_TRACED,
    stage_row,
)
from inferprof.collector.gpu_samples import GpuSamples
from inferprof.collector.sketch import (
    KEY_BITS,
    KEY_MASK,
    KEY_OFFSET,
    KeyMapping,
    concat_reduce,
    rank_index,
)
from inferprof.collector.verdict import decide, gpu_evidence

#: The exported bucket range (seconds): each (series, stage) exposes every bucket in it.
FLEET_MIN_S = 1e-4
FLEET_MAX_S = 100.0
#: Chunks appended before the cumulative tables are compacted.
_COMPACT_AFTER = 16
#: The stage label of the end-to-end table in ``FleetTables.stages``.
E2E = ""


def le_label(value: float) -> str:
    """The ``le`` label of a bucket bound: the same string on every collector."""
    return "+Inf" if value == math.inf else repr(float(value))


class FleetStore:
    """Cumulative quantile and tail tables of one engine, since it started.

    ``add`` takes the engine's per-fold reduced codes: quantile codes ``(series <<
    q_shift) | (stage << KEY_BITS) | key``, tail codes ``attribution.tail_codes`` and the
    weighted sums of the values, coded ``(series << stage_bits) | stage`` (the
    histograms' ``_sum``).
    Not thread-safe: the engine calls it under its lock.
    """

    def __init__(self, q_shift: int, stage_bits: int) -> None:
        self._q_shift = q_shift
        self._stage_mask = (1 << stage_bits) - 1
        self._t_shift = KEY_BITS + COL_BITS
        self._stage_bits = stage_bits
        self._q: list[tuple[np.ndarray, np.ndarray]] = []
        self._t: list[tuple[np.ndarray, np.ndarray]] = []
        self._s: list[tuple[np.ndarray, np.ndarray]] = []

    def add(
        self,
        q: tuple[np.ndarray, np.ndarray],
        t: tuple[np.ndarray, np.ndarray],
        sums: tuple[np.ndarray, np.ndarray],
    ) -> None:
        self._q.append(q)
        self._t.append(t)
        self._s.append(sums)
        if len(self._q) > _COMPACT_AFTER:
            self._compact()

    def _compact(self) -> None:
        self._q = [concat_reduce(self._q)]
        self._t = [concat_reduce(self._t)]
        self._s = [concat_reduce(self._s)]

    def forget_series(self, sid: int) -> None:
        """Drop a reclaimed series: its counters start again from zero (a reset)."""
        self._compact()
        for chunks, shift in (
            (self._q, self._q_shift), (self._t, self._t_shift), (self._s, self._stage_bits),
        ):
            codes, values = chunks[0]
            keep = (codes >> shift) != sid
            chunks[0] = (codes[keep], values[keep])

    def tables(self) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
        """(quantile codes, weights), (tail codes, values), (sum codes, sums): sorted,
        reduced copies."""
        self._compact()
        return tuple((c.copy(), v.copy()) for c, v in (self._q[0], self._t[0], self._s[0]))


class FleetTables:
    """One (service, model)'s tables, as exported or as summed back from Prometheus.

    ``stages``: stage name (``E2E`` for end to end) -> {bucket key: weight};
    ``tail``: stage name -> {e2e bucket key: weighted exclusive seconds};
    ``tail_e2e`` / ``tail_traced``: {e2e bucket key: weighted e2e seconds / traced count};
    ``sums``: stage name -> weighted sum of its values.
    Keys are ``KeyMapping`` keys (0: the zero bucket).
    """

    __slots__ = ("stages", "sums", "tail", "tail_e2e", "tail_traced")

    def __init__(self) -> None:
        self.stages: dict[str, dict[int, float]] = {}
        #: stage name -> weighted sum of its values (the histograms' ``_sum``)
        self.sums: dict[str, float] = {}
        self.tail: dict[str, dict[int, float]] = {}
        self.tail_e2e: dict[int, float] = {}
        self.tail_traced: dict[int, float] = {}


def split_tables(
    q: tuple[np.ndarray, np.ndarray],
    t: tuple[np.ndarray, np.ndarray],
    sums: tuple[np.ndarray, np.ndarray],
    q_shift: int,
    stage_bits: int,
    stage_names: Sequence[str],
    e2e_stage: int,
) -> dict[int, FleetTables]:
    """A ``FleetStore``'s tables per series id."""
    out: dict[int, FleetTables] = {}
    stage_mask = (1 << stage_bits) - 1
    qc, qw = q
    for code, w in zip(qc.tolist(), qw.tolist(), strict=True):
        tables = out.get(code >> q_shift)
        if tables is None:
            tables = out[code >> q_shift] = FleetTables()
        stage = (code >> KEY_BITS) & stage_mask
        name = E2E if stage == e2e_stage else stage_names[stage]
        tables.stages.setdefault(name, {})[code & KEY_MASK] = w
    for code, v in zip(sums[0].tolist(), sums[1].tolist(), strict=True):
        tables = out.get(code >> stage_bits)
        if tables is not None:
            stage = code & stage_mask
            tables.sums[E2E if stage == e2e_stage else stage_names[stage]] = v
    tc, tv = t
    for code, v in zip(tc.tolist(), tv.tolist(), strict=True):
        tables = out.get(code >> (KEY_BITS + COL_BITS))
        if tables is None:
            tables = out[code >> (KEY_BITS + COL_BITS)] = FleetTables()
        key = (code >> COL_BITS) & KEY_MASK
        col = code & COL_MASK
        if col == COL_TRACED:
            tables.tail_traced[key] = tables.tail_traced.get(key, 0.0) + v
        elif col == COL_E2E:
            tables.tail_e2e[key] = tables.tail_e2e.get(key, 0.0) + v
        elif col >= COL_STAGE0:
            per = tables.tail.setdefault(stage_names[col - COL_STAGE0], {})
            per[key] = per.get(key, 0.0) + v
    return out


class Buckets:
    """The exported ``le`` grid of a mapping: keys ``lo..hi`` of ``[FLEET_MIN_S,
    FLEET_MAX_S]``, the zero bucket below them and ``+Inf`` above."""

    def __init__(self, mapping: KeyMapping) -> None:
        self.mapping = mapping
        self.lo = mapping.scalar_key(FLEET_MIN_S)
        self.hi = mapping.scalar_key(FLEET_MAX_S)
        keys = np.arange(self.lo, self.hi + 1)
        upper = np.power(mapping.gamma, (keys - KEY_OFFSET).astype(np.float64))
        self.labels = ["0.0", *(le_label(v) for v in upper.tolist()), "+Inf"]
        #: le label -> the key its bucket reads as (``hi + 1``: above the range)
        self.key_of = {label: k for label, k in zip(
            self.labels, [0, *keys.tolist(), self.hi + 1], strict=True
        )}

    def clamp(self, key: int) -> int:
        """The exported bucket holding sketch bucket ``key``."""
        if key == 0:
            return 0
        return min(max(key, self.lo), self.hi + 1)

    def label(self, key: int) -> str:
        return self.labels[0 if key == 0 else key - self.lo + 1]

    def cumulative(self, weights: Mapping[int, float]) -> list[tuple[str, float]]:
        """Classic cumulative buckets of {sketch key: weight}, every label of the grid."""
        per = np.zeros(len(self.labels))
        for key, w in weights.items():
            k = self.clamp(key)
            per[0 if k == 0 else k - self.lo + 1] += w
        return list(zip(self.labels, np.cumsum(per).tolist(), strict=True))

    def clamped(self, table: Mapping[int, float], from_key: int) -> dict[str, float]:
        """A per-bucket table keyed by ``le`` label (keys clamped to the grid), with every
        bucket of the grid from ``from_key`` up to ``+Inf``, zeros included."""
        start = self.clamp(from_key)
        keys = ([0] if start == 0 else []) + list(range(max(start, self.lo), self.hi + 2))
        out: dict[str, float] = dict.fromkeys(map(self.label, keys), 0.0)
        for key, v in table.items():
            label = self.label(self.clamp(key))
            out[label] = out.get(label, 0.0) + v
        return out


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value: float) -> str:
    return "+Inf" if value == math.inf else repr(float(value))


_HELP = {
    sc.PROM_FLEET_STAGE_DURATION: (
        "histogram",
        (
            "Time per request in each stage (unattributed included), weighted, in the "
            "collector's sketch buckets: sum by (le) across collectors for fleet quantiles."
        ),
    ),
    sc.PROM_FLEET_REQUEST_DURATION: (
        "histogram",
        "End-to-end request latency, weighted, in the collector's sketch buckets.",
    ),
    sc.PROM_FLEET_TAIL_STAGE: (
        "counter",
        (
            "Weighted exclusive time of each stage summed over the requests whose "
            "end-to-end latency falls in bucket le (that bucket only, not cumulative)."
        ),
    ),
    sc.PROM_FLEET_TAIL_REQUEST: (
        "counter",
        "Weighted end-to-end time summed over the requests in end-to-end bucket le.",
    ),
    sc.PROM_FLEET_TAIL_TRACED: (
        "counter", "Traced requests (unweighted) in end-to-end bucket le.",
    ),
    sc.PROM_FLEET_RELATIVE_ACCURACY: (
        "gauge",
        (
            "Relative accuracy of the fleet histograms' buckets: collectors summed "
            "together must share it."
        ),
    ),
}


def render(tables: Mapping[tuple[str, str], FleetTables], buckets: Buckets) -> bytes:
    """The fleet families of ``tables`` in the Prometheus text format (0.0.4).

    Rendered here rather than through ``prometheus_client``'s families, whose per-sample
    validation and escaping make a scrape of some ten thousand lines per (service,
    model) take most of a second (docs/collector.md, A fleet of collectors).
    """
    out: dict[str, list[str]] = {name: [] for name in _HELP}
    svc, mdl, stg, le = (
        sc.PROM_LABEL_SERVICE, sc.PROM_LABEL_MODEL, sc.PROM_LABEL_STAGE, sc.PROM_LABEL_LE,
    )
    for (service, model), t in tables.items():
        base = f'{svc}="{_escape(service)}",{mdl}="{_escape(model)}"'
        for stage, weights in t.stages.items():
            if stage == E2E:
                name, labels = sc.PROM_FLEET_REQUEST_DURATION, base
            else:
                name, labels = sc.PROM_FLEET_STAGE_DURATION, f'{base},{stg}="{_escape(stage)}"'
            cum = buckets.cumulative(weights)
            lines = out[name]
            head = f'{name}_bucket{{{labels},{le}="'
            lines.extend(f'{head}{label}"}} {value!r}' for label, value in cum)
            lines.append(f"{name}_count{{{labels}}} {cum[-1][1]!r}")
            lines.append(f"{name}_sum{{{labels}}} {_num(t.sums.get(stage, 0.0))}")
        fastest = min(t.tail_e2e, default=buckets.hi + 1)
        for stage, table in t.tail.items():
            head = f'{sc.PROM_FLEET_TAIL_STAGE}{{{base},{stg}="{_escape(stage)}",{le}="'
            out[sc.PROM_FLEET_TAIL_STAGE].extend(
                f'{head}{label}"}} {_num(v)}'
                for label, v in buckets.clamped(table, fastest).items()
            )
        for name, table in (
            (sc.PROM_FLEET_TAIL_REQUEST, t.tail_e2e), (sc.PROM_FLEET_TAIL_TRACED, t.tail_traced),
        ):
            head = f'{name}{{{base},{le}="'
            out[name].extend(
                f'{head}{label}"}} {_num(v)}'
                for label, v in buckets.clamped(table, fastest).items()
            )
    out[sc.PROM_FLEET_RELATIVE_ACCURACY].append(
        f"{sc.PROM_FLEET_RELATIVE_ACCURACY} {_num(buckets.mapping.relative_accuracy)}"
    )
    text = []
    for name, lines in out.items():
        kind, help_text = _HELP[name]
        # a counter's family is named without the samples' "_total"
        family = name[: -len("total") - 1] if kind == "counter" else name
        text.append(f"# HELP {family} {help_text}\n# TYPE {family} {kind}\n")
        if lines:
            text.append("\n".join(lines))
            text.append("\n")
    return "".join(text).encode()


class FleetExposition:
    """``/metrics/fleet`` of an engine: ``render`` of its tables, at most ``max_series``
    (service, model) pairs (the overflow series always)."""

    def __init__(self, engine: Any, max_series: int = 1000) -> None:
        self.engine = engine
        self.buckets = Buckets(engine.mapping)
        self.max_series = max_series

    def __call__(self) -> bytes:
        self.engine.advance()
        tables = self.engine.fleet_tables()
        allowed = set(self.engine.series()[: self.max_series]) | {(sc.OVERFLOW_SERIES, "")}
        return render({k: t for k, t in tables.items() if k in allowed}, self.buckets)


# --- reading the summed tables back ------------------------------------------------------


def _uncumulate(buckets: Buckets, cum: Mapping[str, float]) -> dict[int, float]:
    """Per-bucket weights (by key) of cumulative ``{le label: value}`` sums; unknown
    labels (another accuracy or range) raise ``ValueError``."""
    rows = []
    for label, v in cum.items():
        key = buckets.key_of.get(label)
        if key is None:
            raise ValueError(
                f"bucket le={label!r} is not on this accuracy's grid: the collectors summed "
                "do not share --relative-accuracy (or inferprof version)"
            )
        rows.append((key, v))
    rows.sort()
    out: dict[int, float] = {}
    prev = 0.0
    for key, v in rows:
        if v - prev > 0:
            out[key] = v - prev
        prev = max(prev, v)
    return out


def tables_from_sums(
    buckets: Buckets,
    stage_cum: Mapping[str, Mapping[str, float]],
    tail_stage: Mapping[str, Mapping[str, float]],
    tail_e2e: Mapping[str, float],
    tail_traced: Mapping[str, float],
) -> FleetTables:
    """``FleetTables`` from the families summed by ``le`` across collectors:
    ``stage_cum``: stage (``E2E`` for the request histogram) -> {le: cumulative weight};
    the tail families as {le: value} (per stage for ``tail_stage``)."""

    def keyed(table: Mapping[str, float]) -> dict[int, float]:
        out = {}
        for label, v in table.items():
            if label not in buckets.key_of:
                raise ValueError(f"bucket le={label!r} is not on this accuracy's grid")
            out[buckets.key_of[label]] = v
        return out

    tables = FleetTables()
    tables.stages = {stage: _uncumulate(buckets, cum) for stage, cum in stage_cum.items()}
    tables.tail = {stage: keyed(t) for stage, t in tail_stage.items()}
    tables.tail_e2e = keyed(tail_e2e)
    tables.tail_traced = keyed(tail_traced)
    return tables


def _quantiles(
    mapping: KeyMapping, table: Mapping[int, float]
) -> tuple[float, dict[str, float | None], int | None]:
    keys = np.array(sorted(k for k, w in table.items() if w > 0), np.int64)
    if keys.size == 0:
        return 0.0, {"p50": None, "p95": None, "p99": None}, None
    weights = np.array([table[k] for k in keys.tolist()])
    cum = np.cumsum(weights)
    values = mapping.value(keys)
    idx = [rank_index(cum, q) for q in sc.QUANTILES]
    return (
        float(cum[-1]),
        {name: float(values[i]) for name, i in zip(("p50", "p95", "p99"), idx, strict=True)},
        int(keys[idx[1]]),
    )


def _shares(tables: FleetTables, from_key: int) -> tuple[dict[str, float], float]:
    den = sum(v for k, v in tables.tail_e2e.items() if k >= from_key)
    traced = sum(v for k, v in tables.tail_traced.items() if k >= from_key)
    if den <= 0:
        return {}, traced
    shares = {}
    for stage, table in tables.tail.items():
        num = sum(v for k, v in table.items() if k >= from_key)
        if num != 0.0:
            shares[stage] = num / den
    return shares, traced


def document(
    service: str,
    model: str | None,
    window_s: float | None,
    tables: FleetTables,
    mapping: KeyMapping,
    errors: float = 0.0,
) -> dict[str, Any]:
    """The contract §5 breakdown of summed fleet ``tables``: requests, latency, per-stage
    quantiles and shares of p50/p95/p99 and the verdict, as the engine computes them; the
    sections that do not merge across collectors empty."""
    requests, latency, p95_key = _quantiles(mapping, tables.stages.get(E2E, {}))
    e2e = tables.stages.get(E2E, {})
    keys = np.array(sorted(k for k, w in e2e.items() if w > 0), np.int64)
    e2e_keys: dict[float, int] = {}
    if keys.size:
        cum = np.cumsum([e2e[k] for k in keys.tolist()])
        e2e_keys = {q: int(keys[rank_index(cum, q)]) for q in (0.5, 0.99)}
    shares, tail_traced = _shares(tables, p95_key or 0)
    _, traced = _shares(tables, 0)
    shares50 = _shares(tables, e2e_keys.get(0.5, 0))[0]
    shares99 = _shares(tables, e2e_keys.get(0.99, 0))[0]
    order = {name: i for i, name in enumerate(sc.CANONICAL_STAGES)}
    present = [s for s in tables.stages if s not in (E2E, sc.STAGE_UNATTRIBUTED)]
    present.sort(key=lambda s: (order.get(s, len(order)), s))
    if sc.STAGE_UNATTRIBUTED in tables.stages:
        present.append(sc.STAGE_UNATTRIBUTED)
    stages = []
    for name in present:
        count, qs, _ = _quantiles(mapping, tables.stages[name])
        stages.append(stage_row(name, count, qs, shares, shares50, shares99))
    gpu = gpu_evidence(GpuSamples(), [], None)
    doc = {
        "service": service,
        "model": model,
        "window_s": None if window_s is None else float(window_s),
        "requests": round(requests),
        "errors": round(errors),
        "traced_requests": round(traced),
        "latency": latency,
        "stages": stages,
        "gpu": gpu,
        "queue": None,
        "padding": {
            "effective_tokens": 0, "padded_tokens": 0, "waste_ratio": None, "batches": 0,
        },
    }
    doc["verdict"] = decide(shares, round(traced), round(tail_traced), gpu, None)
    doc["examples"] = []
    return doc


__all__ = [
    "E2E",
    "FLEET_MAX_S",
    "FLEET_MIN_S",
    "Buckets",
    "FleetExposition",
    "FleetStore",
    "FleetTables",
    "document",
    "le_label",
    "render",
    "split_tables",
    "tables_from_sums",
]
