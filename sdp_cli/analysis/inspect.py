"""Importance weights of saved batches, mode by mode (``sdp inspect-weights``; docs/design.md §1, §4).

One row per correction mode registered in ``sdp_cli.modes`` (docs/design.md §4,
"Adding a mode"), in registration order — built in: ``bypass`` (the reference, w ≡ 1),
``decoupled`` (log w = π_prox − π_behav), ``segment_wise`` (log w = π_prox_t − π_behav) — and,
after each mode that takes a drift clip, its drift-clipped row ``<mode>_drift`` (built in:
``segment_wise_drift``, log w = π_prox_t − π_behav + clamp(π_prox − π_prox_t, ±log κ),
docs/math.md §1.1). What a row needs (π_prox, π_prox_t) and covers comes from the registry. For
every row and every aggregation (token,
sequence, geometric) this module builds the weights with ``core.weights.importance_weights``
and the divergences with ``core.metrics.offpolicy_metrics`` (rollout = π_behav, training = the
mode's target policy), then breaks the raw token weights down by staleness, lag = c − v. The
per-lag table includes the factor segment-wise drops, π_c/π_{v+1} = exp(π_prox − π_prox_t)
(docs/math.md §1). With ``MaskOptions`` each row also gets the share of its tokens that rejection,
M2PO and OPSM would drop (docs/math.md §3, §9.2, §9.4). No weight or metric is computed here: this module only selects tokens and
arranges the kernels' results. Pure analysis: batches in, a report out; nothing is printed or
written.

Several batches are analysed as one: their response tensors are stacked (each keeps its own
trainer version for the lag), so ``batch_normalize`` normalises over all of them at once.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from sdp_cli.choices import IS_LEVELS, RECOMMENDED_DRIFT_CLIP
from sdp_cli.core.metrics import lag_weight_stats, offpolicy_metrics
from sdp_cli.core.token_status import covered_tokens, lacks_next_version, token_status
from sdp_cli.core.weights import (
    drift_log_factor,
    importance_weights,
    off_policy_sequence_mask,
    rejection_mask,
    second_moment_mask,
)
from sdp_cli.modes import DRIFT_SUFFIX, MODES, weight_names
from sdp_cli.rollout.batch_file import SavedBatch

#: the divergences reported per mode (names as in docs/math.md §4)
DIVERGENCES = ("kl", "k3_kl", "chi2_token", "chi2_seq")
#: our short statistic names → the kernel's metric names (docs/math.md §2.2)
_WEIGHT_STATS = {
    "mean": "rollout_is_mean",
    "std": "rollout_is_std",
    "min": "rollout_is_min",
    "max": "rollout_is_max",
    "ess": "rollout_is_eff_sample_size",
    "frac_high": "rollout_is_ratio_fraction_high",
    "frac_low": "rollout_is_ratio_fraction_low",
    "masked": "rollout_is_masked_fraction",
    "batch_norm_factor": "rollout_is_batch_norm_factor",
}
#: the policy each built-in row's weight corrects towards (π_behav in bypass: no correction);
#: a row named by one input is measured against that input as stored, so that no rounding of
#: π_behav + log w enters its divergences. Other rows: π_behav · w (``target``).
TARGETS = {
    "bypass": "π_behav",
    "decoupled": "π_prox",
    "segment_wise": "π_prox_t",
    "segment_wise_drift": "π_prox_t·clip(π_prox/π_prox_t, 1/κ, κ)",
}
#: the target of a registered mode without an entry in TARGETS
OTHER_TARGET = "π_behav·w"


def report_rows() -> tuple[str, ...]:
    """The rows of the report: every registered mode, each followed by its drift-clipped row
    when it takes ``drift_clip`` (``modes.weight_names``)."""
    return weight_names()


def target(row: str) -> str:
    """The policy ``row``'s weight corrects towards, as shown in the divergence table."""
    return TARGETS.get(row, OTHER_TARGET)


MISSING_PROXIMAL_FIX = (
    "add π_prox with `sdp recompute`, or save batches from a decoupled or segment-wise run "
    "(sdp train train.save_batches=true)"
)


@dataclass(frozen=True)
class WeightOptions:
    """Bounds and normalisation of the behavioural weights, as ``loss.*`` in the training config.

    None/None means raw weights. Validation is the caller's job (the CLI reports bad values).
    """

    cap: float | None = None
    floor: float | None = None
    action: str = "truncate"
    batch_normalize: bool = False
    #: κ of the segment_wise_drift row (loss.drift_clip)
    drift_clip: float = RECOMMENDED_DRIFT_CLIP


@dataclass(frozen=True)
class MaskOptions:
    """The token masks of the training config to measure on each row (docs/math.md §3, §9.2, §9.4), as
    ``loss.*``: rejection (``rejection_level`` None = off), M2PO (``m2_threshold``) and OPSM
    (``opsm_delta``, with π_θ = π_prox: the batch's first optimizer step). Validation is the caller's."""

    rejection_level: str | None = None
    rejection_metric: str = "ratio"
    rejection_upper: float = 2.0
    rejection_lower: float | None = None
    m2_threshold: float | None = None
    opsm_delta: float | None = None

    @property
    def any(self) -> bool:
        return self.rejection_level is not None or self.m2_threshold is not None or self.opsm_delta is not None


#: the masks' names in ``ModeReport.masks``, in the order of the report's columns
MASKS = ("rejection", "m2po", "opsm")


def _options_json(options: WeightOptions) -> dict[str, Any]:
    """The options as JSON values: JSON has no infinity, so κ = ∞ is the string "inf"."""
    return {
        k: "inf" if isinstance(v, float) and math.isinf(v) else v for k, v in asdict(options).items()
    }


@dataclass
class ModeReport:
    """One mode's weights and divergences over the tokens it covers.

    ``weights[level]``: mean/std/min/max/ess of the returned (bounded, normalised) weights over
    tokens, and frac_high/frac_low of raw weights above cap/below floor (of tokens at token level,
    of sequences at the sequence levels); ``masked`` (action mask) is a share of tokens.
    ``per_token[level]`` is the [S, T] weight tensor itself (0 outside the covered tokens).
    Over zero tokens no statistic is defined: every value in ``weights`` and ``divergence`` is
    None (n/a), not the 0 a masked mean over nothing would give.
    """

    mode: str
    available: bool
    reason: str | None = None
    tokens: int = 0
    #: the mode has no behavioural weight (bypass): w ≡ 1, never bounded
    reference: bool = False
    weights: dict[str, dict[str, float | None]] = field(default_factory=dict)
    divergence: dict[str, float | None] = field(default_factory=dict)
    per_token: dict[str, Tensor] = field(default_factory=dict, repr=False)
    covered: Tensor | None = field(default=None, repr=False)
    #: share of the covered tokens each configured mask (``MASKS``) drops; None where it cannot
    #: apply (no behavioural log ratio, no π_prox or advantages, no tokens)
    masks: dict[str, float | None] = field(default_factory=dict)


@dataclass
class LagRow:
    """Raw token weights of the tokens with one lag (c − v). ``w_dec`` and ``dropped`` are None
    without π_prox; ``w_segment_wise`` and ``dropped`` cover the tokens that have π_{v+1} (all but
    ``uncorrectable``) and are None when none has. ``dropped`` = π_c/π_{v+1} = w_dec / w_segment_wise;
    ``drift_clipped`` is the share of those tokens whose dropped factor lies outside [1/κ, κ]."""

    lag: int
    tokens: int
    uncorrectable: int
    w_dec: dict[str, float] | None
    w_segment_wise: dict[str, float] | None
    dropped: dict[str, float] | None
    drift_clipped: float | None = None


@dataclass
class _Layout:
    """Where each response token of the stacked [S, T] tensors sits in the packed inputs."""

    rows: Tensor
    cols: Tensor
    packed_index: Tensor
    num_tokens: int
    cu_seqlens: Tensor
    prompt_lens: Tensor
    file_index: Tensor


@dataclass
class WeightReport:
    """Everything ``sdp inspect-weights`` shows for one set of batches."""

    sources: list[str]
    trainer_versions: list[int]
    sequences: int
    tokens: int
    uncorrectable: int
    options: WeightOptions
    modes: dict[str, ModeReport]
    mask_options: MaskOptions
    lags: list[LagRow]
    mask: Tensor = field(repr=False)
    lag: Tensor = field(repr=False)
    layout: _Layout = field(repr=False)
    dropped: Tensor | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (no tensors)."""
        return {
            "files": list(self.sources),
            "trainer_versions": list(self.trainer_versions),
            "sequences": self.sequences,
            "tokens": self.tokens,
            "uncorrectable_tokens": self.uncorrectable,
            "options": _options_json(self.options),
            "mask_options": asdict(self.mask_options),
            "modes": {
                name: {
                    "available": m.available,
                    "reason": m.reason,
                    "target": target(name),
                    "tokens": m.tokens,
                    "weights": m.weights if m.available else None,
                    "divergence": m.divergence if m.available else None,
                    "masks": m.masks if m.available else None,
                }
                for name, m in self.modes.items()
            },
            "lags": [asdict(row) for row in self.lags],
        }


@dataclass
class _Stacked:
    """Response tokens of every batch, right-padded to one [S, T] (docs/design.md §5 layout)."""

    old: Tensor
    prox: Tensor | None
    prox_t: Tensor
    advantages: Tensor | None
    mask: Tensor
    lag: Tensor
    uncorrectable: Tensor
    #: the tokens a weight that reads π_prox_t covers (token_status.covered_tokens, the trainer's rule)
    with_next: Tensor
    layout: _Layout

    def lacks_proximal(self, mode: str, drift_clip: float | None = None) -> bool:
        """Whether the registered mode's weight (or its drift clip) reads π_prox, which the
        batches lack."""
        return self.prox is None and (drift_clip is not None or MODES[mode].reads_proximal)

    def log_ratio(self, mode: str, drift_clip: float | None = None) -> Tensor | None:
        """The registered mode's behavioural log ratio (``sdp_cli.modes``); None for a mode without
        a weight (bypass). The caller checks ``lacks_proximal`` first."""
        assert not self.lacks_proximal(mode, drift_clip), f"mode {mode} needs π_prox"
        params = {} if drift_clip is None else {"drift_clip": drift_clip}
        return MODES[mode].log_ratio(self.old, self.prox, self.prox_t, self.mask, **params)

    def target(self, row: str, log_ratio: Tensor) -> Tensor:
        """The log-probs of ``row``'s target policy (``TARGETS``): one stored input, else
        π_behav + log w."""
        inputs = {"π_behav": self.old, "π_prox": self.prox, "π_prox_t": self.prox_t}
        stored = inputs.get(target(row))
        return self.old + log_ratio if stored is None else stored


def _stack(batches: Sequence[SavedBatch]) -> _Stacked:
    padded = [b.to_padded() for b in batches]
    rows_total = sum(p.mask.shape[0] for p in padded)
    width = max(p.mask.shape[1] for p in padded)

    def cat(values: list[Tensor], fill: float | int | bool) -> Tensor:
        out = torch.full((rows_total, width), fill, dtype=values[0].dtype)
        start = 0
        for v in values:
            out[start : start + v.shape[0], : v.shape[1]] = v
            start += v.shape[0]
        return out

    has_prox = all(p.proximal_logprobs is not None for p in padded)
    has_advantages = all(p.advantages is not None for p in padded)
    mask = cat([p.mask for p in padded], False)
    versions = cat([p.versions for p in padded], -1)
    t_versions = cat([p.proximal_t_versions for p in padded], -1)
    trainer = cat([torch.full_like(p.versions, b.trainer_version) for p, b in zip(padded, batches)], -1)
    # An output token older than the trainer whose π_{v+1} was never computed has no
    # segment-wise weight (docs/design.md §2): the trainer drops it from a segment-wise loss.
    status = token_status(versions, t_versions, trainer, mask)
    return _Stacked(
        old=cat([p.old_logprobs for p in padded], 0.0),
        prox=cat([p.proximal_logprobs for p in padded], 0.0) if has_prox else None,  # type: ignore[misc]
        prox_t=cat([p.proximal_logprobs_t for p in padded], 0.0),
        advantages=cat([p.advantages for p in padded], 0.0) if has_advantages else None,  # type: ignore[misc]
        mask=mask,
        lag=torch.where(mask, trainer - versions, -1),
        uncorrectable=lacks_next_version(status),
        with_next=covered_tokens(mask, status, reads_proximal_t=True),
        layout=_layout(batches),
    )


def _layout(batches: Sequence[SavedBatch]) -> _Layout:
    rows, cols, index, cu, prompt_lens, file_index = [], [], [], [torch.zeros(1, dtype=torch.int64)], [], []
    row_offset = token_offset = 0
    for i, b in enumerate(batches):
        seq_idx, pos = b.token_layout()
        is_out = pos >= b.prompt_lens[seq_idx]
        rows.append(seq_idx[is_out] + row_offset)
        cols.append(pos[is_out] - b.prompt_lens[seq_idx[is_out]])
        index.append(torch.arange(b.num_tokens)[is_out] + token_offset)
        cu.append(b.cu_seqlens[1:] + token_offset)
        prompt_lens.append(b.prompt_lens)
        file_index.append(torch.full((b.num_sequences,), i, dtype=torch.int64))
        row_offset += b.num_sequences
        token_offset += b.num_tokens
    return _Layout(
        rows=torch.cat(rows),
        cols=torch.cat(cols),
        packed_index=torch.cat(index),
        num_tokens=token_offset,
        cu_seqlens=torch.cat(cu),
        prompt_lens=torch.cat(prompt_lens),
        file_index=torch.cat(file_index),
    )


def _weight_stats(metrics: dict[str, float]) -> dict[str, float]:
    return {short: metrics[name] for short, name in _WEIGHT_STATS.items() if name in metrics}


def _mode_report(
    mode: str, log_ratio: Tensor, covered: Tensor, old: Tensor, target: Tensor, options: WeightOptions,
    reference: bool = False,
) -> ModeReport:
    report = ModeReport(mode=mode, available=True, tokens=int(covered.sum()), covered=covered, reference=reference)
    # A mode without a behavioural weight (bypass) is w ≡ 1, never bounded (the reference row).
    opts = WeightOptions() if reference else options
    for level in IS_LEVELS:
        weights, metrics = importance_weights(
            log_ratio,
            covered,
            level=level,
            cap=opts.cap,
            floor=opts.floor,
            action=opts.action,
            batch_normalize=opts.batch_normalize,
        )
        stats = _weight_stats(metrics)
        report.weights[level] = stats if report.tokens else dict.fromkeys(stats)
        report.per_token[level] = weights
    if not report.tokens:
        report.divergence = dict.fromkeys(DIVERGENCES)
        return report
    divergence = offpolicy_metrics(old, target, covered)
    # + 0.0 turns the −0.0 of an all-zero log ratio (bypass) into 0.0 for display.
    report.divergence = {name: divergence[name] + 0.0 for name in DIVERGENCES}
    return report


def _masks(s: _Stacked, log_ratio: Tensor | None, covered: Tensor, options: MaskOptions) -> dict[str, float | None]:
    """The share of ``covered`` tokens each configured mask drops, by the trainer's kernels: rejection
    and M2PO on the row's behavioural log ratio (none without one), OPSM at π_θ = π_prox."""
    out: dict[str, float | None] = {}
    if not covered.any():
        return dict.fromkeys(_configured(options))
    if options.rejection_level is not None:
        out["rejection"] = None if log_ratio is None else rejection_mask(
            log_ratio,
            covered,
            level=options.rejection_level,
            metric=options.rejection_metric,
            upper=options.rejection_upper,
            lower=options.rejection_lower,
        )[1]["rollout_rs_masked_fraction"]
    if options.m2_threshold is not None:
        out["m2po"] = None if log_ratio is None else second_moment_mask(log_ratio, covered, options.m2_threshold)[1]["masked_fraction"]
    if options.opsm_delta is not None:
        out["opsm"] = None if s.prox is None or s.advantages is None else off_policy_sequence_mask(
            s.prox, s.old, s.advantages, covered, options.opsm_delta
        )[1]["masked_fraction"]
    return out


def _configured(options: MaskOptions) -> list[str]:
    given = (options.rejection_level, options.m2_threshold, options.opsm_delta)
    return [name for name, value in zip(MASKS, given) if value is not None]


def _lag_rows(s: _Stacked, drift_clip: float) -> list[LagRow]:
    lr_segment_wise = s.log_ratio("segment_wise")
    lr_dec = None if s.lacks_proximal("decoupled") else s.log_ratio("decoupled")
    assert lr_segment_wise is not None and (lr_dec is not None or s.prox is None)
    with_next = s.with_next
    w_dec = {} if lr_dec is None else lag_weight_stats(lr_dec, s.mask, s.lag)
    w_segment_wise = lag_weight_stats(lr_segment_wise, with_next, s.lag)
    dropped = {} if s.prox is None else lag_weight_stats(s.prox - s.prox_t, with_next, s.lag)
    clipped = None if s.prox is None else drift_log_factor(s.prox, s.prox_t, drift_clip)[1]
    rows = []
    for lag in torch.unique(s.lag[s.mask]).tolist():
        selected = s.mask & (s.lag == lag)
        drift_clipped = None
        if clipped is not None and lag in w_segment_wise:
            lag_next = with_next & (s.lag == lag)
            drift_clipped = int((clipped & lag_next).sum()) / int(lag_next.sum())
        rows.append(
            LagRow(
                lag=int(lag),
                tokens=int(selected.sum()),
                uncorrectable=int((selected & s.uncorrectable).sum()),
                w_dec=_mean_std_ess(w_dec[lag]) if lag in w_dec else None,
                w_segment_wise=_mean_std_ess(w_segment_wise[lag]) if lag in w_segment_wise else None,
                dropped={"mean": dropped[lag]["mean"], "std": dropped[lag]["std"]} if lag in dropped else None,
                drift_clipped=drift_clipped,
            )
        )
    return rows


def _mean_std_ess(stats: dict[str, float]) -> dict[str, float]:
    return {"mean": stats["mean"], "std": stats["std"], "ess": stats["ess"]}


def analyse_batches(
    batches: Sequence[SavedBatch],
    sources: Sequence[str],
    options: WeightOptions = WeightOptions(),
    masks: MaskOptions = MaskOptions(),
) -> WeightReport:
    """Weights, divergences, the configured masks and the staleness breakdown of ``batches``
    analysed together.

    ``sources`` names each batch (its path) in the report. decoupled needs π_prox in every batch;
    without it the mode is reported unavailable with the way to get it, not as an error.
    """
    assert batches, "analyse_batches needs at least one batch"
    assert len(sources) == len(batches), f"{len(sources)} sources for {len(batches)} batches"
    s = _stack(batches)
    lacking = [src for src, b in zip(sources, batches) if b.proximal_logprobs is None]
    no_prox = (
        f"{lacking[0]}{f' (and {len(lacking) - 1} more)' if len(lacking) > 1 else ''} "
        f"has no proximal_logprobs (π_prox); {MISSING_PROXIMAL_FIX}"
        if lacking
        else None
    )
    modes: dict[str, ModeReport] = {}
    with_next = s.with_next
    for name, spec in MODES.items():
        # a weight that reads π_prox_t (a drift factor π_prox/π_prox_t does) leaves out the stale
        # tokens without π_{v+1} (token_status.covered_tokens: the trainer's rule too)
        variants = [(name, None, with_next if spec.reads_proximal_t else s.mask)]
        if spec.takes_drift_clip:
            variants.append((name + DRIFT_SUFFIX, options.drift_clip, with_next))
        for row, kappa, covered in variants:
            if s.lacks_proximal(name, kappa):
                why = no_prox if kappa is None else f"{no_prox} (the drift factor needs π_prox)"
                modes[row] = ModeReport(mode=row, available=False, reason=why)
                continue
            log_ratio = s.log_ratio(name, kappa)
            reference = log_ratio is None  # no behavioural weight: w ≡ 1
            mask_fractions = _masks(s, log_ratio, covered, masks)
            if log_ratio is None:
                log_ratio = torch.zeros_like(s.old)
            modes[row] = _mode_report(
                row, log_ratio, covered, s.old, s.target(row, log_ratio), options, reference=reference
            )
            modes[row].masks = mask_fractions
    assert tuple(modes) == report_rows(), f"modes out of order: {tuple(modes)}"
    return WeightReport(
        sources=list(sources),
        trainer_versions=[b.trainer_version for b in batches],
        sequences=int(s.mask.shape[0]),
        tokens=int(s.mask.sum()),
        uncorrectable=int(s.uncorrectable.sum()),
        options=options,
        modes=modes,
        mask_options=masks,
        lags=_lag_rows(s, options.drift_clip),
        mask=s.mask,
        dropped=None
        if s.prox is None
        else importance_weights(s.prox - s.prox_t, modes["segment_wise"].covered, level="token")[0],
        lag=s.lag,
        layout=s.layout,
    )


def weight_samples(report: WeightReport, mode: str, level: str) -> Tensor:
    """The weights of ``mode`` at ``level`` on its covered tokens, one value per token (a sequence
    weight counts once per token, as in a token-mean loss), for histograms."""
    m = report.modes[mode]
    assert m.available and m.covered is not None, f"mode {mode} is unavailable"
    return m.per_token[level][m.covered]


def dropped_samples(report: WeightReport) -> tuple[Tensor, Tensor] | None:
    """(π_c/π_{v+1} per token, its lag) over the tokens that have π_{v+1}; None without π_prox."""
    if report.dropped is None:
        return None
    covered = report.modes["segment_wise"].covered
    assert covered is not None
    return report.dropped[covered], report.lag[covered]


def dump_tensors(report: WeightReport) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Per-token weights packed like the input batches (concatenated in order), for a
    safetensors file: ``<row>.<level>`` float32 [N] for every available row with a weight (0 on
    prompt tokens and on tokens the mode does not cover; a mode without one, bypass, is 1 on
    ``mask`` and is left out), plus ``cu_seqlens``, ``prompt_lens``, ``file_index`` (batch of each sequence), ``mask`` and ``lag``
    (−1 on prompt tokens). Returns (tensors, string metadata)."""
    lay = report.layout

    def packed(values: Tensor, fill: float | int) -> Tensor:
        out = torch.full((lay.num_tokens,), fill, dtype=values.dtype)
        out[lay.packed_index] = values[lay.rows, lay.cols]
        return out

    tensors: dict[str, Tensor] = {
        "cu_seqlens": lay.cu_seqlens,
        "prompt_lens": lay.prompt_lens,
        "file_index": lay.file_index,
        "mask": packed(report.mask.to(torch.uint8), 0),
        "lag": packed(report.lag, -1),
    }
    for name, m in report.modes.items():
        if m.reference or not m.available:
            continue
        for level in IS_LEVELS:
            tensors[f"{name}.{level}"] = packed(m.per_token[level].to(torch.float32), 0.0)
    metadata = {
        "format": "sdp-weights",
        "files": json.dumps(report.sources),
        "trainer_versions": json.dumps(report.trainer_versions),
        "options": json.dumps(_options_json(report.options)),
    }
    return tensors, metadata
