"""Checkpoints hold the trainer's state through ``Trainer.state_dict`` / ``load_state_dict``
(issue 12: the seed's API is the production path), in the format run.py wrote by hand before."""

from __future__ import annotations

import copy
import json

import torch

from sdp_cli.config.schema import LossConfig, OptimConfig
from sdp_cli.train.session import checkpoint as ckpt
from sdp_cli.train.step.batch import assemble_batch
from sdp_cli.train.step.trainer import Trainer

from .test_trainer import _groups, _model, _same_weights, _set_old_logprobs


def _trainer(model):
    return Trainer(copy.deepcopy(model), loss=LossConfig(), optim=OptimConfig(lr=1e-2), temperature=1.0, seed=0)


def _step(trainer, groups):
    return trainer.step(assemble_batch(copy.deepcopy(groups), pad_token_id=0, trainer_version=trainer.version))


def _through_a_checkpoint(trainer, root, *, optimizer=True):
    optimizer_state, entry = ckpt.trainer_parts(trainer.state_dict(model=False, optimizer=optimizer))
    path = ckpt.write_checkpoint(
        root, trainer.version, save_policy=lambda d: d.mkdir(), optimizer_state=optimizer_state, state={"trainer": entry, "loop": {}}
    )
    return ckpt.read_checkpoint(path)


def test_a_trainer_restored_from_a_checkpoint_takes_the_same_next_step(tmp_path):
    """Two steps in one trainer, or one step, a checkpoint, and the second step in a trainer made
    from the same weights plus the checkpoint: the weights end equal only if AdamW's moments and
    step count, the generator and the version all came back."""
    model = _model()
    first, second = _groups(version=0, seed=1), _groups(version=1, seed=2)
    _set_old_logprobs(first, model, 1.0)
    _set_old_logprobs(second, model, 1.0)
    straight = _trainer(model)
    _step(straight, first)
    checkpoint = _through_a_checkpoint(straight, tmp_path / "checkpoints")
    restored = Trainer(copy.deepcopy(straight.placed.model), loss=LossConfig(), optim=OptimConfig(lr=1e-2), temperature=1.0, seed=5)
    # the control: the same weights with a fresh AdamW (no moments, step 0)
    fresh = Trainer(copy.deepcopy(straight.placed.model), loss=LossConfig(), optim=OptimConfig(lr=1e-2), temperature=1.0, seed=0)
    fresh.version = 1
    saved_rng = torch.get_rng_state()
    torch.manual_seed(1234)  # the process RNG moved on; the checkpoint's state comes back
    restored.load_state_dict(ckpt.trainer_state(checkpoint))
    assert torch.equal(torch.get_rng_state(), saved_rng)
    assert restored.version == 1
    _step(straight, second)
    _step(restored, second)
    assert straight.version == restored.version == 2
    assert _same_weights(straight, restored)
    _step(fresh, second)
    assert not _same_weights(straight, fresh), "the optimizer state makes no difference: the test cannot fail"


def test_the_checkpoint_holds_what_run_py_wrote_by_hand(tmp_path):
    """state.json's trainer entry is {version, generator, torch_rng} as byte lists, and the
    optimizer tensors are in optimizer.safetensors (the format of checkpoints before)."""
    model = _model()
    groups = _groups(version=0)
    _set_old_logprobs(groups, model, 1.0)
    trainer = _trainer(model)
    _step(trainer, groups)
    checkpoint = _through_a_checkpoint(trainer, tmp_path / "checkpoints")
    state = json.loads((checkpoint.path / "state.json").read_text())
    assert set(state["trainer"]) == {"version", "generator", "torch_rng"}
    assert state["trainer"]["version"] == 1
    assert state["trainer"]["generator"] == trainer.generator.get_state().tolist()
    # AdamW: exp_avg and exp_avg_sq per parameter, and one step taken
    params = sum(1 for p in trainer.placed.model.parameters() if p.requires_grad)
    assert sum(k.endswith((".exp_avg", ".exp_avg_sq")) for k in checkpoint.optimizer_tensors) == 2 * params
    assert {float(v) for k, v in checkpoint.optimizer_tensors.items() if k.endswith(".step")} == {1.0}


def test_without_optimizer_state_the_optimizer_is_left_as_it_is(tmp_path):
    model = _model()
    groups = _groups(version=0)
    _set_old_logprobs(groups, model, 1.0)
    trainer = _trainer(model)
    _step(trainer, groups)
    checkpoint = _through_a_checkpoint(trainer, tmp_path / "checkpoints", optimizer=False)
    assert checkpoint.state["optimizer"] is None and not (checkpoint.path / "optimizer.safetensors").exists()
    other = _trainer(model)
    other.load_state_dict(ckpt.trainer_state(checkpoint))
    assert other.version == 1 and other.placed.optimizer.state_dict()["state"] == {}
