"""The PPO trainer: one optimisation step per consumed batch, math delegated to ``sdp_cli.core``.

Per step (docs/design.md §1, §4):
1. π_prox: a no-grad forward of the current weights at the rollout temperature (not in bypass).
2. π_prox_t of stale tokens was scored by the engine (the loop's recompute passes); only with
   ``rollout.proximal_t_source=trainer`` do tokens one version behind take π_prox_t := π_prox here
   (``fill_one_step_proximal``). Tokens whose π_{v+1} window closed leave the loss.
3. behavioural log ratio of the mode → bounded importance weights (+ optional rejection mask).
4. ``ppo_epochs`` × ``minibatches`` optimizer steps on ``policy_loss`` with π_prox (or π_behav in
   bypass) as the clip anchor; what follows θ is recomputed at every optimizer step from its
   detached π_θ (``_step_weights``): ``reinforce``'s importance weight π_θ/π_behav (docs/math.md
   §5.1), OPSM's mask (§9.4) and, with ``loss.proximal_source=loglinear``, A-3PO's π_prox and
   the weight built on it (§9.7; step 1 is then skipped).

The model and optimizer go through ``accelerate`` so the same code runs under
``accelerate launch``: each process trains on its shard of every minibatch, divides its part of
the loss by the count of the whole minibatch (all-reduced) and scales it by the number of
processes, which DDP's gradient average undoes, so the update equals a single-process one
(docs/training.md, "Several processes"). With ``parallel="fsdp"`` the model is sharded by
``train/step/sharding.py`` instead of wrapped in DDP; FSDP's reduce-scatter averages the same way,
so the same scaling holds. Every registered behavioural weight (decoupled,
segment-wise, its drift-clipped form, and any mode added with ``register_mode``) is measured on
the same tokens whenever its inputs exist, whatever the training mode ("shadow" metrics).

Log-probs come from the model's final hidden states and its output embedding, only at response
tokens, so no [tokens, vocab] logits tensor exists (``train/step/response_logprobs.py``, docs/math.md
§6.2). ``dtype="bfloat16"`` runs forward and backward under autocast; the optimizer sees float32
parameters. With ``loss.kl_coef > 0`` a reference policy (a frozen copy, or the LoRA model with
its adapters disabled) scores each batch once, and the KL and entropy terms of
``core.regularizers`` join the policy loss (docs/math.md §8).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from sdp_cli.choices import RECOMMENDED_DRIFT_CLIP
from sdp_cli.config.schema import LossConfig, OptimConfig
from sdp_cli.core.loss import loss_count, policy_loss
from sdp_cli.core.metrics import lag0_mismatch, lag_weight_stats, offpolicy_metrics
from sdp_cli.core.regularizers import regularizer_loss
from sdp_cli.core.token_status import covered_tokens, lacks_next_version, token_status
from sdp_cli.core.weights import (
    drift_log_factor,
    importance_weights,
    loglinear_proximal,
    off_policy_sequence_mask,
    rejection_mask,
    second_moment_mask,
)
from sdp_cli.models.lora import is_lora
from sdp_cli.modes import DRIFT_SUFFIX, MODES, resolve_mode
from sdp_cli.train.step.batch import TrainBatch, fill_one_step_proximal
from sdp_cli.train.step.response_logprobs import ResponseLogprobs
from sdp_cli.train.step.sharding import sharded_grad_norm
from sdp_cli.train.step.trainer_state import PlacedModel

#: κ of the drift-clipped shadow weight when the run trains without one (loss.drift_clip=null)
SHADOW_DRIFT_CLIP = RECOMMENDED_DRIFT_CLIP


@dataclass
class StepOutput:
    """What one training step reports: flat scalar metrics and the tensors worth saving."""

    metrics: dict[str, float]
    proximal_logprobs: torch.Tensor | None
    loss_mask: torch.Tensor


def disable_dropout(model: torch.nn.Module) -> None:
    """Set every dropout probability of ``model`` to 0.

    π_θ is computed in train mode and π_prox in eval mode: with dropout the two differ at
    θ = π_prox, so the PPO ratio is not 1 there and the clip fires on noise (docs/training.md,
    "The trainer's policy"). Dropout lives in ``nn.Dropout`` modules and in float attributes
    that attention implementations read in train mode (Qwen2's ``attention_dropout``).
    """
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)


def _mean_of(dicts: list[dict[str, float]]) -> dict[str, float]:
    keys = dict.fromkeys(k for d in dicts for k in d)  # first-seen order, the same in every run
    return {k: sum(d[k] for d in dicts if k in d) / sum(1 for d in dicts if k in d) for k in keys}


class Trainer:
    """Owns the trained model (placed on the processes with its optimizer: ``placed``), the
    sampling generator and the trainer version c."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        loss: LossConfig,
        optim: OptimConfig,
        temperature: float,
        seed: int = 0,
        track_proximal_t: bool = False,
        proximal_t_source: str = "engine",
        accelerator: Any | None = None,
        batch_sequences: int | None = None,
        dtype: str = "float32",
        reference: torch.nn.Module | None = None,
        parallel: str = "ddp",
        share_prefixes: bool = True,
    ):
        """``batch_sequences`` (rollout.batch_groups · rollout.group_size) sets, with
        ``loss.norm_length``, the constant of seq-mean-token-sum-norm (docs/math.md §5.2).
        ``dtype``: float32, or bfloat16 for autocast. ``reference``: the frozen policy of the KL
        term (needed when ``loss.kl_coef > 0`` unless ``model`` is a LoRA model, whose base with
        the adapters disabled is the reference). Only parameters that require grad train.
        ``parallel``: ddp, or fsdp to shard the model over several processes (``train/step/sharding.py``).
        ``share_prefixes``: each distinct prompt runs once per forward (``train/step/shared_prefix.py``).
        The settings are trusted: the config validated them (config/validation.py: a mode that reads
        π_prox_t keeps the recompute pass, so ``track_proximal_t``; A-3PO only with decoupled)."""
        from accelerate import Accelerator

        self.mode = resolve_mode(loss.mode)
        #: A-3PO: π_prox interpolated inside each optimizer step, never a forward (docs/math.md §9.7)
        self.loglinear = loss.proximal_source == "loglinear"
        # the contracts train/session/run.py keeps beyond the config's checks
        assert loss.kl_coef == 0 or reference is not None or is_lora(model), (
            "loss.kl_coef > 0 needs a reference model (or a LoRA model)"
        )
        self.loss_cfg = loss
        self.optim_cfg = optim
        self.temperature = float(temperature)
        #: the constant denominator of seq-mean-token-sum-norm: L · sequences per optimizer step
        self.norm_denominator: float | None = None
        if loss.agg == "seq-mean-token-sum-norm":
            assert loss.norm_length is not None and batch_sequences is not None, (
                "loss.agg=seq-mean-token-sum-norm needs loss.norm_length and batch_sequences"
            )
            self.norm_denominator = loss.norm_length * batch_sequences / optim.minibatches
        #: π_prox_t = π_{v+1} is kept for stale tokens (segment_wise, or measured with recompute=always)
        self.track_proximal_t = track_proximal_t
        self.proximal_t_source = proximal_t_source
        self.accelerator = accelerator or Accelerator(cpu=not torch.cuda.is_available())
        disable_dropout(model)
        self.response_logprobs = ResponseLogprobs(
            temperature=self.temperature,
            device=self.accelerator.device,
            autocast_dtype=torch.bfloat16 if dtype == "bfloat16" else None,
            unwrap=self.accelerator.unwrap_model,
            share_prefixes=share_prefixes,
            every_process=self._every_process if self.accelerator.num_processes > 1 else None,
        )
        self.placed = PlacedModel(
            model,
            self.accelerator,
            parallel,
            lambda module: torch.optim.AdamW(
                [p for p in module.parameters() if p.requires_grad],
                lr=optim.lr,
                betas=(optim.beta1, optim.beta2),
                weight_decay=optim.weight_decay,
                # one kernel over all parameters instead of a loop of small ops per tensor: the
                # same update (up to rounding), 5× faster for a 135M model on one CPU thread
                fused=True,
            ),
            reference=None if reference is None else reference.requires_grad_(False).eval(),
        )
        self.generator = torch.Generator().manual_seed(seed)
        self.version = 0

    # ------------------------------------------------------------------ forward
    def logprobs(self, batch: TrainBatch, *, grad: bool) -> torch.Tensor:
        """log π_θ of every response token at the rollout temperature, shape [N, L-1], 0 at
        prompt and padding positions.

        With ``grad`` the result stays on the training device and carries the graph; without it
        it is a detached float32 CPU tensor (π_prox).
        """
        logprobs, _ = self._forward(self.placed.model, batch, grad=grad, with_entropy=False)
        return logprobs if grad else logprobs.detach().float().cpu()

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The training precision as a context: bfloat16 autocast, or nothing for float32."""
        return self.response_logprobs.autocast()

    # ------------------------------------------------------------ whole state
    def unwrapped_model(self) -> torch.nn.Module:
        return self.placed.unwrapped()

    def weights(self) -> dict[str, torch.Tensor]:
        """The weights an engine runs (``PlacedModel.weights``; unsharded only)."""
        return self.placed.weights()

    def full_model_state(self) -> dict[str, torch.Tensor]:
        return self.placed.full_model_state()

    def state_dict(self, *, model: bool = True, optimizer: bool = True) -> dict[str, Any]:
        """What continues this trainer exactly: the trained module's own tensors (adapters
        included, not merged), the optimizer state, the sampling generator, torch's CPU RNG (which
        training draws from) and the version; when sharded, model and optimizer are collectives,
        whole on rank 0. A checkpoint passes model=False (its policy directory holds the weights)
        and optimizer=False when it is not saved: those entries are None, and loading skips them."""
        return {
            "model": self.placed.full_model_state() if model else None,
            "optimizer": self.placed.full_optimizer_state() if optimizer else None,
            "generator": self.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "version": self.version,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("model") is not None:
            self.placed.load_model_state(state["model"])
        if state.get("optimizer") is not None:
            self.placed.load_optimizer_state(state["optimizer"])
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        self.version = int(state["version"])

    def _forward(
        self, model: torch.nn.Module, batch: TrainBatch, *, grad: bool, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.response_logprobs.forward(model, batch, grad=grad, with_entropy=with_entropy)

    def _reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """log π_ref of the response tokens (no grad, float32 on CPU): the frozen reference, or the
        LoRA model with its adapters disabled."""
        model = self.placed.reference
        if model is None:
            model = self.placed.unwrapped()
            context: contextlib.AbstractContextManager[Any] = model.disable_adapter()
        else:
            context = contextlib.nullcontext()
        with context:
            logprobs, _ = self._forward(model, batch, grad=False, with_entropy=False)
        return logprobs.cpu()

    def _regularizers(
        self,
        logprobs: torch.Tensor,
        entropy: torch.Tensor | None,
        mask: torch.Tensor,
        reference: torch.Tensor | None,
        denominator: float | torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """KL-to-reference and entropy terms of one minibatch shard, over the policy loss's
        denominator (docs/math.md §8)."""
        cfg = self.loss_cfg
        return regularizer_loss(
            logprobs,
            mask,
            ref_logprobs=reference,
            entropy=entropy,
            kl_coef=cfg.kl_coef,
            kl_type=cfg.kl_type,
            entropy_coef=cfg.entropy_coef,
            agg=cfg.agg,
            denominator=denominator,
        )

    # --------------------------------------------------------------------- step
    def step(self, batch: TrainBatch) -> StepOutput:
        """Train on one batch; the trainer version then advances by one."""
        cfg = self.loss_cfg
        c = self.version
        assert batch.trainer_version == c, f"batch built for version {batch.trainer_version}, trainer at {c}"
        metrics: dict[str, float] = {}
        mask = batch.mask

        mode = self.mode
        # π_prox: the PPO anchor, an input of the weight, or the drift factor's other end (A-3PO
        # interpolates it inside each optimizer step instead)
        need_prox = (mode.anchor == "proximal" or mode.reads_proximal or self.track_proximal_t) and not self.loglinear
        fused = None
        if need_prox and self._single_update():
            # θ does not move before the batch's only optimizer step: π_prox is the training
            # forward's own output, detached, and the separate no-grad forward is saved.
            # (in the row order the optimizer step would draw, so the update is bit for bit the same)
            order = torch.randperm(batch.num_sequences, generator=self.generator)
            self.placed.model.train()
            logprobs, entropy = self._forward(self.placed.model, batch.rows(order), grad=True, with_entropy=True)
            fused = (order, logprobs, entropy)
            prox = torch.empty_like(logprobs, device="cpu")
            prox[order] = logprobs.detach().float().cpu()
        else:
            prox = self.logprobs(batch, grad=False) if need_prox else None
        reference = self._reference_logprobs(batch) if cfg.kl_coef > 0 else None

        loss_mask = mask
        if self.track_proximal_t and prox is not None:
            if self.proximal_t_source == "trainer":
                metrics["recompute/tokens_trainer_fill"] = float(fill_one_step_proximal(batch, prox))
            # after the take-time pass and the fill: stale tokens still without π_{v+1}
            uncorrectable = lacks_next_version(token_status(batch.versions, batch.proximal_t_versions, c, mask))
            metrics["segment_wise/uncorrectable_token_fraction"] = float(uncorrectable.sum()) / max(
                float(mask.sum()), 1.0
            )
            if mode.reads_proximal_t and bool(uncorrectable.any()):
                # Reachable only without consume-time filtering (staleness=standard): a token whose
                # π_{v+1} window closed cannot be corrected, so it leaves the loss.
                loss_mask = torch.where(uncorrectable, torch.zeros_like(mask), mask)

        # the tokens this step trains on before any rejection: what every weight is measured on
        trained = loss_mask > 0
        old = batch.old_logprobs
        params = {} if cfg.drift_clip is None else {"drift_clip": cfg.drift_clip}
        # with A-3PO the weight follows π̂_prox, which exists only inside an optimizer step
        log_ratio = None if self.loglinear else mode.log_ratio(
            old, prox, batch.proximal_logprobs_t if mode.reads_proximal_t else None, loss_mask > 0, **params
        )
        weights = None
        if cfg.drift_clip is not None and prox is not None:
            _, clipped = drift_log_factor(prox, batch.proximal_logprobs_t, cfg.drift_clip)
            metrics["weights/drift_clipped_fraction"] = float((clipped & (loss_mask > 0)).sum()) / max(
                float((loss_mask > 0).sum()), 1.0
            )
        if log_ratio is not None:
            # over this process's rows, as before: per-minibatch weights normalise across processes
            weights, wmetrics = self._weights(log_ratio, loss_mask, across_processes=False)
            metrics.update({f"weights/{k}": v for k, v in wmetrics.items()})
            metrics.update(self._trained_ess(log_ratio, loss_mask, wmetrics))
            rej = cfg.rejection
            if rej.level is not None or rej.veto is not None:
                # a veto needs no bounds (verl's token veto): level null leaves only the veto
                bounded = rej.level is not None
                loss_mask, rmetrics = rejection_mask(
                    log_ratio,
                    loss_mask,
                    level=rej.level,
                    upper=rej.upper if bounded else None,
                    lower=rej.lower if bounded else None,
                    veto=rej.veto,
                    metric=rej.metric,
                )
                metrics.update({f"rejection/{k}": v for k, v in rmetrics.items()})
            if cfg.m2_threshold is not None:
                loss_mask, mmetrics = second_moment_mask(log_ratio, loss_mask, cfg.m2_threshold)
                metrics.update({f"m2po/{k}": v for k, v in mmetrics.items()})

        metrics.update(self._diagnostics(batch, prox, trained))
        anchor = prox if mode.anchor == "proximal" else old
        metrics.update(
            self._optimise(batch, anchor, loss_mask, weights, log_ratio, reference=reference, fused=fused)
        )
        # of the step's last forward (a training forward, or the KL reference's on the same
        # rows): the fraction of positions that running each distinct prompt once saved
        metrics["batch/positions_saved"] = self.response_logprobs.positions_saved
        self.version += 1
        return StepOutput(metrics=metrics, proximal_logprobs=prox, loss_mask=loss_mask)

    def _optimise(
        self,
        batch: TrainBatch,
        anchor: torch.Tensor | None,
        loss_mask: torch.Tensor,
        weights: torch.Tensor | None,
        log_ratio: torch.Tensor | None,
        *,
        reference: torch.Tensor | None = None,
        fused: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    ) -> dict[str, float]:
        """``ppo_epochs`` × ``minibatches`` optimizer steps; this process trains on its shard.
        ``anchor`` is None with A-3PO (``_step_weights`` interpolates it). ``fused`` = (row order,
        log-probs, entropy): the training forward ``step`` already ran when there is one optimizer
        step only (``_single_update``); it replaces the forward."""
        cfg, opt = self.loss_cfg, self.optim_cfg
        acc = self.accelerator
        n = batch.num_sequences
        per_step: list[dict[str, float]] = []
        self.placed.model.train()
        for _ in range(opt.ppo_epochs):
            order = torch.randperm(n, generator=self.generator) if fused is None else fused[0]
            for chunk in torch.tensor_split(order, opt.minibatches):
                # data parallel: each process takes every world_size-th row of the minibatch
                rows = chunk[acc.process_index :: acc.num_processes]
                # A process with no row of this minibatch still runs forward and backward (DDP's
                # gradient all-reduce needs every process) on a stand-in row with an empty mask:
                # its loss and gradient are exactly 0.
                stand_in = rows.numel() == 0
                if stand_in:
                    rows = chunk[:1]
                mb = batch.rows(rows)
                dev = acc.device
                mb_mask = loss_mask[rows].to(dev)
                if stand_in:
                    mb_mask = torch.zeros_like(mb_mask)
                if fused is None:
                    logprobs, entropy = self._forward(self.placed.model, mb, grad=True, with_entropy=True)
                else:
                    _, logprobs, entropy = fused
                mb_anchor, mb_weights, step_metrics = self._step_weights(
                    logprobs,
                    mb,
                    mb_mask,
                    None if anchor is None else anchor[rows].to(dev),
                    None if weights is None else weights[rows].to(dev),
                    None if log_ratio is None else log_ratio[rows].to(dev),
                )
                denominator = self._denominator(mb_mask)
                loss, lmetrics = policy_loss(
                    logprobs,
                    mb_anchor,
                    mb.advantages.to(dev),
                    mb_mask,
                    weights=mb_weights,
                    clip=cfg.clip,
                    clip_high=cfg.clip_high,
                    dual_clip=cfg.dual_clip,
                    agg=cfg.agg,
                    loss_type=cfg.loss_type,
                    denominator=denominator,
                    ratio_level=cfg.ratio_level,
                    dppo_kl_coef=cfg.dppo_kl_coef,
                )
                ref_rows = None if reference is None else reference[rows].to(dev)
                extra, rmetrics = self._regularizers(logprobs, entropy, mb_mask, ref_rows, denominator)
                # This process's loss is its share of the minibatch's (the denominator counts
                # every process's rows); DDP averages the gradients over processes, so ×N
                # makes that average the gradient of the whole minibatch's loss.
                acc.backward((loss + extra) * acc.num_processes)
                if acc.num_processes > 1:
                    lmetrics["pg_loss"] = float(acc.reduce(loss.detach(), reduction="sum"))
                    rmetrics = {k: float(self._sum_over_processes(torch.tensor(v, device=dev))) for k, v in rmetrics.items()}
                lmetrics.update(rmetrics)
                if self.placed.sharded:
                    grad_norm = sharded_grad_norm(list(self.placed.model.parameters()), opt.grad_clip)
                elif opt.grad_clip is not None:
                    grad_norm = acc.clip_grad_norm_(self.placed.model.parameters(), opt.grad_clip)
                else:
                    grad_norm = torch.sqrt(
                        sum((p.grad.detach() ** 2).sum() for p in self.placed.model.parameters() if p.grad is not None)
                    )
                self.placed.optimizer.step()
                self.placed.optimizer.zero_grad(set_to_none=True)
                lmetrics = {f"loss/{k}": float(v) for k, v in lmetrics.items()}
                lmetrics["loss/grad_norm"] = float(grad_norm)
                per_step.append({**lmetrics, **step_metrics})
        self.placed.model.eval()
        out = _mean_of(per_step)
        out["loss/optimizer_steps"] = float(len(per_step))
        return out

    def _step_weights(
        self,
        logprobs: torch.Tensor,
        mb: TrainBatch,
        mask: torch.Tensor,
        anchor: torch.Tensor | None,
        weights: torch.Tensor | None,
        log_ratio: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """The anchor and the behavioural weight of one optimizer step on minibatch shard ``mb``, with
        what follows θ: A-3PO's π̂_prox and its weight, REINFORCE's weight, OPSM's mask (docs/math.md
        §5.1, §9.4, §9.7), from the step's log π_θ (detached). Returns (anchor, weights, metrics)."""
        cfg = self.loss_cfg
        dev = logprobs.device
        old = mb.old_logprobs.to(dev)
        metrics: dict[str, float] = {}
        if self.loglinear:
            lag = (mb.trainer_version - mb.versions).to(dev)
            anchor, a3po = loglinear_proximal(old, logprobs, lag, mask)
            log_ratio = anchor - old  # the decoupled log ratio, at π̂_prox
            metrics.update({f"a3po/{k}": v for k, v in a3po.items()})
        assert anchor is not None
        if cfg.loss_type == "reinforce":
            weights = self._reinforce_weights(logprobs, anchor, log_ratio, mask)
        elif self.loglinear:
            assert log_ratio is not None
            weights, wmetrics = self._weights(log_ratio, mask)
            metrics.update({f"weights/{k}": v for k, v in wmetrics.items()})
            metrics.update(self._trained_ess(log_ratio, mask, wmetrics))
        if cfg.opsm_delta is not None:
            keep, ometrics = off_policy_sequence_mask(logprobs, old, mb.advantages.to(dev), mask, cfg.opsm_delta)
            # a 0 weight: the dropped tokens stay in the denominator, as in TRL and slime
            weights = keep if weights is None else weights * keep
            metrics.update({f"opsm/{k}": v for k, v in ometrics.items()})
        return anchor, weights, metrics

    def _weights(
        self, log_ratio: torch.Tensor, mask: torch.Tensor, *, across_processes: bool = True
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The behavioural weight ``loss`` configures (docs/math.md §2), normalised over the whole
        minibatch across processes (``across_processes=False``: over this process's rows)."""
        cfg = self.loss_cfg
        across = across_processes and self.accelerator.num_processes > 1
        return importance_weights(
            log_ratio,
            mask,
            level=cfg.is_level,
            cap=cfg.weight_cap,
            floor=cfg.weight_floor,
            action=cfg.weight_action,
            batch_normalize=cfg.batch_normalize,
            all_reduce=self._sum_over_processes if across else None,
        )

    def _trained_ess(
        self, log_ratio: torch.Tensor, mask: torch.Tensor, bounded: dict[str, float]
    ) -> dict[str, float]:
        """ESS of the weight this step trains with, at the level it trains with (per token, or per
        sequence at the sequence and geometric levels), after its bounds (``trained_ess``) and
        before them (``trained_ess_raw``): docs/math.md §2.2."""
        level = self.loss_cfg.is_level
        key = "rollout_is_eff_sample_size" if level == "token" else "rollout_is_seq_eff_sample_size"
        _, raw = importance_weights(log_ratio, mask, level=level)
        return {"weights/trained_ess": bounded[key], "weights/trained_ess_raw": raw[key]}

    def _single_update(self) -> bool:
        """Whether a batch gets exactly one optimizer step, in one process (which then holds
        every row): π_prox = π_θ at that step, so one forward serves both."""
        opt = self.optim_cfg
        return opt.ppo_epochs == 1 and opt.minibatches == 1 and self.accelerator.num_processes == 1

    def _denominator(self, mask: torch.Tensor) -> float | torch.Tensor:
        """What the loss of a minibatch shard divides by: the seq-mean-token-sum-norm constant,
        or the count of the whole minibatch, summed over the processes (docs/math.md §5.2)."""
        if self.norm_denominator is not None:
            return self.norm_denominator
        count = loss_count(mask, self.loss_cfg.agg)
        return self._sum_over_processes(count).clamp_min(1)

    def _every_process(self, flag: bool) -> bool:
        """Whether ``flag`` holds in every process (one all-reduce)."""
        count = self._sum_over_processes(torch.tensor(int(flag), device=self.accelerator.device))
        return int(count) == self.accelerator.num_processes

    def _sum_over_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        acc = self.accelerator
        return acc.reduce(tensor, reduction="sum") if acc.num_processes > 1 else tensor

    def _reinforce_weights(
        self,
        logprobs: torch.Tensor,
        anchor: torch.Tensor,
        log_ratio: torch.Tensor | None,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """REINFORCE's detached importance weight at the current θ (docs/math.md §5.1): log w =
        (log π_θ − log anchor) + the mode's behavioural log ratio, so π_θ/π_behav in bypass and
        decoupled, bounded and normalised as ``loss`` says, over the whole minibatch."""
        current = logprobs.detach() - anchor
        weights, _ = self._weights(current if log_ratio is None else current + log_ratio, mask)
        return weights

    def _diagnostics(self, batch: TrainBatch, prox: torch.Tensor | None, trained: torch.Tensor) -> dict[str, float]:
        """Rewards, lags, verl off-policy metrics, shadow weights and the per-lag breakdown.
        ``trained``: the tokens the step trains on before rejection, the base of every weight's
        coverage (the tokens a saved batch's loss mask holds when no rejection runs)."""
        c = batch.trainer_version
        mask = batch.mask
        valid = mask > 0
        out: dict[str, float] = {
            "reward/mean": float(batch.rewards.mean()),
            "batch/sequences": float(batch.num_sequences),
            "batch/response_tokens": float(mask.sum()),
            "batch/response_len_mean": float(mask.sum() / max(batch.num_sequences, 1)),
        }
        lags = (c - batch.versions)[valid]
        if lags.numel():
            out["staleness/lag_mean"] = float(lags.float().mean())
            out["staleness/lag_max"] = float(lags.max())
        if prox is None:
            return out
        old = batch.old_logprobs
        out.update({f"offpolicy/{k}": v for k, v in offpolicy_metrics(old, prox, mask).items()})
        # engine (π_behav) vs trainer (π_prox) on tokens of the trainer's own version: numerics alone
        lag0 = valid & (batch.versions == c)
        out.update({f"mismatch/lag0_{k}": v for k, v in lag0_mismatch(old, prox, lag0).items()})

        # Every registered weight whose inputs this run has (π_prox_t only when tracked), and the
        # drift-clipped one of each mode that takes κ (modes.shadow_weights), each over the tokens
        # it covers among those trained: a weight that reads π_prox_t leaves out stale tokens
        # without π_{v+1}, as the loss and inspect-weights do (core/token_status.py
        # covered_tokens, docs/math.md §1).
        prox_t = batch.proximal_logprobs_t if self.track_proximal_t else None
        status = token_status(batch.versions, batch.proximal_t_versions, c, mask) if prox_t is not None else None
        shadows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, spec in MODES.items():
            if not spec.has_weight or (prox_t is None and spec.reads_proximal_t):
                continue
            covered = covered_tokens(trained, status, reads_proximal_t=spec.reads_proximal_t)
            shadows[name] = (spec.log_ratio(old, prox, prox_t, covered), covered)
            if spec.takes_drift_clip and prox_t is not None:  # the drift factor is π_prox/π_prox_t
                kappa, drift = self.loss_cfg.drift_clip or SHADOW_DRIFT_CLIP, name + DRIFT_SUFFIX
                with_next = covered_tokens(trained, status, reads_proximal_t=True)
                shadows[drift] = (spec.log_ratio(old, prox, prox_t, with_next, drift_clip=kappa), with_next)
                clipped = drift_log_factor(prox, prox_t, kappa)[1] & with_next
                out[f"shadow/{drift}/kappa"] = float(kappa)
                out[f"shadow/{drift}/drift_clipped_fraction"] = float(clipped.sum()) / max(float(with_next.sum()), 1.0)
        for name, (lr, covered) in shadows.items():
            _, raw = importance_weights(lr, covered, level="token")
            for key in ("rollout_is_mean", "rollout_is_std", "rollout_is_max", "rollout_is_eff_sample_size"):
                out[f"shadow/{name}/{key}"] = raw[key]
            # per-lag breakdown with AReaL's names and signs: behav_kl is its behave_approx_kl,
            # mean(log π_x − log π_behav), the log of the weight (docs/training.md)
            for lag, stats in lag_weight_stats(lr, covered, c - batch.versions).items():
                out[f"shadow/{name}/lag{lag}/tokens"] = stats["tokens"]
                out[f"shadow/{name}/lag{lag}/behav_imp_weight/avg"] = stats["mean"]
                out[f"shadow/{name}/lag{lag}/behav_imp_weight/std"] = stats["std"]
                out[f"shadow/{name}/lag{lag}/behav_kl/avg"] = stats["log_mean"]
        return out
