"""Bad input leaves nothing behind: no `runs/<ts>/` with config.yaml, overrides.json and
events.jsonl (issue 13 item 8). Checked before the run directory exists where possible; a run
that fails during setup removes the directory it created."""

from __future__ import annotations

import json

import pytest

from .harness import FAST, FAST_SERVER, error_line, run_sdp, sdp_env

pytestmark = pytest.mark.reliability


def _bad_inputs(tmp_path):
    empty_model = tmp_path / "empty-model"
    empty_model.mkdir()
    bad_data = tmp_path / "bad.jsonl"
    bad_data.write_text('{"question": "1+1?", "answer": "#### 2"}\n{not json\n')
    return {
        "an empty model directory": ["model=hf", f"model.path={empty_model}"],
        "a malformed gsm8k file": ["task=gsm8k", f"task.path={bad_data}"],
        "a seed beyond int64": [f"seed={2**70}"],
        "a seed just beyond the bound": [f"seed={2**62 + 1}"],
    }


@pytest.mark.parametrize("case", ["an empty model directory", "a malformed gsm8k file", "a seed beyond int64",
                                  "a seed just beyond the bound"])  # fmt: skip
def test_bad_input_writes_no_run_directory(case, tmp_path, sdp_cache):
    root = tmp_path / "runs"
    args = [*FAST, *_bad_inputs(tmp_path)[case], f"run.root={root}", "train.steps=2"]
    done = run_sdp(["train", *args], sdp_env(sdp_cache), timeout=180)
    assert done.returncode == 2, (case, done.returncode, done.stderr[-2000:])
    error_line(done.stderr, alone=False)
    left = [str(p) for p in root.rglob("*")] if root.exists() else []
    assert not left, f"{case}: left {json.dumps(left)}"


@pytest.mark.parametrize("case", ["a file", "/dev/null", "under /proc", "read-only", "a 300-character run.name"])
def test_an_impossible_run_directory_is_one_line(case, tmp_path, sdp_cache):
    """run.dir / run.name that cannot be a run directory: one line, exit 2, no traceback."""
    import os

    if case == "a file":
        (tmp_path / "f").write_text("x")
        where = [f"run.dir={tmp_path / 'f'}"]
    elif case == "/dev/null":
        where = ["run.dir=/dev/null"]
    elif case == "under /proc":
        where = ["run.dir=/proc/sdp-run"]
    elif case == "read-only":
        (tmp_path / "ro").mkdir()
        os.chmod(tmp_path / "ro", 0o555)
        if os.access(tmp_path / "ro", os.W_OK):
            pytest.skip("running as a user that writes into read-only directories (root)")
        where = [f"run.dir={tmp_path / 'ro' / 'run'}"]
    else:
        where = [f"run.root={tmp_path}", "run.name=" + "n" * 300]
    done = run_sdp(["train", *FAST, *where, "train.steps=2"], sdp_env(sdp_cache), timeout=180)
    assert done.returncode == 2, (case, done.returncode, done.stderr[-2000:])
    line = error_line(done.stderr, alone=False)
    assert "run" in line, line


def _bad_task_data(tmp_path):
    """Task data sdp must refuse before it makes a run directory (issue 13 items 7 and 8)."""
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(bytes(range(256)) * 8)  # every byte value: no UTF-8 text
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?", "answer": \n')
    wrong_type = tmp_path / "wrong-type.jsonl"
    wrong_type.write_text('{"prompt": 5, "answer": "5"}\n')
    dataset = ["task=dataset", "task.reward=final_number"]
    return {
        "a binary file as gsm8k data": ["task=gsm8k", f"task.path={binary}"],
        "an empty gsm8k file": ["task=gsm8k", f"task.path={empty}"],
        "a malformed dataset file": [*dataset, f"task.path={malformed}"],
        "a dataset record of the wrong type": [*dataset, f"task.path={wrong_type}"],
        "an empty dataset file": [*dataset, f"task.path={empty}"],
    }


#: engine settings that cannot work, refused by config validation before any connection attempt
BAD_ENGINE = {
    "an engine URL without a scheme": ["engine.urls=[notaurl]"],
    "an engine URL of another protocol": ["engine.urls=[ftp://127.0.0.1:8000]"],
    "an engine URL without a host": ["engine.urls=[http://:8000]"],
    "an engine URL with a port out of range": ["engine.urls=[http://127.0.0.1:99999]"],
    "an engine URL with a port that is no number": ["engine.urls=[http://user:secret@127.0.0.1:abc]"],
    "a request timeout of 1e300 s": ["engine.urls=[http://127.0.0.1:8000]", "engine.request_timeout_s=1e300"],
    "a start-up timeout of 1e12 s": ["engine.startup_timeout_s=1e12"],
    "a reconnect timeout of 1e300 s": ["engine.urls=[http://127.0.0.1:8000]", "engine.reconnect_timeout_s=1e300"],
    "a batch timeout of 1e300 s": ["train.batch_timeout_s=1e300"],
}


@pytest.mark.parametrize("case", ["a binary file as gsm8k data", "an empty gsm8k file", "a malformed dataset file",
                                  "a dataset record of the wrong type", "an empty dataset file", *BAD_ENGINE])  # fmt: skip
def test_bad_task_data_and_engine_settings_leave_no_run_directory(case, tmp_path, sdp_cache):
    """Caught before the run directory exists: the fresh run.root is never even made."""
    fresh = tmp_path / "fresh"
    args = [*FAST, *_bad_task_data(tmp_path)[case]] if case not in BAD_ENGINE else [*FAST_SERVER, "engine=vllm", *BAD_ENGINE[case]]
    done = run_sdp(["train", *args, f"run.root={fresh / 'runs'}", "train.steps=2"], sdp_env(sdp_cache), timeout=180)
    assert done.returncode == 2, (case, done.returncode, done.stderr[-2000:])
    line = error_line(done.stderr, alone=False)
    assert "secret" not in line, line
    assert not fresh.exists(), f"{case}: left {[str(p) for p in fresh.rglob('*')]}"


def test_a_run_that_fails_in_setup_removes_the_directories_it_made(tmp_path, sdp_cache):
    """No server answers at engine.urls: the run fails after it made its directory (and the
    run.root above it); both are removed, nothing is left."""
    fresh = tmp_path / "fresh"
    args = ["engine=vllm", "engine.urls=[http://127.0.0.1:9]", "engine.retries=0", f"run.root={fresh / 'runs'}"]
    done = run_sdp(["train", *FAST_SERVER, *args, "train.steps=2"], sdp_env(sdp_cache), timeout=180)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "cannot reach the vllm server" in error_line(done.stderr, alone=False)
    assert not fresh.exists(), f"left {[str(p) for p in fresh.rglob('*')]}"
