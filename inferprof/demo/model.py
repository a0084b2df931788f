"""The demo model: a small attention-free topic classifier in numpy.

It is deliberately a real batched model rather than a ``sleep()``: token embeddings,
then a few residual blocks that each apply a per-token MLP and mix in the batch
row's masked mean (so every token sees its whole sequence, and padding *would*
change the answer if the mask were wrong), then a masked mean-pool and a
cosine-similarity head over the shipped topics. Batches are padded to their longest
sequence; the mask keeps padding out of every pooled quantity, so a sequence's
output is the same alone as in any padded batch (up to float rounding).

The head is fitted at start-up, without a training loop: each topic's weight
vector is the normalised mean pooled feature of that topic's paragraphs. With
random embeddings this is a nearest-centroid classifier, which is enough to give
sensible labels for prompts drawn from the shipped text.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from inferprof.demo.tokenizer import PAD_ID


@dataclass(frozen=True)
class ModelSize:
    d_model: int
    d_hidden: int
    n_layers: int


#: Named sizes; compute per token grows roughly with ``d_model * d_hidden * n_layers``.
MODEL_SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(32, 64, 1),
    "small": ModelSize(128, 512, 2),
    "medium": ModelSize(256, 1024, 2),
    "large": ModelSize(384, 1536, 3),
}
DEFAULT_MODEL_SIZE = "small"


@dataclass(frozen=True)
class Batch:
    """A collated batch: token ids padded to the longest row, and the matching mask."""

    ids: np.ndarray  # (B, T) int32, PAD_ID where mask == 0
    mask: np.ndarray  # (B, T) float32, 1 for real tokens
    lengths: tuple[int, ...]

    @property
    def effective_tokens(self) -> int:
        return int(sum(self.lengths))

    @property
    def padded_tokens(self) -> int:
        return int(self.ids.shape[0] * self.ids.shape[1])


def collate(sequences: Sequence[Sequence[int]]) -> Batch:
    """Pad token-id sequences to the longest one and build the mask."""
    if not sequences:
        raise ValueError("cannot collate an empty batch")
    lengths = tuple(len(s) for s in sequences)
    if min(lengths) == 0:
        raise ValueError("cannot collate an empty sequence")
    width = max(lengths)
    ids = np.full((len(sequences), width), PAD_ID, dtype=np.int32)
    mask = np.zeros((len(sequences), width), dtype=np.float32)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1.0
    return Batch(ids=ids, mask=mask, lengths=lengths)


#: Weights start on a page boundary. Where numpy's allocator puts an array (16-byte
#: aligned, else arbitrary) changes how fast the vector loops over it, and it differs
#: from one process to the next: measured, two processes of the same uninstrumented
#: service differed by up to 4% CPU per request on this account alone, which swamps the
#: few percent the overhead benchmark compares (docs/overhead.md, "Same batching, same model work").
_WEIGHT_ALIGNMENT = 4096


def page_aligned(a: np.ndarray, alignment: int = _WEIGHT_ALIGNMENT) -> np.ndarray:
    """A C-contiguous copy of ``a`` whose data starts on an ``alignment``-byte boundary."""
    buf = np.empty(a.nbytes + alignment, dtype=np.uint8)
    offset = (-buf.ctypes.data) % alignment
    out = buf[offset : offset + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def _masked_mean(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    # x: (B, T, D), mask: (B, T) -> (B, D); rows are never empty (collate forbids it).
    # A batched (1, T) @ (T, D) product: no (B, T, D) temporary, unlike einsum here.
    return np.matmul(mask[:, None, :], x)[:, 0, :] / mask.sum(axis=1, keepdims=True)


class _Workspace:
    """Page-aligned activation buffers, reused from batch to batch (one per thread).

    Model runtimes keep their activation memory (PyTorch's caching allocator, ONNX
    Runtime's arena); the demo does too, for two measured reasons (docs/overhead.md, "The
    model's memory"): fresh arrays every batch were handed back to the kernel and
    page-faulted in again (63 minor faults per request, ~11% of the model's CPU, and the
    count moved with every other allocation in the process), and where the allocator put
    them changed how fast the vector loops ran, differently in every process.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}

    def view(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A C-contiguous float32 array of ``shape`` over buffer ``name`` (grown on need)."""
        n = int(np.prod(shape))
        buf = self._buffers.get(name)
        if buf is None or buf.size < n:
            buf = self._buffers[name] = page_aligned(np.empty(n, dtype=np.float32))
        return buf[:n].reshape(shape)


@dataclass(frozen=True)
class Outputs:
    logits: np.ndarray  # (B, n_topics) cosine similarities
    token_scores: np.ndarray  # (B, T) each token's score for its row's best topic


class TopicModel:
    """Embedding + residual token-MLP blocks + masked pooling + topic head."""

    def __init__(self, vocab_size: int, topics: Sequence[str], size: str = DEFAULT_MODEL_SIZE,
                 seed: int = 0) -> None:
        if size not in MODEL_SIZES:
            raise ValueError(f"unknown model size {size!r}; choose one of {sorted(MODEL_SIZES)}")
        if vocab_size <= PAD_ID:
            raise ValueError(f"vocab_size must be > {PAD_ID}, got {vocab_size!r}")
        if not topics:
            raise ValueError("the model needs at least one topic")
        self.size_name = size
        self.size = dims = MODEL_SIZES[size]
        self.topics = tuple(topics)
        rng = np.random.default_rng(seed)
        d, h = dims.d_model, dims.d_hidden
        self.embed = rng.standard_normal((vocab_size, d)).astype(np.float32)
        self.embed[PAD_ID] = 0.0
        # Small residual branches keep activations in range without a normalisation layer.
        self.blocks = [
            (
                (rng.standard_normal((d, h)) / np.sqrt(d)).astype(np.float32),
                (rng.standard_normal(h) * 0.1).astype(np.float32),
                (rng.standard_normal((h, d)) * (0.5 / np.sqrt(h))).astype(np.float32),
                (rng.standard_normal((d, d)) * (0.5 / np.sqrt(d))).astype(np.float32),
            )
            for _ in range(dims.n_layers)
        ]
        self.head = np.zeros((d, len(self.topics)), dtype=np.float32)
        self._local = threading.local()

    def features(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Per-token features, shape (B, T, d_model); padded positions are zeroed."""
        return self._features(ids, mask).copy()

    def _features(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        # Computed in this thread's workspace (see _Workspace): the result is a view into
        # it, valid until this thread's next call.
        b, t = ids.shape
        ws = self._workspace()
        # mode="clip": numpy buffers `out` for the default mode="raise" (a fresh array per
        # batch again); the tokenizer only produces ids inside the vocabulary.
        x = np.take(self.embed, ids, axis=0, out=ws.view("x", (b, t, self.size.d_model)),
                    mode="clip")
        hidden = ws.view("hidden", (b, t, self.size.d_hidden))
        branch = ws.view("branch", (b, t, self.size.d_model))
        m = mask[:, :, None]
        for w1, b1, w2, u in self.blocks:
            pooled = _masked_mean(x, mask)
            np.matmul(x, w1, out=hidden)
            hidden += b1
            np.maximum(hidden, 0.0, out=hidden)
            x += np.matmul(hidden, w2, out=branch)
            x += (pooled @ u)[:, None, :]
            x *= m
        return x

    def _workspace(self) -> _Workspace:
        ws = getattr(self._local, "workspace", None)
        if ws is None:
            ws = self._local.workspace = _Workspace()
        return ws

    def forward(self, ids: np.ndarray, mask: np.ndarray) -> Outputs:
        x = self._features(ids, mask)
        pooled = _masked_mean(x, mask)
        pooled /= np.linalg.norm(pooled, axis=1, keepdims=True) + 1e-6
        logits = pooled @ self.head
        best = logits.argmax(axis=1)
        token_scores = np.matmul(x, self.head.T[best][:, :, None])[:, :, 0]
        token_scores[mask == 0] = -np.inf
        return Outputs(logits=logits, token_scores=token_scores)

    def fit_head(self, examples: dict[str, Sequence[Sequence[int]]]) -> None:
        """Nearest-centroid head: each topic's vector is its examples' mean pooled feature."""
        head = np.zeros_like(self.head)
        for col, topic in enumerate(self.topics):
            seqs = examples.get(topic)
            if not seqs:
                raise ValueError(f"no examples for topic {topic!r}")
            batch = collate(seqs)
            pooled = _masked_mean(self.features(batch.ids, batch.mask), batch.mask)
            pooled /= np.linalg.norm(pooled, axis=1, keepdims=True) + 1e-6
            centroid = pooled.mean(axis=0)
            head[:, col] = centroid / (np.linalg.norm(centroid) + 1e-6)
        # Centring removes the direction every topic shares, which would otherwise dominate.
        head -= head.mean(axis=1, keepdims=True)
        head /= np.linalg.norm(head, axis=0, keepdims=True) + 1e-6
        self.head = head

    def add_topic_signal(self, examples: dict[str, Sequence[Sequence[int]]],
                         strength: float = 2.0) -> None:
        """Give each token embedding a component along its topics, by counting.

        A token's topic distribution p (smoothed counts over the examples) moves its
        embedding along ``(p - uniform) @ topic_directions``, scaled by how informative the
        token is (1 - normalised entropy of p, so "the" moves nowhere). This is the
        counting half of a naive-Bayes classifier folded into the embedding table; it
        lets the demo give sensible labels without a training loop.
        """
        n = len(self.topics)
        vocab, d = self.embed.shape
        counts = np.zeros((vocab, n), dtype=np.float64)
        for col, topic in enumerate(self.topics):
            for seq in examples.get(topic, ()):
                np.add.at(counts[:, col], np.asarray(seq, dtype=np.int64), 1.0)
        p = (counts + 0.1) / (counts + 0.1).sum(axis=1, keepdims=True)
        entropy = -(p * np.log(p)).sum(axis=1) / np.log(n) if n > 1 else np.zeros(vocab)
        weight = (1.0 - entropy) * (counts.sum(axis=1) > 0)
        rng = np.random.default_rng(len(self.topics))
        directions = rng.standard_normal((n, d))
        directions /= np.linalg.norm(directions, axis=1, keepdims=True)
        shift = ((p - 1.0 / n) * weight[:, None]) @ directions * strength * np.sqrt(d)
        shift[PAD_ID] = 0.0
        self.embed = (self.embed + shift).astype(np.float32)


def build_model(tokenizer: Any, size: str = DEFAULT_MODEL_SIZE, seed: int = 0,
                max_tokens: int = 512) -> TopicModel:
    """A :class:`TopicModel` over the shipped topics, fitted on their paragraphs by counting."""
    from inferprof.demo import corpus

    docs = corpus.documents()
    model = TopicModel(tokenizer.get_vocab_size(), [d.topic for d in docs], size=size, seed=seed)
    examples = {
        d.topic: [enc.ids[:max_tokens] for enc in tokenizer.encode_batch(list(d.paragraphs))]
        for d in docs
    }
    model.add_topic_signal(examples)
    model.fit_head(examples)
    model.embed = page_aligned(model.embed)
    model.head = page_aligned(model.head)
    model.blocks = [tuple(page_aligned(w) for w in block) for block in model.blocks]
    return model


__all__ = [
    "DEFAULT_MODEL_SIZE",
    "MODEL_SIZES",
    "Batch",
    "ModelSize",
    "Outputs",
    "TopicModel",
    "build_model",
    "collate",
    "page_aligned",
]
