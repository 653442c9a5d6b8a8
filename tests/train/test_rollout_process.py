"""The rollout process end to end (docs/training.md "Three processes"): ``sdp train`` with its local
engine in its own process runs the rollout side in a third process, and a run there is the run
the in-process path makes — every step trained once, nothing lost or duplicated (ledger audit),
every token's behaviour logprob the one of the version it is tagged with — and sdp's end leaves
no process and no scratch directory behind; the process starts with the session and imports no
torch. (A failing reward in it, resumes: tests/cli/test_own_task.py, whose runs have three
processes too; kills of the engine's and of the rollout process, and signals:
tests/reliability/test_engine_process.py.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path


from ..reliability.harness import check_finished_run, metrics, sdp_env
from ..reliability.test_engine_faults_vllm import assert_tokens_carry_their_version
from ..reliability.test_engine_process import gone, rollout_pids, rollout_scratches, scratches


#: a fast run with the engine in its own process: three processes (README's default)
PROCESS = ["+debug=fast", "engine.in_process=false"]


def _train(run_dir: Path, cache: Path, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return _sdp(["train", *PROCESS, f"run.dir={run_dir}", *extra], cache, timeout)


def _sdp(args: list[str], cache: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sdp_cli", *args],
        env=sdp_env(cache),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_run_in_three_processes(tmp_path):
    """(Its resume in three processes: tests/cli/test_own_task.py, pasted resume commands; and
    after kills, tests/reliability/test_engine_process.py.)"""
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    segment_wise = [
        "+preset=segment_wise", "rollout.max_head_offpolicyness=3", "train.save_batches=true",
        "train.keep_version_checkpoints=true", "train.checkpoint_every=3",
    ]  # fmt: skip
    done = _train(run_dir, cache, *segment_wise, "train.steps=8")
    assert done.returncode == 0, done.stderr[-3000:]
    check_finished_run(run_dir, 8)
    assert assert_tokens_carry_their_version(run_dir) > 0
    rows = metrics(run_dir)
    # stale tokens got π_{v+1} from the rollout process's passes, as in sdp's own process
    assert sum(r.get("recompute/tokens", 0) for r in rows) > 0
    started = rollout_pids(run_dir)
    assert len(started) == 1 and gone(started[0]), "one rollout process per session, ended with it"
    used = scratches(run_dir)
    assert len(used) == 1 and not used[0].exists(), "the engine's scratch directory is removed"
    made = [scratch for _, scratch in rollout_scratches(run_dir)]
    assert made == used, "the engine ran on the rollout process's directory"
    # the engine's process that served is the one the rollout process started ahead, as the
    # command began (docs/training.md "Start-up"); its log says so from its first line
    ahead = re.findall(r"the engine's process (\d+) started ahead", (run_dir / "logs" / "rollout.log").read_text())
    served = re.findall(r"sdp local engine: pid (\d+),", (run_dir / "logs" / "local_engine.log").read_text())
    assert ahead == served and len(served) == 1, (ahead, served)
    # a resume, in three processes too, starts them ahead as well (its engine from its saved overrides)
    done = _sdp(["train", f"resume={run_dir}", "train.steps=10"], cache)
    assert done.returncode == 0, done.stderr[-3000:]
    check_finished_run(run_dir, 10)
    ahead = re.findall(r"the engine's process (\d+) started ahead", (run_dir / "logs" / "rollout.log").read_text())
    served = re.findall(r"sdp local engine: pid (\d+),", (run_dir / "logs" / "local_engine.log").read_text())
    assert ahead == served and len(served) == 2, (ahead, served)


def test_a_resume_starts_its_rollout_process_early_where_its_saved_overrides_say_so(tmp_path):
    """``early_start`` of a resume reads the run's saved overrides (nothing else of it, and no
    code): an engine in its own process starts the rollout process at once; an engine in
    sdp's process, a run with its own config directory, or overrides that are not what sdp
    writes leave it to setup (which reports what is wrong, under the run's lock)."""
    from sdp_cli.config.compose import compose_config
    from sdp_cli.train.session.rollout_process import RolloutProcessStart

    cases = {
        "three processes": (["+debug=fast"], None, True),
        "engine in sdp's process": (["+debug=fast", "engine.in_process=true"], None, False),
        "its own config directory": (["+debug=fast"], "config_source.json", False),
        "not a list of strings": ({"+debug": "fast"}, None, False),
        "no overrides file": (None, None, False),
    }
    for name, (saved, extra_file, starts) in cases.items():
        run_dir = tmp_path / name.replace(" ", "-").replace("'", "")
        run_dir.mkdir()
        if saved is not None:
            (run_dir / "overrides.json").write_text(json.dumps(saved))
        if extra_file is not None:
            (run_dir / extra_file).write_text("{}")
        cfg, _ = compose_config([f"resume={run_dir}", "run.progress=false"])
        start = RolloutProcessStart.early_start(cfg, {})
        try:
            assert (start is not None) == starts, name
        finally:
            if start is not None:
                start.cancel()
    assert RolloutProcessStart.early_start(compose_config(["+debug=fast"])[0], {"WORLD_SIZE": "2"}) is None


def test_a_hugging_face_models_rollout_process_imports_its_tokenizer_class_ahead(tmp_path):
    """A Hugging Face model's tokenizer is transformers' AutoTokenizer, whose import (about 2 s
    on a small CPU) the rollout process makes while it waits, not after its recipe; the tiny
    model's tokenizer is sdp's own, so its rollout process does not import transformers."""
    from sdp_cli.config.compose import compose_config
    from sdp_cli.train.session.rollout_process import RolloutProcessStart

    for model, asks in ((["model=hf", f"model.path={tmp_path}"], True), ([], False)):
        cfg, _ = compose_config(["+debug=fast", "engine.in_process=false", "run.progress=false", *model])
        start = RolloutProcessStart.early_start(cfg, {})
        try:
            # empty for a moment after Popen returns: the kernel closes the parent's pipe (exec
            # succeeded) before it has set the new program's arguments
            deadline = time.monotonic() + 30
            while not (argv := Path(f"/proc/{start._process.pid}/cmdline").read_bytes()) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert (b"--auto-tokenizer" in argv.split(b"\0")) == asks, argv
        finally:
            start.cancel()
    probe = (
        "import sys\n"
        "import sdp_cli.train.session.rollout_process as rp\n"
        "rp._import_the_rest(auto_tokenizer=True)\n"
        "print('transformers.models.auto.tokenization_auto' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-3000:]


def test_the_rollout_process_starts_without_torch(tmp_path):
    """Its imports, the default run's tokenizer loaded as the rollout process loads it, and the
    staging of a push leave torch and transformers' model code out (the engine computes in a
    process of its own): they are seconds of start-up, or of the first push, in every run. What
    sdp imports to start it, before its own imports (``early_start``), has no transformers."""
    from sdp_cli.models.tokenizer import build_tokenizer

    build_tokenizer("arith").save_pretrained(tmp_path)
    probe = (
        "import sys\n"
        "import sdp_cli.train.session.rollout_process as rp\n"
        "assert 'transformers' not in sys.modules, 'what starts the process imports transformers'\n"
        "rp._import_the_rest(auto_tokenizer=False)\n"
        "from sdp_cli.models.policy import PromptCodec\n"
        "from sdp_cli.models.tokenizer import load_tokenizer\n"
        f"codec = PromptCodec.of_tokenizer(load_tokenizer(rp.Path({str(tmp_path)!r})), 2)\n"
        "assert codec.decode_completion(codec.encode_prompt('12+7=')[1:]) == '12+7='\n"
        "from sdp_cli.engine.base import WeightUpdate\n"
        "from sdp_cli.engine.process import ProcessEngine\n"
        "pushed = WeightUpdate(version=1, path=rp.Path('v000001'))\n"  # a push, as the link hands it over
        "assert ProcessEngine.stage_weights(None, pushed) is pushed\n"
        "print(sorted(m for m in ('torch', 'transformers.configuration_utils', 'scipy') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"


def _children_of(parent: int) -> list[int]:
    """The rollout processes started by sdp process ``parent`` (their command line names it)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, NotADirectoryError, PermissionError, ProcessLookupError):
            continue
        if b"sdp_cli.train.session.rollout_process" in argv and str(parent).encode() in argv:
            found.append(int(entry.name))
    return found


def test_the_rollout_process_starts_with_the_command_and_an_abort_before_its_recipe_ends_it(tmp_path):
    """It starts as `sdp train` begins, before sdp's own imports and long before the run
    directory exists (its imports, and its engine's, run while sdp imports and loads the
    policy); two Ctrl-Cs while the warm start still trains (the first waits for the step
    boundary, the second aborts) end sdp, and the process, which never got its recipe, with it."""
    import signal

    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "sdp_cli", "train", *PROCESS, f"run.dir={run_dir}",
               "model.warm_start_steps=100000", "train.steps=2"]  # fmt: skip
    sdp = subprocess.Popen(command, env=sdp_env(tmp_path / "cache"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (started := _children_of(sdp.pid)) and time.monotonic() < deadline and sdp.poll() is None:
            time.sleep(0.05)
        assert len(started) == 1 and not run_dir.exists(), "the rollout process starts before the run directory"
        while not (run_dir / "config.yaml").exists() and time.monotonic() < deadline and sdp.poll() is None:
            time.sleep(0.1)
        time.sleep(1.0)  # the run has begun: its warm start is under way
        ((_, scratch),) = rollout_scratches(run_dir)  # the process's first line, in the run's log
        assert scratch.is_dir()
        sdp.send_signal(signal.SIGINT)
        time.sleep(0.5)
        sdp.send_signal(signal.SIGINT)
        _, err = sdp.communicate(timeout=60)
    finally:
        if sdp.poll() is None:
            sdp.kill()
    assert sdp.returncode == 130 and "Traceback" not in err.decode(), err.decode()[-3000:]
    assert "before training started" in err.decode(), err.decode()[-3000:]
    deadline = time.monotonic() + 10
    while not gone(started[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(started[0]), "the rollout process ended with the session"
    assert not scratch.exists(), "and removed the scratch directory it made"
    assert not run_dir.exists(), "a start that never trained leaves no run directory, its log included"
