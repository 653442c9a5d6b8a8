"""Where the trainer's weights live and how whole copies of them come out: a mixin of
:class:`sdp_cli.train.trainer.Trainer` (docs/training.md, "Several processes" and "Sharded
training (FSDP)").

Unsharded (one process, or DDP) the model goes through ``accelerate`` and every rank holds it
whole. Sharded (``parallel="fsdp"`` with several processes) it stays out of accelerate, which
would wrap it in DDP: ``train/sharding.py`` splits it, and its whole weights and optimizer
state come from collective gathers that every rank must join, landing on rank 0.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from sdp_cli.models.lora import merged_state_dict
from sdp_cli.train import sharding


class TrainerState:
    """Placement and whole-state I/O of the trained model; the attributes are Trainer's."""

    accelerator: Any
    model: Any
    optimizer: Any
    reference: torch.nn.Module | None
    generator: torch.Generator
    version: int

    def _place(
        self, model: torch.nn.Module, parallel: str, make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]
    ) -> None:
        """Shard ``model`` and the frozen reference over the processes (each unit moves to the
        device as it is sharded, never the whole model), or hand them to accelerate; the
        optimizer is made afterwards, over the parameters that are trained."""
        acc = self.accelerator
        #: the parameters are split over the processes: whole weights need a collective gather
        self.sharded = parallel == "fsdp" and acc.num_processes > 1
        #: the model's structure without its weights (sharded only), for rebuilding it whole
        self.skeleton = sharding.meta_skeleton(model) if self.sharded else None
        if self.sharded:
            for module in (m for m in (model, self.reference) if m is not None):
                sharding.shard(module, acc.device, acc.num_processes)
            self.model, self.optimizer = model, acc.prepare(make_optimizer(model))
            return
        if self.reference is not None:
            self.reference.to(acc.device)
        self.model, self.optimizer = acc.prepare(model, make_optimizer(model))

    def unwrapped_model(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model)

    def weights(self) -> dict[str, torch.Tensor]:
        """The weights an engine runs (detached; merged under LoRA, ``models.lora``); the local
        engine copies them into its own model, casting to its dtype. Unsharded only: a sharded
        model's whole weights come from ``full_model_state``, which every rank must join."""
        assert not self.sharded, "a sharded trainer's whole weights need a gather on every rank"
        return merged_state_dict(self.unwrapped_model())

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """The trained module's own tensors (when sharded: a collective, whole on rank 0)."""
        return sharding.full_model_state(self.unwrapped_model(), sharded=self.sharded)

    def full_optimizer_state(self) -> dict[str, Any]:
        """The whole optimizer state, index-keyed (when sharded: a collective, on rank 0)."""
        return sharding.full_optimizer_state(self.model, self.optimizer, sharded=self.sharded)

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Load a whole optimizer state (every rank passes all of it)."""
        sharding.load_full_optimizer_state(self.model, self.optimizer, state, sharded=self.sharded)

    def state_dict(self, *, model: bool = True, optimizer: bool = True) -> dict[str, Any]:
        """What continues this trainer exactly: the trained module's own tensors (adapters
        included, not merged), the optimizer state, the sampling generator, torch's CPU RNG (which
        training draws from) and the version; when sharded, model and optimizer are collectives,
        whole on rank 0. A checkpoint passes model=False (its policy directory holds the weights)
        and optimizer=False when it is not saved: those entries are None, and loading skips them."""
        return {
            "model": self.full_model_state() if model else None,
            "optimizer": self.full_optimizer_state() if optimizer else None,
            "generator": self.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "version": self.version,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("model") is not None:
            assert not self.sharded, "a sharded run loads whole weights before sharding (train/run.py)"
            self.unwrapped_model().load_state_dict(state["model"])
        if state.get("optimizer") is not None:
            self.load_optimizer_state(state["optimizer"])
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        self.version = int(state["version"])
