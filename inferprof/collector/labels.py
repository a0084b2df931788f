"""Bounding the strings the collector keeps as names: service and model names.

A name longer than ``semconv.MAX_LABEL_BYTES`` UTF-8 bytes is cut, not rejected: its
spans are good data with a bad name, and dropping them would lose the requests. The cut
name ends with ``…`` and 8 hex digits of a hash of the whole name, so two long names that
share their first 245 bytes stay two series.
"""

from __future__ import annotations

import hashlib

from inferprof import semconv as sc

#: What a cut name ends with before its hash.
MARKER = "…"


def bounded(value: str) -> str:
    """``value`` if at most ``MAX_LABEL_BYTES`` UTF-8 bytes long, else its cut form."""
    limit = sc.MAX_LABEL_BYTES
    # len() counts characters, at most 4 bytes each: only the doubtful are encoded.
    if len(value) <= limit // 4:
        return value
    raw = value.encode("utf-8", "surrogatepass")
    if len(raw) <= limit:
        return value
    digest = hashlib.blake2b(raw, digest_size=4).hexdigest()
    room = limit - len(MARKER.encode()) - len(digest)
    return raw[:room].decode("utf-8", "ignore") + MARKER + digest


def utf8_bytes(value: str) -> int:
    return len(value.encode("utf-8", "surrogatepass"))


__all__ = ["MARKER", "bounded", "utf8_bytes"]
