"""Turn consumed rollout groups into the padded tensors the trainer and the kernels use.

Layout ("target frame"): rows are prompt + output, right-padded to length L. Every per-token
tensor has shape [N, L-1] and column j describes token j+1, the token predicted from position j.
So ``logprobs_from_logits(logits[:, :-1], input_ids[:, 1:])`` lines up with ``old_logprobs`` and
``mask`` is 1 exactly on response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from sdp_cli.core.advantages import group_advantages
from sdp_cli.rollout.batch_file import ragged_layout
from sdp_cli.rollout.records import RolloutGroup, RolloutSample


@dataclass
class TrainBatch:
    """One training batch (N sequences) in the target frame.

    Shapes: input_ids/attention_mask [N, L]; every per-token tensor [N, L-1]; rewards [N].
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor
    proximal_logprobs_t: torch.Tensor
    versions: torch.Tensor
    proximal_t_versions: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    trainer_version: int
    samples: list[RolloutSample] = field(default_factory=list, repr=False)

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    def rows(self, index: torch.Tensor) -> "TrainBatch":
        """The sub-batch of the given rows (for minibatches and data-parallel shards)."""
        picked = [self.samples[i] for i in index.tolist()] if self.samples else []
        return replace(
            self,
            input_ids=self.input_ids[index],
            attention_mask=self.attention_mask[index],
            mask=self.mask[index],
            old_logprobs=self.old_logprobs[index],
            proximal_logprobs_t=self.proximal_logprobs_t[index],
            versions=self.versions[index],
            proximal_t_versions=self.proximal_t_versions[index],
            advantages=self.advantages[index],
            rewards=self.rewards[index],
            group_ids=self.group_ids[index],
            samples=picked,
        )


def assemble_batch(
    groups: Sequence[RolloutGroup],
    *,
    pad_token_id: int,
    trainer_version: int,
    scale_adv_by_std: bool = True,
) -> TrainBatch:
    """Pad the samples of ``groups`` into a :class:`TrainBatch` with GRPO advantages."""
    samples = [s for g in groups for s in g.samples]
    if not samples:
        raise ValueError("assemble_batch: no samples")
    for s in samples:
        s.check_consistent()
        if s.reward is None:
            raise ValueError(f"assemble_batch: sample {s.sample_id} has no reward")
        if not s.output_ids:
            raise ValueError(f"assemble_batch: sample {s.sample_id} has an empty response")
        if not s.prompt_ids:  # its first output token would have no target column
            raise ValueError(f"assemble_batch: sample {s.sample_id} has an empty prompt")

    n = len(samples)
    prompt_lens = torch.tensor([s.prompt_len for s in samples], dtype=torch.long)
    output_lens = torch.tensor([s.output_len for s in samples], dtype=torch.long)
    totals = prompt_lens + output_lens
    length = int(totals.max())
    input_ids = torch.full((n, length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, length), dtype=torch.long)
    shape = (n, length - 1)
    mask = torch.zeros(shape, dtype=torch.float32)
    old = torch.zeros(shape, dtype=torch.float32)
    prox_t = torch.zeros(shape, dtype=torch.float32)
    versions = torch.full(shape, -1, dtype=torch.long)
    prox_t_versions = torch.full(shape, -1, dtype=torch.long)

    # One scatter per tensor over all samples' tokens (a loop of small copies per sample held the
    # trainer's thread 5 ms per step of 128 samples). Row i holds prompt + output from column 0;
    # output token t sits at position prompt_len + t, i.e. target column prompt_len + t - 1.
    rows, cols = ragged_layout(totals)
    input_ids[rows, cols] = torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.long)
    attention_mask[rows, cols] = 1
    rows, cols = ragged_layout(output_lens)
    cols += (prompt_lens - 1)[rows]
    mask[rows, cols] = 1.0
    old[rows, cols] = torch.tensor([x for s in samples for x in s.old_logprobs], dtype=torch.float32)
    prox_t[rows, cols] = torch.tensor([x for s in samples for x in s.proximal_logprobs_t], dtype=torch.float32)
    versions[rows, cols] = torch.tensor([v for s in samples for v in s.versions], dtype=torch.long)
    prox_t_versions[rows, cols] = torch.tensor([v for s in samples for v in s.proximal_t_versions], dtype=torch.long)

    rewards = torch.tensor([float(s.reward) for s in samples], dtype=torch.float32)
    group_ids = torch.tensor([s.group_id for s in samples], dtype=torch.long)
    adv = group_advantages(rewards, group_ids, scale_by_std=scale_adv_by_std)
    advantages = adv[:, None] * mask

    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        mask=mask,
        old_logprobs=old,
        proximal_logprobs_t=prox_t,
        versions=versions,
        proximal_t_versions=prox_t_versions,
        advantages=advantages,
        rewards=rewards,
        group_ids=group_ids,
        trainer_version=trainer_version,
        samples=samples,
    )


def fill_one_step_proximal(batch: TrainBatch, proximal_logprobs: torch.Tensor) -> int:
    """``rollout.proximal_t_source=trainer``: every token one version behind takes π_prox_t from
    the trainer's π_prox (overwriting an engine score, so the source never depends on timing).

    A token of version c−1 consumed at trainer version c needs π_{v+1} = π_c, and π_c is the
    trainer's current policy, whose logprobs (π_prox) were computed for the clip anchor anyway;
    the engine then does not score it at batch time, but trainer/engine numeric differences enter
    the weight of these tokens (docs/training.md). Returns the number of tokens filled.
    """
    c = batch.trainer_version
    todo = (batch.mask > 0) & (batch.versions == c - 1)
    values = proximal_logprobs.to(batch.proximal_logprobs_t.dtype)
    batch.proximal_logprobs_t = torch.where(todo, values, batch.proximal_logprobs_t)
    batch.proximal_t_versions = torch.where(todo, torch.full_like(batch.proximal_t_versions, c), batch.proximal_t_versions)
    # keep the records in step with the tensors (saved batches are written from the records)
    for row, col in todo.nonzero().tolist():
        sample = batch.samples[row]
        sample.set_proximal_t(col - (sample.prompt_len - 1), float(values[row, col]), c)
    return int(todo.sum().item())
