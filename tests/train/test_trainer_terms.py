"""Trainer paths of issue 15 on a tiny Qwen2: log-probs from hidden states (and the full-logits
fallback), bfloat16 autocast, gradient checkpointing, KL to a reference, the entropy bonus, and
LoRA. Expected values come from a separate naive computation: one full forward, log_softmax."""

import copy
import math

import pytest
import torch
from transformers import Qwen2ForCausalLM

from sdp_cli.config.schema import LossConfig, OptimConfig
from sdp_cli.models.lora import apply_lora
from sdp_cli.models.tiny import build_tiny_model
from sdp_cli.rollout.records import RolloutGroup, RolloutSample
from sdp_cli.train.step.batch import assemble_batch
from sdp_cli.train.session.policy_setup import enable_gradient_checkpointing
from sdp_cli.train.step.trainer import Trainer

VOCAB = 32
T = 0.7


def _model(seed=0):
    return build_tiny_model(VOCAB, seed=seed, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128)


def _batch(version=0, seed=0, same_reward=False):
    g = torch.Generator().manual_seed(seed)
    groups = []
    for gid in range(2):
        samples = []
        for _ in range(4):
            s = RolloutSample(prompt_ids=[1, *torch.randint(3, VOCAB, (3,), generator=g).tolist()], group_id=gid)
            out = torch.randint(3, VOCAB, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
            s.append_tokens(out, [-1.0] * len(out), version)
            s.finish("length")
            s.reward = 1.0 if same_reward else float(torch.randint(0, 2, (1,), generator=g))
            samples.append(s)
        groups.append(RolloutGroup(gid, samples))
    return assemble_batch(groups, pad_token_id=0, trainer_version=version)


def _naive(model, batch, temperature=T):
    """log p and entropy at every target position from full logits (float64)."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].double()
    logp = torch.log_softmax(logits / temperature, -1)
    lp = logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return lp * batch.mask, entropy * batch.mask


def _trainer(model, loss=None, lr=1e-2, **kwargs):
    return Trainer(model, loss=loss or LossConfig(mode="bypass"), optim=OptimConfig(lr=lr), temperature=T, **kwargs)


def test_hidden_path_logprobs_match_full_logits_and_are_zero_outside_the_response():
    model = _model()
    batch = _batch()
    trainer = _trainer(copy.deepcopy(model))
    lp = trainer.logprobs(batch, grad=False)
    assert trainer.response_logprobs.hidden_path is True
    ref, _ = _naive(model, batch)
    torch.testing.assert_close(lp.double(), ref, rtol=1e-5, atol=1e-5)
    assert bool((lp[batch.mask == 0] == 0).all())


def test_hidden_path_and_full_logits_path_give_the_same_update():
    model = _model()
    batch = _batch()
    a = _trainer(copy.deepcopy(model))
    b = _trainer(copy.deepcopy(model))
    b.response_logprobs.hidden_path = False  # force the full-logits fallback
    out_a, out_b = a.step(copy.deepcopy(batch)), b.step(copy.deepcopy(batch))
    assert out_a.metrics["loss/pg_loss"] == pytest.approx(out_b.metrics["loss/pg_loss"], abs=1e-6)
    for x, y in zip(a.weights().values(), b.weights().values()):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    assert not all(torch.equal(x, y) for x, y in zip(a.weights().values(), model.state_dict().values()))


class _ScaledLogits(Qwen2ForCausalLM):
    """Logits = 2·(h·Wᵀ), as models with a logit scale compute them."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


def test_a_model_whose_logits_are_not_hidden_times_head_falls_back_with_a_warning():
    base = _model()
    model = _ScaledLogits(base.config)
    model.load_state_dict(base.state_dict())
    batch = _batch()
    trainer = _trainer(copy.deepcopy(model))
    with pytest.warns(UserWarning, match="not its last hidden state times the output embedding"):
        lp = trainer.logprobs(batch, grad=False)
    assert trainer.response_logprobs.hidden_path is False
    ref, _ = _naive(model, batch)  # the scaled logits
    torch.testing.assert_close(lp.double(), ref, rtol=1e-5, atol=1e-5)


def test_bfloat16_autocast_keeps_float32_master_state_and_stays_close_to_float32():
    model = _model()
    batch = _batch()
    t32, t16 = _trainer(copy.deepcopy(model)), _trainer(copy.deepcopy(model), dtype="bfloat16")
    lp32, lp16 = t32.logprobs(batch, grad=False), t16.logprobs(batch, grad=False)
    assert lp16.dtype == torch.float32
    valid = batch.mask > 0
    # bf16 matmuls (8-bit mantissa) move log-probs of this 64-wide model by ~1e-2, not more
    assert 0 < (lp16 - lp32)[valid].abs().max() < 0.1
    t16.step(copy.deepcopy(batch))
    assert {p.dtype for p in t16.placed.model.parameters()} == {torch.float32}
    state = t16.placed.optimizer.state_dict()["state"]
    assert state and all(v.dtype == torch.float32 for s in state.values() for v in s.values() if v.dim() > 0)


def test_gradient_checkpointing_gives_the_same_update():
    model = _model()
    batch = _batch()
    plain = _trainer(copy.deepcopy(model))
    ckpt_model = copy.deepcopy(model)
    enable_gradient_checkpointing(ckpt_model)
    assert ckpt_model.model.gradient_checkpointing
    ckpt = _trainer(ckpt_model)
    plain.step(copy.deepcopy(batch))
    ckpt.step(copy.deepcopy(batch))
    for x, y in zip(plain.weights().values(), ckpt.weights().values()):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kl_type", ["k1", "k2", "low_var_kl"])
def test_kl_metric_matches_the_hand_formula_on_the_reference(kl_type):
    model, reference = _model(seed=0), _model(seed=1)
    batch = _batch()
    trainer = _trainer(copy.deepcopy(model), LossConfig(mode="bypass", kl_coef=0.1, kl_type=kl_type), reference=copy.deepcopy(reference))
    out = trainer.step(copy.deepcopy(batch))
    lp, _ = _naive(model, batch)
    ref, _ = _naive(reference, batch)
    d = (lp - ref)[batch.mask > 0]
    # verl's estimators written out: k1 = d, k2 = ½d², k3 = e^{−d} + d − 1 (no clamp reached here)
    expected = {"k1": d, "k2": 0.5 * d**2, "low_var_kl": torch.exp(-d) + d - 1}[kl_type].mean()
    assert out.metrics["loss/kl_ref"] == pytest.approx(float(expected), rel=1e-4, abs=1e-6)


def test_kl_term_pulls_the_policy_towards_the_reference():
    # equal rewards → zero advantages: the KL term is the whole loss, so a step must lower it
    model, reference = _model(seed=0), _model(seed=1)
    batch = _batch(same_reward=True)
    # a small step: AdamW moves every parameter by ~lr at first, whatever its gradient
    trainer = _trainer(copy.deepcopy(model), LossConfig(mode="bypass", kl_coef=1.0, kl_type="k3"), lr=1e-4, reference=reference)
    first = trainer.step(copy.deepcopy(batch)).metrics["loss/kl_ref"]
    batch.trainer_version = 1
    second = trainer.step(copy.deepcopy(batch)).metrics["loss/kl_ref"]
    assert first > 0 and second < first


def test_no_reference_is_scored_without_a_kl_term():
    trainer = _trainer(_model())
    out = trainer.step(_batch())
    assert "loss/kl_ref" not in out.metrics


def test_entropy_metric_and_bonus():
    model = _model()
    batch = _batch(same_reward=True)
    trainer = _trainer(copy.deepcopy(model), LossConfig(mode="bypass", entropy_coef=1.0), lr=1e-4)
    out = trainer.step(copy.deepcopy(batch))
    _, entropy = _naive(model, batch)
    # token-mean of H(softmax(logits / T)) over response tokens
    assert out.metrics["loss/entropy"] == pytest.approx(float(entropy.sum() / batch.mask.sum()), rel=1e-5)
    assert out.metrics["loss/entropy"] < math.log(VOCAB)  # at most uniform
    # with zero advantages the bonus is the whole loss: the step raises the entropy
    batch.trainer_version = 1
    assert trainer.step(copy.deepcopy(batch)).metrics["loss/entropy"] > out.metrics["loss/entropy"]


def _lora(model, r=4):
    return apply_lora(model, r=r, alpha=None, dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"])


def test_lora_trains_adapters_only_and_pushes_merged_weights():
    model = _model()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(_lora(copy.deepcopy(model)))
    trainer.step(_batch())
    pushed = trainer.weights()
    assert set(pushed) == set(base)  # the base's names, no adapters
    changed = [k for k in base if not torch.equal(pushed[k], base[k])]
    # only adapted layers move (merged), everything else is the frozen base
    assert changed and all(any(t in k for t in ("q_proj", "v_proj", "up_proj")) for k in changed)
    frozen = {n: p for n, p in trainer.unwrapped_model().named_parameters() if "lora_" not in n}
    assert all(not p.requires_grad for p in frozen.values())


def test_lora_reference_is_the_base_with_adapters_disabled():
    model = _model()
    batch = _batch(same_reward=True)
    trainer = _trainer(_lora(copy.deepcopy(model)), LossConfig(mode="bypass", kl_coef=1.0, kl_type="k2", entropy_coef=0.5))
    # peft starts B at 0: the adapted model is the base, so the KL starts at exactly 0
    assert trainer.step(copy.deepcopy(batch)).metrics["loss/kl_ref"] == 0.0
    batch.trainer_version = 1
    # the entropy bonus moved the adapters away from the base: now the KL is positive
    assert trainer.step(copy.deepcopy(batch)).metrics["loss/kl_ref"] > 0
    ref = trainer._reference_logprobs(batch)
    expected, _ = _naive(model, batch)
    torch.testing.assert_close(ref.double(), expected, rtol=1e-5, atol=1e-5)
