"""Checkpoint and version directories are ordered by their number, never by their name.

``step_name`` pads to six digits, so past step 999,999 the names grow a digit: as strings,
``step-1000000`` sorts before ``step-999999``. Everything that picks "the newest" or "all but
the newest N" (resume, pruning, the weights a server loads) must compare numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

from sdp_cli.rundir import saved_batches, step_dirs, superseded_versions, version_dirs
from sdp_cli.train.session import checkpoint as ckpt


def _write(root: Path, step: int, keep: int = 2) -> Path:
    def save_policy(directory: Path) -> None:
        directory.mkdir(parents=True)
        (directory / "config.json").write_text(json.dumps({"step": step}))

    state = {"trainer": {"version": step}, "loop": {"step": step}}
    return ckpt.write_checkpoint(
        root, step, save_policy=save_policy, optimizer_state={"state": {}, "param_groups": []}, state=state, keep=keep
    )


def test_the_newest_checkpoint_past_step_999999_is_found(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (999_998, 999_999, 1_000_000):
        _write(root, step, keep=10)
    # as strings "step-1000000" < "step-999998" < "step-999999": the string order picks 999999
    assert ckpt.find_latest(root) == root / "step-1000000"
    assert ckpt.read_checkpoint(ckpt.find_latest(root)).step == 1_000_000


def test_pruning_past_step_999999_keeps_the_newest(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (999_998, 999_999, 1_000_000, 1_000_001):
        _write(root, step, keep=2)
    # keep=2: the one just written (1000001) and the newest before it (1000000)
    assert sorted(p.name for p in root.glob("step-*")) == ["step-1000000", "step-1000001"]
    assert ckpt.find_latest(root) == root / "step-1000001"


def test_step_directories_are_listed_by_number(tmp_path):
    for name in ("step-000010", "step-1000000", "step-999999", "step-000009", "latest", ".tmp-step-000011-x"):
        (tmp_path / name).mkdir()
    assert [n for n, _ in step_dirs(tmp_path)] == [9, 10, 999_999, 1_000_000]


def test_version_directories_are_listed_by_number(tmp_path):
    for name in ("v1000000", "v999999", "v000002"):
        (tmp_path / name).mkdir()
    assert list(version_dirs(tmp_path)) == [2, 999_999, 1_000_000]


def test_the_weights_a_server_may_still_load_are_the_current_and_the_one_before_by_number(tmp_path):
    # the run keeps the weight directories of the version it pushes and the one before; "launch"
    # is not a version
    for name in ("v999998", "v999999", "v1000000", "launch"):
        (tmp_path / name).mkdir()
    assert superseded_versions(tmp_path, 1_000_000) == [tmp_path / "v999998"]


def test_weight_directories_numbered_above_the_pushed_version_are_superseded(tmp_path):
    # a crashed session's v5 and v6 beside the resumed run's v3 and v4: the newest by number are
    # not the run's (tests/train/test_resume_leftovers.py)
    for name in ("v000003", "v000004", "v000005", "v000006", "launch"):
        (tmp_path / name).mkdir()
    assert superseded_versions(tmp_path, 4) == [tmp_path / "v000005", tmp_path / "v000006"]
    assert superseded_versions(tmp_path, 1) == [tmp_path / n for n in ("v000003", "v000004", "v000005", "v000006")]


def test_saved_batches_are_listed_by_number(tmp_path):
    for name in ("step-1000000.safetensors", "step-999999.safetensors", "step-000002.safetensors"):
        (tmp_path / name).write_bytes(b"")
    for name in ("step-000003.safetensors.tmp", ".step-000004.safetensors.x", "step-00000a.safetensors", "notes.safetensors"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "step-000005.safetensors").mkdir()
    assert [n for n, _ in saved_batches(tmp_path)] == [2, 999_999, 1_000_000]
    assert saved_batches(tmp_path / "absent") == []
