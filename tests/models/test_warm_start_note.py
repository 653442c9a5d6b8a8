"""``sdp train`` prints the accuracy the tiny model's warm start reached, and warns in one line
when it is already >= 0.9 (issue 24 item 7: a user's "count the vowels" task was solved by the
default warm start, greedy accuracy 1.00 before RL, so RL showed nothing)."""

import json

import pytest

from sdp_cli.cli.main import main
from sdp_cli.models.warm_start import SOLVED_ACCURACY, warm_start_note

from ..fast_run import FAST


def _train(tmp_path, monkeypatch, capsys, *extra):
    """stderr of a two-step ``sdp train`` on a data set whose every answer is "1": a task the
    warm start can solve outright."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SDP_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"w{i}=", "answer": "1"}) + "\n" for i in range(40)))
    argv = ["train", *FAST, "task=dataset", f"task.path={data}", "task.reward=final_number",
            "task.eval_fraction=0.2", "rollout.max_new_tokens=3", "train.steps=2", "model.warm_start_lr=3e-3",
            *extra]  # fmt: skip
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    return capsys.readouterr().err


def test_a_warm_start_that_solves_the_task_is_printed_and_warned_about(tmp_path, monkeypatch, capsys):
    # 60 steps at lr 3e-3 learn to answer "1" and stop: every validation problem right
    err = _train(tmp_path, monkeypatch, capsys, "model.warm_start_steps=60")
    lines = err.splitlines()
    # 32 training records; the validation set is all of them (at most 256)
    assert "warm start: greedy accuracy 1.00 on 32 validation problems (training problems)" in lines
    (warning,) = [line for line in lines if "RL has little to learn" in line]
    assert "model.warm_start_target" in warning and "model.warm_start_steps" in warning


def test_a_warm_start_below_the_bar_is_printed_without_a_warning(tmp_path, monkeypatch, capsys):
    # one SFT step cannot produce "1" then EOS from a random model
    err = _train(tmp_path, monkeypatch, capsys, "model.warm_start_steps=1")
    assert "warm start: greedy accuracy 0.00 on 32 validation problems (training problems)" in err.splitlines()
    assert "RL has little to learn" not in err


@pytest.mark.parametrize(("accuracy", "warned"), [(SOLVED_ACCURACY, True), (1.0, True), (0.89, False)])
def test_the_note_warns_from_the_bar_up(accuracy, warned):
    note = warm_start_note(accuracy, 100)
    assert note.count("\n") == int(warned)
    assert ("RL has little to learn" in note) == warned
