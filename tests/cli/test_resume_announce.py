"""A resume announces itself (issue 24, item 12): one line naming the checkpoint and the step it
continues from, shown whether or not the progress display is on; the evaluation at the resume
is labelled with its step, never "initial evaluation". Real `sdp train` sessions in this
process through the console-script entry point."""

from __future__ import annotations

import pytest

from sdp_cli.train.session import display

from .run_main import run_main


def test_the_start_evaluation_is_initial_only_at_step_0():
    assert display.start_evaluation_title(0) == "initial evaluation"
    assert display.start_evaluation_title(4) == "evaluation at step 4 (resumed)"


@pytest.fixture
def two_step_run(tmp_path, monkeypatch, capsys):
    """A finished 2-step run with a checkpoint at step 2 (and the one line of its start)."""
    monkeypatch.setenv("SDP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    # in sdp's process: what is announced does not depend on where the engine runs, and the
    # three sessions would each start a rollout and an engine process (about 2 s apiece)
    argv = ["train", "+debug=fast", "engine.in_process=true", "train.steps=2", "train.checkpoint_every=2",
            "train.eval_samples=4", f"run.dir={run}"]  # fmt: skip
    code, _, err = run_main(argv, capsys)
    assert code == 0, err
    assert "resuming" not in err
    return run


def test_a_resume_names_the_checkpoint_and_step_and_labels_its_evaluation(two_step_run, capsys):
    run = two_step_run
    # +debug=fast turns the progress display off: the resume line is shown all the same
    code, _, err = run_main(["train", f"resume={run}", "train.steps=4"], capsys)
    assert code == 0, err
    lines = err.splitlines()
    announced = [line for line in lines if line.startswith("resuming")]
    assert announced == [f"resuming {run} from checkpoint step-000002 (step 2 of 4)"], err
    assert "initial evaluation" not in err

    code, _, err = run_main(["train", f"resume={run}", "train.steps=6", "run.progress=true"], capsys)
    assert code == 0, err
    lines = err.splitlines()
    assert lines[0] == f"resuming {run} from checkpoint step-000004 (step 4 of 6)", err
    assert sum(line.startswith("resuming") for line in lines) == 1
    assert "initial evaluation" not in err
    assert any(line.startswith("evaluation at step 4 (resumed) (greedy, held-out prompts): greedy accuracy ")
               for line in lines), err  # fmt: skip
    assert any(line.startswith("final evaluation (greedy, held-out prompts): ") for line in lines), err
