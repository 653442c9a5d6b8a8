"""The session's clock (summary.json's ``wall_seconds``, and the steps/s and tokens/s made from
it) times the training loop alone: not setup's garbage collection before it, nor closing the
engine and the pools after it. bench/train.py divides by it, and its ceiling took the η = 0 step
from it: 0.3 s of collection in a 60-step run once added 4–5 ms to every step it reported."""

from __future__ import annotations

import json
import time

from sdp_cli.train.session import run as session_run

from ..fast_run import FAST, train_run

STALL_S = 3.0


def test_the_clock_leaves_out_the_collection_before_the_loop_and_the_close_after(tmp_path, monkeypatch):
    collect = session_run.gc.collect
    close = session_run.TrainingRun.close
    calls = {"collect": 0, "close": 0}

    def slow_collect(*args):
        calls["collect"] += 1
        time.sleep(STALL_S)
        return collect(*args)

    def slow_close(self):
        calls["close"] += 1
        time.sleep(STALL_S)
        return close(self)

    monkeypatch.setattr(session_run.gc, "collect", slow_collect)
    monkeypatch.setattr(session_run.TrainingRun, "close", slow_close)
    run_dir = train_run(tmp_path, [*FAST, "train.steps=4", "train.eval_samples=0"])
    assert calls["collect"] >= 1 and calls["close"] >= 1  # both stalls happened in the run
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    timed = sum(r["time/wait_s"] + r["time/train_s"] + r["time/push_s"] for r in rows)
    # the loop's steps are inside the clock, neither stall is
    assert timed <= summary["wall_seconds"] < STALL_S
    assert summary["steps_per_second"] == summary["steps"] / summary["wall_seconds"]
