"""``train.parallel=fsdp``'s sharding (sdp_cli/train/step/sharding.py) with one process on one GPU.

`sdp train` in one process trains unsharded (docs/training.md "Sharded training (FSDP)"), and
tests/train/test_fsdp.py runs the sharding with gloo on the CPU only. Here a one-process NCCL
group shards a Qwen2.5-0.5B-shaped model with FSDP2 on CUDA, as the trainer does, and one
bf16-autocast optimizer step of the sharded model must equal the same step of the plain model:
log-probs, the clipped gradient norm, the weights after the step gathered whole into CPU memory
under their unsharded names, and a plain model rebuilt from them.
"""

from __future__ import annotations

import copy
import socket

import pytest
import torch
import torch.distributed as dist

from sdp_cli.train.step import sharding
from sdp_cli.train.step.batch import assemble_batch
from sdp_cli.train.step.response_logprobs import ResponseLogprobs

from .qwen_shape import PAD_ID, grpo_groups

pytestmark = pytest.mark.gpu

LR = 1e-4


@pytest.fixture
def one_process_group(device):
    with socket.socket() as sock:  # a free loopback port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _step(model, batch, device) -> tuple[torch.Tensor, float]:
    """One trainer-like optimizer step (bf16 autocast, clip at 1, fused AdamW); its log-probs
    before the step and the gradient norm."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    forward = ResponseLogprobs(
        temperature=1.0, device=device, autocast_dtype=torch.bfloat16, unwrap=lambda m: m, share_prefixes=False
    )
    values, _ = forward.forward(model, batch, grad=True, with_entropy=False)
    mask = batch.mask.to(device)
    (-(values * batch.advantages.to(device)).sum() / mask.sum()).backward()
    norm = float(sharding.sharded_grad_norm(list(model.parameters()), 1.0))
    optimizer.step()
    return values.detach(), norm


def test_a_sharded_step_on_one_gpu_equals_the_plain_step(model, device, one_process_group, record_property):
    from torch.distributed.tensor import DTensor

    batch = assemble_batch(grpo_groups(4, 4, 32, 16, vocab=model.config.vocab_size, seed=1), pad_token_id=PAD_ID, trainer_version=0)
    before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    sharded = copy.deepcopy(model)
    skeleton = sharding.meta_skeleton(sharded)
    sharding.shard(sharded, device, 1)
    assert all(isinstance(p, DTensor) for p in sharded.parameters()), "fully_shard left a parameter plain"

    plain_lp, plain_norm = _step(model, batch, device)
    sharded_lp, sharded_norm = _step(sharded, batch, device)
    mask = batch.mask.to(device) > 0
    lp_diff = float((sharded_lp - plain_lp)[mask].abs().max())
    record_property("logprob_max_abs_diff", lp_diff)
    record_property("grad_norm_plain", plain_norm)
    record_property("grad_norm_sharded", sharded_norm)
    # one process: FSDP gathers each layer's one shard, so both run the same kernels on the same
    # values; only float noise may differ
    assert lp_diff <= 1e-3, lp_diff
    assert abs(sharded_norm - plain_norm) <= 1e-3 * plain_norm, (sharded_norm, plain_norm)

    gathered = sharding.full_model_state(sharded, sharded=True)
    plain_after = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    assert sorted(gathered) == sorted(plain_after), "gathered weights are not under the unsharded names"
    # Adam's first step moves every weight with a gradient well above its ε by exactly ±lr, so a
    # step taken twice, skipped or applied to the wrong parameter shows as a difference of ≥ lr;
    # a weight whose gradient is float noise may flip sign (a few elements at most)
    moved = flipped = total = 0
    for name, after in plain_after.items():
        plain_step = after.float() - before[name].float()
        sharded_step = gathered[name].float() - before[name].float()
        moved += int((plain_step.abs() > 0.5 * LR).sum())
        flipped += int(((sharded_step - plain_step).abs() > 0.5 * LR).sum())
        total += plain_step.numel()
    record_property("weights_moved_fraction", moved / total)
    record_property("weights_differing_fraction", flipped / total)
    assert moved / total > 0.5, moved / total
    assert flipped / total <= 1e-4, flipped / total

    rebuilt = sharding.whole_model(skeleton, gathered).to(device)
    check = ResponseLogprobs(temperature=1.0, device=device, autocast_dtype=None, unwrap=lambda m: m, share_prefixes=False)
    model.eval()
    rebuilt_lp, _ = check.forward(rebuilt, batch, grad=False, with_entropy=False)
    plain_after_lp, _ = check.forward(model, batch, grad=False, with_entropy=False)
    assert float((rebuilt_lp - plain_after_lp)[mask].abs().max()) <= 1e-3
