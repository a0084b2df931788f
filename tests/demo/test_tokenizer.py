import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferprof.demo import corpus
from inferprof.demo.tokenizer import PAD_ID, PAD_TOKEN, build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_every_shipped_paragraph_round_trips(tokenizer):
    for doc in corpus.documents():
        for paragraph in doc.paragraphs:
            assert tokenizer.decode(tokenizer.encode(paragraph).ids) == paragraph


def test_trained_vocabulary_compresses_the_shipped_text(tokenizer):
    # A vocabulary actually trained on the corpus needs far fewer tokens than bytes.
    text = corpus.all_text()
    assert len(tokenizer.encode(text).ids) < len(text.encode()) / 3


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=200))
def test_any_text_round_trips(text):
    tok = _shared()
    ids = tok.encode(text).ids
    assert PAD_ID not in ids
    assert tok.decode(ids) == text


_TOK = None


def _shared():
    global _TOK
    if _TOK is None:
        _TOK = build_tokenizer()
    return _TOK


def test_padding_token_is_id_zero(tokenizer):
    assert tokenizer.token_to_id(PAD_TOKEN) == PAD_ID == 0


def test_bad_vocab_size_is_a_value_error():
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(vocab_size=10)
