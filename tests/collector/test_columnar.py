"""The columnar ingest path (``Assembler._ingest_columns`` / ``_finalise_packed``) against
the span-by-span one, on random mixed workloads: what the engine folds (every column of
every finalised batch, in order), its counters and its documents must be identical.

The workloads mix the common case the columnar path takes with every case it leaves to
the span-by-span path or must hand back to it: traces split over exports, late and
duplicate spans, re-sent exports, linked batch spans (before and after their members),
stages under other spans, extra spans, orphans, invalid ids, times and stage names, new
stage names, generating requests, trace states, error statuses, several resources and
scopes per export, Triton's scope, the clock advancing between exports and a last flush.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from inferprof import semconv as sc
from inferprof.collector.assembly import Assembler
from inferprof.collector.engine import Engine
from tests.collector.synth import CLIENT, INTERNAL, Ref, TraceBuilder

_STAGES = ["receive", "tokenize", "queue", "batch_assembly", "compute", "d2h", "h2d",
           "serialize", "postprocess", "custom_step"]
_COLUMNS = ("service", "model", "weight", "start", "end", "error", "counted", "span_key",
            "span_start", "span_end", "batches", "compute", "instance", "work", "work_share",
            "queue_behind", "trace_id", "tokens", "device")


_MIN_SPANS = Assembler.columnar_min_spans


@pytest.fixture(autouse=True)
def _every_scope_by_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """The columnar path on every scope, however small (``columnar_min_spans``)."""
    monkeypatch.setattr(Assembler, "columnar_min_spans", 1)


def _request(rng: random.Random, b: TraceBuilder, t: float, batch: list[str]) -> list[Any]:
    """One request's spans (the builder's span messages), in a random variant."""
    first = len(b.spans)
    variant = rng.random()
    attrs: dict[str, Any] = {}
    if rng.random() < 0.2:
        attrs[sc.ATTR_TOKENS_PROMPT] = rng.randint(1, 50)
    if rng.random() < 0.05:
        attrs[sc.ATTR_SUMMARY_COUNTED] = True
    if rng.random() < 0.04:
        attrs[sc.ATTR_TOKENS_OUTPUT] = 7  # generating: not the common case
    e2e = rng.uniform(0.01, 0.2)
    req = b.request(
        t, t + e2e,
        model=rng.choice(["m", "m", "n", None]),
        weight=rng.choice([None, None, 4.0, 0.5]),
        trace_state=rng.choice(["", "", "", "ot=th:8", "ot=th:c;rv:1"]),
        status=2 if rng.random() < 0.1 else 0,
        kind=rng.choice([2, 2, 2, 2, 5, 1]),
        **attrs,
    )
    if variant < 0.05:
        return b.spans[first:]  # a request span alone
    parent: Ref = req
    if variant < 0.12:  # stages under an internal span
        parent = b.span("handler", t, t + e2e, parent=req, kind=INTERNAL)
    if rng.random() < 0.1:
        b.span("http send", t, t + 0.001, parent=req, kind=CLIENT)
    cursor = t
    for stage in rng.sample(_STAGES, rng.randint(1, 6)):
        d = rng.uniform(0.0, e2e / 3) if rng.random() > 0.05 else 0.0
        s = cursor - rng.uniform(0, 0.01) if rng.random() < 0.15 else cursor  # overlaps
        extra: dict[str, Any] = {}
        if stage in ("batch_assembly", "compute", "d2h", "h2d") and rng.random() < 0.7:
            extra = {
                "batch_id": rng.choice(batch) if rng.random() < 0.9 else None,
                "batch_size": rng.choice([None, 4, 8]),
                "effective": rng.choice([None, 90, 100]),
                "padded": rng.choice([None, 128]),
                "gpu_id": rng.choice([None, "0", "GPU-1"]) if stage == "compute" else None,
                "model": rng.choice([None, "m2"]),
            }
        if stage == "queue" and rng.random() < 0.5:
            extra[sc.ATTR_QUEUE_BEHIND_BATCHES_S] = rng.uniform(0, 0.01)
        if rng.random() < 0.02:
            stage = "Bad Stage!"
        if rng.random() < 0.02:
            stage = f"new_{rng.randint(0, 3)}"
        b.stage(parent, stage, s, s + d, **extra)
        cursor += d
    spans = b.spans[first:]
    roll = rng.random()
    if roll < 0.02:  # a zero span id
        spans[-1].span_id = bytes(8)
    elif roll < 0.04:  # ends before it starts
        spans[-1].end_time_unix_nano = spans[-1].start_time_unix_nano - 1
    elif roll < 0.06:  # a duplicate span id
        spans.append(type(spans[-1])())
        spans[-1].CopyFrom(spans[0])
    return spans


def _workload(seed: int) -> list[tuple[float, ExportTraceServiceRequest]]:
    """(collector time, export) pairs."""
    rng = random.Random(seed)
    builders = [TraceBuilder("svc-a", host="h1", instance="i1"),
                TraceBuilder("svc-b", host="h2", instance="i2"),
                TraceBuilder("svc-a", host="h3", instance="i3", scope="triton-server")]
    carry: dict[int, list[Any]] = {0: [], 1: []}
    sent: list[ExportTraceServiceRequest] = []
    out: list[tuple[float, ExportTraceServiceRequest]] = []
    now = 1000.0
    links: list[Ref] = []
    for e in range(rng.randint(8, 16)):
        export = ExportTraceServiceRequest()
        batch = [f"b{e}-{i}" for i in range(3)] + ["shared"]
        for which in (0, 1):
            b = builders[which]
            spans = carry[which]
            carry[which] = []
            for i in range(rng.randint(0, 25)):
                t = e * 0.5 + i * 0.003
                got = _request(rng, b, t, batch)
                if rng.random() < 0.15:  # the rest of this trace comes in a later export
                    cut = rng.randint(0, len(got))
                    carry[which].extend(got[cut:])
                    got = got[:cut]
                spans.extend(got)
                req = got[0] if got else None
                if req is not None and rng.random() < 0.1:
                    links.append(Ref(req.trace_id, req.span_id))
            if links and rng.random() < 0.5:  # linked batch spans (encoding b)
                members = rng.sample(links, min(len(links), rng.randint(1, 4)))
                b.stage(None, "compute", e * 0.5, e * 0.5 + 0.01, links=members,
                        batch_id=f"L{e}", batch_size=len(members))
                spans.append(b.spans.pop())
            if spans and rng.random() < 0.1:  # a late span of a trace sent before
                late = type(spans[0])()
                late.CopyFrom(rng.choice(spans))
                late.span_id = rng.randbytes(8)
                carry[which].append(late)
            if rng.random() < 0.3:
                rng.shuffle(spans)
            b.spans = []
            part = b.export(spans)
            if rng.random() < 0.3 and len(spans) > 4:  # two scopes
                half = len(spans) // 2
                part = b.export(spans[:half])
                part.resource_spans[0].scope_spans.add().spans.extend(spans[half:])
            export.resource_spans.extend(part.resource_spans)
        if rng.random() < 0.3:
            tb = builders[2]
            tb.triton_request(None, e * 0.5, e * 0.5 + 0.01, compute=[e * 0.5 + 0.001,
                              e * 0.5 + 0.002, e * 0.5 + 0.003, e * 0.5 + 0.004])
            export.resource_spans.extend(tb.export().resource_spans)
        out.append((now, export))
        sent.append(export)
        if rng.random() < 0.1 and sent:  # an export re-sent
            out.append((now, rng.choice(sent)))
        now += rng.choice([0.2, 0.7, 1.5, 3.0, 30.0, 70.0])
    return out


def _run(work: list, *, columnar: bool, payload: bool) -> tuple[Engine, list[dict]]:
    clock = [0.0]
    engine = Engine(settle_s=2.0, trace_timeout_s=60.0, clock=lambda: clock[0],
                    retention_s=float("inf"))
    engine._asm.columnar = columnar
    folded: list[dict] = []
    fold = engine._fold

    def record(fin: Any, now: float) -> None:
        if not len(fin):  # readers catch up too: nothing to compare there
            fold(fin, now)
            return
        columns = {name: list(getattr(fin, name)) for name in _COLUMNS}
        # Work windows are a set to the fold (sorted, copies merged): their order may differ.
        work = columns["work"]
        columns["work"] = sorted(zip(work[::3], work[1::3], work[2::3], strict=True))
        folded.append(columns)
        fold(fin, now)

    engine._fold = record  # type: ignore[method-assign]
    for now, export in work:
        clock[0] = now
        engine.ingest_traces(export, payload=export.SerializeToString() if payload else None)
    clock[0] += 1000.0
    engine.flush()
    asm = engine._asm
    folded.append({"stats": engine.stats, "stage_names": list(asm.stage_names),
                   "seen_batches": list(asm.seen_batches.items()),
                   "recent_done": list(asm.recent_done.items()),
                   "counted": sorted(asm.counted.items())})
    return engine, folded


def _documents(engine: Engine) -> list:
    docs = []
    for service, model in sorted(engine.series()):
        docs.append(engine.breakdown(service, model, window_s=None))
    return docs


@pytest.mark.parametrize("seed", range(12))
def test_columnar_equals_span_by_span(seed: int) -> None:
    work = _workload(seed)
    ref, ref_folded = _run(work, columnar=False, payload=False)
    assert ref.stats.requests_finalised > 0
    for payload in (True, False):
        got, got_folded = _run(work, columnar=True, payload=payload)
        assert len(got_folded) == len(ref_folded)
        for i, (a, b) in enumerate(zip(got_folded[:-1], ref_folded[:-1], strict=True)):
            for name in _COLUMNS:
                assert a[name] == b[name], (i, name)
        assert got_folded[-1] == ref_folded[-1]  # counters and what the assembler keeps
        assert _documents(got) == _documents(ref)
        for a, b in zip(got.histograms(), ref.histograms(), strict=True):
            assert a[:3] == b[:3] and np.array_equal(a[3], b[3]) and a[4] == b[4]


@pytest.mark.parametrize("seed", range(4))
def test_columnar_equals_span_by_span_with_both_paths_in_one_run(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the cut between the paths inside the workloads' scope sizes, one run takes
    both: a trace split over exports is assembled partly by columns, partly span by span,
    a packed trace gets a late span read span by span; the same figures."""
    monkeypatch.setattr(Assembler, "columnar_min_spans", 20)
    work = _workload(100 + seed)
    ref, ref_folded = _run(work, columnar=False, payload=False)
    got, got_folded = _run(work, columnar=True, payload=True)
    assert len(got_folded) == len(ref_folded)
    for i, (a, b) in enumerate(zip(got_folded[:-1], ref_folded[:-1], strict=True)):
        for name in _COLUMNS:
            assert a[name] == b[name], (i, name)
    assert got_folded[-1] == ref_folded[-1]
    assert _documents(got) == _documents(ref)


def test_columnar_path_taken() -> None:
    """The common case is assembled by columns (else the test above compares nothing)."""
    work = _workload(3)
    engine = Engine(settle_s=2.0, clock=lambda: 1000.0)
    packed = 0
    take = engine._asm._ingest_columns

    def count(*args: Any) -> bool:
        nonlocal packed
        before = len(engine._asm.traces)
        taken = take(*args)
        packed += len(engine._asm.traces) - before
        return taken

    engine._asm._ingest_columns = count  # type: ignore[method-assign]
    for _, export in work:
        engine.ingest_traces(export, payload=export.SerializeToString())
    assert packed > 50


def test_packed_trace_holds_only_its_spans() -> None:
    """A packed trace held until due keeps its own spans, not the rest of its scope's:
    spans rejected (or not pending) beside it must not stay in memory with it, or memory
    would no longer be bounded by the pending spans (docs/collector.md, sizing)."""
    import gc
    import tracemalloc

    def export() -> ExportTraceServiceRequest:
        b = TraceBuilder("svc")
        req = b.request(0.0, 0.1, trace_state="ot=th:8")
        b.stage(req, "compute", 0.0, 0.05)
        for _ in range(20_000):  # ends before it starts: rejected
            b.span("bad", 0.2, 0.1, trace_state="ot=th:8")
        return b.export()

    held = {}
    for columnar in (False, True):
        asm = Assembler(settle_s=2.0, trace_timeout_s=60.0, max_spans_per_trace=100,
                        clock=lambda: 0.0)
        asm.columnar = columnar
        warm = export()  # the readers' caches filled first
        asm.ingest(warm, warm.SerializeToString())
        asm.advance(0.0, everything=True)
        work = export()
        payload = work.SerializeToString()
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            assert asm.ingest(work, payload)[:2] == (2, 20_000)
            gc.collect()
            held[columnar] = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert asm.pending == 2
    # Two pending spans: a few KiB at most either way, not a share of the 20,000 rejected.
    assert held[True] < 64 * 1024, held


# --- odd inputs, at the assembler: attribute types, huge ids and times, budgets --------

_ODD = {
    sc.ATTR_MODEL_NAME: ["m", "", 5, b"x", True],
    sc.ATTR_SAMPLE_WEIGHT: [4.0, 4, 0.5, 1e9, True, "4", float("nan"), float("inf")],
    sc.ATTR_TOKENS_PROMPT: [10, 0, -3, 2**62, 5.0, True],
    sc.ATTR_SUMMARY_COUNTED: [True, False, 1, "true"],
    sc.ATTR_BATCH_ID: ["b1", "b2", 7, 7.0, True, b"b"],
    sc.ATTR_BATCH_SIZE: [4, 8, 0, -1, True, 4.0, "4", 2**62],
    sc.ATTR_TOKENS_EFFECTIVE: [90, 100, 0, True, 90.0, -5],
    sc.ATTR_TOKENS_PADDED: [128, 0, True, 128.0, -1],
    sc.ATTR_GPU_ID: ["0", "GPU-1", 0, 1, "", True],
    sc.ATTR_QUEUE_BEHIND_BATCHES_S: [0.01, 1, -1.0, float("nan"), float("inf"), True, "x"],
}


def _odd_value(v: Any) -> Any:
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue

    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    if isinstance(v, bytes):
        return AnyValue(bytes_value=v)
    return AnyValue(string_value=v)


def _odd_export(rng: random.Random, base: int, t: int, links: list) -> ExportTraceServiceRequest:
    from opentelemetry.proto.trace.v1 import trace_pb2

    def attrs(keys: list[str]) -> list:
        return [{"key": k, "value": _odd_value(rng.choice(_ODD[k]))} for k in keys
                if rng.random() < 0.5]

    export = ExportTraceServiceRequest()
    for _ in range(rng.randint(1, 3)):
        rs = export.resource_spans.add()
        rs.resource.attributes.add(key="service.name").value.string_value = rng.choice("ab")
        for _ in range(rng.randint(1, 2)):
            spans = rs.scope_spans.add().spans
            for _ in range(rng.randint(0, 20)):
                tid, rid = rng.randbytes(16), rng.randbytes(8)  # high bits set too
                start = base + t + rng.randint(0, 10**9)
                end = start + rng.randint(0, 10**8)
                spans.add(
                    trace_id=tid, span_id=rid, kind=rng.choice([2, 2, 2, 5, 1]),
                    trace_state=rng.choice(["", "", "ot=th:8", "ot=th:zz", "x=1,ot=th:c"]),
                    start_time_unix_nano=start, end_time_unix_nano=end,
                    flags=rng.choice([0, 0x300, 0xFFFFFFFF]),
                    status=trace_pb2.Status(code=rng.choice([0, 0, 2])),
                    attributes=attrs([sc.ATTR_MODEL_NAME, sc.ATTR_SAMPLE_WEIGHT,
                                      sc.ATTR_TOKENS_PROMPT, sc.ATTR_SUMMARY_COUNTED]))
                if rng.random() < 0.1:
                    links.append((tid, rid))
                for _ in range(rng.randint(0, 4)):
                    stage = rng.choice([*_STAGES[:8], "new_1", "Bad!"])
                    s = start + rng.randint(0, 10**7)
                    span = spans.add(
                        trace_id=tid, span_id=rng.randbytes(8), parent_span_id=rid,
                        start_time_unix_nano=s, end_time_unix_nano=s + rng.randint(0, 10**7),
                        attributes=[{"key": sc.ATTR_STAGE, "value": _odd_value(stage)},
                                    *attrs([k for k in _ODD if k != sc.ATTR_SUMMARY_COUNTED])])
                    if links and rng.random() < 0.03:
                        ltid, lsid = rng.choice(links)
                        span.links.add(trace_id=ltid, span_id=lsid)
                roll = rng.random()
                if roll < 0.03:
                    spans[-1].end_time_unix_nano = spans[-1].start_time_unix_nano - 1
                elif roll < 0.06:
                    spans.add().CopyFrom(spans[-1])  # a duplicate span id
                elif roll < 0.09 and links:  # a span of a trace sent before
                    late = spans.add()
                    late.CopyFrom(spans[-1])
                    late.trace_id, late.span_id = rng.choice(links)[0], rng.randbytes(8)
            if rng.random() < 0.3:
                shuffled = list(spans)
                rng.shuffle(shuffled)
                del spans[:]
                spans.extend(shuffled)
    return export


def _odd_run(work: list, *, columnar: bool, seed: int) -> list:
    rng = random.Random(seed)
    clock = [0.0]
    asm = Assembler(settle_s=rng.choice([0.0, 2.0]), trace_timeout_s=rng.choice([1.0, 60.0]),
                    max_spans_per_trace=rng.choice([3, 1000]), max_links_per_span=2,
                    clock=lambda: clock[0])
    asm.columnar = columnar
    budget = rng.choice([7, 5000])
    out: list = []

    def advance(everything: bool = False) -> None:
        while True:
            fin = asm.advance(clock[0], everything=everything, budget=budget)
            cols = {name: list(getattr(fin, name)) for name in _COLUMNS}
            work = cols["work"]
            cols["work"] = sorted(zip(work[::3], work[1::3], work[2::3], strict=True))
            # Token counts sent as booleans: numbers to the fold, which adds them up.
            cols["batches"] = [(r, int(e), int(p)) for r, e, p in cols["batches"]]
            out.append(cols)
            if not asm.backlog:
                return

    for now, export in work:
        clock[0] = now
        out.append(asm.ingest(export, export.SerializeToString() if columnar else None))
        out.append((asm.pending, len(asm.traces)))
        advance()
    clock[0] += 1000.0
    advance(everything=True)
    out.append((asm.dropped, asm.received, asm.accepted, asm.ignored, asm.incomplete,
                asm.pending, asm.stage_names, list(asm.seen_batches.items()),
                list(asm.recent_done.items()), sorted(asm.counted.items())))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_columnar_equals_span_by_span_odd_inputs(seed: int) -> None:
    """Attribute values of every type a sender may use, random ids and times near
    2**64, small budgets, a small max_spans_per_trace and settle_s 0: the same figures,
    counters and reasons (nan compared as itself: ``repr``)."""
    rng = random.Random(seed)
    base = rng.choice([1_700_000_000 * 10**9, 2**64 - 10**15])
    links: list = []
    work = [(1000.0 + 1.5 * i, _odd_export(rng, base, i * 10**9, links)) for i in range(10)]
    work.append((2000.0, work[3][1]))  # re-sent
    ref = _odd_run(work, columnar=False, seed=seed)
    got = _odd_run(work, columnar=True, seed=seed)
    assert repr(got) == repr(ref)
    assert any(isinstance(step, dict) and step["start"] for step in ref)


def test_small_scopes_go_span_by_span() -> None:
    """A scope of fewer than ``columnar_min_spans`` spans is read span by span (numpy's
    cost per call outweighs the columns there); a larger one by columns; same figures."""
    def export(n: int) -> ExportTraceServiceRequest:
        b = TraceBuilder("svc")
        for i in range(n):
            req = b.request(i * 0.001, i * 0.001 + 0.1)
            b.stage(req, "queue", i * 0.001, i * 0.001 + 0.01)
            b.stage(req, "compute", i * 0.001 + 0.01, i * 0.001 + 0.05, batch_id=f"b{i}")
        return b.export()

    small, large = export(2), export(_MIN_SPANS // 3 + 1)
    for work, by_columns in ((small, False), (large, True)):
        docs = []
        for columnar in (False, True):
            engine = Engine(settle_s=0.0, clock=lambda: 1000.0)
            asm = engine._asm
            asm.columnar = columnar
            asm.columnar_min_spans = _MIN_SPANS
            taken: list[int] = []

            def count(*args: Any, _taken: list = taken, _take: Any = asm._ingest_columns) -> bool:
                _taken.append(1)
                return bool(_take(*args))

            asm._ingest_columns = count  # type: ignore[method-assign]
            engine.ingest_traces(work, payload=work.SerializeToString())
            engine.flush()
            assert bool(taken) == (columnar and by_columns)
            docs.append(_documents(engine))
        assert docs[0] == docs[1]
