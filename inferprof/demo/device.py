"""Where the demo model's batch lives while it computes: preallocated "device" buffers.

A real GPU server copies each collated batch into device memory (``h2d``), runs the
model there (``compute``) and copies the outputs back (``d2h``). The demo keeps the
same three steps with the same shape of work on a machine without a GPU: the batch
is copied into buffers allocated once at start-up, the model reads only those
buffers, and the outputs are copied out into fresh host arrays. On CPU these copies
are real ``memcpy`` calls within host memory, so ``h2d``/``d2h`` are honest but
small (microseconds for a few KB); they are not PCIe transfers, and the demo's docs
say so. The buffers are sized for the largest batch the service accepts, exactly as
a GPU server pre-allocates its input tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from inferprof.demo.model import Batch, Outputs, page_aligned


@dataclass(frozen=True)
class DeviceBatch:
    ids: np.ndarray
    mask: np.ndarray
    nbytes: int


class HostDevice:
    """Preallocated input buffers in host memory, standing in for device memory."""

    name = "cpu"

    def __init__(self, max_batch_size: int, max_tokens: int) -> None:
        if max_batch_size < 1 or max_tokens < 1:
            raise ValueError("max_batch_size and max_tokens must be >= 1")
        self.max_batch_size = max_batch_size
        self.max_tokens = max_tokens
        # page-aligned like the weights: the same speed in every process (model.py)
        self._ids = page_aligned(np.zeros((max_batch_size, max_tokens), dtype=np.int32))
        self._mask = page_aligned(np.zeros((max_batch_size, max_tokens), dtype=np.float32))

    def to_device(self, batch: Batch) -> DeviceBatch:
        rows, width = batch.ids.shape
        if rows > self.max_batch_size or width > self.max_tokens:
            raise ValueError(
                f"batch {rows}x{width} exceeds the device buffers "
                f"{self.max_batch_size}x{self.max_tokens}"
            )
        ids = self._ids[:rows, :width]
        mask = self._mask[:rows, :width]
        np.copyto(ids, batch.ids)
        np.copyto(mask, batch.mask)
        return DeviceBatch(ids=ids, mask=mask, nbytes=batch.ids.nbytes + batch.mask.nbytes)

    @staticmethod
    def to_host(outputs: Outputs) -> tuple[Outputs, int]:
        host = Outputs(logits=outputs.logits.copy(), token_scores=outputs.token_scores.copy())
        return host, host.logits.nbytes + host.token_scores.nbytes


__all__ = ["DeviceBatch", "HostDevice"]
