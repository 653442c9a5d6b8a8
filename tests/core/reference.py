"""The correction math of one training step written the most direct way, term by term.

Segment-wise log ratio → token importance weights (truncated to [FLOOR, CAP], batch-normalised)
→ geometric rejection with veto → PPO clip loss (clip-higher, dual clip, weights, token-mean) →
verl's off-policy metrics: float masks, one op per formula term, no fusion, no chunking
(docs/math.md §1–§5). tests/core/test_reference_oracle.py checks the fused kernels of
``sdp_cli.core`` against it; bench/loss.py times them against it.
"""

from __future__ import annotations

import torch

from sdp_cli.core.metrics import OFFPOLICY_METRIC_NAMES

CAP, FLOOR, RS_UPPER, VETO = 2.0, 0.5, 1.5, 1e-4
CLIP, CLIP_HIGH, DUAL_CLIP = 0.2, 0.28, 3.0

#: reference metric name → the kernel and key that report it in sdp_cli.core
OURS = {
    "frac_high": ("weights", "rollout_is_ratio_fraction_high"),
    "frac_low": ("weights", "rollout_is_ratio_fraction_low"),
    "factor": ("weights", "rollout_is_batch_norm_factor"),
    "mean": ("weights", "rollout_is_mean"),
    "std": ("weights", "rollout_is_std"),
    "min": ("weights", "rollout_is_min"),
    "max": ("weights", "rollout_is_max"),
    "ess": ("weights", "rollout_is_eff_sample_size"),
    "seq_mean": ("weights", "rollout_is_seq_mean"),
    "seq_std": ("weights", "rollout_is_seq_std"),
    "seq_min": ("weights", "rollout_is_seq_min"),
    "seq_max": ("weights", "rollout_is_seq_max"),
    "seq_frac_high": ("weights", "rollout_is_seq_fraction_high"),
    "seq_frac_low": ("weights", "rollout_is_seq_fraction_low"),
    "rs_masked": ("rejection", "rollout_rs_masked_fraction"),
    "rs_seq_masked": ("rejection", "rollout_rs_seq_masked_fraction"),
    "rs_veto": ("rejection", "rollout_rs_veto_fraction"),
    "rs_catastrophic": ("rejection", "rollout_rs_catastrophic_token_fraction"),
    "rs_mean": ("rejection", "rollout_rs_mean"),
    "rs_min": ("rejection", "rollout_rs_min"),
    "rs_max": ("rejection", "rollout_rs_max"),
    "pg_loss": ("loss", "pg_loss"),
    "clipfrac": ("loss", "pg_clipfrac"),
    "clipfrac_high": ("loss", "pg_clipfrac_high"),
    "clipfrac_low": ("loss", "pg_clipfrac_low"),
    "clipfrac_dual": ("loss", "pg_clipfrac_dual"),
    "ppo_kl": ("loss", "ppo_kl"),
    **{name: ("offpolicy", name) for name in OFFPOLICY_METRIC_NAMES},
}


def make_inputs(batch: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random padded batch: response lengths uniform in [1, T], logprobs a few versions apart."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=gen) * 3
    prox = old + 0.1 * torch.randn(batch, length, generator=gen)
    prox_t = old + 0.05 * torch.randn(batch, length, generator=gen)
    logprobs = prox + 0.05 * torch.randn(batch, length, generator=gen)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length) < lengths[:, None]).float()
    advantages = torch.randn(batch, 1, generator=gen).expand(batch, length).contiguous()
    return {
        "old": old,
        "prox": prox,
        "prox_t": prox_t,
        "logprobs": logprobs,
        "mask": mask,
        "adv": advantages,
    }


def reference(x: dict[str, torch.Tensor], logprobs: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """The correction math of one step written term by term, no helpers, no fusion, no chunking:
    (loss, metrics named as in ``OURS``)."""
    old, prox, mask, adv = x["old"], x["prox"], x["mask"], x["adv"]
    metrics: dict[str, float] = {}
    n_tok = mask.sum()
    valid = mask.bool()
    # Importance weights, token level, truncated, batch-normalised.
    log_ratio = (x["prox_t"] - old) * mask
    raw = torch.exp(torch.clamp(log_ratio, -20, 20)) * mask
    metrics["frac_high"] = (((raw > CAP).float() * mask).sum() / n_tok).item()
    metrics["frac_low"] = (((raw < FLOOR).float() * mask).sum() / n_tok).item()
    w = torch.clamp(raw, FLOOR, CAP) * mask
    factor = (w * mask).sum() / n_tok
    w = w / factor
    metrics["factor"] = factor.item()
    w_mean = (w * mask).sum() / n_tok
    metrics["mean"] = w_mean.item()
    metrics["std"] = torch.sqrt((((w - w_mean) ** 2) * mask).sum() / n_tok).item()
    metrics["min"] = w[valid].min().item()
    metrics["max"] = w[valid].max().item()
    metrics["ess"] = (1.0 / ((((w / w_mean) ** 2) * mask).sum() / n_tok)).item()
    seq_w = (w * mask).sum(-1) / mask.sum(-1)
    metrics["seq_mean"] = seq_w.mean().item()
    metrics["seq_std"] = seq_w.std(unbiased=False).item()
    metrics["seq_min"] = seq_w.min().item()
    metrics["seq_max"] = seq_w.max().item()
    raw_seq = (raw * mask).sum(-1) / mask.sum(-1)
    metrics["seq_frac_high"] = (raw_seq > CAP).float().mean().item()
    metrics["seq_frac_low"] = (raw_seq < FLOOR).float().mean().item()
    # Geometric rejection with veto.
    geo = torch.exp(torch.clamp((log_ratio * mask).sum(-1) / mask.sum(-1), -20, 20))
    keep = ((geo >= 1 / RS_UPPER) & (geo <= RS_UPPER)).float()
    catastrophic = ((x["prox_t"] - old) < torch.log(torch.tensor(VETO))).float() * mask
    vetoed = (catastrophic.sum(-1) > 0).float()
    keep = keep * (1 - vetoed)
    rs_mask = mask * keep[:, None]
    metrics["rs_masked"] = (1 - rs_mask.sum() / n_tok).item()
    metrics["rs_seq_masked"] = (1 - keep).mean().item()
    metrics["rs_veto"] = vetoed.mean().item()
    metrics["rs_catastrophic"] = (catastrophic.sum() / n_tok).item()
    metrics["rs_mean"] = geo.mean().item()
    metrics["rs_min"] = geo.min().item()
    metrics["rs_max"] = geo.max().item()
    # PPO clip loss with clip-higher, dual clip and weights, token-mean.
    delta = (logprobs - prox) * rs_mask
    ratio = torch.exp(torch.clamp(delta, -20, 20))
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1 - CLIP, 1 + CLIP_HIGH)
    clipped_loss = torch.maximum(loss1, loss2)
    loss3 = -adv * DUAL_CLIP
    dual_loss = torch.minimum(loss3, clipped_loss)
    per_token = torch.where(adv < 0, dual_loss, clipped_loss) * w * rs_mask
    n_rs = rs_mask.sum()
    loss = per_token.sum() / n_rs
    clipped = (loss2 > loss1).float() * rs_mask
    metrics["pg_loss"] = loss.item()
    metrics["clipfrac"] = (clipped.sum() / n_rs).item()
    metrics["clipfrac_high"] = ((clipped * (adv > 0).float()).sum() / n_rs).item()
    metrics["clipfrac_low"] = ((clipped * (adv < 0).float()).sum() / n_rs).item()
    metrics["clipfrac_dual"] = (
        ((clipped_loss > loss3) & (adv < 0)).float() * rs_mask
    ).sum().item() / n_rs.item()
    metrics["ppo_kl"] = ((-delta * rs_mask).sum() / n_rs).item()
    # Off-policy metrics (verl definitions; every row is non-empty here).
    lr = (prox - old) * mask
    metrics["kl"] = ((-lr * mask).sum() / n_tok).item()
    lr_safe = torch.clamp(lr, -20, 20)
    metrics["k3_kl"] = (((torch.exp(lr_safe) - lr_safe - 1) * mask).sum() / n_tok).item()
    train_mean = (prox * mask).sum(-1) / mask.sum(-1)
    roll_mean = (old * mask).sum(-1) / mask.sum(-1)
    metrics["training_ppl"] = torch.exp(-train_mean).mean().item()
    metrics["training_log_ppl"] = (-train_mean).mean().item()
    metrics["rollout_ppl"] = torch.exp(-roll_mean).mean().item()
    metrics["rollout_log_ppl"] = (-roll_mean).mean().item()
    diff = roll_mean - train_mean
    metrics["log_ppl_diff"] = diff.mean().item()
    metrics["log_ppl_abs_diff"] = diff.abs().mean().item()
    metrics["log_ppl_diff_max"] = diff.max().item()
    metrics["log_ppl_diff_min"] = diff.min().item()
    metrics["ppl_ratio"] = torch.exp(diff).mean().item()
    metrics["chi2_token"] = (((torch.exp(lr_safe) ** 2) * mask).sum() / n_tok - 1).item()
    metrics["chi2_seq"] = (
        torch.exp(2 * torch.clamp((lr * mask).sum(-1), -20, 20)).mean() - 1
    ).item()
    return loss, metrics
