"""The demo's serving path, stage by stage: tokenize, collate, h2d, compute, d2h, postprocess.

The pipeline is written once and takes a ``stage`` context-manager factory, so the
same code runs uninstrumented (a no-op factory; the overhead baseline) and under
inferprof (``inferprof.stage``). ``receive`` and ``serialize`` are measured by the
HTTP middleware, ``queue`` and ``batch_assembly`` by the batcher.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np

from inferprof import semconv
from inferprof.demo.device import HostDevice
from inferprof.demo.model import Batch, build_model, collate
from inferprof.demo.settings import DemoSettings
from inferprof.demo.tokenizer import build_tokenizer

StageFactory = Callable[..., AbstractContextManager[Any]]
TOP_TOKENS = 5


def no_stage(name: str, **attributes: Any) -> AbstractContextManager[None]:
    """The uninstrumented stand-in for ``inferprof.stage``."""
    return contextlib.nullcontext()


@dataclass(frozen=True)
class RowOutput:
    """One request's slice of a batch's outputs, back on the host."""

    logits: np.ndarray
    token_scores: np.ndarray


class DemoPipeline:
    def __init__(self, settings: DemoSettings, stage: StageFactory = no_stage) -> None:
        self.settings = settings
        self._stage = stage
        self.tokenizer = build_tokenizer()
        self.model = build_model(self.tokenizer, size=settings.model_size,
                                 max_tokens=settings.max_tokens)
        self.device = HostDevice(settings.max_batch_size, settings.max_tokens)

    # --- per request, before the batcher --------------------------------------
    def tokenize(self, text: str) -> list[int]:
        with self._stage(semconv.STAGE_TOKENIZE):
            ids = self.tokenizer.encode(text).ids[: self.settings.max_tokens]
        if not ids:
            raise ValueError("text produced no tokens")
        return ids

    # --- per batch, inside the batcher ----------------------------------------
    @staticmethod
    def collate(items: Sequence[Sequence[int]]) -> Batch:
        return collate(items)

    def run_batch(self, batch: Batch) -> list[RowOutput]:
        """Model execution for one collated batch; returns one output per member, in order."""
        with self._stage(semconv.STAGE_H2D) as span:
            on_device = self.device.to_device(batch)
            _set(span, semconv.ATTR_BYTES, on_device.nbytes)
        with self._stage(semconv.STAGE_COMPUTE) as span:
            _set(span, semconv.ATTR_TOKENS_EFFECTIVE, batch.effective_tokens)
            _set(span, semconv.ATTR_TOKENS_PADDED, batch.padded_tokens)
            outputs = self.model.forward(on_device.ids, on_device.mask)
        with self._stage(semconv.STAGE_D2H) as span:
            host, nbytes = self.device.to_host(outputs)
            _set(span, semconv.ATTR_BYTES, nbytes)
        return [
            RowOutput(logits=host.logits[row], token_scores=host.token_scores[row, :length])
            for row, length in enumerate(batch.lengths)
        ]

    # --- per request, after the batcher ---------------------------------------
    def postprocess(self, ids: Sequence[int], out: RowOutput) -> dict[str, Any]:
        with self._stage(semconv.STAGE_POSTPROCESS):
            logits = out.logits.astype(np.float64)
            # Cosine logits live in [-1, 1]; a temperature makes the softmax readable.
            weights = np.exp((logits - logits.max()) * 10.0)
            probs = weights / weights.sum()
            best = int(probs.argmax())
            k = min(TOP_TOKENS, len(ids))
            top_rows = np.argpartition(-out.token_scores, k - 1)[:k]
            top_rows = top_rows[np.argsort(-out.token_scores[top_rows])]
            top_tokens = [self.tokenizer.decode([ids[int(i)]]).strip() for i in top_rows]
            return {
                "topic": self.model.topics[best],
                "confidence": round(float(probs[best]), 4),
                "scores": {
                    t: round(float(p), 4)
                    for t, p in zip(self.model.topics, probs, strict=False)
                },
                "top_tokens": top_tokens,
                "tokens": len(ids),
            }


def _set(span: Any, key: str, value: Any) -> None:
    # The no-op stage yields None; inferprof.stage yields its span.
    if span is not None and hasattr(span, "set_attribute") and not (
        isinstance(value, float) and math.isnan(value)
    ):
        span.set_attribute(key, value)


__all__ = ["TOP_TOKENS", "DemoPipeline", "RowOutput", "StageFactory", "no_stage"]
