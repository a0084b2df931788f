"""The demo's shipped text: training data for its tokenizer and its model, and prompts.

Everything the demo reads is original English prose shipped under
``inferprof/demo/data/*.txt`` (one short essay per file), so the demo never downloads
anything. Each file is one *topic*; the demo model classifies a prompt by topic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

_DATA_PACKAGE = "inferprof.demo"
_DATA_DIR = "data"
# A sentence ends at . ! or ? followed by whitespace; good enough for our own prose.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass(frozen=True)
class Document:
    topic: str
    text: str

    @property
    def paragraphs(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.text.split("\n\n") if p.strip())

    @property
    def sentences(self) -> tuple[str, ...]:
        return tuple(
            s.strip() for p in self.paragraphs for s in _SENTENCE_END.split(p) if s.strip()
        )


@lru_cache(maxsize=1)
def documents() -> tuple[Document, ...]:
    """Every shipped document, sorted by topic (so label order is stable)."""
    root = resources.files(_DATA_PACKAGE).joinpath(_DATA_DIR)
    docs = [
        Document(topic=entry.name[: -len(".txt")], text=entry.read_text(encoding="utf-8"))
        for entry in root.iterdir()
        if entry.name.endswith(".txt")
    ]
    if not docs:  # pragma: no cover - a broken install
        raise RuntimeError("inferprof demo data is missing: reinstall inferprof")
    return tuple(sorted(docs, key=lambda d: d.topic))


def topics() -> tuple[str, ...]:
    return tuple(d.topic for d in documents())


def all_text() -> str:
    return "\n\n".join(d.text for d in documents())


__all__ = ["Document", "all_text", "documents", "topics"]
