"""Finalising a trace held span by span into rows of ``finalised.Finalised``: one row per
request span, with the stage spans that belong to it.

* a stage span without links belongs to the nearest request span among its ancestors
  (``traces.find_owner``); one that has none is dropped (``orphan_stage``);
* a linked batch stage span (batch encoding (b), ``links``) belongs to every request span
  it links to: once per member;
* batch encoding (a) (the stage span repeated under each member) needs nothing special;
* a Triton request with no inferprof stage gets the stages derived from Triton's own spans
  (``triton_spans``), an engine's request span those of its ``gen_ai.latency.*``
  attributes (``gen_spans``);
* a request span with no stage span and no ``inferprof.*`` attribute (health checks,
  metric scrapes on an instrumented server) is not an inference request and is ignored;
* a request span counted in the last ``trace_timeout_s`` (an export sent again) is
  dropped as a duplicate, with its stage spans, instead of being counted twice.

Padding, batch work and compute windows count once per batch (its id within the service
instance), remembered in ``seen_batches``; each member's share of a work span (cost) is
counted for every member.
"""

from __future__ import annotations

import math
from typing import Any

from inferprof import semconv as sc
from inferprof.collector import gen_spans as _gen
from inferprof.collector import triton_spans as _triton
from inferprof.collector.cost import member_share
from inferprof.collector.finalised import (
    COMPUTE_STAGES,
    PADDING_STAGES,
    WORK_STAGES,
    Finalised,
    request_fields,
)
from inferprof.collector.links import LinkIndex
from inferprof.collector.traces import Trace, find_owner, local_roots
from inferprof.collector.verdict import normalize_gpu_id

_MODEL = sc.ATTR_MODEL_NAME
_BATCH_ID = sc.ATTR_BATCH_ID
_EFFECTIVE = sc.ATTR_TOKENS_EFFECTIVE
_PADDED = sc.ATTR_TOKENS_PADDED
_GPU_ID = sc.ATTR_GPU_ID
_BATCH_SIZE = sc.ATTR_BATCH_SIZE
_BEHIND_S = sc.ATTR_QUEUE_BEHIND_BATCHES_S
_QUEUE = sc.STAGE_QUEUE


class TraceFinaliser(LinkIndex):
    """The steps of ``Assembler`` that finalise a trace held span by span."""

    def _finalise(self, tid: bytes, trace: Trace, out: Finalised, now: float) -> None:
        self.pending -= len(trace.spans)
        counted = self.counted
        before = counted.get(tid, ())
        now_counted = self._finalise_trace(tid, trace, out, now, before)
        out.trace_id.extend([tid] * (len(out.start) - len(out.trace_id)))
        counted[tid] = before + now_counted if before else now_counted
        recent_done = self.recent_done
        recent_done[tid] = now
        recent_done.move_to_end(tid)  # keeps clock order

    def _finalise_trace(
        self, tid: bytes, trace: Trace, out: Finalised, now: float, counted: tuple = ()
    ) -> tuple[bytes, ...]:
        """Fold the trace's requests into ``out``; returns the request span ids counted.

        ``counted``: request spans of this trace finalised before (in the last
        ``trace_timeout_s``). An exporter that re-sends an export (its answer was lost, a
        persistent queue replays it) brings them again: they and their stage spans are
        dropped as duplicates instead of being counted twice. Other request spans of the
        trace (another service's, arriving later) are counted as usual.
        """
        spans = trace.spans
        requests = local_roots(trace)
        repeated = requests.intersection(counted) if counted else None
        # Request span id -> its row in ``out``; a row is opened by the request's first
        # stage span (or at the end for a request with attributes but no stage span).
        rows: dict[bytes, int] = {}
        self._own_stages(tid, spans, requests, repeated, rows, out, now)
        if repeated:
            requests -= repeated
            self._forget_repeated(tid, repeated)
        translated = (
            _triton.translate(spans, trace.triton, requests) if trace.triton is not None else None
        )
        links = self.links
        for rid in requests:
            linked = links.pop((tid, rid), None) if links else None
            if linked is not None:
                self._linked_stages(tid, rid, linked, spans, rows, out, now)
            if translated and rid not in rows and rid in translated:
                self._triton_stages(rid, translated[rid], spans, rows, out)
            if rid not in rows:
                self._request_alone(spans[rid], out)
        return tuple(requests)

    def _own_stages(self, tid: bytes, spans: dict, requests: set[bytes],
                    repeated: set[bytes] | None, rows: dict[bytes, int], out: Finalised,
                    now: float) -> None:
        """The trace's stage spans, each into its request's row (orphans and the stages
        of repeated requests dropped); other spans counted as ignored."""
        owner_of: dict[bytes, bytes | None] = {}
        add_key = out.span_key.append
        add_start = out.span_start.append
        add_end = out.span_end.append
        ignored = 0
        for sid, (parent, s, e, stage, res, extra, _, _, _) in spans.items():
            if stage is None:
                if sid not in requests:
                    ignored += 1
                continue
            # Common case first: the stage span is a direct child of its request.
            owner = parent if parent in requests else find_owner(sid, spans, requests, owner_of)
            if owner is None:
                self._drop(sc.DROP_ORPHAN_STAGE)
                continue
            if repeated and owner in repeated:
                self._drop(sc.DROP_DUPLICATE)
                continue
            row = rows.get(owner)
            if row is None:
                row = rows[owner] = self._open_row(spans[owner], out)
            add_key(row << 32 | stage)
            add_start(s)
            add_end(e)
            if extra is not None:
                share = self._stage_attrs(out, row, stage, s, e, res, extra, (tid, sid), now,
                                          len(out.span_key) - 1)
                if share is not None:
                    out.device.extend((row, stage, (e - s) * 1e-9 if e > s else 0.0, share))
            elif self.stage_names[stage] in WORK_STAGES:  # a bare work span: no batch
                out.work.extend((row, s * 1e-9, e * 1e-9))
                out.device.extend((row, stage, (e - s) * 1e-9 if e > s else 0.0, 1.0))
        self.ignored += ignored

    def _linked_stages(self, tid: bytes, rid: bytes, linked: list, spans: dict,
                       rows: dict[bytes, int], out: Finalised, now: float) -> None:
        """Batch stage spans linked to request ``rid`` (the ``links`` encoding)."""
        self._settle_links(tid, rid, linked)
        row = rows.get(rid)
        if row is None:
            row = rows[rid] = self._open_row(spans[rid], out)
        for stage, s, e, res, extra, ident in linked:
            out.span_key.append(row << 32 | stage)
            out.span_start.append(s)
            out.span_end.append(e)
            if extra is not None:
                share = self._stage_attrs(out, row, stage, s, e, res, extra, ident, now,
                                          len(out.span_key) - 1)
                if share is not None:
                    out.device.extend((row, stage, (e - s) * 1e-9 if e > s else 0.0, share))
            elif self.stage_names[stage] in WORK_STAGES:
                out.work.extend((row, s * 1e-9, e * 1e-9))
                out.device.extend((row, stage, (e - s) * 1e-9 if e > s else 0.0, 1.0))

    def _triton_stages(self, rid: bytes, translated: tuple, spans: dict,
                       rows: dict[bytes, int], out: Finalised) -> None:
        """A Triton request with no inferprof stage of its own: its derived stages."""
        model, derived, used = translated
        row = rows[rid] = self._open_row(spans[rid], out)
        out.model[row] = model
        for name, s, e in derived:
            number = self._stage_number(name)
            out.span_key.append(row << 32 | number)
            out.span_start.append(s)
            out.span_end.append(e)
            if name in WORK_STAGES:
                # Requests Triton batched together share these times: the engine
                # keeps one of each (no work_share: Triton traces all or none).
                out.work.extend((row, s * 1e-9, e * 1e-9))
                # Triton's spans give no batch size: each request is charged the
                # whole window (docs/concepts.md, cost).
                out.device.extend((row, number, (e - s) * 1e-9 if e > s else 0.0, 1.0))
        if len(derived) < len(_triton.STAGES):
            self.triton_partial += 1
        self.ignored -= used  # counted as ignored above; they were not

    def _request_alone(self, req: tuple, out: Finalised) -> None:
        """A request span with no stage span: an engine's own request span (vLLM,
        SGLang), whose stages come from its gen_ai.latency.* attributes; one with no
        inferprof.* attribute at all (health checks, metric scrapes) is not an inference
        request."""
        derived = _gen.derived_stages(req[1], req[2], req[5]) if req[5] else None
        if req[3] is None and not _gen.marks_request(req[5]):
            self.ignored += 1
            return
        row = self._open_row(req, out)
        for name, s, e in derived or ():
            out.span_key.append(row << 32 | self._stage_number(name))
            out.span_start.append(s)
            out.span_end.append(e)

    @staticmethod
    def _open_row(req: tuple, out: Finalised) -> int:
        _, start, end, _, resource, extra, _, flags, trace_state = req
        model, weight, error, counted, tokens = request_fields(extra, flags, trace_state)
        row = len(out.start)
        out.service.append(resource[0])
        out.instance.append(resource[1:])
        out.model.append(model)
        out.weight.append(weight)
        out.start.append(start)
        out.end.append(end)
        out.error.append(error)
        out.counted.append(counted)
        if extra and _gen.is_generating(extra):
            out.gen.append((row, extra))
        out.tokens.append(tokens)
        return row

    def _stage_attrs(
        self,
        out: Finalised,
        row: int,
        stage_id: int,
        s: int,
        e: int,
        res: tuple,
        extra: dict,
        ident: tuple,
        now: float,
        position: int,
    ) -> float | None:
        """Model fallback, padding, batch work and compute windows from a stage span's
        attributes; ``position``: the span's in ``out.span_key``. Returns, for a work
        stage, the request's share of the span (for ``out.device``, which the caller
        extends), else None."""
        stage = self.stage_names[stage_id]
        if out.model[row] is None:
            out.model[row] = extra.get(_MODEL)
        if stage == _QUEUE:
            behind = extra.get(_BEHIND_S)
            if type(behind) in (float, int) and math.isfinite(behind) and behind >= 0:
                out.queue_behind.extend((position, float(behind)))
            return None
        batch_id = extra.get(_BATCH_ID)
        if stage in PADDING_STAGES:
            eff = extra.get(_EFFECTIVE)
            pad = extra.get(_PADDED)
            if isinstance(eff, int) and isinstance(pad, int) and pad > 0:
                # One count per batch: batch id within the service instance, or the
                # span itself when the batch carries no id.
                pad_key = (*res, "b", batch_id) if batch_id is not None else ident
                if pad_key not in self.seen_batches:
                    self.seen_batches[pad_key] = now
                    out.batches.append((row, eff, pad))
        if stage not in WORK_STAGES:
            return None
        # Every member's share of the span (cost): not once per batch like the rest.
        share = member_share(out.tokens[row], extra.get(_EFFECTIVE), extra.get(_BATCH_SIZE))
        # Once per batch: its id within the service instance (service.name,
        # host.name, service.instance.id). A span of no batch id is not remembered,
        # unless it names a GPU (a linked span joins the GPU samples once: remembered
        # as itself), and adds nothing to the work estimate: without an id, copies of
        # one batch's span cannot be told from the spans of several batches.
        gpu = extra.get(_GPU_ID) if stage in COMPUTE_STAGES else None
        if batch_id is not None:
            key: Any = (*res, "c", stage, batch_id)
        else:
            key = ident if gpu else None
        first = key is None or key not in self.seen_batches
        if batch_id is not None:
            size = extra.get(_BATCH_SIZE)
            seconds = (e - s) * 1e-9 if e > s else 0.0
            if type(size) is int and size > 0:  # not a bool
                out.work_share.extend((row, seconds / size))
            elif first:
                out.work_share.extend((row, seconds))
        if first:
            if key is not None:
                self.seen_batches[key] = now
            out.work.extend((row, s * 1e-9, e * 1e-9))
            if gpu:
                out.compute.append((row, (res[1], normalize_gpu_id(str(gpu)), s * 1e-9,
                                          e * 1e-9)))
        return share


__all__ = ["TraceFinaliser"]
