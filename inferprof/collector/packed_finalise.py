"""Finalising packed traces (``packed.Packed``, assembled by ``column_ingest``) together,
with numpy: the same rows of :class:`~inferprof.collector.finalised.Finalised`, in the same
order, as ``TraceFinaliser`` gives each trace one at a time. Request rows, stage spans,
work windows and device shares are computed as arrays; batch padding, work shares and
compute windows once per distinct entry of attributes, with "seen before"
(``seen_batches``) decided per batch in order."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from inferprof import semconv as sc
from inferprof.collector.finalise import TraceFinaliser
from inferprof.collector.finalised import (
    COMPUTE_STAGES,
    PADDING_STAGES,
    WORK_STAGES,
    Finalised,
    request_fields,
)
from inferprof.collector.packed import Block, Packed
from inferprof.collector.traces import FLAG_ERROR, OTLP_FLAGS, STATUS_ERROR
from inferprof.collector.verdict import normalize_gpu_id
from inferprof.collector.wire import id_bytes

_MODEL = sc.ATTR_MODEL_NAME
_BATCH_ID = sc.ATTR_BATCH_ID
_EFFECTIVE = sc.ATTR_TOKENS_EFFECTIVE
_PADDED = sc.ATTR_TOKENS_PADDED
_GPU_ID = sc.ATTR_GPU_ID
_BATCH_SIZE = sc.ATTR_BATCH_SIZE
_BEHIND_S = sc.ATTR_QUEUE_BEHIND_BATCHES_S
_QUEUE = sc.STAGE_QUEUE


class EntryReads:
    """What ``TraceFinaliser._stage_attrs`` reads of each entry of attributes (stage and wanted
    values) of ``entries`` numbered ``used``, as arrays over them; ``res``: the resource."""

    __slots__ = ("b_key", "behind", "by_size", "c_key", "eff_pad", "eff_share", "gpu",
                 "has_bid", "is_queue", "is_work", "model_of", "pad_ok", "size")

    def __init__(self, used: list[int], entries: list[tuple], res: tuple) -> None:
        n_ent = len(used)
        self.behind = np.full(n_ent, np.nan)  # a valid inferprof.queue.behind_batches_s
        self.is_queue = np.zeros(n_ent, bool)
        self.pad_ok = np.zeros(n_ent, bool)  # effective and padded tokens counted
        self.eff_pad = np.zeros((n_ent, 2), np.int64)
        self.is_work = np.zeros(n_ent, bool)
        self.has_bid = np.zeros(n_ent, bool)
        self.size = np.zeros(n_ent)  # > 0: a valid batch size
        self.by_size = np.ones(n_ent)  # member_share without tokens
        self.eff_share = np.zeros(n_ent, np.int64)  # > 0: effective tokens for member_share
        self.gpu: list[Any] = [None] * n_ent
        self.model_of: list[Any] = [None] * n_ent
        #: the batch's padding and work keys in ``seen_batches`` (None: no batch id)
        self.b_key: list[Any] = [None] * n_ent
        self.c_key: list[Any] = [None] * n_ent
        for i, ent in enumerate(used):
            self._read(i, entries[ent][0], entries[ent][1], res)

    def _read(self, i: int, st_name: str, extra: dict, res: tuple) -> None:
        self.model_of[i] = extra.get(_MODEL)
        if st_name == _QUEUE:
            self.is_queue[i] = True
            b = extra.get(_BEHIND_S)
            if type(b) in (float, int) and math.isfinite(b) and b >= 0:
                self.behind[i] = float(b)
            return
        batch_id = extra.get(_BATCH_ID)
        self.has_bid[i] = batch_id is not None
        eff = extra.get(_EFFECTIVE)
        if st_name in PADDING_STAGES:
            pad = extra.get(_PADDED)
            if isinstance(eff, int) and isinstance(pad, int) and pad > 0:
                self.pad_ok[i] = True
                self.eff_pad[i] = (eff, pad)
                if batch_id is not None:
                    self.b_key[i] = (*res, "b", batch_id)
        if st_name in WORK_STAGES:
            self.is_work[i] = True
            bs = extra.get(_BATCH_SIZE)
            if type(bs) is int and bs > 0:
                self.size[i] = bs
                self.by_size[i] = 1.0 / bs
            if type(eff) is int and eff > 0:
                self.eff_share[i] = eff
            if st_name in COMPUTE_STAGES:
                self.gpu[i] = extra.get(_GPU_ID)
            if batch_id is not None:
                self.c_key[i] = (*res, "c", st_name, batch_id)


class PackedFinaliser(TraceFinaliser):
    """The steps of ``Assembler`` that finalise packed traces."""

    def _finalise_packed(self, run: list[tuple[bytes, Packed]], out: Finalised,
                         now: float) -> None:
        """``_finalise`` of each packed trace of ``run``, in order: the same columns, with
        numpy for all but the stage spans that carry attributes."""
        blocks = [t.block for _, t in run]
        i = 0
        n = len(run)
        while i < n:
            block = blocks[i]
            k = i + 1
            while k < n and blocks[k] is block:
                k += 1
            part = run[i:k]
            self._finalise_block(block, [t.j for _, t in part], [tid for tid, _ in part], out,
                                 now)
            i = k

    def _finalise_block(self, block: Block, js: list[int], tids: list[bytes],
                        out: Finalised, now: float) -> None:
        cols = block.cols
        n = len(js)
        jj = np.asarray(js, np.int64)
        rid = block.rid
        # Bookkeeping per trace, as ``_finalise``: none of these traces was counted or
        # finalised in the last trace_timeout_s (else it would not be packed).
        self.pending -= int(block.n[jj].sum())
        self.ignored += int(block.ignored[jj].sum())
        self.counted.update(zip(tids, [(rid[j],) for j in js], strict=True))
        self.recent_done.update(dict.fromkeys(tids, now))
        r0 = len(out.start)
        model, tokens = self._request_rows(block, jj, tids, out)
        # The stage spans, per request in order, as ``_own_stages``.
        st_lo = block.st_ptr[jj]
        cnt = block.st_ptr[jj + 1] - st_lo
        each = np.repeat(np.arange(n), cnt)
        total = int(cnt.sum())
        q = st_lo[each] + (np.arange(total) - (np.cumsum(cnt) - cnt)[each])
        at = block.st_pos[q]
        rows = r0 + each
        stage = block.sn[at]
        s = cols.start[at]
        e = cols.end[at]
        k0 = len(out.span_key)
        out.span_key.frombytes(((rows << 32) | stage).tobytes())
        out.span_start.frombytes(s.tobytes())
        out.span_end.frombytes(e.tobytes())
        work = block.st_work[q]
        extra_at = np.flatnonzero(block.st_extra[q])
        if work.any():
            dur = np.where(e > s, (e - s).astype(np.float64) * 1e-9, 0.0)
            share = np.ones(total)
        else:
            dur = share = None
        if extra_at.size:
            self._extra_spans(out, block, tids, extra_at, rows, each, at, stage, s, e,
                              model, tokens, share, k0, now)
        if dur is not None:
            w = np.flatnonzero(work)
            device = np.empty((w.size, 4))
            device[:, 0] = rows[w]
            device[:, 1] = stage[w]
            device[:, 2] = dur[w]
            device[:, 3] = share[w]
            out.device.frombytes(device.tobytes())
            # Bare work spans; those with attributes went through _stage_attrs.
            bare = w[~block.st_extra[q][w]]
            if bare.size:
                windows = np.empty((bare.size, 3))
                windows[:, 0] = rows[bare]
                windows[:, 1] = s[bare].astype(np.float64) * 1e-9
                windows[:, 2] = e[bare].astype(np.float64) * 1e-9
                out.work.frombytes(windows.tobytes())

    @staticmethod
    def _request_rows(block: Block, jj: np.ndarray, tids: list[bytes],
                      out: Finalised) -> tuple[list, list[int]]:
        """One row per request of traces ``jj`` of ``block``, as ``_open_row`` opens it:
        its fields read once per distinct request-span attributes (and trace state).
        Returns the rows' models and prompt tokens."""
        cols = block.cols
        n = jj.size
        cand = block.cand[jj]
        entries = cols.entries
        states = cols.trace_state
        if states is None:
            used, which = np.unique(cols.tail[cand], return_inverse=True)
            keys: list[Any] = used.tolist()
            states_u: list[str] = [""] * len(keys)
        else:
            pairs = list(zip(cols.tail[cand].tolist(), [states[k] for k in cand.tolist()],
                             strict=True))
            number = {p: i for i, p in enumerate(dict.fromkeys(pairs))}
            which = np.fromiter(map(number.__getitem__, pairs), np.int64, n)
            keys = [t for t, _ in number]
            states_u = [st for _, st in number]
        fields = []
        for t, st in zip(keys, states_u, strict=True):
            _, extra, _, code, flags = entries[t]
            flags &= OTLP_FLAGS
            if code == STATUS_ERROR:
                flags |= FLAG_ERROR
            fields.append(request_fields(extra, flags, st))
        which = which.ravel()
        model_u, weight_u, error_u, counted_u, tokens_u = zip(*fields, strict=True)
        model = [model_u[i] for i in which.tolist()]
        tokens = np.asarray(tokens_u, np.int64)[which].tolist()
        resource = block.resource
        out.service.extend([resource[0]] * n)
        out.instance.extend([resource[1:]] * n)
        out.model.extend(model)
        out.weight.frombytes(np.asarray(weight_u, np.float64)[which].tobytes())
        out.start.frombytes(cols.start[cand].tobytes())
        out.end.frombytes(cols.end[cand].tobytes())
        out.error.frombytes(np.asarray(error_u, np.uint8)[which].tobytes())
        out.counted.frombytes(np.asarray(counted_u, np.uint8)[which].tobytes())
        out.tokens.extend(tokens)
        out.trace_id.extend(tids)
        return model, tokens

    def _extra_spans(self, out: Finalised, block: Block, tids: list[bytes],
                     xs: np.ndarray, rows: np.ndarray, each: np.ndarray, at: np.ndarray,
                     stage: np.ndarray, s: np.ndarray, e: np.ndarray, model: list,
                     tokens: list[int], share: np.ndarray | None, k0: int,
                     now: float) -> None:
        """``_stage_attrs`` of the stage spans ``xs`` (positions in the run's stage spans
        ``rows``, ``stage``, ``s``, ``e``; ``at`` in the scope, ``each`` the trace in the
        run) of a packed run, which carry attributes, in order, at once: what each entry
        of attributes gives is read once; only "seen before" (``seen_batches``) is
        decided in order, per batch. ``model`` / ``tokens``: the run's requests'. Writes
        each work span's share into ``share``."""
        cols = block.cols
        entries = cols.entries
        res = block.resource
        ent_u, ent_inv = np.unique(cols.tail[at[xs]], return_inverse=True)
        r = EntryReads(ent_u.tolist(), entries, res)
        behind, is_queue, pad_ok, eff_pad = r.behind, r.is_queue, r.pad_ok, r.eff_pad
        is_work, has_bid, size, by_size = r.is_work, r.has_bid, r.size, r.by_size
        eff_share, gpu, model_of = r.eff_share, r.gpu, r.model_of
        rows_x = rows[xs]
        # Model fallback, in order, for requests that name none.
        if None in model:
            for x, row in enumerate(rows_x.tolist()):
                if out.model[row] is None:
                    out.model[row] = model_of[ent_inv[x]]
        pos_x = k0 + xs
        q = is_queue[ent_inv] & ~np.isnan(behind[ent_inv])
        if q.any():
            pairs = np.empty((int(q.sum()), 2))
            pairs[:, 0] = pos_x[q]
            pairs[:, 1] = behind[ent_inv][q]
            out.queue_behind.frombytes(pairs.tobytes())
        # "Seen before", in order: a key per (span, b: padding / c: work), first use only.
        pad_x = pad_ok[ent_inv]
        work_x = is_work[ent_inv]
        if not (pad_x.any() or work_x.any()):
            return
        first_b, first_c = self._first_uses(r, ent_inv, pad_x, work_x, tids, each[xs],
                                             cols.sid[at[xs]], now)
        if pad_x.any():
            b = np.flatnonzero(pad_x & first_b)
            out.batches.extend(zip(rows_x[b].tolist(), eff_pad[ent_inv[b], 0].tolist(),
                                   eff_pad[ent_inv[b], 1].tolist(), strict=True))
        if not work_x.any():
            return
        w = np.flatnonzero(work_x)
        we = ent_inv[w]
        ws, wend = s[xs[w]], e[xs[w]]
        seconds = np.where(wend > ws, (wend - ws).astype(np.float64) * 1e-9, 0.0)
        # member_share: by tokens where the request's and the batch's are known
        tok = np.asarray(tokens, np.int64)[each[xs[w]]]
        sh = by_size[we].copy()
        by_tok = (tok > 0) & (eff_share[we] > 0)
        for y in np.flatnonzero(by_tok).tolist():
            sh[y] = min(1.0, int(tok[y]) / int(eff_share[we[y]]))
        assert share is not None
        share[xs[w]] = sh
        # work share: per member where the size is known, else once per batch
        bid = has_bid[we]
        sized = size[we] > 0
        fc = first_c[w]
        keep = bid & (sized | fc)
        if keep.any():
            part = np.empty((int(keep.sum()), 2))
            part[:, 0] = rows_x[w][keep]
            part[:, 1] = np.where(sized, seconds / np.where(sized, size[we], 1.0), seconds)[keep]
            out.work_share.frombytes(part.tobytes())
        if fc.any():
            win = np.empty((int(fc.sum()), 3))
            win[:, 0] = rows_x[w][fc]
            win[:, 1] = ws[fc].astype(np.float64) * 1e-9
            win[:, 2] = wend[fc].astype(np.float64) * 1e-9
            out.work.frombytes(win.tobytes())
            for y in np.flatnonzero(fc).tolist():
                g = gpu[we[y]]
                if g:
                    out.compute.append((int(rows_x[w[y]]), (res[1], normalize_gpu_id(str(g)),
                                                            int(ws[y]) * 1e-9,
                                                            int(wend[y]) * 1e-9)))

    def _first_uses(self, r: EntryReads, ent_inv: np.ndarray, pad_x: np.ndarray,
                    work_x: np.ndarray, tids: list[bytes], trace_of: np.ndarray,
                    sid: np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray]:
        """Per stage span of ``_extra_spans`` (``ent_inv``: its entry of ``r``), whether it
        is the first use of its batch's padding key (``pad_x`` spans) and of its work key
        (``work_x`` spans; True where it has none), as ``_stage_attrs`` decides them in
        order; the new keys are remembered in ``seen_batches``, in that order.
        ``trace_of`` / ``sid``: each span's trace in ``tids`` and span id, the key of a
        span without a batch id."""
        n = ent_inv.size
        n_ent = len(r.gpu)
        b_key, c_key = r.b_key, r.c_key
        # Key numbers: per entry where the batch id makes the key, per span (the span
        # itself) where there is none.
        key_ids: dict[Any, int] = {}
        keys: list[Any] = []

        def number(key: Any) -> int:
            k = key_ids.get(key)
            if k is None:
                k = key_ids[key] = len(keys)
                keys.append(key)
            return k

        b_num = np.fromiter((-1 if k is None else number(k) for k in b_key), np.int64, n_ent)
        c_num = np.fromiter((-1 if k is None else number(k) for k in c_key), np.int64, n_ent)
        has_gpu = np.fromiter((bool(g) for g in r.gpu), bool, n_ent)
        ev_b = np.flatnonzero(pad_x)
        ev_c = np.flatnonzero(work_x & ((c_num >= 0) | has_gpu)[ent_inv])
        kb = b_num[ent_inv[ev_b]]
        kc = c_num[ent_inv[ev_c]]
        for ev, kk in ((ev_b, kb), (ev_c, kc)):  # keyed by the span itself
            for y in np.flatnonzero(kk < 0).tolist():
                x = int(ev[y])
                kk[y] = number((tids[int(trace_of[x])], id_bytes(sid[x])))
        ev_x = np.concatenate([ev_b, ev_c])
        ev_kind = np.concatenate([np.zeros(ev_b.size, np.int64), np.ones(ev_c.size, np.int64)])
        order = np.lexsort((ev_kind, ev_x))
        ev_x, ev_kind, ev_key = ev_x[order], ev_kind[order], np.concatenate([kb, kc])[order]
        first_b = np.zeros(n, bool)
        first_c = np.ones(n, bool)  # a work span of no key is always "first"
        if ev_key.size:
            uk, fi = np.unique(ev_key, return_index=True)
            seen = self.seen_batches
            new_key = np.fromiter((keys[k] not in seen for k in uk.tolist()), bool, uk.size)
            is_first = np.zeros(ev_key.size, bool)
            is_first[fi[new_key]] = True
            first_b[ev_x[(ev_kind == 0) & is_first]] = True
            first_c[ev_x[(ev_kind == 1) & ~is_first]] = False
            for k in ev_key[np.sort(fi[new_key])].tolist():  # in the order they came
                seen[keys[k]] = now
        return first_b, first_c


__all__ = ["EntryReads", "PackedFinaliser"]
