"""models/packed.py, which the trainer's shared-prefix forward packs its windows with: the block
mask by hand, a KV cache laid out row after row, and when packing is worth it. That the packed
forward gives the plain forward's log-probs, entropies and gradients is checked in
tests/train/test_shared_prefix.py."""

from __future__ import annotations

import torch

from sdp_cli.models.kv_cache import lay_rows_end_to_end, returned_cache
from sdp_cli.models.packed import block_mask, packing_saves

from ..engine.tiny_qwen import tiny_model
from ..sliding_models import KINDS, sliding_model


def test_the_block_mask_by_hand():
    # prefix 0 = [a b] (no padding), prefix 1 = [_ c] (one left pad); rows: 0 → prefix 1 with 2
    # tokens, 1 → prefix 0 with 0 tokens, 2 → prefix 0 with 1 token. Keys: a b _ c | r0 r0 r2
    visible = block_mask(torch.tensor([1, 0, 0]), torch.tensor([[1, 1], [0, 1]]), torch.tensor([2, 0, 1]))
    assert visible.shape == (3, 4 + 3)
    assert visible.int().tolist() == [
        [0, 0, 0, 1, 1, 0, 0],  # row 0's first token: c, itself
        [0, 0, 0, 1, 1, 1, 0],  # row 0's second: c, both of row 0's
        [1, 1, 0, 0, 0, 0, 1],  # row 2's token: a b, itself
    ]


def test_a_dynamic_cache_is_laid_out_row_after_row_and_a_sliding_one_is_left_alone():
    model = tiny_model()
    with torch.no_grad():
        cache = returned_cache(model(input_ids=torch.tensor([[1, 2, 3], [4, 5, 6]]), use_cache=True))
    keys = [layer.keys.clone() for layer in cache.layers]
    assert lay_rows_end_to_end(cache)
    for before, layer in zip(keys, cache.layers, strict=True):
        assert layer.keys.shape == (1, before.shape[1], 6, before.shape[3])
        assert torch.equal(layer.keys[0, :, :3], before[0]) and torch.equal(layer.keys[0, :, 3:], before[1])
    sliding = sliding_model(KINDS[0], vocab=32, seed=0)
    with torch.no_grad():
        cache = returned_cache(sliding(input_ids=torch.tensor([[1, 2, 3], [4, 5, 6]]), use_cache=True))
    shapes = [tuple(layer.keys.shape) for layer in cache.layers]
    assert not lay_rows_end_to_end(cache)
    assert [tuple(layer.keys.shape) for layer in cache.layers] == shapes


def test_packing_is_worth_it_only_where_padding_is_saved():
    assert packing_saves([1, 3, 1, 3])  # 8 of 12 positions
    assert not packing_saves([3, 3, 2])  # 8 of 9: attention over the block mask would cost more
    assert not packing_saves([0, 0]) and not packing_saves([])
