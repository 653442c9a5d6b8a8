"""kill -9 of `sdp train` at named and at random points, then `resume`, on the embedded engine.

Named points come from the test-only hook ``SDP_TEST_FAULTS=kill:POINT@N`` (sdp_cli/faults.py):
the process SIGKILLs itself the N-th time it reaches POINT, so every kill lands exactly where
it is meant to (between two files of a checkpoint, between two optimizer steps of one training
step, ...). Random kills come from this test after a random delay. One run directory goes
through a chain of killed sessions and a final resume; after each kill the next session must
start from the newest complete checkpoint, and the finished run must pass
``check_finished_run`` (steps and versions exactly once, optimizer steps, counters, ledger).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest

from . import report
from .harness import (
    FAST,
    check_finished_run,
    complete_checkpoint_steps,
    error_line,
    events,
    first_step_time_after,
    metrics,
    read_jsonl,
    run_sdp,
    sdp_env,
    start_sdp,
    wait_for,
)

pytestmark = pytest.mark.reliability

# (kill point, what the process was doing). Each session of the chain dies at one of them.
# With checkpoint_every=1 and minibatches=2, arrival @2 of a per-step point falls in the
# session's second step (after its first checkpoint), and trainer.optimizer_step@3 is the first
# of the two optimizer steps of the second step: a training step half applied.
NAMED_KILLS = [
    ("loop.weights_loaded@3", "after the engine loaded new weights (with η > 0, while the next step trains)"),
    ("producer.generated@3", "during generation: groups generated, not handed over"),
    ("local.generate@25", "mid-generation, inside the local engine's decode loop"),
    ("local.score@2", "during the recompute pass (scoring)"),
    ("loop.recomputed@2", "after the recompute pass, before the weight load"),
    ("trainer.optimizer_step@3", "mid optimizer step: one of two minibatch updates applied"),
    ("loop.batch_taken@2", "a batch taken from the cache, not trained on"),
    ("producer.handover@6", "mid hand-over: one group queued, the rest not"),
    ("run.metrics_written@2", "metrics of a step written, its checkpoint not"),
    ("checkpoint.policy@2", "checkpoint write: policy written, optimizer not"),
    ("checkpoint.optimizer@2", "checkpoint write: optimizer written, state not"),
    ("checkpoint.state@2", "checkpoint write: state written, no manifest"),
    ("checkpoint.manifest@2", "checkpoint write: complete but not renamed"),
    ("checkpoint.renamed@2", "checkpoint renamed into place, `latest` not updated"),
    ("checkpoint.latest@2", "`latest` updated, old checkpoints not pruned"),
]
CHECKPOINT_TMP_POINTS = {
    "checkpoint.policy",
    "checkpoint.optimizer",
    "checkpoint.state",
    "checkpoint.manifest",
}


def _resumed_from(run_dir, since: float) -> int:
    """The step the session that started after ``since`` resumed from."""
    resumed = [e for e in events(run_dir) if e["event"] == "resumed" and e["time"] >= since]
    assert resumed, "the session did not resume"
    return resumed[0]["step"]


def test_kill_9_at_named_points_then_resume(tmp_path, sdp_cache):
    run_dir = tmp_path / "run"
    steps = 40
    args = [
        *FAST,
        f"run.dir={run_dir}",
        f"train.steps={steps}",
        "train.checkpoint_every=1",
        "+preset=segment_wise",
        "optim.minibatches=2",
    ]
    run_id = "kill-9 chain (named points)"
    kills: list[tuple[str, float]] = []
    for i, (point, _) in enumerate(NAMED_KILLS):
        session = args if i == 0 else [f"resume={run_dir}"]
        newest_before = max(complete_checkpoint_steps(run_dir), default=None)
        started = time.time()
        done = run_sdp(["train", *session], sdp_env(sdp_cache, SDP_TEST_FAULTS=f"kill:{point}"), 240)
        assert done.returncode == -signal.SIGKILL, f"{point} was not reached: {done.stderr[-3000:]}"
        kills.append((point, time.time()))
        if i > 0:
            # the session started from the newest complete checkpoint left by the one before
            assert _resumed_from(run_dir, started) == newest_before, point
        name = point.split("@")[0]
        checkpoints = run_dir / "checkpoints"
        if name in CHECKPOINT_TMP_POINTS:
            assert list(checkpoints.glob(".tmp-step-*")), f"{point}: no half-written checkpoint"
        if name == "checkpoint.renamed":
            newest = f"step-{max(complete_checkpoint_steps(run_dir)):06d}"
            assert (checkpoints / "latest").read_text().strip() != newest, "latest was updated"

    newest_before = max(complete_checkpoint_steps(run_dir))
    final_start = time.time()
    done = run_sdp(["train", f"resume={run_dir}"], sdp_env(sdp_cache), 300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _resumed_from(run_dir, final_start) == newest_before

    verdict = check_finished_run(run_dir, steps, optimizer_steps_per_step=2)
    crashes = [e for e in events(run_dir) if e["event"] == "crashed"]
    assert len(crashes) == len(NAMED_KILLS), "every crash is recorded in events.jsonl"
    report.run_result(run_id, survived=True, samples_lost=verdict.audit.samples_lost,
                      samples_duplicated=verdict.audit.samples_duplicated)  # fmt: skip
    for point, killed_at in kills:
        back = first_step_time_after(run_dir, 0, killed_at)
        report.fault("kill -9", point.split("@")[0], run_id, None if back is None else back - killed_at)
    # Every kill was absorbed by the ledger: the crashed sessions' groups are gone from it,
    # and groups in flight at a checkpoint were marked abandoned when a session resumed from it.
    assert verdict.audit.fates["consumed"] == steps * 4


def test_kill_9_at_random_times_and_a_corrupted_checkpoint(tmp_path, sdp_cache):
    rng = random.Random(int(os.environ.get("SDP_RELIABILITY_SEED", "7")))
    run_dir = tmp_path / "run"
    steps = 60
    args = [
        *FAST,
        f"run.dir={run_dir}",
        f"train.steps={steps}",
        "train.checkpoint_every=2",
        "+preset=decoupled",
        "rollout.max_head_offpolicyness=3",
    ]
    run_id = "kill-9 chain (random times)"
    kills = []
    log = tmp_path / "sdp.log"
    for i in range(4):
        session = args if i == 0 else [f"resume={run_dir}"]
        started = time.time()
        proc = start_sdp(["train", *session], sdp_env(sdp_cache), log)
        # wait for a step of this session (and, for the first, a checkpoint), then kill at random
        wait_for(
            lambda: proc.poll() is not None
            or (any(r["time"] >= started for r in metrics(run_dir)) and complete_checkpoint_steps(run_dir)),
            120,
            "a step of the session",
        )
        time.sleep(rng.uniform(0.0, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.returncode != -signal.SIGKILL:
            assert proc.returncode == 0, log.read_text()[-3000:]
            break  # the run finished before the signal
        kills.append(time.time())

    # A checkpoint whose bytes changed after it was written is never loaded: the resume falls
    # back to the newest one whose manifest still matches.
    newest, *older = sorted(complete_checkpoint_steps(run_dir), reverse=True)
    damaged = run_dir / "checkpoints" / f"step-{newest:06d}" / "optimizer.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    final_start = time.time()
    done = run_sdp(["train", f"resume={run_dir}"], sdp_env(sdp_cache), 300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _resumed_from(run_dir, final_start) == older[0]

    verdict = check_finished_run(run_dir, steps)
    report.run_result(run_id, survived=True, samples_lost=verdict.audit.samples_lost,
                      samples_duplicated=verdict.audit.samples_duplicated)  # fmt: skip
    assert len(kills) >= 3, "the run finished before most random kills"
    for killed_at in kills:
        back = first_step_time_after(run_dir, 0, killed_at)
        report.fault("kill -9", "random time", run_id, None if back is None else back - killed_at)


def test_an_exception_inside_local_generation(tmp_path, sdp_cache):
    """EngineErrors inside the local engine's generation are engine faults: their groups are
    rejected (capacity returned) and the run goes on. An unexpected exception stops the run
    with one line and a resumable checkpoint; the traceback goes to events.jsonl."""
    steps = 16
    run_dir = tmp_path / "faults"
    transient = ",".join(f"engine_error:local.generate@{n}" for n in (4, 16, 28, 40, 52))
    done = run_sdp(
        ["train", *FAST, f"run.dir={run_dir}", f"train.steps={steps}", "train.checkpoint_every=3"],
        sdp_env(sdp_cache, SDP_TEST_FAULTS=transient),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    verdict = check_finished_run(run_dir, steps)
    ledger = read_jsonl(run_dir / "ledger.jsonl")
    rejected = [e for e in ledger if e["event"] == "rejected"]
    assert len(rejected) == 5 and all("fault injected at local.generate" in e["reason"] for e in rejected)
    assert metrics(run_dir)[-1]["engine/faults_total"] == 5
    run_id = "local engine: EngineError in generation"
    report.run_result(run_id, survived=True, samples_lost=verdict.audit.samples_lost,
                      samples_duplicated=verdict.audit.samples_duplicated)  # fmt: skip
    consumed_times = [e["time"] for e in ledger if e["event"] == "consumed"]
    for event in rejected:
        later = [t for t in consumed_times if t > event["time"]]
        seconds = later[0] - event["time"] if later else None
        report.fault("engine", "local: EngineError in generation", run_id, seconds)

    run_dir = tmp_path / "bug"
    done = run_sdp(
        ["train", *FAST, f"run.dir={run_dir}", f"train.steps={steps}", "train.checkpoint_every=2"],
        sdp_env(sdp_cache, SDP_TEST_FAULTS="raise:local.generate@30"),
    )
    failed_at = time.time()
    assert done.returncode == 2
    line = error_line(done.stderr, alone=False)
    assert "rollout producer failed: InjectedFault: fault injected at local.generate" in line
    assert f"resume with: sdp train resume={run_dir}" in line
    stopped = events(run_dir)[-1]
    assert stopped["event"] == "stopped" and "InjectedFault" in stopped["traceback"]
    assert stopped["checkpoint"] and complete_checkpoint_steps(run_dir)[-1] == stopped["step"]
    done = run_sdp(["train", f"resume={run_dir}"], sdp_env(sdp_cache))
    assert done.returncode == 0, done.stderr[-3000:]
    verdict = check_finished_run(run_dir, steps)
    run_id = "local engine: exception in generation (stop, resume)"
    report.run_result(run_id, survived=True, samples_lost=verdict.audit.samples_lost,
                      samples_duplicated=verdict.audit.samples_duplicated)  # fmt: skip
    back = first_step_time_after(run_dir, stopped["step"], failed_at)
    report.fault("engine", "local: unexpected exception (stop + resume)", run_id, back - failed_at)
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == steps


def test_falling_back_from_a_damaged_newest_checkpoint_says_so(tmp_path, sdp_cache):
    """A resume that skips a damaged newest checkpoint for an older one prints a warning naming
    both (it used to fall back silently); with every checkpoint damaged it refuses in one line
    (it must not start the run over)."""
    run_dir = tmp_path / "run"
    done = run_sdp(["train", *FAST, f"run.dir={run_dir}", "train.steps=4", "train.checkpoint_every=2"],
                   sdp_env(sdp_cache))  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert complete_checkpoint_steps(run_dir) == [2, 4]

    def damage(step: int) -> None:
        target = max((p for p in (run_dir / "checkpoints" / f"step-{step:06d}").rglob("*.safetensors")),
                     key=lambda p: p.stat().st_size)  # fmt: skip
        data = bytearray(target.read_bytes())
        data[-1] ^= 0xFF  # one flipped byte: the checksum in the manifest no longer matches
        target.write_bytes(bytes(data))

    damage(4)
    done = run_sdp(["train", f"resume={run_dir}", "train.steps=5"], sdp_env(sdp_cache))
    assert done.returncode == 0, done.stderr[-2000:]
    warning = [line for line in done.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warning) == 1 and "step-000004" in warning[0] and "step-000002" in warning[0], done.stderr
    for step in complete_checkpoint_steps(run_dir):
        damage(step)
    damaged = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    done = run_sdp(["train", f"resume={run_dir}", "train.steps=7"], sdp_env(sdp_cache))
    assert done.returncode == 2, done.stderr[-2000:]
    line = error_line(done.stderr, alone=False)  # after the task's summary line
    assert "no checkpoint passes its checks" in line and damaged[-1] in line, line


def test_a_full_disk_during_a_checkpoint_is_one_line_and_a_stopped_event(tmp_path, sdp_cache):
    """ENOSPC while a checkpoint is written (the test-only `enospc` action at
    `checkpoint.optimizer`, every arrival): one line, a `stopped` event, no temporaries, and the
    run resumes from its last complete checkpoint once there is space."""
    run_dir = tmp_path / "run"
    args = [*FAST, f"run.dir={run_dir}", "train.steps=6", "train.checkpoint_every=2"]
    done = run_sdp(["train", *args], sdp_env(sdp_cache, SDP_TEST_FAULTS="enospc:checkpoint.optimizer"))
    assert done.returncode == 2, done.stderr[-3000:]
    line = error_line(done.stderr, alone=False)
    assert "No space left on device" in line and f"resume with: sdp train resume={run_dir}" in line, line
    last = events(run_dir)[-1]
    assert last["event"] == "stopped" and "No space left on device" in last["reason"], last
    assert not list((run_dir / "checkpoints").glob(".tmp-*")) if (run_dir / "checkpoints").exists() else True
    done = run_sdp(["train", f"resume={run_dir}"], sdp_env(sdp_cache))
    assert done.returncode == 0, done.stderr[-3000:]
    check_finished_run(run_dir, 6)


@pytest.mark.parametrize("tail", [b'{"step": 99, "ti\n', b"\x00" * 64, b"\x00" * 40 + b"\n", b"not json at all\n"])
def test_a_non_json_torn_tail_of_events_and_metrics_is_cut_at_resume(tail, tmp_path, sdp_cache):
    """The last line of events.jsonl or metrics.jsonl that is not JSON (a half-written line
    with its newline, zeros a lost page left): cut at resume like a line without its newline."""
    run_dir = tmp_path / "run"
    done = run_sdp(["train", *FAST, f"run.dir={run_dir}", "train.steps=2"], sdp_env(sdp_cache))
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("events.jsonl", "metrics.jsonl"):
        with open(run_dir / name, "ab") as fh:
            fh.write(tail)
    done = run_sdp(["train", f"resume={run_dir}", "train.steps=4"], sdp_env(sdp_cache))
    assert done.returncode == 0, done.stderr[-3000:]
    check_finished_run(run_dir, 4)
