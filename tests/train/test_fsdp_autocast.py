"""A sharded model's first training forward under bfloat16 autocast reaches every parameter.

``ResponseLogprobs`` runs one-time no-grad check forwards on its first batch (are the logits the
head times the last hidden state; does the shared-prompt forward reproduce the plain one). Run
inside the training forward's autocast region, autocast kept the bf16 copies they made of an
FSDP-sharded model's gathered weights and handed them, without their graph, to the training
forward: no decoder layer got a gradient on that step (found by the GPU check's FSDP test,
tests/gpu/test_fsdp_gpu.py; in `sdp train` a run whose first forward trains, e.g. ``mode=bypass
train.parallel=fsdp train.dtype=bfloat16``, lost its first step's update of every decoder layer).
One gloo process shards through the same hooks as several do.
"""

from __future__ import annotations

import copy
import socket

import pytest
import torch
import torch.distributed as dist

from sdp_cli.train.step.response_logprobs import ResponseLogprobs
from sdp_cli.train.step.sharding import local_tensor, shard

from . import cases

CPU = torch.device("cpu")


@pytest.fixture
def one_process_group():
    with socket.socket() as sock:  # a free loopback port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("share", [False, True], ids=["plain", "shared-prompts"])
def test_the_first_bf16_forward_of_a_sharded_model_reaches_every_parameter(one_process_group, share):
    model = cases.tiny_model(seed=1)
    sharded = copy.deepcopy(model)
    shard(sharded, CPU, 1)
    # 3 prompts × 8 samples: the shared-prompt forward saves more than its 20 % threshold
    batch = cases.batch_of(cases.random_groups(24, seed=5, group_size=8, shared_prompts=True))
    grads = []
    for m in (model, sharded):
        m.train()
        forward = ResponseLogprobs(
            temperature=1.0, device=CPU, autocast_dtype=torch.bfloat16, unwrap=lambda x: x, share_prefixes=share
        )
        values, _ = forward.forward(m, batch, grad=True, with_entropy=False)
        values.sum().backward()
        assert (forward.positions_saved > 0) == share  # with sharing on, both checks ran and kept it
        grads.append({n: None if p.grad is None else local_tensor(p.grad) for n, p in m.named_parameters()})
    plain, got = grads
    for name, expected in plain.items():
        assert expected is not None and got[name] is not None, f"{name}: no gradient"
        # one process: the same kernels on the same values, float noise at most
        torch.testing.assert_close(got[name], expected, rtol=1e-3, atol=1e-6, msg=lambda m: f"{name}: {m}")
