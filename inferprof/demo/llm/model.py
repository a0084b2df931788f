"""A small decoder-only transformer in numpy, with a paged KV cache: the LLM demo's model.

Random weights (seeded, so every start gives the same model and the same greedy output),
but every operation of a real decoder runs for real: token and sinusoidal position
embeddings, pre-norm blocks of multi-head causal self-attention and an MLP, a final norm
and a vocabulary head. Keys and values live in a :class:`~inferprof.demo.llm.kv_cache.KVCache`
of fixed-size blocks; a step runs any mix of prefill chunks and decode tokens of several
requests as one stacked matrix through the projections and the MLP, and each request's
queries attend causally over its own cached keys.

What it guarantees: a sequence's logits are the same whether its tokens went through in
one prefill, in chunks, or one decode token at a time, and whatever else shared the step
(up to float32 rounding; tests/demo/llm/test_model.py checks this against a full
recomputation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from inferprof.demo.llm.kv_cache import KVCache


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 2048
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 1024
    max_seq_len: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads "
                             f"({self.n_heads})")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass(frozen=True)
class StepItem:
    """One request's part of a step: ``tokens`` at positions ``start .. start+len-1``.

    A decode token is a one-token item; a prefill chunk is a longer one. The request's
    blocks in the cache must already cover ``start + len(tokens)`` positions.
    """

    blocks: Sequence[int]
    start: int
    tokens: Sequence[int]


@dataclass(frozen=True)
class _Layer:
    ln1: np.ndarray
    wqkv: np.ndarray
    wo: np.ndarray
    ln2: np.ndarray
    w1: np.ndarray
    w2: np.ndarray


def _layer_norm(x: np.ndarray, gain: np.ndarray) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = x.var(axis=-1, keepdims=True)
    return ((x - mean) / np.sqrt(var + 1e-5)) * gain


def _positions(max_len: int, d: int) -> np.ndarray:
    pos = np.arange(max_len, dtype=np.float64)[:, None]
    rate = np.exp(-np.log(10000.0) * (np.arange(0, d, 2, dtype=np.float64) / d))
    table = np.zeros((max_len, d))
    table[:, 0::2] = np.sin(pos * rate)
    table[:, 1::2] = np.cos(pos * rate)
    return table.astype(np.float32)


class TinyLM:
    """The model. ``step()`` is its only entry point; it is not thread-safe (one engine
    thread calls it)."""

    def __init__(self, config: ModelConfig | None = None) -> None:
        self.config = c = config or ModelConfig()
        rng = np.random.default_rng(c.seed)

        def weight(rows: int, cols: int) -> np.ndarray:
            return (rng.standard_normal((rows, cols)) / np.sqrt(rows)).astype(np.float32)

        self.embed = rng.standard_normal((c.vocab_size, c.d_model)).astype(np.float32)
        self.pos = _positions(c.max_seq_len, c.d_model)
        self.layers = tuple(
            _Layer(ln1=np.ones(c.d_model, np.float32), wqkv=weight(c.d_model, 3 * c.d_model),
                   wo=weight(c.d_model, c.d_model), ln2=np.ones(c.d_model, np.float32),
                   w1=weight(c.d_model, c.d_ff), w2=weight(c.d_ff, c.d_model))
            for _ in range(c.n_layers)
        )
        self.ln_f = np.ones(c.d_model, np.float32)
        self.head = weight(c.d_model, c.vocab_size)

    def new_cache(self, num_blocks: int, block_size: int) -> KVCache:
        c = self.config
        return KVCache(num_layers=c.n_layers, num_blocks=num_blocks, block_size=block_size,
                       num_heads=c.n_heads, head_dim=c.head_dim)

    def step(self, items: Sequence[StepItem], cache: KVCache,
             logits_for: Sequence[bool] | None = None) -> np.ndarray:
        """Run one step; return the logits of each item's last token, ``(n_items, vocab)``.

        ``logits_for[i]`` False skips item i's head (a prefill chunk that does not end its
        prompt samples nothing); its row is then zeros.
        """
        c = self.config
        if not items:
            return np.zeros((0, c.vocab_size), np.float32)
        ids = np.concatenate([np.asarray(it.tokens, dtype=np.int64) for it in items])
        pos = np.concatenate([np.arange(it.start, it.start + len(it.tokens)) for it in items])
        if pos.max() >= c.max_seq_len:
            raise ValueError(f"sequence longer than max_seq_len={c.max_seq_len}")
        x = self.embed[ids] + self.pos[pos]
        bounds = np.cumsum([0] + [len(it.tokens) for it in items])
        h, hd = c.n_heads, c.head_dim
        scale = np.float32(1.0 / np.sqrt(hd))
        for index, layer in enumerate(self.layers):
            qkv = _layer_norm(x, layer.ln1) @ layer.wqkv
            q, k, v = (qkv[:, i * c.d_model:(i + 1) * c.d_model].reshape(-1, h, hd)
                       for i in range(3))
            attn = np.empty((len(ids), h, hd), np.float32)
            for n, it in enumerate(items):
                lo, hi = bounds[n], bounds[n + 1]
                end = it.start + (hi - lo)
                cache.write(index, it.blocks, it.start, k[lo:hi], v[lo:hi])
                keys, values = cache.read(index, it.blocks, end)  # (end, h, hd)
                # (h, t, hd) @ (h, hd, end) -> (h, t, end); query i sits at start + i.
                scores = np.matmul(q[lo:hi].transpose(1, 0, 2), keys.transpose(1, 2, 0)) * scale
                if hi - lo > 1:
                    causal = (np.arange(end)[None, :]
                              > np.arange(it.start, end)[:, None])
                    scores[:, causal] = -np.inf
                scores -= scores.max(axis=-1, keepdims=True)
                weights = np.exp(scores)
                weights /= weights.sum(axis=-1, keepdims=True)
                attn[lo:hi] = np.matmul(weights, values.transpose(1, 0, 2)).transpose(1, 0, 2)
            x = x + attn.reshape(-1, c.d_model) @ layer.wo
            hidden = _layer_norm(x, layer.ln2) @ layer.w1
            np.maximum(hidden, 0, out=hidden)
            x = x + hidden @ layer.w2
        last = bounds[1:] - 1
        wanted = (np.ones(len(items), bool) if logits_for is None
                  else np.asarray(logits_for, dtype=bool))
        logits = np.zeros((len(items), c.vocab_size), np.float32)
        if wanted.any():
            logits[wanted] = _layer_norm(x[last[wanted]], self.ln_f) @ self.head
        return logits


__all__ = ["ModelConfig", "StepItem", "TinyLM"]
