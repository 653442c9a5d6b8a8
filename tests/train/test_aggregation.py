"""The trainer's loss denominators (docs/math.md §5.2): the Dr.GRPO normaliser is a constant."""

import copy
import json
import math

import pytest
import torch

from sdp_cli.config.schema import LossConfig, OptimConfig

from . import cases
from .cases import Trainer

NORM = LossConfig(mode="bypass", agg="seq-mean-token-sum-norm", weight_cap=None, norm_length=4)
# rewards 1 and 0: GRPO advantages ±(0.5 / std) with the unbiased std √0.5, i.e. ±√0.5
ADV = math.sqrt(0.5)
RESPONSES = [[5, 6, 7], [8]]


def _step(model, batch_groups, loss=NORM, batch_sequences=4, minibatches=1, lr=1e-2):
    cases.set_old_logprobs(batch_groups, model)  # every ratio is 1, so ℓ = −A on every token
    trainer = Trainer(
        copy.deepcopy(model),
        loss=loss,
        optim=OptimConfig(lr=lr, grad_clip=None, minibatches=minibatches),
        temperature=1.0,
        batch_sequences=batch_sequences,
    )
    grads = cases.capture_gradients(trainer)
    out = trainer.step(cases.batch_of(batch_groups))
    return out.metrics["loss/pg_loss"], grads


@pytest.mark.parametrize("prompt_len", [5, 40])
def test_dr_grpo_loss_does_not_depend_on_the_prompt_length(prompt_len):
    model = cases.tiny_model()
    loss, _ = _step(model, cases.groups([RESPONSES], [[1.0, 0.0]], prompt_len=prompt_len))
    # Σ_i Σ_t −A_i = −√0.5·3 + √0.5·1; the constant is L · sequences per step = 4 · 4 / 1 = 16
    assert loss == pytest.approx((-3 * ADV + ADV) / 16, rel=1e-5)


def test_an_extra_zero_advantage_group_changes_neither_loss_nor_gradient():
    model = cases.tiny_model()
    alone = cases.groups([RESPONSES], [[1.0, 0.0]])
    with_extra = cases.groups([RESPONSES, [[9, 10], [11, 12, 13, 14]]], [[1.0, 0.0], [1.0, 1.0]])
    loss_a, grads_a = _step(model, alone)
    loss_b, grads_b = _step(model, with_extra)
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    assert loss_a == pytest.approx((-3 * ADV + ADV) / 16, rel=1e-5)
    assert grads_a[0].keys() == grads_b[0].keys()
    for name, grad in grads_a[0].items():
        torch.testing.assert_close(grads_b[0][name], grad, rtol=1e-5, atol=1e-8, msg=name)
    # token-mean, by contrast, counts the extra group's tokens: its loss shrinks 4 / 10
    token_mean = LossConfig(mode="bypass", weight_cap=None)
    mean_a, _ = _step(model, alone, loss=token_mean)
    mean_b, _ = _step(model, with_extra, loss=token_mean)
    assert mean_b == pytest.approx(mean_a * 4 / 10, rel=1e-5)


def test_the_constant_counts_sequences_per_optimizer_step():
    # 2 minibatches of a 4-sequence batch: each step divides by L · 4 / 2 = 8, so the mean
    # over the two steps of Σ_mb s_i / 8 is (Σ_all s_i) / 16, as with one minibatch (a tiny lr
    # keeps the second step's ratios at 1)
    model = cases.tiny_model()
    batch_groups = cases.groups([RESPONSES, RESPONSES], [[1.0, 0.0], [1.0, 0.0]])
    loss, grads = _step(model, batch_groups, minibatches=2, lr=1e-9)
    assert len(grads) == 2
    assert loss == pytest.approx(2 * (-3 * ADV + ADV) / 16, rel=1e-5)


def test_the_norm_needs_its_constant():
    # an internal contract (train/session/run.py resolves a null loss.norm_length to the generation budget:
    # the dr-grpo run below goes through it)
    with pytest.raises(AssertionError, match="norm_length and batch_sequences"):
        Trainer(cases.tiny_model(), loss=NORM, optim=OptimConfig(), temperature=1.0)


@pytest.mark.parametrize(
    "overrides",
    [
        ["loss.agg=seq-mean-token-sum-norm"],
        ["mode=bypass", "loss.loss_type=reinforce", "loss.weight_cap=2", "loss.batch_normalize=true"],
        ["loss.rejection.veto=0.0001", "optim.minibatches=2"],
    ],
    ids=["dr-grpo", "reinforce-bypass", "veto-alone"],
)
def test_sdp_train_runs_with(fast_config, overrides):
    from pathlib import Path

    from sdp_cli.train.session.run import run_training

    cfg, raw = fast_config(*overrides, "train.steps=2")
    summary = run_training(cfg, raw, overrides=[])
    rows = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines() if x]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss/pg_loss"]) for r in rows)
    if any("veto" in o for o in overrides):  # the veto alone is applied (its metrics exist)
        assert all("rejection/rollout_rs_veto_fraction" in r for r in rows)
