"""Columnar ingest: one scope of an export read as numpy columns (``wire.SpanReader.columns``)
and its common traces assembled at once, held packed (``packed.Block``) until due; the
rest of the scope goes span by span (``span_ingest``), in its place in the scope's order.
The result is exactly what the span-by-span path would hold
(``tests/collector/test_columnar.py`` compares them)."""

from __future__ import annotations

from typing import Any

import numpy as np

from inferprof import semconv as sc
from inferprof.collector.assembler_state import Export
from inferprof.collector.finalised import WORK_STAGES
from inferprof.collector.packed import Block, Packed
from inferprof.collector.span_ingest import SpanIngest
from inferprof.collector.traces import DAY_NS, KIND_CONSUMER, KIND_SERVER
from inferprof.collector.wire import Columns

#: The attributes a span of a trace assembled by columns may carry (see
#: ``ColumnIngest._ingest_columns``): none makes a span a request, a step or a generating one.
_SIMPLE_KEYS = frozenset(
    {
        sc.ATTR_SAMPLE_WEIGHT,
        sc.ATTR_MODEL_NAME,
        sc.ATTR_BATCH_ID,
        sc.ATTR_TOKENS_EFFECTIVE,
        sc.ATTR_TOKENS_PADDED,
        sc.ATTR_GPU_ID,
        sc.ATTR_BATCH_SIZE,
        sc.ATTR_QUEUE_BEHIND_BATCHES_S,
        sc.ATTR_SUMMARY_COUNTED,
        sc.ATTR_TOKENS_PROMPT,
        sc.ATTR_GEN_AI_USAGE_PROMPT_TOKENS,
    }
)
_ZERO_TRACE_V = np.zeros(1, "V16")[0]


def _packable(cols: Columns, inv: np.ndarray, n_groups: int, good: np.ndarray,
              cand: np.ndarray, is_stage: np.ndarray,
              max_spans: int) -> tuple[np.ndarray, np.ndarray]:
    """Per trace of the scope (``inv``: each span's), whether it may be packed: all its
    spans ``good``, one request-span candidate with no parent, at least one stage span,
    every stage span a child of it, at most ``max_spans`` spans and no span id twice; and
    the position of its candidate (where it has one)."""
    sid, parent = cols.sid, cols.parent
    ok = np.bincount(inv, ~good, n_groups) == 0
    ok &= np.bincount(inv, cand, n_groups) == 1
    ok &= np.bincount(inv, is_stage, n_groups) >= 1
    ok &= np.bincount(inv, minlength=n_groups) <= max_spans
    cand_at = np.zeros(n_groups, np.int64)
    where_cand = np.flatnonzero(cand)
    cand_at[inv[where_cand]] = where_cand
    ok &= parent[cand_at] == 0
    ok &= np.bincount(inv, is_stage & (parent != sid[cand_at][inv]), n_groups) == 0
    by_sid = np.sort(sid)
    if (by_sid[1:] == by_sid[:-1]).any():  # a span id twice: in the same trace?
        o = np.lexsort((sid, inv))
        dup = (inv[o][1:] == inv[o][:-1]) & (sid[o][1:] == sid[o][:-1])
        ok[inv[o][1:][dup]] = False
    return ok, cand_at


def _pack(cols: Columns, resource: tuple, tids: list[bytes], span_j: np.ndarray,
          cand: np.ndarray, sn: np.ndarray, is_stage: np.ndarray, e_extra: np.ndarray,
          work_of: np.ndarray) -> tuple[Block, np.ndarray]:
    """The :class:`Block` of the traces to pack (``span_j``: each span's among them, -1 for
    a span of none; ``cand``: their request spans), and which spans it holds. ``sn``,
    ``is_stage``: per span, its stage number and whether it is a stage span; ``e_extra``:
    per entry, whether it has wanted attributes; ``work_of``: per stage number, whether it
    is a work stage."""
    n_packed = len(tids)
    packed = span_j >= 0
    at = np.flatnonzero(packed)
    pos = at[np.argsort(span_j[at], kind="stable")]
    ptr = np.zeros(n_packed + 1, np.int64)
    np.cumsum(np.bincount(span_j[at], minlength=n_packed), out=ptr[1:])
    st_pos = pos[is_stage[pos]]
    st_ptr = np.zeros(n_packed + 1, np.int64)
    np.cumsum(np.bincount(span_j[st_pos], minlength=n_packed), out=st_ptr[1:])
    work, st_extra = work_of[sn[st_pos]], e_extra[cols.tail[st_pos]]
    if packed.all():
        return Block(cols, resource, tids, cand, pos, ptr, st_pos, st_ptr, sn, work,
                     st_extra), packed
    # Held until due: the packed traces' spans only, not the rest of the scope
    # (rejected, or pending elsewhere), whose memory the pending count leaves out.
    new_at = np.empty(len(cols), np.int64)
    new_at[pos] = np.arange(pos.size)
    return Block(cols.take(pos), resource, tids, new_at[cand], new_at[pos], ptr,
                 new_at[st_pos], st_ptr, sn[pos], work, st_extra), packed


class ColumnIngest(SpanIngest):
    """The columnar ingest steps of ``Assembler``."""

    def _ingest_columns(self, ex: Export, cols: Columns, spans: Any, resource: tuple,
                        base: int) -> bool:
        """Take one scope's spans read as columns; False (nothing taken) when none of its
        traces can be assembled by columns: then take its records.

        A trace is assembled by columns, with numpy, when all it has in this export is in
        this scope, it is new (not open, not finalised in the last ``trace_timeout_s``) and
        it is the common case: one request span (SERVER or CONSUMER, no parent, no
        stage), stage spans of known names, each a child of it and without links, maybe
        other spans; valid ids and durations, no duplicate span id; only attributes of
        ``_SIMPLE_KEYS``. It is then held as a :class:`~inferprof.collector.packed.Packed`
        trace, exactly what ``_ingest_spans`` would hold, in less memory, until it is due or
        another span of it comes (``unpack``). The other spans go through
        ``_ingest_spans``, in order."""
        e_sn, e_ok, e_extra, e_simple, unknown = self._entry_table(cols.entries)
        tail = cols.tail
        start, end, kind = cols.start, cols.end, cols.kind
        cand = (kind == KIND_SERVER) | (kind == KIND_CONSUMER)
        valid = (end >= start) & (end - start <= DAY_NS) & (cols.sid != 0) & (
            cols.tid != _ZERO_TRACE_V)
        if unknown:
            self._number_stages(cols, unknown, valid & e_simple[tail], e_sn, e_ok, e_simple)
        sn = e_sn[tail]
        is_stage = sn >= 0
        good = e_ok[tail] & valid & ~(cand & is_stage)
        uniq, first, inv = np.unique(cols.tid, return_index=True, return_inverse=True)
        inv = inv.ravel()
        n_groups = uniq.size
        ok, cand_at = _packable(cols, inv, n_groups, good, cand, is_stage,
                                self.max_spans_per_trace)
        groups = np.flatnonzero(ok)
        if not groups.size:
            return False
        groups = groups[np.argsort(first[groups], kind="stable")]
        tid_bytes = uniq[groups].tobytes()
        tids = [tid_bytes[i:i + 16] for i in range(0, len(tid_bytes), 16)]
        traces = self.traces
        recent_done = self.recent_done
        new = [not (t in traces or t in recent_done) for t in tids]
        if not all(new):
            groups = groups[np.asarray(new, bool)]
            if not groups.size:
                return False
            tids = [t for t, keep in zip(tids, new, strict=True) if keep]
        j_of = np.full(n_groups, -1, np.int64)
        j_of[groups] = np.arange(groups.size)
        work_of = np.fromiter((name in WORK_STAGES for name in self.stage_names), bool,
                              len(self.stage_names))
        cand = cand_at[groups]
        ex.due_at.extend((cand + base).tolist())
        block, packed = _pack(cols, resource, tids, j_of[inv], cand, sn, is_stage, e_extra,
                              work_of)
        ex.seen += len(cols)
        ex.packed = True
        now, due = ex.now, ex.due
        made = [Packed(block, j, n, due, now) for j, n in enumerate(block.n.tolist())]
        ex.made_due.extend(tids)
        self._open_packed(ex, cols, spans, resource, base, packed, tids, made,
                          first[groups])
        return True

    def _open_packed(self, ex: Export, cols: Columns, spans: Any, resource: tuple,
                     base: int, packed: np.ndarray, tids: list[bytes], made: list[Packed],
                     firsts: np.ndarray) -> None:
        """Open the packed traces ``made`` (ids ``tids``, first spans at ``firsts``) in the
        order of their first span, between the scope's other spans (those not
        ``packed``), taken span by span, as one pass over the scope would open them."""
        traces = self.traces
        if packed.all():
            traces.update(zip(tids, made, strict=True))
            ex.created.extend(tids)
            return
        n_packed = len(made)
        other = np.flatnonzero(~packed)
        records = [cols.record(k) for k in other.tolist()]
        cut = np.searchsorted(other, firsts).tolist()
        done = 0
        j = 0
        while j < n_packed:
            c = cut[j]
            if c > done:
                self._ingest_spans(ex, records[done:c], spans, resource, False, base)
                done = c
            j_end = j + 1
            while j_end < n_packed and cut[j_end] == c:
                j_end += 1
            traces.update(zip(tids[j:j_end], made[j:j_end], strict=True))
            ex.created.extend(tids[j:j_end])
            j = j_end
        if done < len(records):
            self._ingest_spans(ex, records[done:], spans, resource, False, base)

    def _entry_table(self, entries: list[tuple]) -> tuple:
        """Per entry of a scope's columns: its stage number (-1: none; -2: a name not
        numbered), whether a span of it may be in a packed trace, whether it has wanted
        attributes, whether only those of ``_SIMPLE_KEYS``; and the entries of valid stage
        names not numbered yet."""
        stage_index = self.stage_index
        n_entries = len(entries)
        e_sn = np.full(n_entries, -1, np.int64)
        e_ok = np.ones(n_entries, bool)
        e_extra = np.zeros(n_entries, bool)
        e_simple = np.ones(n_entries, bool)
        unknown: list[int] = []  # entries of valid stage names not seen before
        for i, (stage, extra, n_links, _, _) in enumerate(entries):
            if extra is not None:
                e_extra[i] = True
                if not extra.keys() <= _SIMPLE_KEYS:
                    e_ok[i] = e_simple[i] = False
            if stage is not None:
                try:
                    sidx = stage_index.get(stage)
                except TypeError:
                    sidx = None
                if sidx is None:
                    e_ok[i] = False
                    if (
                        isinstance(stage, str)
                        and sc.STAGE_NAME_PATTERN.match(stage)
                        and stage != sc.STAGE_UNATTRIBUTED
                    ):
                        unknown.append(i)
                    e_sn[i] = -2
                elif n_links:
                    e_ok[i] = False
                else:
                    e_sn[i] = sidx
        return e_sn, e_ok, e_extra, e_simple, unknown

    def _number_stages(self, cols: Columns, unknown: list[int], checked: np.ndarray,
                       e_sn: np.ndarray, e_ok: np.ndarray, e_simple: np.ndarray) -> None:
        """Number the valid stage names of entries ``unknown`` in the order one pass over
        the scope would (at its first span of each name), where each such span is one
        ``checked``: the pass reads its stage (valid ids and times, not an engine step);
        else number none (the pass will)."""
        name_of = {i: cols.entries[i][0] for i in unknown}
        # Each entry's first span, in one pass: one scan per entry would cost the scope's
        # length once per new name.
        used, first_span = np.unique(cols.tail, return_index=True)
        first_of = dict(zip(used.tolist(), first_span.tolist(), strict=True))
        firsts: dict[str, int] = {}
        for i in unknown:
            k = first_of[i]
            name = name_of[i]
            if name not in firsts or k < firsts[name]:
                firsts[name] = k
        if not all(checked[k] for k in firsts.values()):
            return
        for name in sorted(firsts, key=firsts.__getitem__):
            self.stage_index[name] = len(self.stage_names)
            self.stage_names.append(name)
        for i in unknown:
            e_sn[i] = self.stage_index[name_of[i]]
            e_ok[i] = e_simple[i] and not cols.entries[i][2]


__all__ = ["ColumnIngest"]
