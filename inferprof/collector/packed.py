"""Traces assembled by columns: a :class:`Block` is the traces of one scope of one export
that ``ColumnIngest`` assembled with numpy, a :class:`Packed` one of them, held as a row
of its block (less memory than a :class:`~inferprof.collector.traces.Trace`) until it is
finalised or another span of it comes; ``Packed.unpack`` then gives exactly the
``Trace`` the span-by-span path would hold."""

from __future__ import annotations

import numpy as np

from inferprof.collector.traces import FLAG_ERROR, OTLP_FLAGS, STATUS_ERROR, Trace
from inferprof.collector.wire import Columns, id_bytes


class Block:
    """The traces of one scope of one export assembled by columns (``_ingest_columns``):
    each is one request span and its stage spans (every one a child of it), maybe other
    spans, all in that scope. Per trace ``j`` (in order of first span): its id, request
    span id, the positions of its spans in the scope (``pos[ptr[j]:ptr[j + 1]]``, in
    order), of its stage spans (``st_pos[st_ptr[j]:st_ptr[j + 1]]``) and its request
    span's (``cand[j]``)."""

    __slots__ = ("cand", "cols", "ignored", "n", "pos", "ptr", "resource", "rid", "sn",
                 "st_extra", "st_pos", "st_ptr", "st_work", "tids")

    def __init__(self, cols: Columns, resource: tuple, tids: list[bytes], cand: np.ndarray,
                 pos: np.ndarray, ptr: np.ndarray, st_pos: np.ndarray, st_ptr: np.ndarray,
                 sn: np.ndarray, work: np.ndarray, has_extra: np.ndarray) -> None:
        self.cols = cols
        self.resource = resource
        self.tids = tids
        self.cand = cand
        rid = cols.sid[cand].astype("<u8").tobytes()
        self.rid = [rid[i:i + 8] for i in range(0, len(rid), 8)]
        self.pos = pos
        self.ptr = ptr
        self.n = np.diff(ptr)
        self.st_pos = st_pos
        self.st_ptr = st_ptr
        #: per span: its stage number (-1: none)
        self.sn = sn
        #: per stage span (in st_pos order): a work stage, has wanted attributes
        self.st_work = work
        self.st_extra = has_extra
        self.ignored = self.n - np.diff(st_ptr) - 1

    def record(self, j: int) -> tuple:
        """Trace ``j``'s request span as a ``Trace.spans`` value."""
        cols = self.cols
        k = int(self.cand[j])
        _, extra, _, code, flags = cols.entries[int(cols.tail[k])]
        flags &= OTLP_FLAGS
        if code == STATUS_ERROR:
            flags |= FLAG_ERROR
        parent = id_bytes(cols.parent[k]) if cols.has_parent[k] else b""
        trace_state = cols.trace_state[k] if cols.trace_state is not None else ""
        return (parent, int(cols.start[k]), int(cols.end[k]), None, self.resource, extra,
                True, flags, trace_state)


class Packed:
    """A trace of a :class:`Block`, held as such until it is finalised or another span
    of it comes (``unpack``)."""

    __slots__ = ("block", "created", "due", "j", "n")

    late = False
    triton = None

    def __init__(self, block: Block, j: int, n: int, due: float, created: float) -> None:
        self.block = block
        self.j = j
        self.n = n
        self.due: float | None = due
        self.created = created

    def __len__(self) -> int:
        return self.n

    @property
    def rid(self) -> bytes:
        return self.block.rid[self.j]

    def unpack(self) -> Trace:
        """The trace as ``_ingest_spans`` would have assembled it."""
        block, j = self.block, self.j
        cols = block.cols
        trace = Trace(self.created)
        trace.due = self.due
        spans = trace.spans
        cand = int(block.cand[j])
        resource = block.resource
        entries = cols.entries
        for k in block.pos[block.ptr[j]:block.ptr[j + 1]].tolist():
            sid = id_bytes(cols.sid[k])
            if k == cand:
                spans[sid] = block.record(j)
                trace.candidates.append(sid)
                continue
            sn = int(block.sn[k])
            parent = id_bytes(cols.parent[k]) if cols.has_parent[k] else b""
            spans[sid] = (parent, int(cols.start[k]), int(cols.end[k]),
                          sn if sn >= 0 else None, resource,
                          entries[int(cols.tail[k])][1], False, 0, None)
        return trace


__all__ = ["Block", "Packed"]
