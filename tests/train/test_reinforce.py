"""loss_type=reinforce is the importance-sampled policy gradient on every optimizer step
(docs/math.md §5.1): ∇ = −Σ A·w·∇log π_θ / N with w = clip(π_θ/π_behav) recomputed at the θ
of that step (segment-wise: π_θ/π_prox · π_prox_t/π_behav), in every mode."""

import copy

import pytest
import torch

from sdp_cli.config.schema import LossConfig, OptimConfig

from . import cases
from .cases import Trainer

CAP, FLOOR = 1.25, 0.8


def _plain_logprobs(model, batch):
    """log π_θ of the target tokens, written out with autograd ops (the reference)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]


@pytest.mark.parametrize("mode", ["bypass", "decoupled", "segment_wise"])
def test_every_optimizer_step_takes_the_importance_sampled_gradient_at_its_own_theta(mode):
    model = cases.tiny_model(seed=5)
    version = 2
    batch_groups = cases.random_groups(6, seed=6, version=version - 2)
    cases.set_old_logprobs(batch_groups, model, noise=0.4, seed=7)
    gen = torch.Generator().manual_seed(8)
    for group in batch_groups:
        for s in group.samples:
            # an engine's π_{v+1} for these lag-2 tokens, away from π_behav and from π_prox
            for t in range(s.output_len):
                s.set_proximal_t(t, s.old_logprobs[t] + 0.3 * float(torch.randn(1, generator=gen)), version - 1)
    loss = LossConfig(mode=mode, loss_type="reinforce", weight_cap=CAP, weight_floor=FLOOR)
    trainer = Trainer(
        copy.deepcopy(model),
        loss=loss,
        optim=OptimConfig(lr=3e-2, grad_clip=None, ppo_epochs=3),
        temperature=1.0,
        track_proximal_t=mode == "segment_wise",
    )
    trainer.version = version
    params: list[dict[str, torch.Tensor]] = []
    grads = cases.capture_gradients(trainer, params)
    batch = cases.batch_of(batch_groups, version=version)
    with torch.no_grad():
        prox = _plain_logprobs(model, batch)  # θ at the start of the step
    trainer.step(batch)
    assert len(grads) == 3

    mask = batch.mask > 0
    reference = copy.deepcopy(model)
    for step, (theta, grad) in enumerate(zip(params, grads)):
        reference.load_state_dict(theta, strict=False)  # tied lm_head: not a named parameter
        reference.zero_grad()
        lp = _plain_logprobs(reference, batch)
        if mode == "segment_wise":
            log_w = (lp.detach() - prox) + (batch.proximal_logprobs_t - batch.old_logprobs)
        else:  # bypass and decoupled: π_θ/π_behav
            log_w = lp.detach() - batch.old_logprobs
        w = torch.exp(log_w).clamp(FLOOR, CAP)
        objective = torch.where(mask, -batch.advantages * w * lp, 0.0).sum() / mask.sum()
        objective.backward()
        for name, p in reference.named_parameters():
            torch.testing.assert_close(grad[name], p.grad, rtol=1e-4, atol=1e-6, msg=f"step {step} {name}")
    # the weights moved: the bounds bind on some tokens at the last step (the test is not vacuous)
    assert ((torch.exp(log_w) > CAP) | (torch.exp(log_w) < FLOOR))[mask].any()
