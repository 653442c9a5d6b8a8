"""The exact multi-step decomposition of the decoupled weight (docs/recompute.md "The exact
decomposition"): per lag ℓ = c − v, log π_c/π_behav as the sum of its one-step factors, and the
part segment-wise drops, log π_c/π_{v+1}: its distribution, and how much of it a drift clip κ
keeps (docs/math.md §1.1: the drift-clipped weight keeps clamp(log π_c/π_{v+1}, ±log κ)).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sdp_cli.analysis.recompute_plan import output_mask
from sdp_cli.choices import STUDIED_DRIFT_CLIPS
from sdp_cli.rollout.batch_file import SavedBatch


@dataclass
class Moments:
    """Mean, standard deviation (population), mean |x| and max |x| of a set of values."""

    mean: float
    std: float
    mean_abs: float
    max_abs: float

    @classmethod
    def of(cls, x: torch.Tensor) -> Moments:
        x = x.double()
        return cls(
            float(x.mean()),
            float(x.std(correction=0)),
            float(x.abs().mean()),
            float(x.abs().max()),
        )


#: quantiles of the dropped factor π_c/π_{v+1} reported per lag
DROPPED_QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99)
#: the drift clips whose effect is reported by default (the κ values of the drift-clip study)
DEFAULT_DRIFT_CLIPS = STUDIED_DRIFT_CLIPS


@dataclass
class DriftKept:
    """What the drift clip κ keeps of the dropped factor d = π_c/π_{v+1} over a lag's tokens.

    Attributes:
        kappa: κ.
        tokens_unclipped: share of tokens whose d lies inside [1/κ, κ] (kept whole).
        log_kept: Σ |clamp(log d, ±log κ)| / Σ |log d|, the share of the factor's log mass the
            clipped weight keeps (1 when d ≡ 1).
    """

    kappa: float
    tokens_unclipped: float
    log_kept: float


def drift_kept(dropped_log: torch.Tensor, kappa: float) -> DriftKept:
    """``DriftKept`` of κ for the log dropped factors ``dropped_log`` (one per token)."""
    bound = math.log(kappa)
    inside = dropped_log.abs() <= bound
    total = float(dropped_log.abs().sum())
    kept = float(dropped_log.clamp(-bound, bound).abs().sum())
    return DriftKept(
        kappa=float(kappa),
        tokens_unclipped=float(inside.double().mean()) if dropped_log.numel() else 1.0,
        log_kept=kept / total if total > 0 else 1.0,
    )


@dataclass
class LagDecomposition:
    """The exact chain over the loss-mask tokens of one lag ℓ = c − v ≥ 1, all batches together.

    log π_c/π_behav = Σ_{j=0}^{ℓ−1} log π_{v+j+1}/π_{v+j} with π_v := π_behav (the sampled
    logprob). Segment-wise keeps j = 0 and drops the rest, log π_c/π_{v+1}.

    Attributes:
        lag: ℓ.
        tokens: loss-mask output tokens with this lag.
        segment_wise: log π_{v+1}/π_behav, the segment-wise log weight.
        decoupled: log π_c/π_behav, the full (decoupled) log weight.
        dropped: log π_c/π_{v+1}, the factor segment-wise drops (0 for ℓ = 1).
        dropped_ratio_mean: mean of π_c/π_{v+1} = exp(dropped) over the tokens.
        step_means: ℓ entries, mean of log π_{v+j+1}/π_{v+j} for j = 0 … ℓ−1; they sum to
            ``decoupled.mean`` and entries 1 … ℓ−1 to ``dropped.mean``.
        dropped_quantiles: quantile (``DROPPED_QUANTILES``, as "q0.01" …) → π_c/π_{v+1}.
        drift_kept: per drift clip κ, what the clipped weight keeps of the dropped factor.
    """

    lag: int
    tokens: int
    segment_wise: Moments
    decoupled: Moments
    dropped: Moments
    dropped_ratio_mean: float
    step_means: list[float] = field(default_factory=list)
    dropped_quantiles: dict[str, float] = field(default_factory=dict)
    drift_kept: list[DriftKept] = field(default_factory=list)


def exact_decomposition(
    batches: Sequence[SavedBatch],
    scores: Sequence[dict[int, torch.Tensor]],
    drift_clips: Sequence[float] = DEFAULT_DRIFT_CLIPS,
) -> list[LagDecomposition]:
    """Per lag, the chain of one-step log ratios of the loss-mask tokens (needs the scores of
    every version v+1 … c for each token, as planned with ``exact``), the distribution of the
    dropped factor and what each drift clip in ``drift_clips`` keeps of it."""
    # per lag: rows of [log π_behav, log π_{v+1}, …, log π_c], one row per token
    chains: dict[int, list[torch.Tensor]] = {}
    for batch, batch_scores in zip(batches, scores, strict=True):
        c = batch.trainer_version
        keep = output_mask(batch) & batch.effective_loss_mask().bool() & (batch.versions < c)
        for v in sorted(set(batch.versions[keep].tolist())):
            mask = keep & (batch.versions == v)
            columns = [batch.old_logprobs[mask]] + [batch_scores[k][mask] for k in range(v + 1, c + 1)]
            chain = torch.stack(columns, dim=1).double()
            assert not bool(chain.isnan().any()), f"the chain of version {v} tokens was scored fully"
            chains.setdefault(c - v, []).append(chain)
    result = []
    for lag in sorted(chains):
        chain = torch.cat(chains[lag])
        steps = chain[:, 1:] - chain[:, :-1]
        dropped = chain[:, -1] - chain[:, 1]
        result.append(
            LagDecomposition(
                lag=lag,
                tokens=int(chain.shape[0]),
                segment_wise=Moments.of(chain[:, 1] - chain[:, 0]),
                decoupled=Moments.of(chain[:, -1] - chain[:, 0]),
                dropped=Moments.of(dropped),
                dropped_ratio_mean=float(dropped.exp().mean()),
                step_means=[float(x) for x in steps.mean(dim=0)],
                dropped_quantiles={
                    f"q{q:g}": float(torch.quantile(dropped, q).exp()) for q in DROPPED_QUANTILES
                },
                drift_kept=[drift_kept(dropped, kappa) for kappa in drift_clips],
            )
        )
    return result
