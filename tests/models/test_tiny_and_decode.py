"""Tiny Qwen2: parameter count, determinism, config; greedy decode equals a no-cache reference."""

import pytest
import torch

from sdp_cli.errors import UserError
from sdp_cli.models.decode import greedy_decode
from sdp_cli.models.tiny import build_tiny_model, padded_vocab_size


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(24, seed=3)


def test_parameter_count_by_hand(model):
    # vocab 24 -> padded to 32; hidden h=128, 4 layers, 4 q and 4 kv heads of size 32, SwiGLU 512.
    # embeddings (tied with lm_head, counted once): 32*128 = 4096
    # per layer: q,k,v with bias 3*(128*128+128) = 49536; o 128*128 = 16384;
    #            gate, up, down 3*128*512 = 196608; two RMSNorms 2*128 = 256  -> 262784
    # total: 4096 + 4*262784 + final norm 128 = 1055360
    assert sum(p.numel() for p in model.parameters()) == 1055360
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_config_is_vllm_friendly(model):
    config = model.config
    assert config.vocab_size == 32
    assert config.hidden_size // config.num_attention_heads == 32  # a head size vLLM's CPU backend accepts
    assert config._attn_implementation == "sdpa"
    assert next(model.parameters()).dtype == torch.float32
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (0, 1, 2)


def test_padded_vocab_size():
    assert [padded_vocab_size(n) for n in (1, 24, 32, 33, 100)] == [32, 32, 32, 64, 128]


def test_same_seed_same_weights_and_rng_untouched():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = build_tiny_model(24, seed=5, num_layers=1)
    b = build_tiny_model(24, seed=5, num_layers=1)
    assert torch.rand(1) == expected_next  # building a model did not consume the global RNG
    c = build_tiny_model(24, seed=6, num_layers=1)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"hidden_size": 100, "num_heads": 3}, "heads of even size"),
        ({"num_heads": 4, "num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"num_layers": 0}, "num_layers must be a positive integer"),
    ],
)
def test_bad_architecture_is_a_user_error(kwargs, fragment):
    with pytest.raises(UserError, match=fragment):
        build_tiny_model(24, **kwargs)


def _reference_greedy(model, prompt, max_new_tokens, eos_id):
    """No cache, no padding: recompute the whole sequence for every token."""
    ids = list(prompt)
    out = []
    for _ in range(max_new_tokens):
        token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        if token == eos_id:
            return out, True
        out.append(token)
        ids.append(token)
    return out, False


def test_batched_cached_decode_matches_reference():
    model = build_tiny_model(24, seed=11, num_layers=2)
    # At init (std 0.02) the residual stream carries the current token and attention barely moves
    # the argmax. Scaling the attention weights up makes the output depend on the context, so a
    # bug in positions, cache or padding mask changes the tokens (checked by breaking each once).
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj):
                proj.weight.mul_(30)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 24, (n,), generator=generator).tolist() for n in (1, 4, 9, 2, 6)]
    # Pick an EOS that the model actually produces somewhere, so both stop paths are exercised.
    first = [int(model(torch.tensor([p])).logits[0, -1].argmax()) for p in prompts]
    eos_id = first[2]
    decoded = greedy_decode(model, prompts, max_new_tokens=12, eos_id=eos_id, pad_id=0, batch_size=3)
    stops = []
    for prompt, result in zip(prompts, decoded):
        tokens, stopped = _reference_greedy(model, prompt, 12, eos_id)
        assert result.token_ids == tokens
        assert result.stopped == stopped
        stops.append(stopped)
    assert decoded[2].token_ids == [] and decoded[2].stopped  # EOS as the very first token
    assert not all(stops)  # and at least one row runs out of budget


def test_max_length_caps_each_row_at_the_context(model):
    # issue 24: no row grows past max_length tokens (prompt + completion); with an EOS the model
    # cannot produce (id 10**6), every row runs to its own cap: min(12, 10 - prompt length)
    prompts = [[5] * n for n in (1, 4, 9)]
    decoded = greedy_decode(model, prompts, max_new_tokens=12, eos_id=10**6, pad_id=0, max_length=10)
    assert [len(d.token_ids) for d in decoded] == [9, 6, 1]
    assert not any(d.stopped for d in decoded)
    for prompt, result in zip(prompts, decoded):  # the tokens are the uncapped decode's first ones
        assert result.token_ids == _reference_greedy(model, prompt, 12, 10**6)[0][: len(result.token_ids)]
