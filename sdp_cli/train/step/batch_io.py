"""Write a training batch in the sdp batch format (``train.save_batches=true``)."""

from __future__ import annotations

from pathlib import Path

import torch

from sdp_cli.rollout.batch_file import SavedBatch, write_batch
from sdp_cli.train.step.batch import TrainBatch
from sdp_cli.train.step.trainer import StepOutput


def _per_output_token(batch: TrainBatch, tensor: torch.Tensor) -> list[list[float]]:
    """Cut a target-frame tensor [N, L-1] into one list per sample over its output tokens."""
    rows = []
    for i, sample in enumerate(batch.samples):
        start = sample.prompt_len - 1
        rows.append(tensor[i, start : start + sample.output_len].tolist())
    return rows


def write_train_batch(
    path: Path, batch: TrainBatch, output: StepOutput, *, temperature: float, model: str, mode: str
) -> Path:
    """Save ``batch`` with π_prox, advantages and the effective loss mask of its training step."""
    saved = SavedBatch.from_samples(
        batch.samples,
        trainer_version=batch.trainer_version,
        temperature=temperature,
        model=model,
        mode=mode,
        proximal_logprobs=None if output.proximal_logprobs is None else _per_output_token(batch, output.proximal_logprobs),
        advantages=_per_output_token(batch, batch.advantages),
        loss_mask=[[int(x) for x in row] for row in _per_output_token(batch, output.loss_mask)],
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_batch(path, saved)
