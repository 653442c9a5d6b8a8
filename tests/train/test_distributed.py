"""Two training processes (torchrun, gloo on CPU): rank 0 runs the loop and the engine, both
ranks train on their half of every batch, and they end with identical weights."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import FAST


@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None, reason="torchrun not installed")
def test_two_processes_train_the_same_model(tmp_path):
    torchrun = str(Path(sys.executable).parent / "torchrun")
    run_dir = tmp_path / "run"
    env = dict(os.environ, SDP_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    cmd = [torchrun, "--nproc_per_node", "2", "-m", "sdp_cli", "train", *FAST, "+preset=segment_wise",
           "train.steps=3", "train.threads=1", f"run.dir={run_dir}"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert events[0]["event"] == "started" and events[0]["processes"] == 2
    assert events[-1]["event"] == "finished"  # reached only if both ranks ended with equal weights
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # each process trains on half of the 16 sequences of a batch
    assert all(r["batch/sequences"] == 16 for r in rows)
