"""LocalEngine.score with continuations laid end to end under a block mask (models/packed.py):
the mask by hand, the cache laid out row after row, the scores of one unpadded full forward on
random GRPO-shaped batches, and the padded forward wherever packing cannot hold (sliding
windows, a model that ignores a 4-D mask, a mask over the size limit, nothing to save)."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdp_cli.engine.local import LocalEngine
from sdp_cli.models import packed
from sdp_cli.models.kv_cache import lay_rows_end_to_end, returned_cache
from sdp_cli.models.packed import block_mask, packing_saves

from ..sliding_models import KINDS, sliding_model
from .tiny_qwen import EOS, PAD, reference_logprobs, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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


@st.composite
def groups(draw):
    """Sequences of a few prompts with several continuations each (of unequal length), scored
    from the prompt's end, from inside it, or from a sequence's end (nothing to score)."""
    sequences, starts = [], []
    for _ in range(draw(st.integers(1, 3))):
        prompt = draw(st.lists(st.integers(1, EOS - 1), min_size=1, max_size=6))
        for _ in range(draw(st.integers(1, 5))):
            answer = draw(st.lists(st.integers(1, EOS), min_size=1, max_size=7))
            sequences.append(prompt + answer)
            starts.append(draw(st.sampled_from([len(prompt), max(1, len(prompt) - 1), len(prompt) + len(answer)])))
    return sequences, starts


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=groups(), temperature=st.sampled_from([1.0, 0.7]), kernel=st.sampled_from(["sdpa", "eager"]))
def test_packed_scores_equal_one_unpadded_full_forward(batch, temperature, kernel):
    # SDPA takes the mask as booleans, eager attention as an additive float mask
    sequences, starts = batch
    model = tiny_model(seed=2)
    model.set_attn_implementation(kernel)
    engine = LocalEngine(model, temperature=temperature, eos_token_id=EOS, pad_token_id=PAD)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the first packed chunk agrees with the padded forward
        scored = engine.score(sequences, starts)
        scored = engine.score(sequences, starts)  # packed, now without the comparison
    suffixes = [len(s) - 1 - start for s, start in zip(sequences, starts, strict=True)]
    if packing_saves(suffixes):
        assert engine._packing is True and engine._packed_last
    for seq, start, values in zip(sequences, starts, scored, strict=True):
        expected = reference_logprobs(model, seq, start, temperature)
        assert len(values) == len(expected)
        assert all(abs(a - b) <= 1e-5 for a, b in zip(values, expected, strict=True))


def _unequal_batch() -> tuple[list[list[int]], list[int]]:
    prompt = [3, 4, 5]
    answers = [[6], [7, 8, 9, 10, 11], [12, EOS], [6, 6, 6, 6, 6, 6]]
    return [prompt + a for a in answers], [len(prompt)] * len(answers)


def _check_reference(model, sequences, starts, scored, temperature=1.0):
    for seq, start, values in zip(sequences, starts, scored, strict=True):
        expected = reference_logprobs(model, seq, start, temperature)
        assert max(abs(a - b) for a, b in zip(values, expected, strict=True)) <= 1e-5


@pytest.mark.parametrize("fault", ["ignores the mask", "raises"])
def test_a_model_that_mishandles_a_four_dimensional_mask_is_scored_row_by_row_with_one_warning(fault):
    model = tiny_model(seed=5)
    plain_forward = model.forward

    def forward(*args, attention_mask=None, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 4:
            if fault == "raises":
                raise RuntimeError("The size of tensor a (5) must match the size of tensor b (9)")
            attention_mask = None  # every packed token then attends to every earlier one
        return plain_forward(*args, attention_mask=attention_mask, **kwargs)

    model.forward = forward
    engine = LocalEngine(model, eos_token_id=EOS, pad_token_id=PAD)
    sequences, starts = _unequal_batch()
    with pytest.warns(UserWarning, match="laid end to end"):
        scored = engine.score(sequences, starts)
    assert engine._packing is False
    _check_reference(model, sequences, starts, scored)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        _check_reference(model, sequences, starts, engine.score(sequences, starts))


def test_over_the_mask_limit_or_on_a_sliding_window_model_the_engine_pads(monkeypatch):
    sequences, starts = _unequal_batch()
    model = tiny_model(seed=6)
    engine = LocalEngine(model, eos_token_id=EOS, pad_token_id=PAD)
    monkeypatch.setattr(packed, "MAX_MASK_ENTRIES", 10)
    _check_reference(model, sequences, starts, engine.score(sequences, starts))
    assert not engine._packed_last and engine._packing is None  # not yet compared
    monkeypatch.undo()
    for kind in KINDS:
        sliding = sliding_model(kind, vocab=32, seed=1)
        engine = LocalEngine(sliding, eos_token_id=EOS, pad_token_id=PAD)
        assert engine._packing is False
        _check_reference(sliding, sequences, starts, engine.score(sequences, starts))
