"""The numpy decoder: the KV cache and chunking change nothing but the cost."""

import numpy as np
import pytest

from inferprof.demo.llm.kv_cache import BlockAllocator, KVCache, blocks_for
from inferprof.demo.llm.model import ModelConfig, StepItem, TinyLM

CONFIG = ModelConfig(vocab_size=300, d_model=64, n_heads=4, n_layers=2, d_ff=128,
                     max_seq_len=256)
BLOCK = 8


def _full_logits(model, tokens):
    """Every position's logits from one prefill of the whole sequence, in a fresh cache."""
    cache = model.new_cache(blocks_for(len(tokens), BLOCK), BLOCK)
    blocks = list(range(cache.num_blocks))
    return np.stack([
        model.step([StepItem(blocks, 0, tokens[:n])], cache)[0] for n in range(1, len(tokens) + 1)
    ])


def test_cached_decode_gives_the_logits_of_a_full_recompute():
    model = TinyLM(CONFIG)
    rng = np.random.default_rng(1)
    seq = [int(t) for t in rng.integers(1, CONFIG.vocab_size, 40)]
    truth = _full_logits(model, seq)
    alloc = BlockAllocator(64)
    cache = model.new_cache(64, BLOCK)
    # Prefill the first 13 tokens in chunks of 5, 5, 3, then decode one token at a time,
    # sharing every step with another request so batching is exercised too.
    mine = alloc.allocate(blocks_for(len(seq), BLOCK))
    other = alloc.allocate(blocks_for(len(seq), BLOCK))
    got = {}
    pos = 0
    for chunk in (5, 5, 3, *([1] * (len(seq) - 13))):
        items = [StepItem(mine, pos, seq[pos:pos + chunk]),
                 StepItem(other, pos, seq[::-1][pos:pos + chunk])]
        got[pos + chunk - 1] = model.step(items, cache)[0]
        pos += chunk
    for position, logits in got.items():
        np.testing.assert_allclose(logits, truth[position], rtol=1e-4, atol=1e-4)
    # And the head reads real context: a different prefix gives different logits.
    assert not np.allclose(truth[-1], _full_logits(model, [7, *seq[1:]])[-1], atol=1e-3)


def test_skipped_heads_are_zero_and_models_are_reproducible():
    a, b = TinyLM(CONFIG), TinyLM(CONFIG)
    cache = a.new_cache(4, BLOCK)
    items = [StepItem([0], 0, [1, 2, 3]), StepItem([1], 0, [4, 5])]
    logits = a.step(items, cache, logits_for=[False, True])
    assert not logits[0].any() and logits[1].any()
    np.testing.assert_allclose(b.step(items, b.new_cache(4, BLOCK))[1], logits[1], atol=1e-5)


def test_the_cache_addresses_positions_through_the_block_table():
    cache = KVCache(num_layers=1, num_blocks=4, block_size=2, num_heads=1, head_dim=1)
    keys = np.arange(3, dtype=np.float32).reshape(3, 1, 1)
    cache.write(0, [3, 1], 0, keys, -keys)
    k, v = cache.read(0, [3, 1], 3)
    np.testing.assert_array_equal(k, keys)
    np.testing.assert_array_equal(v, -keys)
    with pytest.raises(ValueError, match="cannot hold"):
        cache.read(0, [3], 3)


def test_allocator_never_hands_out_more_than_it_has():
    alloc = BlockAllocator(5)
    a = alloc.allocate(3)
    assert alloc.allocate(3) is None and alloc.free == 2  # nothing taken on failure
    alloc.release(a)
    assert sorted(alloc.allocate(5)) == [0, 1, 2, 3, 4] and alloc.usage == 1.0


def test_bad_configs_are_value_errors():
    with pytest.raises(ValueError, match="multiple of n_heads"):
        ModelConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="max_seq_len"):
        TinyLM(CONFIG).step([StepItem(list(range(40)), 255, [1, 2])],
                            TinyLM(CONFIG).new_cache(40, BLOCK))
