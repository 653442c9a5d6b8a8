"""A stop that comes inside a training step: after its batch was taken, before it was counted.

The trainer may then hold the next step's weights and version while the loop is still at the
step before, and the batch is out of the rollout side's hands: a checkpoint written at that
stop would be a step it is not (its resume trains the step again, from the wrong weights, on
another batch). Such a stop writes no checkpoint; its ``stopped`` event and its line name the
last complete checkpoint as the resume point.

And every error a user can fix that ends the loop, wherever it comes from (your correction
mode raising or breaking its contract at a real batch, a run directory changed under the run),
ends it as a stop: a ``stopped`` event, one line, and how to resume; never a traceback, never
a line alone."""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path

import pytest

from ..cli.run_main import run_main
from .conftest import FAST


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line]


def _checkpoint_versions(run: Path) -> dict[int, int]:
    """step → the trainer version its checkpoint holds."""
    found = {}
    for state in sorted((run / "checkpoints").glob("step-*/state.json")):
        step = int(state.parent.name.removeprefix("step-"))
        found[step] = json.loads(state.read_text())["trainer"]["version"]
    return found


def _one_line(code, err: str) -> str:
    assert code == 2 and "Traceback" not in err, err
    return [line for line in err.splitlines() if line.strip()][-1]


# A mode that is decoupled's weight until it has seen its third real batch (the small-batch
# check before the run is one more `old`), then fails the way the test says.
_FAILS_AT_STEP_3 = """
from sdp_cli.modes import mode
import torch

SEEN = set()

@mode(needs=("proximal_logprobs",))
def weight(old, proximal, proximal_t, mask):
    SEEN.add(round(float(old.sum()), 4))
    if len(SEEN) > 3:
        {failure}
    return proximal - old
"""


@pytest.mark.parametrize(
    ("failure", "reason"),
    [
        ("raise ValueError('my bug')", r"\S*my_mode\.py:11: ValueError: my bug in loss\.mode=\S+my_mode\.py:weight; fix the function"),
        ("return (proximal - old) * float('nan')", r"loss\.mode=\S+my_mode\.py:weight returned nan at a valid token"),
    ],
    ids=["raises", "nan"],
)
def test_a_mode_of_yours_failing_during_training_stops_the_run_and_a_fixed_file_resumes_it(
    tmp_path, capsys, forget_user_modes, failure, reason
):
    mode_file = tmp_path / "my_mode.py"
    mode_file.write_text(_FAILS_AT_STEP_3.format(failure=failure))
    run = tmp_path / "run"
    code, _, err = run_main(
        ["train", *FAST, "train.steps=4", "train.checkpoint_every=1", f"run.dir={run}", f"loss.mode={mode_file}:weight"],
        capsys,
    )
    line = _one_line(code, err)

    assert re.search(rf"^error: training stopped at step 2: {reason}", line), line
    assert line.endswith(
        f"; resume with: sdp train resume={run} loss.mode={mode_file}:weight (from step 2, the last complete checkpoint)"
    ), line
    stopped = _events(run)[-1]
    assert stopped["event"] == "stopped" and stopped["step"] == 2 and stopped["checkpoint"] is None, stopped
    assert stopped["resume_step"] == 2
    if failure.startswith("raise"):  # your code's own traceback, for you
        assert "my_mode.py" in stopped["traceback"] and "ValueError: my bug" in stopped["traceback"]
    assert _checkpoint_versions(run) == {1: 1, 2: 2}
    # fixed, the file is loaded afresh by the resume, which trains the run to its end
    mode_file.write_text(_FAILS_AT_STEP_3.format(failure="pass"))
    code, _, err = run_main(["train", f"resume={run}", f"loss.mode={mode_file}:weight"], capsys)
    assert code == 0, err
    versions = _checkpoint_versions(run)  # (the last train.keep_checkpoints of them)
    assert max(versions) == 4 and all(version == step for step, version in versions.items()), versions


def test_a_failed_write_after_the_trainers_update_writes_no_checkpoint_of_a_step_it_is_not(tmp_path, capsys, monkeypatch):
    # The weights of version 4 cannot be written (a full disk): the trainer holds version 4, the
    # loop is at step 3. Before, the stop checkpointed "step 3" with version 4's weights.
    from sdp_cli.errors import WriteFailed
    from sdp_cli.train.session.run import TrainingRun

    real = TrainingRun._weight_update

    def full_at_version_4(self, version):
        if version == 4:
            cause = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "weights"))
            raise WriteFailed(f"cannot write {tmp_path / 'weights'}: No space left on device (free space there)", cause)
        return real(self, version)

    monkeypatch.setattr(TrainingRun, "_weight_update", full_at_version_4)
    run = tmp_path / "run"
    code, _, err = run_main(["train", *FAST, "train.steps=4", "train.checkpoint_every=2", f"run.dir={run}"], capsys)
    line = _one_line(code, err)
    assert line.startswith("error: training stopped at step 3: cannot write"), line
    assert line.endswith("(from step 2, the last complete checkpoint)"), line
    assert _checkpoint_versions(run) == {2: 2}
    stopped = _events(run)[-1]
    assert stopped["event"] == "stopped" and stopped["checkpoint"] is None and stopped["resume_step"] == 2, stopped

    monkeypatch.setattr(TrainingRun, "_weight_update", real)
    code, _, err = run_main(["train", f"resume={run}"], capsys)
    assert code == 0, err
    assert _checkpoint_versions(run) == {2: 2, 4: 4}


def test_a_stop_inside_the_first_step_of_a_run_without_checkpoints_says_it_starts_over(tmp_path, capsys, monkeypatch):
    from sdp_cli.errors import WriteFailed
    from sdp_cli.train.session.run import TrainingRun

    def full(self, version):
        cause = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "weights"))
        raise WriteFailed(f"cannot write {tmp_path / 'weights'}: No space left on device (free space there)", cause)

    monkeypatch.setattr(TrainingRun, "_weight_update", full)
    run = tmp_path / "run"
    code, _, err = run_main(["train", *FAST, "train.steps=2", f"run.dir={run}"], capsys)
    line = _one_line(code, err)
    assert line.endswith(f"; resume with: sdp train resume={run} (it starts over: no checkpoint yet)"), line
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


def test_an_error_you_can_fix_after_a_step_was_counted_stops_the_run_with_a_checkpoint_of_that_step(
    tmp_path, capsys, monkeypatch
):
    # any UserError once the step is whole (here, in saving its batch) ends the run as a stop
    from sdp_cli.errors import UserError
    from sdp_cli.train.session.run import TrainingRun

    real = TrainingRun._save_batch

    def refused_at_step_2(self, record):
        if record.step == 2:
            raise UserError("the batch of step 2 is refused; fix it")
        return real(self, record)

    monkeypatch.setattr(TrainingRun, "_save_batch", refused_at_step_2)
    run = tmp_path / "run"
    code, _, err = run_main(["train", *FAST, "train.steps=4", "train.save_batches=true", f"run.dir={run}"], capsys)
    line = _one_line(code, err)
    assert line == f"error: training stopped at step 2: the batch of step 2 is refused; fix it; resume with: sdp train resume={run}", line
    assert _checkpoint_versions(run) == {2: 2}
    stopped = _events(run)[-1]
    assert stopped["event"] == "stopped" and stopped["checkpoint"].endswith("step-000002"), stopped


def test_a_full_disk_between_the_two_optimizer_steps_of_a_step_writes_no_half_trained_checkpoint(tmp_path):
    # The test-only fault (sdp_cli/faults.py) after the 7th optimizer step: step 4's first of its
    # two minibatch updates is applied, the loop is at step 3. Before, the stop checkpointed
    # "step 3" holding those half-trained weights.
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "SDP_TEST_FAULTS": "enospc:trainer.optimizer_step@7"}
    run = tmp_path / "run"
    args = [*FAST, "train.steps=4", "train.checkpoint_every=2", "optim.minibatches=2", f"run.dir={run}"]
    done = subprocess.run(
        [sys.executable, "-m", "sdp_cli", "train", *args], capture_output=True, text=True, env=env, timeout=300
    )
    line = _one_line(done.returncode, done.stderr)
    assert line.startswith("error: training stopped at step 3: No space left on device"), line
    assert line.endswith("(from step 2, the last complete checkpoint)"), line
    assert _checkpoint_versions(run) == {2: 2}
    env.pop("SDP_TEST_FAULTS")
    done = subprocess.run(
        [sys.executable, "-m", "sdp_cli", "train", f"resume={run}"], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert _checkpoint_versions(run) == {2: 2, 4: 4}


@pytest.mark.parametrize("where", ["start", "final"])
def test_a_reward_failing_in_the_start_or_final_evaluation_ends_the_session_as_a_stop(tmp_path, capsys, monkeypatch, where):
    # Outside the loop, before: the line alone, no stopped event (the next resume then recorded
    # a crash), and after the final evaluation no resume line although the run needs one to finish.
    from sdp_cli.tasks.plugins import reward_failure
    from sdp_cli.train.session.run import TrainingRun

    real = TrainingRun._evaluate
    failing_step = 0 if where == "start" else 2

    def failing(self, step, progress=None):
        if step == failing_step:
            try:
                raise RuntimeError("reward broke")
            except RuntimeError as err:
                raise reward_failure("rw.py:fn", "record 3 (data.jsonl:4)", err) from None
        return real(self, step, progress)

    monkeypatch.setattr(TrainingRun, "_evaluate", failing)
    run = tmp_path / "run"
    code, _, err = run_main(["train", *FAST, "train.steps=2", "train.eval_samples=4", f"run.dir={run}"], capsys)
    line = _one_line(code, err)
    reason = "reward function rw.py:fn failed on record 3 (data.jsonl:4): RuntimeError: reward broke"
    if where == "start":  # nothing to resume from: the command starts the run over, and says so
        assert line == (
            f"error: training stopped at step 0: {reason}; resume with: sdp train resume={run} "
            "(it starts over: no checkpoint yet)"
        ), line
    else:
        assert line == f"error: training stopped at step 2: {reason}; resume with: sdp train resume={run}", line
    stopped = _events(run)[-1]
    assert stopped["event"] == "stopped" and stopped["step"] == failing_step, stopped
    assert "RuntimeError: reward broke" in stopped["traceback"]
    if where == "final":
        assert stopped["checkpoint"].endswith("step-000002")
    monkeypatch.setattr(TrainingRun, "_evaluate", real)
    code, _, err = run_main(["train", f"resume={run}"], capsys)
    assert code == 0, err
    names = [e["event"] for e in _events(run)]
    assert names[-1] == "finished" and "crashed" not in names, names


def test_a_resume_whose_setup_fails_once_accepted_records_a_stop_not_a_crash(tmp_path, capsys, monkeypatch):
    # A resume accepted (its checks passed, the model loaded: it may write) whose setup then
    # fails in one line (here a tracker that cannot start) ended with no event of its own: the
    # next resume recorded it as a crash.
    from sdp_cli.errors import UserError
    from sdp_cli.train.session import run as run_module

    run = tmp_path / "run"
    code, _, err = run_main(["train", *FAST, "train.steps=2", "train.checkpoint_every=2", f"run.dir={run}"], capsys)
    assert code == 0, err

    def cannot_start(*args, **kwargs):
        raise UserError("run.trackers: wandb could not start (no API key); log in with `wandb login`")

    monkeypatch.setattr(run_module, "open_trackers", cannot_start)
    code, _, err = run_main(["train", f"resume={run}", "train.steps=4"], capsys)
    assert _one_line(code, err) == "error: run.trackers: wandb could not start (no API key); log in with `wandb login`"
    stopped = _events(run)[-1]
    assert stopped["event"] == "stopped" and stopped["step"] == 2 and stopped["checkpoint"] is None, stopped
    assert stopped["reason"].startswith("run.trackers: wandb could not start")
    monkeypatch.undo()
    code, _, err = run_main(["train", f"resume={run}", "train.steps=4"], capsys)
    assert code == 0, err
    names = [e["event"] for e in _events(run)]
    assert "crashed" not in names and names[-1] == "finished", names


def test_a_resume_aborted_by_a_second_ctrl_c_while_its_engine_starts_records_the_abort(tmp_path, capsys, monkeypatch):
    # the second Ctrl-C's Abort, raised where the engine starts (after the resume was accepted):
    # its aborted event was written into logs already closed, so none was recorded
    import signal

    from sdp_cli.stopsignals import Abort
    from sdp_cli.train.session.run import TrainingRun

    run = tmp_path / "run"
    code, _, err = run_main(["train", *FAST, "train.steps=2", "train.checkpoint_every=2", f"run.dir={run}"], capsys)
    assert code == 0, err

    def aborted(*args, **kwargs):
        raise Abort(signal.SIGINT)

    monkeypatch.setattr(TrainingRun, "_start_rollout", aborted)
    code, _, err = run_main(["train", f"resume={run}", "train.steps=4"], capsys)
    assert code == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("aborted at step 2 (second SIGINT); resume with:"), err
    last = _events(run)[-1]
    assert last["event"] == "aborted" and last["step"] == 2 and last["resume_step"] == 2, last


def test_a_stop_whose_first_checkpoint_cannot_be_written_says_the_run_starts_over(tmp_path, capsys, monkeypatch):
    # The first checkpoint (step 1) fails to write, and the one the stop tries fails alike: there
    # is no checkpoint to go on from. The line said "(from step 0)", a checkpoint that does not
    # exist; the resume starts the run over, and the line must say so.
    from sdp_cli.train.session.run import TrainingRun

    def full_disk(self, step):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.run_dir.checkpoints))

    monkeypatch.setattr(TrainingRun, "checkpoint", full_disk)
    run = tmp_path / "run"
    code, _, err = run_main(["train", *FAST, "train.steps=2", "train.checkpoint_every=1", f"run.dir={run}"], capsys)
    line = _one_line(code, err)
    assert line.startswith("error: training stopped at step 1: cannot write"), line
    assert line.endswith(
        f"its checkpoint could not be written for the same reason; resume with: sdp train resume={run} "
        "(it starts over: no checkpoint yet)"
    ), line
    monkeypatch.undo()
    code, _, err = run_main(["train", f"resume={run}"], capsys)
    assert code == 0, err
    assert _checkpoint_versions(run) == {1: 1, 2: 2}


def test_a_signal_before_the_first_step_says_the_run_starts_over(tmp_path, capsys, monkeypatch):
    # A Ctrl-C during the start's evaluation stops the run at step 0, with no checkpoint (there is
    # nothing trained to keep): the line's resume command starts it over, and it must say so.
    import signal

    from sdp_cli.train.session.run import TrainingRun

    real = TrainingRun._evaluate

    def interrupted(self, step, progress=None):
        result = real(self, step, progress)
        if step == 0:
            self.stop_request(signal.SIGINT)
        return result

    monkeypatch.setattr(TrainingRun, "_evaluate", interrupted)
    run = tmp_path / "run"
    code, _, err = run_main(["train", *FAST, "train.steps=2", "train.eval_samples=4", f"run.dir={run}"], capsys)
    assert code == 130 and "Traceback" not in err, err
    line = [line for line in err.splitlines() if line.strip()][-1]
    assert line == (
        f"stopped at step 0 (SIGINT); resume with: sdp train resume={run} (it starts over: no checkpoint yet)"
    ), line
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
    monkeypatch.undo()
    code, _, err = run_main(["train", f"resume={run}"], capsys)
    assert code == 0, err
    assert _checkpoint_versions(run) == {2: 2}
