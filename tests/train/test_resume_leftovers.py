"""A resume goes on from its checkpoint: what the crashed session wrote past it is not the run's.

Found in CI: an sdp that launched a vLLM server was killed -9 after step 2, before its first
checkpoint, when step 3's weights were already in ``weights/`` (``v000002``, ``v000003``). The
resume started the run over, wrote step 1's weights to ``weights/v000001`` and then pruned
"all but the newest two by number", which were the crashed session's v2 and v3: it deleted the
directory it had just written, and the server was told to load a directory that was gone.

The class is "numbered files of the crashed session past the resume point": the weight
directories (which broke the run), the saved batches and the version checkpoints (which did
not, and are worse: a stopped resume left the crashed session's batch 6, whose version-4 tokens
``sdp recompute`` would score under the resumed session's version 5, other weights). The metrics
log and TensorBoard were already cut back to the checkpoint; these now are too.

The local engine takes its weights from disk here, as a server does (``accepts_state_dict`` off),
so the push goes through ``weights/vN`` without a vLLM.
"""

from __future__ import annotations

import errno
import json
import shutil

import pytest

from sdp_cli.engine.local import LocalEngine
from sdp_cli.errors import UserError
from sdp_cli.rollout.batch_file import read_batch
from sdp_cli.rundir import RunDir, parse_step_name, step_dirs, version_dirs

from ..fast_run import FAST, resume_run as resume, train_run

RUN = [
    *FAST,
    "train.steps=6",
    "train.checkpoint_every=3",
    "train.save_batches=true",
    "train.keep_version_checkpoints=true",
]


@pytest.fixture
def weights_through_disk(monkeypatch):
    monkeypatch.setattr(LocalEngine, "accepts_state_dict", False)


def crash_after_last_metrics(run: RunDir, *, keep_checkpoints: int) -> None:
    """Leave ``run`` as a kill -9 after its last step's metrics line leaves it: that step's
    checkpoint (and any later) not written, no summary, no final event."""
    for _, step_dir in step_dirs(run.checkpoints)[keep_checkpoints:]:
        shutil.rmtree(step_dir)
    run.summary.unlink()
    lines = run.events.read_text().splitlines(keepends=True)
    run.events.write_text("".join(line for line in lines if '"event": "finished"' not in line))


def batch_steps(run: RunDir) -> list[int]:
    # listed apart from rundir.saved_batches, which the resume removes by: an oracle of its own
    return sorted(parse_step_name(p.name.removesuffix(".safetensors")) for p in run.batches.glob("step-*"))


def test_a_resume_from_an_earlier_checkpoint_keeps_the_weights_it_pushes(tmp_path, weights_through_disk):
    run = RunDir(train_run(tmp_path, RUN))
    assert sorted(version_dirs(run.weights)) == [5, 6]  # the newest two of the first session
    crash_after_last_metrics(run, keep_checkpoints=1)  # step-000003 is the last checkpoint

    # the resume pushes v4 while the crashed session's v5 and v6 are still there
    resume(run.path, "train.steps=5")

    assert sorted(version_dirs(run.weights)) == [4, 5]
    # the crashed session's step 6 is gone with its batch and version checkpoint
    assert batch_steps(run) == [1, 2, 3, 4, 5]
    assert sorted(version_dirs(run.versions)) == [0, 1, 2, 3, 4, 5]
    # what is left is this run's: each batch was trained at the step its file is named for
    for step in batch_steps(run):
        assert read_batch(run.batch(step)).trainer_version == step - 1


def test_a_run_started_over_keeps_the_weights_it_pushes(tmp_path, weights_through_disk):
    run = RunDir(train_run(tmp_path, [*RUN, "train.steps=3"]))
    assert sorted(version_dirs(run.weights)) == [2, 3]
    crash_after_last_metrics(run, keep_checkpoints=0)  # killed before its first checkpoint

    resume(run.path, "train.steps=2")  # starts over: step 1 pushes v1 beside the old v2 and v3

    assert sorted(version_dirs(run.weights)) == [1, 2]
    assert batch_steps(run) == [1, 2]
    assert sorted(version_dirs(run.versions)) == [0, 1, 2]


def test_what_the_crashed_session_saved_past_the_checkpoint_is_removed_and_said(tmp_path, capsys):
    # the local engine as it is (weights pushed in memory): no weight directory, the batches and
    # version checkpoints of steps 4 to 6 are what is left past the checkpoint
    run = RunDir(train_run(tmp_path, RUN))
    crash_after_last_metrics(run, keep_checkpoints=1)
    torn = run.batches / ".step-000007.safetensors.k2x9.tmp"  # killed while it wrote step 7's batch
    torn.write_bytes(b"\0" * 64)
    capsys.readouterr()

    resume(run.path, "train.steps=4")

    assert not torn.exists()
    assert batch_steps(run) == [1, 2, 3, 4]
    assert sorted(version_dirs(run.versions)) == [0, 1, 2, 3, 4]
    gone = [*(f"batches/step-00000{s}.safetensors" for s in (4, 5, 6)), *(f"versions/v00000{v}" for v in (4, 5, 6))]
    assert (
        f"note: removed what an earlier session wrote past step 3, which this run goes on without: "
        f"{', '.join(gone[:4])} and 2 more"
    ) in capsys.readouterr().err.splitlines()
    resumed = [e for e in map(json.loads, run.events.read_text().splitlines()) if e["event"] == "resumed"]
    assert resumed[-1]["discarded"] == gone


def test_a_resume_after_a_stop_removes_nothing(tmp_path, capsys):
    run = RunDir(train_run(tmp_path, [*RUN, "train.steps=3"]))
    capsys.readouterr()

    resume(run.path, "train.steps=4")

    assert batch_steps(run) == [1, 2, 3, 4]
    assert sorted(version_dirs(run.versions)) == [0, 1, 2, 3, 4]
    assert "note: removed" not in capsys.readouterr().err
    resumed = [e for e in map(json.loads, run.events.read_text().splitlines()) if e["event"] == "resumed"]
    assert "discarded" not in resumed[-1]


@pytest.mark.parametrize(
    ("leftover", "remover", "why"),
    [
        (lambda run: run.batch(5), "unlink", "wrote past step 3"),
        (lambda run: run.weights_of(5), "rmtree", "wrote for its server to load"),
    ],
    ids=["batch", "weights"],
)
def test_a_leftover_that_cannot_be_removed_is_one_line(tmp_path, monkeypatch, weights_through_disk, leftover, remover, why):
    run = RunDir(train_run(tmp_path, RUN))
    crash_after_last_metrics(run, keep_checkpoints=1)
    stuck = leftover(run)
    owner = type(stuck) if remover == "unlink" else shutil
    remove = getattr(owner, remover)

    def refuse(path, *args, **kwargs):
        if path == stuck:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return remove(path, *args, **kwargs)

    monkeypatch.setattr(owner, remover, refuse)
    with pytest.raises(UserError) as caught:
        resume(run.path, "train.steps=4")
    assert str(caught.value) == (
        f"cannot remove {stuck}, which an earlier session {why} (Permission denied); make it writable, then resume again"
    )
    assert stuck.exists()
