"""Deterministic tiny models, batches and gradient capture for the trainer's loss tests.

Imported by the tests and by ``dist_loss_worker.py`` (the two-process run), so that both build
bit-identical models and batches from the same seeds.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from sdp_cli.config.schema import LossConfig, OptimConfig
from sdp_cli.models.tiny import build_tiny_model
from sdp_cli.rollout.records import RolloutGroup, RolloutSample
from sdp_cli.train.step.batch import TrainBatch, assemble_batch
from sdp_cli.train.step.sharding import local_tensor
from sdp_cli.train.step.trainer import Trainer

VOCAB = 32


def tiny_model(seed: int = 0) -> torch.nn.Module:
    return build_tiny_model(
        VOCAB, seed=seed, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64
    )


def groups(
    responses: list[list[list[int]]],
    rewards: list[list[float]],
    *,
    prompt_len: int = 4,
    version: int = 0,
    seed: int = 0,
) -> list[RolloutGroup]:
    """One group per entry of ``responses``; prompts of ``prompt_len`` random tokens."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for gid, (outputs, group_rewards) in enumerate(zip(responses, rewards)):
        samples = []
        for tokens, reward in zip(outputs, group_rewards):
            prompt = [1, *torch.randint(3, VOCAB, (prompt_len - 1,), generator=gen).tolist()]
            sample = RolloutSample(prompt_ids=prompt, group_id=gid)
            sample.append_tokens(list(tokens), [0.0] * len(tokens), version)
            sample.finish("length")
            sample.reward = reward
            samples.append(sample)
        out.append(RolloutGroup(gid, samples))
    return out


def random_groups(
    n_rows: int, *, seed: int = 0, version: int = 0, group_size: int = 2, shared_prompts: bool = False
) -> list[RolloutGroup]:
    """``n_rows`` samples in groups of at most ``group_size``, with prompts of 2..6 and responses of
    1..5 tokens, so that rows differ in length and in their number of valid tokens. The samples of
    a group get one prompt with ``shared_prompts`` (as GRPO's do), else a prompt each."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for gid, start in enumerate(range(0, n_rows, group_size)):
        samples = []
        prompt: list[int] = []
        for k in range(min(group_size, n_rows - start)):
            if k == 0 or not shared_prompts:
                plen = int(torch.randint(2, 7, (1,), generator=gen))
                prompt = [1, *torch.randint(3, VOCAB, (plen - 1,), generator=gen).tolist()]
            sample = RolloutSample(prompt_ids=list(prompt), group_id=gid)
            tokens = torch.randint(3, VOCAB, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen)
            sample.append_tokens(tokens.tolist(), [0.0] * len(tokens), version)
            sample.finish("length")
            sample.reward = float(torch.rand(1, generator=gen))
            samples.append(sample)
        out.append(RolloutGroup(gid, samples))
    return out


def set_old_logprobs(
    batch_groups: list[RolloutGroup], model: torch.nn.Module, *, noise: float = 0.0, seed: int = 0
) -> None:
    """old := the model's own logprobs (+ uniform noise in ±``noise``); π_prox_t := old."""
    trainer = Trainer(copy.deepcopy(model), loss=LossConfig(), optim=OptimConfig(), temperature=1.0)
    batch = assemble_batch(batch_groups, pad_token_id=0, trainer_version=0)
    lp = trainer.logprobs(batch, grad=False)
    gen = torch.Generator().manual_seed(seed)
    for i, s in enumerate(batch.samples):
        start = s.prompt_len - 1
        values = lp[i, start : start + s.output_len]
        values = values + noise * (2 * torch.rand(values.shape, generator=gen) - 1)
        s.old_logprobs[:] = values.tolist()
        s.proximal_logprobs_t[:] = values.tolist()


def batch_of(batch_groups: list[RolloutGroup], version: int = 0) -> TrainBatch:
    return assemble_batch(copy.deepcopy(batch_groups), pad_token_id=0, trainer_version=version)


def capture_gradients(
    trainer: Trainer, params: list[dict[str, torch.Tensor]] | None = None
) -> list[dict[str, torch.Tensor]]:
    """Every optimizer step appends the gradients it is about to apply, by parameter name (and
    to ``params`` the parameters they were computed at)."""
    grads: list[dict[str, torch.Tensor]] = []
    named = list(trainer.unwrapped_model().named_parameters())
    inner = getattr(trainer.placed.optimizer, "optimizer", trainer.placed.optimizer)

    def record(*_: object) -> None:
        # a sharded model's shards are gathered whole (every rank runs this hook)
        grads.append({name: local_tensor(p.grad.detach()).clone() for name, p in named if p.grad is not None})
        if params is not None:
            params.append({name: local_tensor(p.detach()).clone() for name, p in named})

    inner.register_step_pre_hook(record)
    return grads


@dataclass(frozen=True)
class Case:
    """One multi-process gradient case: a trainer step (2 PPO epochs) on a fixed batch of ``rows``
    sequences in ``minibatches`` minibatches; ``shared_prompts``: groups of 8 samples with one
    prompt, so that each process's shard runs its distinct prompts once (train/step/shared_prefix.py)
    when ``ranks_share``; with ``ranks_share=False`` one process's shard could share and
    another's could not, so none may (the shared forward calls the model twice, and the
    forward's collectives must pair up)."""

    name: str
    loss: LossConfig
    rows: int
    minibatches: int
    grad_clip: float | None = None
    shared_prompts: bool = False
    ranks_share: bool = True

    def run(self, parallel: str = "ddp") -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor], int, float]:
        """The gradients of every optimizer step in this process (single or one of several, whole
        even when sharded), the whole weights after the step (on rank 0; ``{}`` on the other
        ranks of a sharded run), the parameter elements this process held, and the fraction of
        positions its last training forward saved by sharing prompts."""
        model = tiny_model(seed=1)
        batch_groups = random_groups(
            self.rows, seed=2, group_size=8 if self.shared_prompts else 2, shared_prompts=self.shared_prompts
        )
        set_old_logprobs(batch_groups, model, noise=0.5, seed=3)
        trainer = Trainer(
            model,
            loss=self.loss,
            optim=OptimConfig(lr=1e-2, grad_clip=self.grad_clip, ppo_epochs=2, minibatches=self.minibatches),
            temperature=1.0,
            seed=4,
            batch_sequences=self.rows,
            parallel=parallel,
        )
        grads = capture_gradients(trainer)
        saved = trainer.step(batch_of(batch_groups)).metrics["batch/positions_saved"]
        return grads, trainer.full_model_state(), held_elements(trainer.placed.model), saved


_SHARED = LossConfig(mode="decoupled", agg="token-mean", weight_cap=1.3)

#: The sharded (FSDP) gradient cases: an uneven split, a rank without rows at every optimizer
#: step, the Dr.GRPO constant, REINFORCE's whole-minibatch normalisation, a clip that binds (the
#: tiny model's gradient norms are about 0.3-1 here, so 0.05 scales every step's gradient), and
#: groups that share their prompt.
FSDP_CASES = [
    Case("token-mean-5x1", LossConfig(mode="decoupled", agg="token-mean", weight_cap=1.3), 5, 1),
    Case("token-mean-3x3", LossConfig(mode="decoupled", agg="token-mean", weight_cap=1.3), 3, 3),
    Case(
        "seq-mean-token-sum-norm-4x2",
        LossConfig(mode="decoupled", agg="seq-mean-token-sum-norm", weight_cap=1.3, norm_length=6),
        4,
        2,
    ),
    Case(
        "reinforce-sequence-batchnorm-5x1",
        LossConfig(mode="decoupled", loss_type="reinforce", is_level="sequence", weight_cap=1.3, batch_normalize=True),
        5,
        1,
    ),
    Case("token-mean-clip-5x1", LossConfig(mode="decoupled", agg="token-mean", weight_cap=1.3), 5, 1, grad_clip=0.05),
    Case("shared-prompts-token-mean-16x1", _SHARED, 16, 1, shared_prompts=True),
    Case("shared-prompts-uneven-3x1", _SHARED, 3, 1, shared_prompts=True, ranks_share=False),
]

#: The multi-process gradient cases. With two processes 5 rows in one minibatch split 3/2 with
#: unequal token counts and 3 rows in 3 minibatches leave the second process without a row at
#: every optimizer step; with three, 4 rows in 2 minibatches leave the third process without a
#: row while the others have one. The shared-prompt cases run each shard's prompts once.
DISTRIBUTED_CASES = [
    *(
        Case(f"{agg}-{rows}x{mbs}", LossConfig(mode="decoupled", agg=agg, weight_cap=1.3, norm_length=6), rows, mbs)
        for agg in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
        for rows, mbs in ((5, 1), (3, 3), (4, 2))
    ),
    Case(
        "reinforce-sequence-batchnorm-5x1",
        LossConfig(mode="decoupled", loss_type="reinforce", is_level="sequence", weight_cap=1.3, batch_normalize=True),
        5,
        1,
    ),
    Case(
        "reinforce-bypass-token-batchnorm-3x3",
        LossConfig(mode="bypass", loss_type="reinforce", weight_cap=1.3, batch_normalize=True),
        3,
        3,
    ),
    Case("shared-prompts-token-mean-16x1", _SHARED, 16, 1, shared_prompts=True),
    Case(
        "shared-prompts-seq-mean-token-sum-norm-16x2",
        LossConfig(mode="decoupled", agg="seq-mean-token-sum-norm", weight_cap=1.3, norm_length=6),
        16,
        2,
        shared_prompts=True,
    ),
    # 2 rows that could share on one process, 1 row on the other
    Case("shared-prompts-uneven-3x1", _SHARED, 3, 1, shared_prompts=True, ranks_share=False),
]


def held_elements(model: torch.nn.Module) -> int:
    """Parameter elements this process holds (its shards' when sharded)."""
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
