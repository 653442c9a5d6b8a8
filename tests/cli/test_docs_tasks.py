"""docs/tasks.md "Bring your own task" works verbatim: its shell commands are parsed out of the
document and run with `sdp` on a copy of examples/own_task, and the files the document shows
are the shipped ones — so the walk-through and the example cannot drift apart."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "tasks.md"
EXAMPLE = REPO / "examples" / "own_task"


def _blocks(language: str) -> list[str]:
    text = DOC.read_text()
    section = text.split("## Bring your own task", 1)[1].split("\n## ", 1)[0]
    return [body for lang, body in re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S) if lang == language]


def test_the_files_shown_are_the_shipped_ones():
    (reward,) = _blocks("python")
    assert reward == (EXAMPLE / "reward.py").read_text()
    task, preset = _blocks("yaml")
    assert task == (EXAMPLE / "conf" / "task" / "larger.yaml").read_text()
    assert preset == (EXAMPLE / "conf" / "preset" / "quick.yaml").read_text()
    (records,) = _blocks("json")
    shipped = (EXAMPLE / "data.jsonl").read_text().splitlines()
    assert records.splitlines() == shipped[:2]


def test_the_walkthrough_runs_verbatim(tmp_path):
    commands = _blocks("bash")
    assert [c.split()[:2] for c in commands] == [
        ["cd", "examples/own_task"],
        ["sdp", "train"],
        ["sdp", "train"],
        ["sdp", "inspect-weights"],
    ]
    shutil.copytree(EXAMPLE, tmp_path / "examples" / "own_task")
    shim = tmp_path / "bin" / "sdp"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m sdp_cli "$@"\n')
    shim.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{shim.parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "SDP_CACHE_DIR": str(tmp_path / "cache"),
    }
    done = subprocess.run(
        ["bash", "-e", "-c", "".join(commands)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--- prompt 1 (12 tokens" in done.stdout  # step 4
    run = tmp_path / "examples" / "own_task" / "runs" / "larger"
    summary = json.loads((run / "summary.json").read_text())  # step 5
    assert summary["steps"] == 40 and summary["greedy_accuracy_end"] is not None
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all("reward/format" in r and "data/epoch" in r for r in rows if "reward/mean" in r)
    assert len(list((run / "batches").glob("*.safetensors"))) == 40
    assert "40 batches: 1280 sequences" in done.stdout  # step 6
