"""Where the trainer's weights live and how whole copies of them come out (docs/training.md,
"Several processes" and "Sharded training (FSDP)"). The trainer owns one ``PlacedModel``.

Unsharded (one process, or DDP) the model goes through ``accelerate`` and every rank holds it
whole. Sharded (``parallel="fsdp"`` with several processes) it stays out of accelerate, which
would wrap it in DDP: ``train/step/sharding.py`` splits it, and its whole weights and optimizer
state come from collective gathers that every rank must join, landing on rank 0.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from accelerate import Accelerator

from sdp_cli.models.lora import merged_state_dict
from sdp_cli.train.step import sharding


class PlacedModel:
    """The trained model and its optimizer, placed on the processes, and the frozen KL reference
    placed alongside (sharded like the model, or moved to the device)."""

    def __init__(
        self,
        model: torch.nn.Module,
        accelerator: Accelerator,
        parallel: str,
        make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
        reference: torch.nn.Module | None = None,
    ):
        """Shard ``model`` and ``reference`` over the processes (each unit moves to the device as
        it is sharded, never the whole model), or hand them to accelerate; the optimizer is made
        afterwards, over the parameters that are trained."""
        self.accelerator = accelerator
        #: the parameters are split over the processes: whole weights need a collective gather
        self.sharded = parallel == "fsdp" and accelerator.num_processes > 1
        #: the model's structure without its weights (sharded only), for rebuilding it whole
        self.skeleton = sharding.meta_skeleton(model) if self.sharded else None
        self.reference = reference
        self.model: torch.nn.Module
        self.optimizer: torch.optim.Optimizer
        if self.sharded:
            for module in (m for m in (model, reference) if m is not None):
                sharding.shard(module, accelerator.device, accelerator.num_processes)
            self.model, self.optimizer = model, accelerator.prepare(make_optimizer(model))
        else:
            if reference is not None:
                reference.to(accelerator.device)
            self.model, self.optimizer = accelerator.prepare(model, make_optimizer(model))
        # unwrapped once: accelerate's unwrap_model looks through its wrappers on every call,
        # 0.06–0.15 ms of the trainer's time on each push's weights
        self._unwrapped = accelerator.unwrap_model(self.model)

    def unwrapped(self) -> torch.nn.Module:
        return self._unwrapped

    def weights(self) -> dict[str, torch.Tensor]:
        """The weights an engine runs (detached; merged under LoRA, ``models.lora``); the local
        engine copies them into its own model, casting to its dtype. Unsharded only: a sharded
        model's whole weights come from ``full_model_state``, which every rank must join."""
        assert not self.sharded, "a sharded trainer's whole weights need a gather on every rank"
        return merged_state_dict(self.unwrapped())

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """The trained module's own tensors (when sharded: a collective, whole on rank 0)."""
        return sharding.full_model_state(self.unwrapped(), sharded=self.sharded)

    def full_optimizer_state(self) -> dict[str, Any]:
        """The whole optimizer state, index-keyed (when sharded: a collective, on rank 0)."""
        return sharding.full_optimizer_state(self.model, self.optimizer, sharded=self.sharded)

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        assert not self.sharded, "a sharded run loads whole weights before sharding (train/session/run.py)"
        self.unwrapped().load_state_dict(state)

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Load a whole optimizer state (every rank passes all of it)."""
        sharding.load_full_optimizer_state(self.model, self.optimizer, state, sharded=self.sharded)
