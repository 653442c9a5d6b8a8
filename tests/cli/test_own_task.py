"""`sdp train` with the user's own data, reward and config files (issue 14): --config-dir,
--config-name, --show-prompts, --print-config, and bad files refused in one line naming
file:line (or the key) before anything is written."""

import json
import shutil
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from sdp_cli.config.schema import SdpConfig

from ..fast_run import printed_command
from .run_main import run_main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_task"


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A copy of examples/own_task as the working directory (its paths are relative to it)."""
    work = tmp_path / "work"
    shutil.copytree(EXAMPLE, work)
    monkeypatch.chdir(work)
    return work


def _replace_line(path: Path, number: int, text: str) -> None:
    lines = path.read_text().splitlines()
    lines[number - 1] = text
    path.write_text("\n".join(lines) + "\n")


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


def _refused(argv, capsys, root: Path) -> str:
    """Run `sdp ARGV`, expect exit 2, one stderr line and no file written under ``root``."""
    before = _tree(root)
    code, out, err = run_main(argv, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert _tree(root) == before, "something was written"
    return lines[0]


def test_config_dir_options_become_group_options(workdir, capsys):
    code, out, _ = run_main(["train", "--config-dir", "conf", "task=larger", "+preset=quick", "--print-config"], capsys)
    assert code == 0
    config = yaml.safe_load(out)  # the prompt preview is YAML comments: the output stays YAML
    assert config["task"]["name"] == "dataset" and config["task"]["reward"] == "reward.py:larger"
    assert config["loss"]["mode"] == "segment_wise"  # +preset=quick builds on sdp's segment_wise preset
    assert config["model"]["hidden_size"] == 64
    assert "#   max(" in out and out.rstrip().endswith("=")  # the rendered first prompt, e.g. max(74,18)=


def test_config_name_picks_a_primary_config(workdir, capsys):
    (workdir / "conf" / "experiment.yaml").write_text(
        "defaults:\n  - config\n  - override task: larger\n  - _self_\ntrain:\n  steps: 7\n"
    )
    code, out, _ = run_main(["train", "--config-dir", "conf", "--config-name", "experiment", "--print-config"], capsys)
    assert code == 0
    config = yaml.safe_load(out)
    assert (config["task"]["path"], config["train"]["steps"]) == ("data.jsonl", 7)


def test_show_prompts_prints_the_exact_prompts_and_writes_nothing(workdir, capsys):
    before = _tree(workdir)
    code, out, _ = run_main(["train", "--config-dir", "conf", "task=larger", "--show-prompts", "3"], capsys)
    assert code == 0 and _tree(workdir) == before
    blocks = out.split("--- prompt ")[1:]
    assert len(blocks) == 3
    for block in blocks:
        header, text = block.split("\n", 1)
        # max(a,b)= with two-digit a, b is 11 characters; the character tokenizer adds <s>: 12 tokens
        assert header.startswith("0 (12 tokens") or "(12 tokens" in header
        assert text.strip().startswith("<s>max(") and text.strip().endswith(")=")
    assert out.startswith("task dataset: 180 training prompts from data.jsonl; 20 held out for evaluation")


@pytest.mark.parametrize(
    ("setup", "argv", "fragment"),
    [
        # config files
        (lambda w: (w / "conf/task/bad.yaml").write_text("name: dataset\npath: [unclosed\n"),
         ["task=bad"], "conf/task/bad.yaml:3: not valid YAML (expected ',' or ']', but got '<stream end>', "
                       "while parsing a flow sequence at line 2)"),
        (lambda w: (w / "conf/task/bad.yaml").write_text("name: dataset\npth: data.jsonl\n"),
         ["task=bad"], "conf/task/bad.yaml:2: unknown config key 'task.pth'; the nearest valid key is task.path"),
        (lambda w: (w / "conf/preset/bad.yaml").write_text("train:\n  steps: 3\n"),
         ["+preset=bad"], "add '# @package _global_' as its first line"),
        (lambda w: (w / "conf/preset/bad.yaml").write_text("# @package _global_\ntrain:\n  stpes: 3\n"),
         ["+preset=bad"], "conf/preset/bad.yaml:3: unknown config key 'train.stpes'; the nearest valid key is train.steps"),
        (lambda w: (w / "conf/preset/bad.yaml").write_text("# @package _global_\ntrain:\n  steps: many\n"),
         ["+preset=bad"], "conf/preset/bad.yaml:3: train.steps"),
        (lambda w: (w / "conf/task/arith1.yaml").write_text("name: arith1\n"),
         ["task=larger"], "has the name of sdp's task=arith1"),
        (lambda w: None, ["task=nope"], "task=nope: no such option; choose one of arith1, arith2, dataset, gsm8k, larger"),
        # data files
        (lambda w: (w / "data.jsonl").write_text('{"a": 1, "b": 2, "answer": "2"}\n{"a": 3,\n'),
         ["task=larger"], "data.jsonl:2: not valid JSON"),
        (lambda w: (w / "data.jsonl").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00"),
         ["task=larger"], "data.jsonl is a binary file"),
        (lambda w: _replace_line(w / "data.jsonl", 3, '{"a": 1, "answer": "2"}'),
         ["task=larger"], "data.jsonl:3: task.prompt_template uses {b}, which the record does not have"),
        (lambda w: _replace_line(w / "data.jsonl", 5, '{"a": 1, "b": 2}'),
         ["task=larger"], "data.jsonl:5: no field 'answer' (task.answer_key), which the tiny model's warm start"),
        (lambda w: None, ["task=larger", "task.path=missing.jsonl"], "task.path=missing.jsonl: no such file"),
        # reward files
        (lambda w: (w / "reward.py").write_text("def larger(prompt, completion, record):\n    return (\n"),
         ["task=larger"], "reward.py:2: SyntaxError"),
        (lambda w: (w / "reward.py").write_text("import numpy_not_installed_here\n"),
         ["task=larger"], "reward.py:1: ModuleNotFoundError"),
        (lambda w: (w / "reward.py").write_text("def largest(prompt, completion, record):\n    return 0\n"),
         ["task=larger"], "reward.py has no function 'larger'; did you mean largest?"),
        (lambda w: None, ["task=larger", "+task.reward_kwargs.x=1"],
         "cannot be called as fn(prompt, completion, record, x=...)"),
        (lambda w: None, ["task=larger", "task.reward_kwargs.x=1"],
         "task.reward_kwargs is a mapping; add a new key with '+': +task.reward_kwargs.x=..."),
    ],
)  # fmt: skip
def test_bad_config_data_and_reward_files_are_one_line_and_write_nothing(workdir, capsys, setup, argv, fragment):
    setup(workdir)
    line = _refused(["train", "--config-dir", "conf", *argv], capsys, workdir)
    assert fragment in line, line


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--config-dir", "nowhere"], "--config-dir nowhere: no such directory"),
        (["--config-name", "experiment"], "--config-name experiment needs --config-dir DIR"),
        (["--config-dir", "conf", "--config-name", "nope"], "no primary configs" if False else "--config-name nope: no "),
        (["--show-prompts", "0"], "Invalid value for '--show-prompts'"),
    ],
)
def test_bad_config_options_are_one_line(workdir, capsys, argv, fragment):
    assert fragment in _refused(["train", *argv], capsys, workdir)


def test_a_primary_config_without_sdps_is_refused(workdir, capsys):
    (workdir / "conf" / "alone.yaml").write_text("train:\n  steps: 3\n")
    line = _refused(["train", "--config-dir", "conf", "--config-name", "alone"], capsys, workdir)
    assert "alone.yaml does not build on sdp's config; make its first defaults entry `- config`" in line


def test_a_failing_reward_stops_in_one_line_and_debug_prints_its_traceback(workdir, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SDP_CACHE_DIR", str(tmp_path / "cache"))
    (workdir / "reward.py").write_text(
        "def larger(prompt, completion, record):\n    return int(record['answer']) / 0\n"
    )
    argv = ["train", "--config-dir", "conf", "task=larger", "+preset=quick", "model.warm_start_steps=0",
            "train.eval_samples=0", "run.progress=false", "run.tensorboard=false"]  # fmt: skip
    code, _, err = run_main([*argv, f"run.dir={tmp_path / 'a'}"], capsys)
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("task ")]
    assert code == 2 and len(lines) == 1, err
    assert "reward function reward.py:larger failed on record " in lines[0]
    assert "(data.jsonl:" in lines[0] and "ZeroDivisionError: division by zero" in lines[0]
    events = [json.loads(line) for line in (tmp_path / "a" / "events.jsonl").read_text().splitlines()]
    assert "return int(record['answer']) / 0" in events[-1]["traceback"]

    code, _, err = run_main([*argv, f"run.dir={tmp_path / 'b'}", "run.debug=true"], capsys)
    assert code == 2
    assert "Traceback (most recent call last)" in err and "return int(record['answer']) / 0" in err
    assert err.strip().splitlines()[-1].startswith("error: training stopped at step ")
    assert "rewarding.py" not in err  # the user's traceback, not sdp's machinery


def test_ablate_takes_the_same_config_options(workdir, tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "SDP_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(EXAMPLE.parents[1]), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    argv = ["ablate", "smoke", "--config-dir", "conf", "--dir", str(tmp_path / "sweep"), "hydra/launcher=basic",
            "task=larger", "+preset=segment_wise", "rollout.max_head_offpolicyness=0", "seed=0,1",
            "rollout.max_new_tokens=4", "--no-plots", "--no-study"]  # one mode: no study contrast to register; fmt: skip
    done = subprocess.run([sys.executable, "-m", "sdp_cli", *argv], env=env, cwd=workdir,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    runs = sorted((tmp_path / "sweep" / "runs").iterdir())
    assert [r.name for r in runs] == ["segment_wise-eta0-rollout.max_new_tokens@4-task@larger-seed0",
                                      "segment_wise-eta0-rollout.max_new_tokens@4-task@larger-seed1"]  # fmt: skip
    for run in runs:
        config = yaml.safe_load((run / "config.yaml").read_text())
        assert (config["task"]["name"], config["task"]["reward"]) == ("dataset", "reward.py:larger")
        assert json.loads((run / "config_source.json").read_text())["config_dir"] == str(workdir / "conf")
        assert (run / "summary.json").is_file()
    assert json.loads((tmp_path / "sweep" / "ablate.json").read_text())["config_dir"] == str(workdir / "conf")


def test_resume_composes_with_the_config_dir_the_run_started_with(workdir, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SDP_CACHE_DIR", str(tmp_path / "cache"))
    run = tmp_path / "run"
    argv = ["train", "--config-dir", "conf", "task=larger", "+preset=quick", "model.warm_start_steps=0",
            "train.eval_samples=0", "train.steps=2", "run.progress=false", "run.tensorboard=false", f"run.dir={run}"]  # fmt: skip
    assert run_main(argv, capsys)[0] == 0
    assert json.loads((run / "config_source.json").read_text()) == {"config_dir": str(workdir / "conf"), "config_name": "config"}
    # task=larger exists only in conf/: the resume finds it through config_source.json; its
    # reward function is a program, which a resume takes only from the command line
    line = _refused(["train", f"resume={run}", "train.steps=3"], capsys, workdir)
    assert "its saved config sets task.reward=reward.py:larger, which sdp would run" in line
    code, _, err = run_main(["train", f"resume={run}", "train.steps=3", "task.reward=reward.py:larger"], capsys)
    assert code == 0, err
    assert json.loads((run / "summary.json").read_text())["steps"] == 3
    (workdir / "other").mkdir()
    line = _refused(["train", "--config-dir", "other", f"resume={run}"], capsys, workdir)
    assert "resume it without --config-dir/--config-name (its own are used)" in line


def test_a_new_group_of_the_config_dir_is_added_with_plus(workdir, capsys):
    # (sdp ships a debug group with fast.yaml: a group sdp does not have is the user's own)
    (workdir / "conf" / "trial").mkdir()
    (workdir / "conf" / "trial" / "short.yaml").write_text("# @package _global_\ntrain:\n  steps: 2\n  eval_samples: 0\n")
    code, out, err = run_main(["train", "--config-dir", "conf", "+trial=short", "--print-config"], capsys)
    assert code == 0, err
    config = yaml.safe_load(out)
    assert (config["train"]["steps"], config["train"]["eval_samples"]) == (2, 0)
    assert "trial" not in config


# ------------------------------------------------- the resume commands sdp prints (issue 24 item 6)
QUICK = ["--config-dir", "conf", "task=larger", "+preset=quick", "model.warm_start_steps=0", "train.eval_samples=0",
         "run.progress=false", "run.tensorboard=false"]  # fmt: skip


def _sdp_env(tmp_path) -> dict[str, str]:
    import os

    return {**os.environ, "SDP_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(EXAMPLE.parents[1]), os.environ.get("PYTHONPATH", "")])}  # fmt: skip


def _pasted(line: str, marker: str) -> list[str]:
    """The command a line prints after ``marker``, split as a shell would, as `python -m sdp_cli`."""
    import sys

    return [sys.executable, "-m", "sdp_cli", *printed_command(line, marker)[1:]]


def test_the_resume_command_printed_at_ctrl_c_pasted_verbatim_finishes_the_run(workdir, tmp_path):
    import signal
    import subprocess
    import time

    run, env = tmp_path / "run", _sdp_env(tmp_path)
    proc = subprocess.Popen([*_pasted("x: sdp train", "x: "), *QUICK, "train.steps=8", f"run.dir={run}"],
                            cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    last = err.strip().splitlines()[-1]
    # before: "resume with: sdp train resume=RUN", which the resume refused ("its saved config
    # sets task.reward=reward.py:larger, ... pass task.reward=... again")
    assert last.endswith(f"resume with: sdp train resume={run} task.reward=reward.py:larger"), last
    done = subprocess.run(_pasted(last, "resume with: "), cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["steps"] == 8
    # the done line says how to train further, and that command works as printed too
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("done: ")]
    more = _pasted(line, "train further with: ")
    assert more[4:] == [f"resume={run}", "task.reward=reward.py:larger", "train.steps=16"], line
    again = subprocess.run(more, cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["steps"] == 16


def test_the_resume_command_of_a_stop_by_error_pasted_verbatim_finishes_the_run(workdir, capsys, tmp_path, monkeypatch):
    import shlex

    monkeypatch.setenv("SDP_CACHE_DIR", str(tmp_path / "cache"))
    run = tmp_path / "run with space"
    reward = (workdir / "reward.py").read_text()
    # the judge fails once the run has logged a step, so the run stops with a checkpoint
    metrics = run / "metrics.jsonl"
    (workdir / "reward.py").write_text(
        f"{reward}\n\nimport os\n\n\ndef flaky(prompt, completion, record):\n"
        f"    if os.path.exists({str(metrics)!r}) and os.path.getsize({str(metrics)!r}):\n"
        "        raise ConnectionError('judge went away')\n"
        "    return larger(prompt, completion, record)\n"
    )
    code, _, err = run_main(["train", *QUICK, "task.reward=reward.py:flaky", "train.steps=6", f"run.dir={run}"], capsys)
    assert code == 2, err
    line = err.strip().splitlines()[-1]
    assert "ConnectionError: judge went away" in line
    # the path is quoted for the shell and for Hydra: one argument, taken as a string
    assert line.endswith(f"; resume with: sdp train {shlex.quote(f'resume={run}')} task.reward=reward.py:flaky"), line
    (workdir / "reward.py").write_text(reward + "\n\ndef flaky(prompt, completion, record):\n"
                                                "    return larger(prompt, completion, record)\n")  # fmt: skip
    code, out, err = run_main(printed_command(line)[1:], capsys)
    assert code == 0, err
    assert json.loads((run / "summary.json").read_text())["steps"] == 6


_VALUES = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1),
    st.from_regex(r"[A-Za-z0-9_./:@+~%, '-]{1,24}", fullmatch=True),  # paths and module:function specs
)


@settings(max_examples=500, deadline=None)
@given(value=_VALUES)
def test_a_printed_override_reads_back_as_the_value_through_the_shell_and_hydra(value):
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from sdp_cli.train.session.session_end import resume_command

    # a resume command for a run directory named `value`: one shell word per override, whose
    # value Hydra reads back as exactly the directory's name (a string, also for "0", "true" or "a,b")
    run_dir = Path(value)
    words = shlex.split(resume_command(run_dir, SdpConfig()))
    assert words[:2] == ["sdp", "train"] and len(words) == 3, words
    assert OverridesParser.create().parse_override(words[2]).value() == str(run_dir)


def _long_records(data: Path, lines: list[int]) -> None:
    """Records at ``lines`` get a 20,000-digit ``a``: a prompt far over the tiny model's context."""
    for number in lines:
        _replace_line(data, number, json.dumps({"a": "9" * 20000, "b": number, "answer": "9" * 20000}))


def test_prompts_longer_than_the_context_are_dropped_counted_and_the_run_finishes(workdir, capsys, tmp_path, monkeypatch):
    # issue 24: before, such prompts made the tiny model's warm start run for over ten minutes
    monkeypatch.setenv("SDP_CACHE_DIR", str(tmp_path / "cache"))
    _long_records(workdir / "data.jsonl", [3, 50, 120])
    argv = ["train", "--config-dir", "conf", "task=larger", "+preset=quick", "model.warm_start_steps=5",
            "train.steps=2", "train.eval_samples=0", "run.progress=false", "run.tensorboard=false",
            f"run.dir={tmp_path / 'run'}"]  # fmt: skip
    code, _, err = run_main(argv, capsys)
    assert code == 0, err
    (line,) = [line for line in err.splitlines() if line.startswith("task dataset:")]
    # the three long records fall in the training or the held-out split (eval_fraction 0.1)
    assert "training and" in line and "held-out prompts dropped" in line
    assert "the 1020 tokens the model's context (1024) leaves beside rollout.max_new_tokens=4" in line
    dropped = [int(w) for w in line.split("dropped")[0].split(";")[-1].split() if w.isdigit()]
    assert sum(dropped) == 3


def test_every_prompt_longer_than_the_context_refuses_in_one_line_and_writes_nothing(workdir, capsys):
    data = workdir / "data.jsonl"
    _long_records(data, list(range(1, len(data.read_text().splitlines()) + 1)))
    line = _refused(["train", "--config-dir", "conf", "task=larger", "+preset=quick"], capsys, workdir)
    assert "every training prompt in data.jsonl is longer than the 1020 tokens the model's context (1024)" in line
    assert "lower rollout.max_new_tokens" in line
