"""The trainer's shared-prompt forward (sdp_cli/train/step/shared_prefix.py) on a GPU's kernels.

tests/train/test_shared_prefix.py checks it on the CPU in float32. Here CUDA's attention and
matmul kernels run it on a Qwen2.5-0.5B-shaped model (151,936-token vocabulary, 24 layers, grouped
KV heads): in float32 it must give the plain forward's log-probs, entropies and gradient up to
summation order; under bfloat16 autocast, where no two layouts agree exactly, it must be as close
to the float32 truth as the plain bf16 forward is, and the first-batch check the trainer runs
must keep it on.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from sdp_cli.train.step.batch import assemble_batch
from sdp_cli.train.step.response_logprobs import ResponseLogprobs

from .qwen_shape import PAD_ID, grpo_groups

pytestmark = pytest.mark.gpu


def _batch(model):
    # 4 prompts of 48 tokens × 8 responses of 1..32 tokens (483 response tokens); the shared
    # forward runs 54 % fewer positions
    groups = grpo_groups(4, 8, 48, 32, vocab=model.config.vocab_size, seed=0)
    return assemble_batch(groups, pad_token_id=PAD_ID, trainer_version=0)


def _forward(model, batch, device, *, share: bool, bf16: bool):
    """Log-probs, entropies (both [N, L-1]) and the flat gradient of logprobs.sum() + entropy.sum()."""
    logprobs = ResponseLogprobs(
        temperature=1.0,
        device=device,
        autocast_dtype=torch.bfloat16 if bf16 else None,
        unwrap=lambda m: m,
        share_prefixes=share,
    )
    if share:
        logprobs.share_prefixes = True  # skip the first-batch comparison: these tests make it
    model.zero_grad(set_to_none=True)
    values, entropy = logprobs.forward(model, batch, grad=True, with_entropy=True)
    (values.sum() + entropy.sum()).backward()
    assert (logprobs.positions_saved > 0) == share, logprobs.positions_saved
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return values.detach(), entropy.detach(), grad


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


def test_shared_forward_equals_plain_in_float32(model, device, record_property):
    model.train()
    batch = _batch(model)
    mask = batch.mask.to(device) > 0
    plain_lp, plain_ent, plain_grad = _forward(model, batch, device, share=False, bf16=False)
    lp, ent, grad = _forward(model, batch, device, share=True, bf16=False)
    lp_diff = float((lp - plain_lp)[mask].abs().max())
    ent_diff = float((ent - plain_ent)[mask].abs().max())
    grad_rel = float((grad - plain_grad).norm() / plain_grad.norm())
    record_property("logprob_max_abs_diff", lp_diff)
    record_property("entropy_max_abs_diff", ent_diff)
    record_property("grad_rel_diff", grad_rel)
    # summation order only: float32 noise through 24 layers is ~1e-5 nats; a wrong position or
    # a key the shared path misses moves log-probs by 1e-2 and more
    assert lp_diff <= 1e-3 and ent_diff <= 1e-3, (lp_diff, ent_diff)
    assert grad_rel <= 1e-3, grad_rel


def test_shared_forward_in_bfloat16_is_as_accurate_as_the_plain_one(model, device, record_property):
    model.train()
    batch = _batch(model)
    mask = batch.mask.to(device) > 0
    truth_lp, _, truth_grad = _forward(model, batch, device, share=False, bf16=False)
    plain_lp, _, plain_grad = _forward(model, batch, device, share=False, bf16=True)
    lp, _, grad = _forward(model, batch, device, share=True, bf16=True)
    plain_err = float((plain_lp - truth_lp)[mask].abs().mean())
    shared_err = float((lp - truth_lp)[mask].abs().mean())
    plain_cos, shared_cos = _cosine(plain_grad, truth_grad), _cosine(grad, truth_grad)
    record_property("plain_bf16_vs_fp32_abs_mean", plain_err)
    record_property("shared_bf16_vs_fp32_abs_mean", shared_err)
    record_property("shared_vs_plain_bf16_max_abs", float((lp - plain_lp)[mask].abs().max()))
    record_property("plain_bf16_grad_cosine", plain_cos)
    record_property("shared_bf16_grad_cosine", shared_cos)
    # Both bf16 forwards round the same products in another order, so their errors against the
    # float32 forward are of one size (a ratio near 1); sharing must not add error of its own.
    # The 1e-3 absolute term covers a CPU run, where bf16 errors of the tiny model are ~1e-6.
    assert shared_err <= 1.5 * plain_err + 1e-3, (shared_err, plain_err)
    assert shared_cos >= plain_cos - 0.01, (shared_cos, plain_cos)


def test_the_trainers_first_batch_check_keeps_sharing_in_bfloat16(model, device):
    """The trainer compares the shared forward with the plain one on its first batch and falls
    back to the plain forward, with a warning, if they differ; under bf16 on the GPU's kernels
    they must still count as the same."""
    batch = _batch(model)
    logprobs = ResponseLogprobs(
        temperature=1.0, device=device, autocast_dtype=torch.bfloat16, unwrap=lambda m: m, share_prefixes=True
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logprobs.forward(model, batch, grad=False, with_entropy=False)
    assert logprobs.share_prefixes is True
    assert logprobs.positions_saved > 0
