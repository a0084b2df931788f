import numpy as np
import pytest

from inferprof.demo import corpus
from inferprof.demo.model import TopicModel, build_model, collate
from inferprof.demo.tokenizer import PAD_ID, build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_model(tokenizer, size="tiny")


def test_collate_pads_to_the_longest_sequence():
    batch = collate([[5, 6, 7], [8], [9, 10, 11, 12, 13]])
    assert batch.ids.shape == (3, 5)
    assert batch.ids[1].tolist() == [8, PAD_ID, PAD_ID, PAD_ID, PAD_ID]
    assert batch.mask.sum(axis=1).tolist() == [3, 1, 5]
    assert batch.effective_tokens == 9
    assert batch.padded_tokens == 15


def test_collate_rejects_empty_input():
    with pytest.raises(ValueError):
        collate([])
    with pytest.raises(ValueError):
        collate([[1], []])


def test_padding_does_not_change_a_sequence_output(model, tokenizer):
    short = tokenizer.encode("The tide came in.").ids
    long = tokenizer.encode(corpus.documents()[0].paragraphs[0]).ids
    alone = model.forward(*_arrays(collate([short])))
    batched = model.forward(*_arrays(collate([long, short, long[:7]])))
    assert batched.logits.shape[0] == 3
    np.testing.assert_allclose(batched.logits[1], alone.logits[0], rtol=1e-4, atol=1e-5)
    n = len(short)
    np.testing.assert_allclose(batched.token_scores[1, :n], alone.token_scores[0], rtol=1e-4,
                               atol=1e-4)
    assert np.all(np.isneginf(batched.token_scores[1, n:]))


def test_the_mask_is_what_keeps_padding_out(model, tokenizer):
    # Same padded ids, but a mask that claims the padding is real: the answer changes.
    # This is what makes the previous test meaningful.
    short = tokenizer.encode("The tide came in.").ids
    batch = collate([short + [PAD_ID] * 30])
    honest = collate([short])
    a = model.forward(batch.ids, batch.mask).logits[0]
    b = model.forward(honest.ids, honest.mask).logits[0]
    assert not np.allclose(a, b, atol=1e-4)


def test_head_classifies_shipped_paragraphs_above_chance(tokenizer):
    model = build_model(tokenizer, size="small")
    hits = total = 0
    for doc in corpus.documents():
        batch = collate([e.ids for e in tokenizer.encode_batch(list(doc.paragraphs))])
        best = model.forward(batch.ids, batch.mask).logits.argmax(axis=1)
        hits += int((best == model.topics.index(doc.topic)).sum())
        total += len(doc.paragraphs)
    assert hits / total > 2 / len(model.topics)


def test_unknown_size_is_a_value_error():
    with pytest.raises(ValueError, match="model size"):
        TopicModel(100, ["a"], size="huge")


def _arrays(batch):
    return batch.ids, batch.mask


def test_sentences_it_never_saw_get_sensible_topics(tokenizer):
    model = build_model(tokenizer, size="small")
    cases = {
        "The orchard in spring, blossom and bees.": "orchard",
        "The signal box released the token.": "railway",
        "The porter carried the slips down to the stacks.": "library",
        "He sharpened the chisel before turning the leg.": "workshop",
        "Gulls circled the boats on the quay.": "harbour",
    }
    batch = collate([e.ids for e in tokenizer.encode_batch(list(cases))])
    best = model.forward(batch.ids, batch.mask).logits.argmax(axis=1)
    assert [model.topics[i] for i in best] == list(cases.values())


def test_weights_and_device_buffers_start_on_a_page_boundary(model):
    from inferprof.demo.device import HostDevice
    from inferprof.demo.model import page_aligned

    arrays = [model.embed, model.head, *(w for block in model.blocks for w in block)]
    device = HostDevice(4, 16)
    arrays += [device._ids, device._mask]
    assert all(a.ctypes.data % 4096 == 0 and a.flags.c_contiguous for a in arrays)
    odd = np.arange(7, dtype=np.float32)[1:]  # data 4 bytes past an allocation's start
    copy = page_aligned(odd)
    assert copy.ctypes.data % 4096 == 0
    np.testing.assert_array_equal(copy, odd)


def _reference_forward(model, ids, mask):
    """The model written plainly, a fresh array per operation: what the workspace must equal."""
    x = model.embed[ids]
    m = mask[:, :, None]
    for w1, b1, w2, u in model.blocks:
        pooled = np.matmul(mask[:, None, :], x)[:, 0, :] / mask.sum(axis=1, keepdims=True)
        hidden = np.maximum(x @ w1 + b1, 0.0)
        x = x + hidden @ w2 + (pooled @ u)[:, None, :]
        x *= m
    return x


def test_the_workspace_computes_what_fresh_arrays_would(tokenizer):
    model = build_model(tokenizer, size="small")
    rng = np.random.default_rng(3)
    for shape in ((16, 120), (2, 7), (9, 64)):  # the workspace shrinks and grows between
        ids = rng.integers(PAD_ID + 1, tokenizer.get_vocab_size(), size=shape).astype(np.int32)
        mask = np.ones(shape, dtype=np.float32)
        mask[0, shape[1] // 2 :] = 0.0
        ids[mask == 0] = PAD_ID
        np.testing.assert_array_equal(model.features(ids, mask),
                                      _reference_forward(model, ids, mask))


def test_a_batch_allocates_no_activation_arrays(tokenizer):
    import tracemalloc

    model = build_model(tokenizer, size="small")
    batch = collate([list(range(PAD_ID + 1, PAD_ID + 200))] * 16)
    model.forward(batch.ids, batch.mask)  # the workspace is sized by the first batch
    activations = 16 * 199 * model.size.d_hidden * 4  # one (B, T, hidden) float32 array
    tracemalloc.start()
    try:
        model.forward(batch.ids, batch.mask)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Small outputs (logits, token scores) only: a fresh activation array per batch is
    # what page-faulted (docs/overhead.md, "The model's memory").
    assert peak < activations / 8


def test_features_are_a_copy_the_next_batch_does_not_overwrite(model):
    batch = collate([[PAD_ID + 1, PAD_ID + 2, PAD_ID + 3]])
    first = model.features(batch.ids, batch.mask)
    kept = first.copy()
    model.features(collate([[PAD_ID + 4] * 3]).ids, np.ones((1, 3), dtype=np.float32))
    np.testing.assert_array_equal(first, kept)
