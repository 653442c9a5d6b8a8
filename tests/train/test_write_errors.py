"""A real write error where safetensors writes the file: the process's file-size limit makes
the write fail with EFBIG, as a full disk makes it fail with ENOSPC. safetensors reports either
as its own ``SafetensorError`` ("I/O error: File too large (os error 27)"), not as the OSError
that sdp's handling of write errors looks for (and that the injected faults of
sdp_cli/faults.py raise), so before this a full disk at a checkpoint or in the warm-start cache
ended `sdp train` in a traceback. Each case is one line naming the file and the cause."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..small_tmpfs import run_with_tmpfs

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="needs RLIMIT_FSIZE")


def _limit_files_to(max_bytes: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    return apply


def _train(run: Path, cache: Path, *overrides: str, limit: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "SDP_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "sdp_cli", "train", "+debug=fast", f"run.dir={run}", *overrides]
    return subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=300,
        preexec_fn=_limit_files_to(limit) if limit is not None else None,
    )  # fmt: skip


@pytest.fixture(scope="module")
def sizes(tmp_path_factory):
    """A run of one step without a limit: the warm-start cache it leaves, and the sizes of the
    files a checkpoint writes (the weights, then the optimizer's state: twice the weights)."""
    root = tmp_path_factory.mktemp("unlimited")
    done = _train(root / "run", root / "cache", "train.steps=1", "train.checkpoint_every=1")
    assert done.returncode == 0, done.stderr
    checkpoint = root / "run" / "checkpoints" / "step-000001"
    weights = (checkpoint / "policy" / "model.safetensors").stat().st_size
    optimizer = (checkpoint / "optimizer.safetensors").stat().st_size
    assert optimizer > 1.5 * weights
    return root / "cache", weights, optimizer


def _one_line(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    return lines[-1]


def test_a_checkpoint_that_cannot_be_written_ends_the_run_in_one_line(sizes, tmp_path):
    cache, weights, optimizer = sizes
    run = tmp_path / "run"
    done = _train(run, cache, "train.steps=3", "train.checkpoint_every=1", limit=(weights + optimizer) // 2)
    line = _one_line(done)
    assert line.startswith("error: training stopped at step 1:") and "File too large" in line, line
    assert "optimizer.safetensors" in line and "(raise the file-size limit (ulimit -f))" in line, line
    # the stop's own checkpoint fails on the same limit: said once, not the cause twice over
    assert line.count("File too large") == 1 and "could not be written for the same reason" in line, line
    assert not (run / "checkpoints" / "step-000001").exists()  # no checkpoint half written


def test_a_warm_start_cache_that_cannot_be_written_is_one_line_and_no_run(sizes, tmp_path):
    _, weights, _ = sizes
    run, cache = tmp_path / "run", tmp_path / "cache"
    done = _train(run, cache, "train.steps=2", limit=weights // 2)
    line = _one_line(done)
    assert "warm-start cache" in line and "File too large" in line and "SDP_CACHE_DIR" in line, line
    assert not run.exists()
    assert not [p for p in cache.rglob("*") if p.is_file()], "a cache entry was left half written"


def test_a_batch_file_that_cannot_be_written_stops_the_run_at_its_step_with_a_resume_line(sizes, tmp_path):
    """sdp's own atomic writes (a saved batch, the checkpoints' pointer, the summary) said a
    failed write as a plain one-line error, which the session did not take for a failed write: a
    full disk at a saved batch ended the run with that line alone, no `stopped` event, no attempt
    at a checkpoint and no resume command. Now it stops as any failed write does."""
    cache, _, _ = sizes
    run = tmp_path / "run"
    # room for the run's config (the largest file written before the first batch, which is
    # about 7 KB), and engine.in_process: no weight files for an engine process
    limit = (cache.parent / "run" / "config.yaml").stat().st_size + 1_000
    done = _train(
        run, cache, "train.steps=3", "train.save_batches=true", "train.checkpoint_every=0",
        "engine.in_process=true", limit=limit,
    )  # fmt: skip
    line = _one_line(done)
    batch = run / "batches" / "step-000001.safetensors"
    assert line.startswith(f"error: training stopped at step 1: cannot write {batch}: File too large"), line
    assert f"resume with: sdp train resume={run}" in line, line
    events = [json.loads(text) for text in (run / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "stopped" and "File too large" in events[-1]["reason"], events[-1]
    assert not batch.exists() and not list(run.glob("batches/.*")), "a batch file was left half written"
    # the step's row is written before its batch: a stop there keeps it (it had none)
    rows = [json.loads(text) for text in (run / "metrics.jsonl").read_text().splitlines() if text]
    assert [row["step"] for row in rows if "loss/pg_loss" in row] == [1], rows


def test_a_dev_shm_without_room_for_the_engines_weights_is_one_line_before_anything_is_written(sizes, tmp_path):
    """A container's /dev/shm is 64 MB unless it is given more. A push into a slot file there
    that the tmpfs had no room for killed sdp with SIGBUS: exit 135, no line, no event. The room
    the weight files take is now checked before the first is written (the tmpfs here holds the
    start's weights and half a push: before, the first push was that SIGBUS)."""
    cache, weights, _ = sizes
    size = f"{weights * 3 // 2 // 1024}k"
    run = tmp_path / "run"
    env = {**os.environ, "SDP_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "sdp_cli", "train", "+debug=fast", f"run.dir={run}", "train.steps=2"]
    done = run_with_tmpfs(size, Path("/dev/shm"), command, env=env, timeout=300)
    line = _one_line(done)
    assert line.startswith("error: the local engine's weight files need ") and "in /dev/shm" in line, line
    assert "SDP_SCRATCH_DIR" in line and "engine.in_process=true" in line, line
    assert not run.exists()
    # pointed elsewhere, the same run trains
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    done = run_with_tmpfs(size, Path("/dev/shm"), command, env={**env, "SDP_SCRATCH_DIR": str(scratch)}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert list(scratch.iterdir()) == []  # the rollout process removed its directory


def test_a_scratch_dir_that_is_no_writable_directory_is_one_line(tmp_path):
    env = {**os.environ, "SDP_CACHE_DIR": str(tmp_path / "cache"), "SDP_SCRATCH_DIR": str(tmp_path / "none")}
    command = [sys.executable, "-m", "sdp_cli", "train", "+debug=fast", f"run.dir={tmp_path / 'run'}"]
    done = subprocess.run(command, capture_output=True, text=True, env={**env, "PYTHONPATH": str(REPO)}, timeout=300)
    line = _one_line(done)
    assert line == f"error: SDP_SCRATCH_DIR={tmp_path / 'none'} is not a writable directory; point it at one (the local engine's weight files go there) or unset it", line
    assert not (tmp_path / "run").exists()


def test_a_resume_on_a_full_disk_is_one_line(sizes, tmp_path):
    """Taking the run's lock writes sdp's PID into the lock file: on a full disk that write
    failed with a traceback, before anything else could say so."""
    cache, _, _ = sizes
    full = tmp_path / "full"
    full.mkdir()
    script = (
        'cp -r "$1" "$2/run" && rm -f "$2/run/.lock" && (dd if=/dev/zero of="$2/filler" bs=4k 2>/dev/null; true) '
        '&& exec "$3" -m sdp_cli train resume="$2/run" train.steps=3'
    )
    env = {**os.environ, "SDP_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    command = ["sh", "-c", script, "sh", str(cache.parent / "run"), str(full), sys.executable]
    done = run_with_tmpfs("4m", full, command, env=env, timeout=300)
    line = _one_line(done)
    assert line == f"error: run directory {full}/run: cannot write its lock file (No space left on device); free space there", line


def test_a_resume_whose_run_files_cannot_be_written_ends_the_engine_it_set_up(tmp_path, monkeypatch):
    """A resume rewrites the run's config files once its setup is done; a full disk there ended
    the session in one line but left the rollout process and its engine running: in `sdp train`
    until the process ended, in a sweep's worker (which trains its next job in the same process)
    for good."""
    import errno

    from sdp_cli.errors import UserError, WriteFailed
    from sdp_cli.train.session import run as run_module

    from ..fast_run import train_run
    from .test_rollout_process import _children_of

    run = train_run(tmp_path, ["+debug=fast", "train.steps=1"])

    def full_disk(path, text):
        raise WriteFailed(f"{path}: cannot be written (No space left on device); free space there", OSError(errno.ENOSPC, "No space left on device"), path)

    monkeypatch.setattr(run_module, "atomic_write_text", full_disk)
    with pytest.raises(UserError, match="overrides.json: cannot be written"):
        train_run(tmp_path, [f"resume={run}", "train.steps=2"])
    deadline = time.monotonic() + 10
    while _children_of(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _children_of(os.getpid()) == [], "the run's rollout process outlived its session"


@pytest.mark.parametrize("into", ["a/b", "empty"])
def test_a_new_run_on_a_full_disk_is_one_line_and_leaves_nothing(sizes, tmp_path, into):
    """The run directory was made and locked before anything told the disk was full: the lock's
    PID failed to write with a traceback, and after that fix the line still left the directories
    it made (and the lock file in an empty directory given)."""
    cache, _, _ = sizes
    full = tmp_path / "full"
    full.mkdir()
    # what the tmpfs holds after sdp is listed inside its namespace, where it exists
    script = (
        'mkdir "$1/empty" && (dd if=/dev/zero of="$1/filler" bs=1k 2>/dev/null; true) '
        '&& { "$2" -m sdp_cli train +debug=fast run.dir="$1/$3"; rc=$?; '
        'echo "left:" $(cd "$1" && find . -mindepth 1 | sort); exit $rc; }'
    )
    env = {**os.environ, "SDP_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    done = run_with_tmpfs("256k", full, ["sh", "-c", script, "sh", str(full), sys.executable, into], env=env, timeout=300)
    line = _one_line(done)
    assert line == f"error: run directory {full}/{into}: cannot write its lock file (No space left on device); free space there", line
    assert done.stdout.splitlines()[-1] == "left: ./empty ./filler", done.stdout


def test_a_metrics_log_that_cannot_grow_stops_the_run_in_one_line_naming_it(sizes, tmp_path):
    """A failed append to metrics.jsonl stopped the run, and then closing the log flushed the
    line it held again: a traceback after the stop, whose reason named no file."""
    cache, _, _ = sizes
    run = tmp_path / "run"
    limit = (cache.parent / "run" / "config.yaml").stat().st_size + 4_000  # a step's line is ~3 KB
    done = _train(run, cache, "train.steps=50", "train.checkpoint_every=0", "engine.in_process=true", limit=limit)
    line = _one_line(done)
    assert line.startswith("error: training stopped at step ") and f"cannot write {run}/metrics.jsonl: File too large" in line, line
    events = [json.loads(text) for text in (run / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "stopped" and "metrics.jsonl" in events[-1]["reason"], events[-1]


def test_a_ledger_append_that_fails_leaves_the_file_and_its_mark_in_agreement(tmp_path):
    """The ledger's length and sha256 go into every checkpoint. A failed append (a full disk)
    left its line in the write buffer, and the length a checkpoint took counted those bytes,
    which the file and the sha256 did not have: a resume from that checkpoint would find the
    ledger damaged. Now a failed append leaves no trace, names the file, and closing is quiet."""
    code = (
        "import hashlib, resource, signal, sys\n"
        "from pathlib import Path\n"
        "from sdp_cli.train.asyncloop.ledger import LedgerLog\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))\n"
        "path = Path(sys.argv[1])\n"
        "ledger = LedgerLog(path)\n"
        "try:\n"
        "    for i in range(1000):\n"
        "        ledger.write('consumed', [i], note='x' * 30)\n"
        "except OSError as err:\n"
        "    print('failed', err.filename == str(path))\n"
        "mark = ledger.mark()\n"
        "data = path.read_bytes()\n"
        "print(mark['ledger_offset'] == len(data) == ledger.offset(), mark['ledger_sha256'] == hashlib.sha256(data).hexdigest())\n"
        "print(data.endswith(b'\\n'))\n"
        "ledger.close()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ledger.jsonl")], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["failed", "True", "True", "True", "True"], done.stdout


@pytest.mark.parametrize(
    "message,kept",
    [
        ("cannot write the warm-start cache entry E (File too large); raise the file-size limit (ulimit -f)", False),
        ("the vllm server did not start; full log in {logs}/vllm.log", True),
        ("sdp's engine process stopped answering; see local_engine.log in the run's logs directory", True),
        (None, False),
    ],
)
def test_a_failed_start_keeps_its_logs_only_when_its_error_points_to_one(tmp_path, message, kept):
    """The rollout process writes logs/rollout.log from the run's first second: a start that
    failed for another reason (the warm start, the disk) left the directory with it and the lock,
    although the docs promise a failed setup removes what it made."""
    from types import SimpleNamespace

    from sdp_cli.train.session.recovery import make_run_dir

    parent = tmp_path / "runs"
    owned = make_run_dir(SimpleNamespace(run=SimpleNamespace(dir=str(parent / "run"))))
    logs = owned.run_dir.logs
    logs.mkdir()
    for name in ("rollout.log", "vllm.log", "local_engine.log"):
        (logs / name).write_text("sdp rollout process 1: the engine's scratch directory is /dev/shm/x\n")
    (owned.run_dir.path / "config.yaml").write_text("seed: 1\n")
    owned.remove(RuntimeError(message.format(logs=logs)) if message is not None else None)
    if kept:
        assert sorted(p.name for p in owned.run_dir.path.iterdir()) == [".lock", "logs"]
    else:
        assert not parent.exists()  # the run directory and the parent made for it


def test_the_files_safetensors_writes_get_the_modes_of_every_other_file(sizes, tmp_path):
    """safetensors creates its files owner-only (0600) whatever the umask, so a checkpoint's
    weights, an export a colleague's vLLM should read, and the warm-start cache that is meant to be
    shared were unreadable to anyone else, beside a config.json that was 0644. Now every file sdp
    writes there has the mode a new file gets: 0666 minus the umask."""
    from sdp_cli.fileio import default_file_mode

    cache, _, _ = sizes
    run = tmp_path / "run"
    done = _train(run, cache, "train.steps=1", "train.checkpoint_every=1")
    assert done.returncode == 0, done.stderr
    exported = tmp_path / "exported"
    env = {**os.environ, "SDP_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    export = subprocess.run([sys.executable, "-m", "sdp_cli", "export", str(run), str(exported)],
                            capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert export.returncode == 0, export.stderr
    written = [*run.joinpath("checkpoints").rglob("*.safetensors"), *exported.glob("*"), *cache.rglob("*.safetensors")]
    assert len([p for p in written if p.suffix == ".safetensors"]) >= 4
    modes = {str(p.relative_to(tmp_path) if tmp_path in p.parents else p): oct(p.stat().st_mode & 0o777)
             for p in written if p.is_file()}  # fmt: skip
    assert set(modes.values()) == {oct(default_file_mode())}, modes
