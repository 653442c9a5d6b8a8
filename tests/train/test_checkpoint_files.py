"""Checkpoint files (sdp_cli/train/session/checkpoint.py): keep-last-N pruning never deletes the newest
complete checkpoint, and checkpoints without optimizer state."""

import json
from pathlib import Path

import pytest
import torch

from sdp_cli.errors import UserError
from sdp_cli.train.session import checkpoint as ckpt

from .test_resume_trust import resign


_OPTIMIZER = object()


def _write(root: Path, step: int, keep: int, optimizer=_OPTIMIZER) -> Path:
    def save_policy(directory: Path) -> None:
        directory.mkdir(parents=True)
        (directory / "weights.txt").write_text(f"step {step}")

    if optimizer is _OPTIMIZER:
        optimizer = {
            "state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.ones(3)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        }
    return ckpt.write_checkpoint(
        root, step, save_policy=save_policy, optimizer_state=optimizer, state={"trainer": {}, "loop": {}}, keep=keep
    )


def _corrupt(path: Path) -> None:
    (path / "policy" / "weights.txt").write_text("torn")


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*"))


def test_keep_last_n(tmp_path):
    for step in (10, 20, 30, 40):
        _write(tmp_path, step, keep=3)
    assert _steps(tmp_path) == [20, 30, 40]


def test_a_resumed_run_never_deletes_its_newest_complete_checkpoint(tmp_path):
    # A first session wrote 30, 40, 50; 50 was torn (a disk fault), so the run resumed from 40.
    # Its next checkpoint is 45: the stale, higher-numbered 50 must not count as one of the kept.
    for step in (30, 40, 50):
        _write(tmp_path, step, keep=3)
    _corrupt(tmp_path / "step-000050")
    assert ckpt.find_latest(tmp_path).name == "step-000040"
    _write(tmp_path, 45, keep=1)
    assert ckpt.find_latest(tmp_path) == tmp_path / "step-000045"
    _write(tmp_path, 47, keep=2)
    # the newest two complete ones stay: 45 and 47
    assert {45, 47} <= set(_steps(tmp_path))
    assert ckpt.find_latest(tmp_path) == tmp_path / "step-000047"


def test_without_optimizer_state(tmp_path):
    path = _write(tmp_path, 10, keep=2, optimizer=None)
    assert not (path / "optimizer.safetensors").exists()
    loaded = ckpt.read_checkpoint(path)
    assert loaded.state["optimizer"] is None and loaded.optimizer_tensors == {}
    manifest = json.loads((path / "manifest.json").read_text())
    assert "optimizer.safetensors" not in manifest["files"]


def test_with_optimizer_state_round_trips(tmp_path):
    loaded = ckpt.read_checkpoint(_write(tmp_path, 10, keep=2))
    state = ckpt.unflatten_optimizer_state(loaded.optimizer_tensors, loaded.state["optimizer"])
    assert torch.equal(state["state"][0]["exp_avg"], torch.ones(3)) and state["param_groups"][0]["lr"] == 0.1


def test_a_held_checkpoint_outlives_its_pruning(tmp_path):
    # hard links on one file system: the run's pruning removes its names, not the held files
    written = _write(tmp_path / "run", 10, keep=1)
    held = tmp_path / "held"
    assert ckpt.hold_checkpoint(written, held)
    _write(tmp_path / "run", 20, keep=1)  # prunes step 10
    assert not written.exists()
    assert (held / "policy" / "weights.txt").read_text() == "step 10"
    assert ckpt.is_complete(held)


def test_a_checkpoint_is_copied_where_it_cannot_be_linked(tmp_path, monkeypatch):
    import errno
    import os

    def cross_device(*args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    written = _write(tmp_path / "run", 10, keep=1)
    monkeypatch.setattr(os, "link", cross_device)
    assert ckpt.hold_checkpoint(written, tmp_path / "held")
    assert (tmp_path / "held" / "policy" / "weights.txt").read_text() == "step 10"
    assert os.stat(tmp_path / "held" / "state.json").st_nlink == 1  # a copy, not a link


def test_holding_a_gone_or_incomplete_checkpoint_says_so(tmp_path):
    written = _write(tmp_path / "run", 10, keep=1)
    _corrupt(written)
    assert not ckpt.hold_checkpoint(written, tmp_path / "torn")
    assert not ckpt.hold_checkpoint(tmp_path / "run" / "step-000099", tmp_path / "gone")


def test_a_manifest_naming_files_outside_its_checkpoint_is_not_followed(tmp_path):
    # the held directory is written: a manifest path "../x" would place a link outside it
    written = _write(tmp_path / "run", 10, keep=1)
    (tmp_path / "secret.txt").write_text("not the run's")
    manifest = json.loads((written / "manifest.json").read_text())
    manifest["files"]["../../secret.txt"] = {"size": 13, "sha256": "0"}
    (written / "manifest.json").write_text(json.dumps(manifest))
    assert not ckpt.hold_checkpoint(written, tmp_path / "held")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["held", "run", "secret.txt"]


def test_find_latest_looks_again_when_a_live_run_prunes_the_checkpoint_it_was_checking(tmp_path, monkeypatch):
    """The listing showed step 2 only; while it was being checked, the run wrote step 3 and
    pruned step 2 (keep=1). There was a complete checkpoint at every moment, so the answer is
    step 3, not None ("has no complete checkpoint", which failed `sdp export` of a live run)."""
    root = tmp_path / "checkpoints"
    _write(root, 2, keep=1)
    real_is_valid = ckpt._is_valid
    pruned = []

    def the_run_moves_on(path):
        if not pruned:
            pruned.append(path)
            _write(root, 3, keep=1)  # renamed into place, then step 2 pruned
        return real_is_valid(path)

    monkeypatch.setattr(ckpt, "_is_valid", the_run_moves_on)
    latest = ckpt.find_latest(root)
    assert pruned and not pruned[0].exists()
    assert latest is not None and latest.name == "step-000003"
    monkeypatch.setattr(ckpt, "_is_valid", real_is_valid)
    assert ckpt.find_latest(tmp_path / "empty") is None


def _edit_state(path: Path, edit) -> None:
    """Rewrite ``state.json`` and re-sign the manifest, as a writer other than this sdp would."""
    state = json.loads((path / "state.json").read_text())
    edit(state)
    (path / "state.json").write_text(json.dumps(state))
    resign(path)


def test_a_manifest_of_another_format_is_not_a_checkpoint(tmp_path):
    written = _write(tmp_path, 10, keep=1)
    manifest = json.loads((written / "manifest.json").read_text())
    manifest["format"] = "other-tool"
    (written / "manifest.json").write_text(json.dumps(manifest))
    assert ckpt.find_latest(tmp_path) is None
    with pytest.raises(UserError, match="checkpoint is incomplete or corrupted; resume from an earlier one"):
        ckpt.read_checkpoint(written)


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda s: s.update(format="other-tool"), "(ValueError: state.json is not an sdp checkpoint state)"),
        (lambda s: s.pop("loop"), "(ValueError: state.json is not an sdp checkpoint state)"),
        (lambda s: s.pop("format_version"), "(ValueError: state.json has no integer format_version)"),
        (lambda s: s.update(format_version="1"), "(ValueError: state.json has no integer format_version)"),
        (lambda s: s.update(format_version=0), "(ValueError: state.json has format_version 0, which no sdp wrote)"),
    ],
)
def test_a_state_sdp_did_not_write_is_one_line(tmp_path, edit, expected):
    written = _write(tmp_path, 10, keep=1)
    _edit_state(written, edit)
    with pytest.raises(UserError) as err:
        ckpt.read_checkpoint(written)
    assert str(err.value) == (
        f"{written}: checkpoint cannot be read {expected}; move it away to resume from an earlier one"
    )


def test_a_checkpoint_of_a_newer_sdp_says_to_upgrade(tmp_path):
    written = _write(tmp_path, 10, keep=1)
    _edit_state(written, lambda s: s.update(format_version=ckpt.FORMAT_VERSION + 1))
    with pytest.raises(UserError) as err:
        ckpt.read_checkpoint(written)
    assert str(err.value) == (
        f"{written}: checkpoint format version {ckpt.FORMAT_VERSION + 1} is newer than this sdp reads "
        f"({ckpt.FORMAT_VERSION}); upgrade sdp to resume from it, or move it away to resume from an earlier one"
    )


def test_stale_temporaries_of_killed_writes_are_removed(tmp_path):
    _write(tmp_path, 10, keep=1)
    for name in (".tmp-step-000020-abc", ".tmp-step-000030-def"):
        (tmp_path / name / "policy").mkdir(parents=True)
    ckpt.remove_stale_temporaries(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000010"]
    ckpt.remove_stale_temporaries(tmp_path / "absent")  # a run that never wrote one
