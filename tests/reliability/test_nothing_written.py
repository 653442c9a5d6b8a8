"""Bad input leaves nothing behind: no `runs/<ts>/` with config.yaml, overrides.json and
events.jsonl (issue 13 item 8). Checked before the run directory exists where possible; a run
that fails during setup removes the directory it created."""

from __future__ import annotations

import json

import pytest

from .harness import FAST, error_line, run_sdp, sdp_env

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
