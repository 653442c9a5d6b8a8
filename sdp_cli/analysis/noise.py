"""Dtype noise or damage: how far a recomputed log-probability may move on an intact batch
(docs/recompute.md "Noise floor"). Pure torch; ``recompute`` measures, this module judges.

Two floors, both measured on the given batches' output tokens of version c (the batch's trainer
version), where the exact value is known without any change of weights, because the run's engine
sampled them under checkpoint c and recorded π_behav:

- ``engine``: |log π_c from the scorer − π_behav|. π_prox_t was computed by the run's engine, so
  this is how far the scorer's numbers may sit from the engine's: ~1e-7 for the local engine
  scoring its own dtype on a CPU (up to ~2e-3 in bfloat16 where the CPU emulates it: decode steps
  and the scoring forward round differently), more for a server or another device.
- ``trainer``: |π_prox in the file − π_behav|. π_prox was computed by the trainer (train.dtype),
  so this is the engine/trainer mismatch of the run (the trainer's ``mismatch/lag0_*``), how far
  a π_prox recomputed on the engine's side may move.

A quantity is unchanged when every |Δ| ≤ ``EXACT_TOLERANCE``, dtype noise when every |Δ| lies
within its floor's tolerance, and damaged when some token lies beyond it or a tag changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: |Δ| that counts as no change: two float32 computations of the same log-probability
EXACT_TOLERANCE = 1e-5
#: a |Δ| up to this many times the floor's largest is still noise: the floor's maximum comes from
#: fewer tokens than the batches it judges, and bf16 rounding noise has long tails (on the tiny
#: model a batch's largest trainer/engine gap was 3.2× the floor's, over 54 and 57 tokens)
NOISE_MARGIN = 8.0


@dataclass
class NoiseFloor:
    """|Δ| between two computations of the same log-probabilities (None: no token measured it)."""

    tokens: int = 0
    mean_abs: float | None = None
    max_abs: float | None = None

    @classmethod
    def of(cls, delta: torch.Tensor) -> NoiseFloor:
        if delta.numel() == 0:
            return cls()
        d = delta.double().abs()
        return cls(int(d.numel()), float(d.mean()), float(d.max()))

    @property
    def tolerance(self) -> float | None:
        """The largest |Δ| that is noise: ``NOISE_MARGIN`` × the floor's max, at least
        ``EXACT_TOLERANCE``; None when nothing was measured."""
        if self.max_abs is None:
            return None
        return max(EXACT_TOLERANCE, NOISE_MARGIN * self.max_abs)


@dataclass
class Verdict:
    """What a recomputation found in one batch's quantity.

    ``kind``: ``unchanged`` (every |Δ| ≤ EXACT_TOLERANCE, no tag changed), ``dtype noise`` (every
    |Δ| within the floor's tolerance), ``damaged`` (a tag changed, or ``beyond`` tokens exceed the
    tolerance), ``unverified`` (some |Δ| > EXACT_TOLERANCE but no floor was measured to judge it).
    """

    kind: str
    beyond: int = 0
    retagged: int = 0


def judge(
    delta: torch.Tensor,
    tolerance: float | torch.Tensor | None,
    *,
    retagged: int = 0,
    exact: torch.Tensor | None = None,
) -> Verdict:
    """The verdict on |``delta``| (new − stored, over the recomputed tokens) given the largest
    |Δ| that is noise (a floor's ``tolerance``, or one per token; None when unmeasured) and
    ``retagged`` changed tags; ``exact`` holds deltas that must be exactly 0 (π_prox_t := π_behav
    on version-c tokens: a stored value that differs at all is damage)."""
    d = delta.double().abs()
    limit = EXACT_TOLERANCE if tolerance is None else torch.as_tensor(tolerance, dtype=torch.float64)
    broken = 0 if exact is None else int((exact != 0).sum())
    if retagged or broken:
        return Verdict("damaged", broken + int((d > limit).sum()), retagged)
    if not bool((d > EXACT_TOLERANCE).any()):
        return Verdict("unchanged")
    beyond = int((d > limit).sum())
    if tolerance is None:
        return Verdict("unverified", beyond)
    return Verdict("damaged", beyond) if beyond else Verdict("dtype noise")
