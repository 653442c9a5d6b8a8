"""Hostile config input (issue 24, items 22–24): YAML bombs, huge scalars, cycles, overrides
that parse in quadratic time, interpolations that double, and absurd counts.

Each case runs `sdp` in-process through the console-script entry point (as
``test_hostile_input.py`` does) and must end in one ``error: ...`` line, a non-zero exit,
nothing written, and within ``DEADLINE_S`` (unguarded, the 320-byte alias bomb took 146 s
and 785 MB, a 50 MB scalar minutes). The cases count as hostile inputs in the reliability
report. The limits are those of docs/reliability.md, "Config input limits".
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from sdp_cli.cli.main import main
from sdp_cli.config import limits, validation

from . import report
from .harness import error_line

pytestmark = pytest.mark.reliability

#: seconds a refusal may take (the machine is shared; the hangs it guards against take minutes)
DEADLINE_S = 30.0

#: 9 levels of 9 aliases: 9^9 ≈ 3.9·10^8 nodes expanded from ~330 bytes
ALIAS_BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{','.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8)
)
GLOBAL = "# @package _global_\n"


def _conf(tmp: Path, files: dict[str, str | bytes]) -> Path:
    """A --config-dir holding ``files`` (relative path → text or bytes)."""
    root = tmp / "conf"
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return root


def _fifo_conf(tmp: Path) -> Path:
    root = tmp / "conf"
    (root / "task").mkdir(parents=True)
    os.mkfifo(root / "task" / "pipe.yaml")
    return root


def _started_run(tmp: Path, overrides: list[str], source: dict | None = None) -> Path:
    """A run directory killed before its first checkpoint (a resume starts it over); its lock
    file stays, as a killed session leaves it."""
    run = tmp / "oldrun"
    run.mkdir()
    (run / ".lock").write_text("4242\n")
    (run / "overrides.json").write_text(json.dumps(overrides))
    (run / "events.jsonl").write_text('{"event": "started", "time": 0}\n')
    if source is not None:
        (run / "config_source.json").write_text(json.dumps(source))
    return run


def _sweep_with_a_bombed_run(tmp: Path) -> Path:
    run = tmp / "sweep" / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "overrides.json").write_text(json.dumps(["loss.mode=decoupled"]))
    (run / "config.yaml").write_text(ALIAS_BOMB)
    return tmp / "sweep"


def _doubling(keys: list[str]) -> list[str]:
    return ["run.root=abcdefgh"] + [f"{key}=${{{prev}}}${{{prev}}}" for prev, key in zip(keys, keys[1:])]


STRING_KEYS = ["run.root", "run.project", "run.name", "task.system_prompt", "task.prompt_template",
               "task.reward", "task.eval_path", "task.answer_key", "task.prompt_key", "engine.host",
               "engine.python", "model.path", "model.charset", "task.path", "engine.reload_method"]  # fmt: skip
CPUS = validation.machine_cpus()

# (name, builder(tmp) -> argv, fragment of the one error line)
HOSTILE_CONFIGS = [
    ("config dir: alias bomb in a task file",
     lambda t: ["train", "--config-dir", _conf(t, {"task/bomb.yaml": GLOBAL + ALIAS_BOMB}), "task=bomb"],
     "task/bomb.yaml:6: aliases expand it to more than 10000 nodes"),
    ("config dir: alias bomb as the primary config",
     lambda t: ["train", "--config-dir", _conf(t, {"exp.yaml": "defaults:\n  - config\n" + ALIAS_BOMB}),
                "--config-name", "exp"], "exp.yaml:7: aliases expand"),  # e: the first node past 10,000
    ("config dir: alias bomb in a file no option names",
     lambda t: ["train", "--config-dir", _conf(t, {"preset/unused.yaml": ALIAS_BOMB})], "aliases expand"),
    ("config dir: 50 MB scalar",
     lambda t: ["train", "--config-dir", _conf(t, {"task/big.yaml": b"run:\n  name: " + b"a" * (50 << 20)}),
                "task=big"], "a config file may have at most 1048576 (1 MiB)"),
    ("config dir: 20000-item list", lambda t: ["train", "--config-dir",
     _conf(t, {"task/list.yaml": GLOBAL + "engine:\n  extra_args: [" + ",".join(["x"] * 20_000) + "]\n"}),
     "task=list"], "more than 10000 nodes"),
    ("config dir: flow nesting 100000 deep",
     lambda t: ["train", "--config-dir", _conf(t, {"task/deep.yaml": "a: " + "[" * 100_000 + "]" * 100_000}),
                "task=deep"], "task/deep.yaml"),
    ("config dir: block nesting 200 deep", lambda t: ["train", "--config-dir", _conf(t, {"task/deep.yaml":
     "a:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 200)) + "  " * 200 + "v: 1\n"}), "task=deep"],
     "nests deeper than 64 levels"),
    ("config dir: alias inside its own anchor",
     lambda t: ["train", "--config-dir", _conf(t, {"task/loop.yaml": "a: &x [1, *x]\n"}), "task=loop"],
     "an alias refers to a node that contains it"),
    ("config dir: not UTF-8",
     lambda t: ["train", "--config-dir", _conf(t, {"task/latin.yaml": b"train:\n  steps: \xe9\n"}), "task=latin"],
     "task/latin.yaml:2:10: not UTF-8 (byte 0xe9)"),
    ("config dir: a FIFO named like a config",
     lambda t: ["train", "--config-dir", _fifo_conf(t), "task=pipe"], "pipe.yaml: not a regular file"),
    ("config dir: defaults cycle", lambda t: ["train", "--config-dir", _conf(t, {
        "task/one.yaml": GLOBAL + "defaults:\n  - /task/two\n", "task/two.yaml": GLOBAL + "defaults:\n  - /task/one\n"}),
        "task=one"], "in a cycle (task/one → task/two → task/one)"),
    ("config dir: unset ${oc.env:...}", lambda t: ["train", "--config-dir", _conf(t, {"task/env.yaml":
     GLOBAL + "run:\n  name: ${oc.env:SDP_NO_SUCH_VARIABLE_X}\n"}), "task=env"],
     "task/env.yaml:3: run.name: environment variable SDP_NO_SUCH_VARIABLE_X is not set"),
    ("config dir: primary without `- config`, a key overridden",
     lambda t: ["train", "--config-dir", _conf(t, {"exp.yaml": "loss:\n  clip: 0.3\n"}), "--config-name", "exp",
                "train.steps=3"], "does not build on sdp's config"),
    ("overrides: interpolations doubling 14 times", lambda t: ["train", *_doubling(STRING_KEYS)],
     "expand to more than 1000 references"),
    ("overrides: 20000-item list",
     lambda t: ["train", "engine.extra_args=[" + ",".join(["x"] * 20_000) + "]"],
     "more than 1000 list or mapping items"),
    ("ablate: a 20000-item override",
     lambda t: ["ablate", "smoke", "--dir", str(t / "sweep"), "engine.extra_args=[" + ",".join(["x"] * 20_000) + "]"],
     "more than 1000 list or mapping items"),
    ("overrides: one of 70 KB", lambda t: ["train", "run.name='" + "a" * 70_000 + "'"],
     "longer than 65536 characters"),
    ("overrides: 1001 of them", lambda t: ["train", *(["seed=1"] * 1001)], "1001 overrides"),
    ("resume: overrides.json with a 20000-item list",
     lambda t: ["train", f"resume={_started_run(t, ['engine.extra_args=[' + ','.join(['x'] * 20_000) + ']'])}"],
     "more than 1000 list or mapping items"),
    ("resume: the run's config dir holds an alias bomb",
     lambda t: ["train", "resume=" + str(_started_run(t, ["task=bomb"], {
         "config_dir": str(_conf(t, {"task/bomb.yaml": GLOBAL + ALIAS_BOMB})), "config_name": "config"}))],
     "aliases expand"),
    ("ablate --report: a run's config.yaml is an alias bomb",
     lambda t: ["ablate", "--report", str(_sweep_with_a_bombed_run(t)), "--no-plots"], "config.yaml:5: aliases expand"),
    ("count: train.threads=20000", lambda t: ["train", "train.threads=20000"],
     f"train.threads=20000 is more than 4 per CPU ({4 * CPUS} on this machine's {CPUS} CPUs)"),
    ("count: train.threads=50000", lambda t: ["train", "train.threads=50000"], "train.threads=50000 is more than"),
    ("count: task.reward_workers=100000", lambda t: ["train", "task.reward_workers=100000"],
     "task.reward_workers=100000 is more than 8 per CPU"),
    ("count: 4097 groups of 16 per batch", lambda t: ["train", "rollout.batch_groups=4097", "rollout.group_size=16"],
     "65552 samples per batch is more than 65536"),
    ("count: max_new_tokens 10^9", lambda t: ["train", "rollout.max_new_tokens=1000000000"],
     "rollout.max_new_tokens=1000000000 is more than 1048576"),
    ("count: engine.retries=2000", lambda t: ["train", "engine.retries=2000"], "engine.retries=2000 is more than 100"),
    ("count: model.lora.r=100000", lambda t: ["train", "model.lora.r=100000"], "model.lora.r=100000 is more than 4096"),
    ("count: train.steps=2^63", lambda t: ["train", f"train.steps={2**63}"], "is more than 2147483647"),
    ("count: a tiny model of 2^40 parameters",
     lambda t: ["train", "model.hidden_size=131072", "model.num_heads=64", "model.num_layers=64"],
     "GiB to train, more than this machine's"),
    ("count: a KV cache of 10^6 GiB", lambda t: ["train", "engine=vllm", "engine.cpu_kv_cache_gib=1e6"],
     "is more than this machine's memory"),
]  # fmt: skip


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and mtime; a directory's lock file is sdp's own
    bookkeeping (a resume and `sdp ablate` take the lock before they read the config)."""
    return {
        str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in root.rglob("*")
        if p.name != ".lock"
    }


def _unblock_fifos_after(root: Path, seconds: float) -> threading.Timer:
    """A reader stuck on a FIFO would hang the suite: after ``seconds`` a writer opens each
    one and closes it, so the reader sees the end of the file and the test fails on time."""

    def open_writers():
        for fifo in root.rglob("*.yaml"):
            if fifo.is_fifo():
                try:
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass

    timer = threading.Timer(seconds, open_writers)
    timer.daemon = True
    timer.start()
    return timer


def _run_main(argv: list[str], capsys) -> tuple[int, str]:
    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


@pytest.mark.parametrize("name,build,fragment", HOSTILE_CONFIGS, ids=[c[0] for c in HOSTILE_CONFIGS])
def test_hostile_config_is_one_line_nonzero_quick_and_writes_nothing(
    name, build, fragment, tmp_path, monkeypatch, capsys
):
    monkeypatch.delenv("SDP_NO_SUCH_VARIABLE_X", raising=False)
    inputs = tmp_path / "in"
    inputs.mkdir()
    argv = build(inputs)
    capsys.readouterr()
    work = tmp_path / "work"  # the working directory: runs/ would appear here
    work.mkdir()
    monkeypatch.chdir(work)
    before = _tree(tmp_path)
    timer = _unblock_fifos_after(inputs, 2 * DEADLINE_S)
    started = time.perf_counter()
    try:
        code, err = _run_main(argv, capsys)
    finally:
        timer.cancel()
    elapsed = time.perf_counter() - started
    written = sorted(set(_tree(tmp_path).items()) - set(before.items()))
    one_line = nonzero = False
    try:
        nonzero = code != 0
        line = error_line(err)
        one_line = True
        assert fragment in line, line
    finally:
        report.hostile_input(name, one_line=one_line, nonzero_exit=nonzero, nothing_written=not written)
    assert nonzero and not written, (code, written)
    assert elapsed < DEADLINE_S, f"{name}: {elapsed:.1f} s"


def test_the_limits_quoted_here_are_the_codes():
    """The fragments above spell out the limits; they are the constants of the code."""
    assert (limits.MAX_YAML_BYTES, limits.MAX_YAML_NODES, limits.MAX_YAML_DEPTH) == (1 << 20, 10_000, 64)
    assert (limits.MAX_OVERRIDES, limits.MAX_OVERRIDE_CHARS, limits.MAX_OVERRIDE_ITEMS) == (1000, 65536, 1000)
    assert limits.MAX_INTERPOLATION_REFS == 1000 and validation.MAX_INT == 2**31 - 1
    assert (validation.THREADS_PER_CPU, validation.REWARD_WORKERS_PER_CPU, validation.MAX_SAMPLES) == (4, 8, 65536)
    assert (validation.MAX_TOKENS, validation.MAX_RETRIES, validation.MAX_LORA_RANK) == (1 << 20, 100, 4096)


def test_at_least_twenty_hostile_configs():
    assert len(HOSTILE_CONFIGS) >= 20
