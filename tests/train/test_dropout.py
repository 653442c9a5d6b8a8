"""The policy trains without dropout (docs/training.md, "The trainer's policy"): π_θ (train
mode) and π_prox (eval mode) are the same function at θ = π_prox, so the PPO ratio is exactly 1
there and the clip cannot fire, for models whose config asks for dropout."""

import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from sdp_cli.config.schema import LossConfig, OptimConfig

from . import cases
from .cases import Trainer


def _qwen2():
    # Qwen2's only dropout is attention_dropout, applied inside attention in train mode
    config = Qwen2Config(
        vocab_size=cases.VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, intermediate_size=64, attention_dropout=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def _gpt2():
    # GPT-2 has nn.Dropout modules on embeddings, attention weights and residuals
    config = GPT2Config(
        vocab_size=cases.VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64,
        embd_pdrop=0.5, attn_pdrop=0.5, resid_pdrop=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


@pytest.mark.parametrize("build", [_qwen2, _gpt2], ids=["qwen2-attention-dropout", "gpt2-dropout-modules"])
def test_the_ratio_is_exactly_one_at_the_proximal_policy(build):
    model = build()
    batch_groups = cases.random_groups(8, seed=1)
    # old = π_prox + noise: the weights differ from 1, the PPO ratio at θ = π_prox must not
    cases.set_old_logprobs(batch_groups, model, noise=0.3, seed=2)
    trainer = Trainer(copy.deepcopy(model), loss=LossConfig(), optim=OptimConfig(), temperature=1.0)
    out = trainer.step(cases.batch_of(batch_groups))
    # one optimizer step at θ = π_prox: log r = log π_θ − log π_prox = 0 on every token
    assert out.metrics["loss/optimizer_steps"] == 1.0
    assert out.metrics["loss/ppo_kl"] == 0.0
    assert out.metrics["loss/pg_clipfrac"] == 0.0
    # and the model still trains (the test is not vacuous)
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), trainer.weights().values()))
