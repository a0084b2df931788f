"""Batch encoding (b) of contract §2: a batch stage span *with* links belongs to every
request span it links to, whichever trace and export those arrive in, before or after the
batch span.

The link index holds each such span under each (trace id, span id) it links to until that
member's trace is finalised (``TraceFinaliser`` takes them) or ``trace_timeout_s`` passes
(:meth:`LinkIndex._expire_links`: dropped as ``orphan_stage``, or ``late`` when the member
was finalised before they came). Index entries are kept in arrival (clock) order, so
expiring them costs what it removes. A member trace has at most ``max_spans_per_trace``
index entries, like its own spans, and a linked span reads at most ``max_links_per_span``
links."""

from __future__ import annotations

from typing import Any

from inferprof import semconv as sc
from inferprof.collector.assembler_state import AssemblyState, Export
from inferprof.collector.traces import pop_older


class LinkIndex(AssemblyState):
    """The link index's steps of ``Assembler``."""

    def _link_span(self, ex: Export, span_links: Any, tid: bytes, sid: bytes,
                   record: tuple) -> None:
        """A batch stage span linked to its member requests: pending under each link
        until the member's trace is finalised."""
        ident = record[5]
        link_refs = self.link_refs
        if ident in link_refs:
            ex.reject(sc.DROP_DUPLICATE,
                      f"span {sid.hex()}: duplicate span id in trace {tid.hex()}")
            return
        max_links = self.max_links_per_span
        n_links = len(span_links)
        if n_links > max_links:
            self._drop(sc.DROP_TOO_MANY_LINKS, n_links - max_links)
            ex.note(f"span {sid.hex()}: {n_links} links, only the first {max_links} read "
                    "(max_links_per_span)")
            span_links = span_links[:max_links]
        # One member request linked twice (a sender linking once per item) is still one
        # member: its stage counts once.
        targets = (
            dict.fromkeys((ln.trace_id, ln.span_id) for ln in span_links)
            if n_links > 1
            else ((span_links[0].trace_id, span_links[0].span_id),)
        )
        links = self.links
        link_count = self.link_count
        max_spans = self.max_spans_per_trace
        kept = 0
        for lk in targets:
            # A member trace's index entries count as its own spans do: at most
            # max_spans_per_trace (they are folded with it, in one share of work).
            n_member = link_count.get(lk[0], 0)
            if n_member >= max_spans:
                continue
            link_count[lk[0]] = n_member + 1
            kept += 1
            lst = links.get(lk)
            if lst is None:
                links[lk] = [record]
                self.link_created[lk] = ex.now
                if lk[0] in self.recent_done:
                    self.link_late.add(lk)
            else:
                lst.append(record)
        if kept < len(targets):
            why = (f"span {sid.hex()}: {len(targets) - kept} of its member traces have "
                   f"{max_spans} linked spans already (max_spans_per_trace)")
            if not kept:
                ex.reject(sc.DROP_TRACE_TOO_LARGE, why)
                return
            self._drop(sc.DROP_TRACE_TOO_LARGE, len(targets) - kept)
            ex.note(why)
        link_refs[ident] = kept
        # A linked batch span is pending once per member it links (one index entry
        # each): beyond the one span ``accepted`` counts.
        ex.link_pending += kept - 1

    def _uncount(self, tid: bytes, n: int) -> None:
        left = self.link_count.get(tid, 0) - n
        if left > 0:
            self.link_count[tid] = left
        else:
            self.link_count.pop(tid, None)

    def _release_linked(self, records: list[tuple]) -> None:
        """Each record is one member's use of a linked span: pending once each."""
        refs = self.link_refs
        self.pending -= len(records)
        for rec in records:
            ident = rec[5]
            left = refs.get(ident, 1) - 1
            if left <= 0:
                refs.pop(ident, None)
            else:
                refs[ident] = left

    def _settle_links(self, tid: bytes, rid: bytes, linked: list[tuple]) -> None:
        """The index entry of member ``rid`` (its spans ``linked``, taken out of
        ``links``) is gone: forget its bookkeeping, its spans no longer pending there."""
        self.link_created.pop((tid, rid), None)
        self.link_late.discard((tid, rid))
        self._uncount(tid, len(linked))
        self._release_linked(linked)

    def _forget_repeated(self, tid: bytes, repeated: set[bytes]) -> None:
        """Requests counted before, sent again: dropped, with the batch spans linked to
        them (re-sent with their member)."""
        links = self.links
        self._drop(sc.DROP_DUPLICATE, len(repeated))
        for rid in repeated:
            linked = links.pop((tid, rid), None) if links else None
            if linked is not None:
                self._settle_links(tid, rid, linked)
                self._drop(sc.DROP_DUPLICATE, len(linked))

    def _expire_links(self, horizon: float, left: int) -> int:
        """Drop the linked batch spans indexed before ``horizon`` whose member requests
        never came (or came and went), oldest first, while ``left`` (work units) lasts;
        returns what is left."""
        recent_done = self.recent_done
        for lk in pop_older(self.link_created, horizon):
            records = self.links.pop(lk, None)
            left -= 1
            if records:
                self._uncount(lk[0], len(records))
            late = lk in self.link_late
            if late:
                self.link_late.discard(lk)
            if records:
                self._release_linked(records)
                late = late or lk[0] in recent_done
                reason = sc.DROP_LATE if late else sc.DROP_ORPHAN_STAGE
                self._drop(reason, len(records))
                left -= len(records)
            if left <= 0:
                break
        return left


__all__ = ["LinkIndex"]
