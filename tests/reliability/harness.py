"""`sdp train` in real subprocesses and the checks every surviving run must pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sdp_cli.rundir import RunDir
from sdp_cli.train.session import checkpoint as ckpt
from sdp_cli.train.asyncloop.ledger import Audit, audit

from ..fast_run import FAST, FAST_SERVER
GROUP_SIZE = 4
TERMINAL_EVENTS = ("finished", "stopped", "interrupted")


def sdp_env(cache_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of an sdp subprocess: shared warm-start cache, no inherited faults."""
    env = {k: v for k, v in os.environ.items() if k != "SDP_TEST_FAULTS"}
    env.update(SDP_CACHE_DIR=str(cache_dir), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", **extra)
    return env


def train_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "sdp_cli", "train", *args]


def versioned_segment_wise(run_dir: Path, steps: int, *extra: str) -> list[str]:
    """The overrides of a segment-wise run whose tokens' versions can be audited afterwards:
    batches and every version's checkpoint kept, a checkpoint every 3 steps. The tiny warm start
    earns no reward, so the gradient is zero: AdamW's decoupled decay (weights × 0.97 per step)
    makes every version differ from the last (max |Δ logprob| 0.02-0.3 per sequence), so a token
    tagged with the wrong version cannot pass the version check."""
    return [
        "+preset=segment_wise",
        "optim.lr=3e-3",
        "optim.weight_decay=10",
        f"train.steps={steps}",
        "train.checkpoint_every=3",
        "train.save_batches=true",
        "train.keep_version_checkpoints=true",
        f"run.dir={run_dir}",
        *extra,
    ]


def run_sdp(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sdp_cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_sdp(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", "sdp_cli", *args],
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def whole_lines(path: Path) -> str:
    """The whole lines of a log sdp may still be appending to ("" before it exists). sdp writes a
    line in one ``write``, but the kernel copies a write into the file a page at a time, so a
    reader can see a long line's first page alone, and a pid or a path can be seen cut short:
    what follows the last newline is not read yet."""
    if not path.is_file():
        return ""
    data = path.read_bytes()
    return data[: data.rfind(b"\n") + 1].decode()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in whole_lines(path).splitlines() if line.strip()]


def metrics(run_dir: Path) -> list[dict]:
    return read_jsonl(RunDir(run_dir).metrics)


def events(run_dir: Path) -> list[dict]:
    return read_jsonl(RunDir(run_dir).events)


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name: state, ppid, pgrp, session, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def gone(pid: int) -> bool:
    """The process has exited (a zombie counts as gone: it no longer runs)."""
    try:
        return _stat(pid)[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def session_of(pid: int) -> int:
    return int(_stat(pid)[3])


def running_in_session(sid: int) -> list[int]:
    """The processes of session ``sid`` that still run."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = _stat(int(entry.name))
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def shared_memory_of(pids: list[int]) -> set[Path]:
    """The files under /dev/shm that processes ``pids`` have mapped: POSIX shared memory and named
    semaphores, which a process's clean exit removes and a kill -9 leaves behind. Matched by
    inode: a semaphore is mapped under the temporary name glibc made it with, since deleted."""
    inodes = set()
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        for parts in (line.split(maxsplit=5) for line in lines):
            if len(parts) == 6 and parts[5].startswith("/dev/shm/"):  # the sixth field: the file
                inodes.add(int(parts[4]))
    found = set()
    for path in Path("/dev/shm").iterdir():
        try:
            if path.stat().st_ino in inodes:
                found.add(path)
        except FileNotFoundError:
            continue
    return found


def processes_whose_command_has(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (FileNotFoundError, ProcessLookupError):
                continue
            if text in command:
                found.append(int(entry.name))
    return found


def complete_checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps of the checkpoints renamed into place (complete by construction: the rename is the
    last step of a write), read from the directory listing, not through checkpoint.py."""
    root = run_dir / "checkpoints"
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*") if p.is_dir())


def first_step_time_after(run_dir: Path, step: int, since: float) -> float | None:
    """Wall-clock time of the first metrics row past ``step`` written after ``since``."""
    rows = [r for r in metrics(run_dir) if r["step"] > step and r["time"] >= since]
    return min(r["time"] for r in rows) if rows else None


@dataclass
class Verdict:
    audit: Audit
    optimizer_steps: set[float]


def check_finished_run(run_dir: Path, steps: int, *, optimizer_steps_per_step: int = 1) -> Verdict:
    """Everything a run that reached its target must satisfy, resumed or not (docs/reliability.md):
    steps 1..steps logged exactly once with version == step, a summary, valid checkpoints and
    no leftovers of interrupted writes, the optimizer stepped exactly
    steps × optimizer_steps_per_step times, and a clean ledger audit (nothing lost or
    duplicated, staleness counters consistent with the fates)."""
    rows = metrics(run_dir)
    step_rows = [r for r in rows if "version" in r]
    assert [r["step"] for r in step_rows] == list(range(1, steps + 1)), "a step was lost or repeated"
    # "version" is the engine's after the step's weight push (the one loading, for an asynchronous
    # push); a row with push_failed (the run stopped there and its resume pushed the weights) has
    # the engine behind: one version, or two when the previous step's asynchronous push failed
    assert all(r["version"] == r["step"] for r in step_rows if not r.get("engine/push_failed"))
    assert all(r["step"] - 2 <= r["version"] < r["step"] for r in step_rows if r.get("engine/push_failed"))
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == steps
    assert events(run_dir)[-1]["event"] == "finished"

    root = run_dir / "checkpoints"
    assert not list(root.glob(".tmp-*")), "a temporary checkpoint was left behind"
    assert not list((run_dir / "weights").glob(".v*")), "a temporary weights directory was left"
    final = ckpt.find_latest(root)
    assert final is not None and final.name == f"step-{steps:06d}"
    for path in root.glob("step-*"):
        ckpt.read_checkpoint(path)  # every checkpoint left is complete
    checkpoint = ckpt.read_checkpoint(final)
    counts = {float(v) for k, v in checkpoint.optimizer_tensors.items() if k.endswith(".step")}
    assert counts == {float(steps * optimizer_steps_per_step)}, f"optimizer steps {counts}"
    assert checkpoint.state["trainer"]["version"] == steps

    result = audit(RunDir(run_dir).ledger, checkpoint.state["loop"], GROUP_SIZE)
    assert result.ok, (
        f"ledger: lost {result.lost}, duplicated {result.duplicated}, bad sample counts "
        f"{result.bad_sample_counts}, counters {result.counter_mismatches}"
    )
    return Verdict(audit=result, optimizer_steps=counts)


def assert_no_secret(secret: str, run_dir: Path, *texts: str) -> int:
    """``secret`` appears in no file of ``run_dir`` (logs, config, checkpoints, batches, server
    logs) and in none of ``texts`` (what the process printed). Returns the files scanned."""
    needle = secret.encode()
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    leaks = [str(p) for p in files if needle in p.read_bytes()]
    leaks += [f"output {i}" for i, text in enumerate(texts) if secret in text]
    assert not leaks, f"the API key leaked into {leaks}"
    return len(files)


def error_line(stderr: str, *, alone: bool = True) -> str:
    """The one ``error: ...`` line of a failed command. ``alone``: it is the only non-empty line
    of stderr (bad input); otherwise warnings before it are allowed (a run that logged engine
    faults, then stopped). Never a traceback."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, f"not one error line: {stderr!r}"
    assert not alone or len(lines) == 1, f"more than the error line: {stderr!r}"
    return errors[0]
