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
