"""The demo's tokenizer: a byte-level BPE vocabulary trained at start-up from the shipped text.

Why the ``tokenizers`` package: it is the Rust tokenizer behind most production
model servers, so the ``tokenize`` and ``postprocess`` stages cost what they cost in
real services (a few microseconds per short prompt, more for long ones), not what a
toy Python splitter would. Byte-level BPE (the GPT-2 scheme) encodes any UTF-8 text
and decodes it back exactly, so the demo never meets an unknown character.
Training on the ~25 KB of shipped prose takes a few tens of milliseconds.
"""

from __future__ import annotations

from typing import Any

from inferprof._optional import require
from inferprof.demo import corpus

DEFAULT_VOCAB_SIZE = 2048
_MIN_VOCAB_SIZE = 300  # the 256 byte symbols plus room for merges and specials
PAD_TOKEN = "<pad>"
PAD_ID = 0  # trained first, so it is always id 0: the model's padding index


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Any:
    """Train a byte-level BPE ``tokenizers.Tokenizer`` on the shipped corpus."""
    if not isinstance(vocab_size, int) or vocab_size < _MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be an int >= {_MIN_VOCAB_SIZE}, got {vocab_size!r}")
    tk = require("tokenizers", "demo")
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD_TOKEN],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([d.text for d in corpus.documents()], trainer=trainer)
    if tokenizer.token_to_id(PAD_TOKEN) != PAD_ID:  # pragma: no cover - tokenizers changed
        raise RuntimeError("the padding token did not get id 0")
    return tokenizer


__all__ = ["DEFAULT_VOCAB_SIZE", "PAD_ID", "PAD_TOKEN", "build_tokenizer"]
