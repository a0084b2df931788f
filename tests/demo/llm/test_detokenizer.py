"""Streamed text: the pieces of an incremental decode add up to the whole decode."""

from functools import lru_cache

from hypothesis import given, settings
from hypothesis import strategies as st

from inferprof.demo.llm.service import Detokenizer
from inferprof.demo.tokenizer import DEFAULT_VOCAB_SIZE, build_tokenizer


@lru_cache(maxsize=1)
def _tokenizer():
    return build_tokenizer()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, DEFAULT_VOCAB_SIZE - 1), min_size=1, max_size=80))
def test_pieces_add_up_to_the_whole_text_and_are_valid_text(ids):
    tk = _tokenizer()
    detok = Detokenizer(tk)
    pieces = [detok.add((t,), final=(n == len(ids) - 1)) for n, t in enumerate(ids)]
    assert "".join(pieces) == tk.decode(ids)


def test_a_split_character_is_held_back_until_complete():
    tk = _tokenizer()
    # "é" is the bytes C3 A9: byte-level BPE's symbols "Ã" and "©", one token each here.
    ids = [*tk.encode("caf").ids, tk.token_to_id("Ã"), tk.token_to_id("©")]
    detok = Detokenizer(tk)
    pieces = [detok.add((t,)) for t in ids]
    assert pieces[-2:] == ["", "é"]
    assert "".join(pieces) == "café"
