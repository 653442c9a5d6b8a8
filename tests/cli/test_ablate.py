"""`sdp ablate` end to end on the smoke grid (2 η × 3 modes × 1 seed, real training runs).

The sweep takes about a minute, so the tests that use it are marked ``slow`` (run them with
``pytest -m slow tests/cli/test_ablate.py``); the quick input-error tests run by default. The
sweep runs on the joblib launcher with 2 workers, its table / CSV / Markdown / PNGs are checked
against numbers recomputed here from the runs' own files (token-level weights from the saved
batches, rewards and lags from metrics.jsonl and the batches, the rest from summary.json), and
re-running the command skips finished runs and resumes interrupted ones. The tests share one
sweep directory and run in file order; the resume test, which changes it, comes last.
"""

import csv
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from types import SimpleNamespace

import numpy as np
import pytest

from sdp_cli.rollout.batch_file import read_batch

from .run_main import run_main

MODES = ("bypass", "decoupled", "segment_wise")
ETAS = (0, 2)
EXTRA = "train.save_batches=true"  # the test recomputes the weights from the saved batches
AS_JOB = "train.save_batches=True"  # how Hydra's sweeper hands that override to the job


def _sdp(args, env, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "sdp_cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    root = tmp_path_factory.mktemp("ablate")
    env = {**os.environ, "SDP_CACHE_DIR": str(root / "cache"), "COLUMNS": "200"}
    # checkpoints kept: the resume test interrupts a run by removing its last one
    command = [
        "ablate",
        "smoke",
        "--dir",
        str(root / "sweep"),
        "--jobs",
        "2",
        "--keep-checkpoints",
        EXTRA,
    ]
    started = time.monotonic()
    proc = _sdp(command, env)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return SimpleNamespace(dir=root / "sweep", proc=proc, env=env, command=command, elapsed=elapsed)


def _run_dir(smoke, mode, eta):
    return smoke.dir / "runs" / f"{mode}-eta{eta}-train.save_batches@True-seed0"


def _csv_rows(smoke):
    with open(smoke.dir / "summary.csv") as fh:
        return {(r["mode"], int(r["eta"])): r for r in csv.DictReader(fh)}


@pytest.mark.slow
def test_smoke_sweep_prints_the_table_and_writes_csv_markdown_and_plots(smoke):
    assert smoke.elapsed < 180
    out = smoke.proc.stdout
    assert "6 runs (6 new)" in out
    assert (
        "Behavioural weights, both measured on the same tokens" in out
        and "Training outcome and cost" in out
    )
    for mode in MODES:
        for eta in ETAS:
            assert (_run_dir(smoke, mode, eta) / "summary.json").is_file()
    assert sorted(_csv_rows(smoke)) == sorted((m, e) for m in MODES for e in ETAS)
    md = (smoke.dir / "summary.md").read_text()
    assert md.count("| segment_wise | 2 | 1 |") == 2  # one row in each of the two tables
    pngs = sorted((smoke.dir / "plots").glob("*.png"))
    assert [p.name for p in pngs] == [
        "difference_vs_eta.png",
        "reward_curves.png",
        "reward_vs_eta.png",
        "throughput_vs_eta.png",
        "weights_vs_eta.png",
    ]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


@pytest.mark.slow
def test_the_study_is_registered_before_the_first_run_and_tested_by_the_report(smoke):
    out = smoke.proc.stdout
    # sdp_cli/conf/ablate/study/smoke.yaml: segment_wise − decoupled at η = 2 in final reward
    assert "study " in out and "reward_last, primary segment_wise − decoupled at η = 2, margin ±0.05" in out
    registration = json.loads((smoke.dir / "study.json").read_text())
    assert registration["study"]["primary"] == {"treatment": "segment_wise", "at": {"rollout.max_head_offpolicyness": "2"}}
    registered = datetime.fromisoformat(registration["registered"]).timestamp()
    for run_dir in (smoke.dir / "runs").iterdir():
        events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
        started = min(e["time"] for e in events if e["event"] == "started")
        assert registered <= started + 1.0, run_dir.name  # the record keeps whole seconds
    # one seed: nothing to test with, every verdict inconclusive
    assert "Primary: segment_wise − decoupled at η = 2" in out and "verdict: inconclusive (1 pair: no variance)" in out
    rows = list(csv.DictReader(open(smoke.dir / "study.csv")))
    assert [(r["role"], r["treatment"], r["eta"]) for r in rows] == [
        ("primary", "segment_wise", "2"),
        ("secondary", "bypass", "0"),
        ("secondary", "segment_wise", "0"),
        ("secondary", "bypass", "2"),
    ]
    reward = {(m, e): float(r["reward_last_mean"]) for (m, e), r in _csv_rows(smoke).items()}
    assert float(rows[0]["difference"]) == pytest.approx(reward["segment_wise", 2] - reward["decoupled", 2])
    assert all(r["n"] == "1" and r["p"] == "" and r["verdict"] == "inconclusive (1 pair: no variance)" for r in rows)
    assert "## Study" in (smoke.dir / "summary.md").read_text()


@pytest.mark.slow
def test_every_run_records_a_complete_sdp_train_recipe(smoke):
    run_dir = _run_dir(smoke, "segment_wise", 2)
    overrides = json.loads((run_dir / "overrides.json").read_text())
    assert overrides == [
        "+preset=segment_wise",
        "rollout.max_head_offpolicyness=2",
        "seed=0",
        "+ablate=smoke",
        AS_JOB,
        f"run.dir='{run_dir}'",
    ]


def _batch_weights(run_dir):
    """Per step: raw decoupled and segment-wise weights and lags of every response token."""
    steps = []
    for path in sorted((run_dir / "batches").glob("step-*.safetensors")):
        batch = read_batch(path)
        out = batch.versions >= 0  # response tokens (prompt tokens have version −1)
        old = batch.old_logprobs[out].double()
        w_dec = np.exp(np.clip((batch.proximal_logprobs[out].double() - old).numpy(), -20, 20))
        w_seg = np.exp(np.clip((batch.proximal_logprobs_t[out].double() - old).numpy(), -20, 20))
        lags = (batch.trainer_version - batch.versions[out]).numpy()
        steps.append((w_dec, w_seg, lags))
    return steps


@pytest.mark.slow
def test_table_matches_numbers_recomputed_from_the_runs(smoke):
    rows = _csv_rows(smoke)
    for mode in MODES:
        for eta in ETAS:
            run_dir = _run_dir(smoke, mode, eta)
            row = rows[(mode, eta)]
            summary = json.loads((run_dir / "summary.json").read_text())
            steps = _batch_weights(run_dir)
            assert len(steps) == summary["steps"] == 6
            assert (row["n"], row["seeds"]) == ("1", "0")
            for short, index in (("dec", 0), ("segment_wise", 1)):
                tokens = np.concatenate([s[index] for s in steps])
                # population std over every response token of the run
                assert float(row[f"w_{short}_std_mean"]) == pytest.approx(
                    float(np.std(tokens)), rel=1e-4, abs=1e-5
                )
                assert float(row[f"w_{short}_max_mean"]) == pytest.approx(
                    float(tokens.max()), rel=1e-5
                )
                # ESS fraction mean(w)² / mean(w²) per step, averaged over the steps
                ess = np.mean([np.mean(s[index]) ** 2 / np.mean(s[index] ** 2) for s in steps])
                assert float(row[f"w_{short}_ess_mean"]) == pytest.approx(float(ess), rel=1e-5)
            lag = np.mean([s[2].mean() for s in steps])
            assert float(row["lag_mean"]) == pytest.approx(float(lag))
            metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            rewards = [m["reward/mean"] for m in metrics if "reward/mean" in m]
            window = summary["reward_window"]
            assert float(row["reward_last_mean"]) == pytest.approx(sum(rewards[-window:]) / window)
            assert float(row["acc_end_mean"]) == pytest.approx(summary["greedy_accuracy_end"])
            steps_s = sum(
                m["time/wait_s"] + m["time/train_s"] + m["time/push_s"]
                for m in metrics
                if "reward/mean" in m
            )
            tokens = [
                m["throughput/tokens_generated_total"] for m in metrics if "reward/mean" in m
            ][-1]
            assert float(row["tokens_per_s_mean"]) == pytest.approx(tokens / steps_s)
            # the loop's time is the run's wall time less thread start and stop
            assert steps_s <= summary["wall_seconds"] and float(
                row["wall_s_mean"]
            ) == pytest.approx(steps_s)
            filtered = summary["filtered_groups"] / summary["counters"]["groups_generated"]
            assert float(row["filtered_mean"]) == pytest.approx(filtered)


@pytest.mark.slow
def test_the_shadow_weights_are_the_segment_wise_and_decoupled_ratios(smoke):
    """On the same tokens: lag 0 → both weights 1; lag 1 → equal (π_{v+1} = π_c); lag 2 →
    they differ by the factor π_c/π_{v+1} the segment-wise weight drops. At lag 1 π_c is the
    trainer's forward and π_{v+1} the engine's, so they agree to float32 rounding (the lag-0
    tolerance, the same two forwards' mismatch), not bit for bit."""
    rows = _csv_rows(smoke)
    for mode in MODES:
        assert float(rows[(mode, 0)]["w_dec_std_mean"]) < 1e-5
        assert float(rows[(mode, 0)]["w_dec_ess_mean"]) == pytest.approx(1.0, abs=1e-9)
        steps = _batch_weights(_run_dir(smoke, mode, 2))
        w_dec, w_seg, lags = (np.concatenate(parts) for parts in zip(*steps))
        assert np.allclose(w_dec[lags == 0], 1.0, atol=1e-4) and np.all(w_seg[lags == 0] == 1.0)
        assert (lags == 1).any() and np.allclose(w_dec[lags == 1], w_seg[lags == 1], rtol=1e-4, atol=0)
        assert (lags == 2).any() and not np.allclose(w_dec[lags == 2], w_seg[lags == 2])


@pytest.mark.slow
def test_joblib_ran_two_runs_at_once(smoke):
    assert "n_jobs=2" in smoke.proc.stdout + smoke.proc.stderr
    spans = []
    for run_dir in sorted((smoke.dir / "runs").iterdir()):
        events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
        times = {e["event"]: e["time"] for e in events}
        spans.append((times["started"], times["finished"]))
    # a sequential launcher never has two runs between their start and end at the same time
    assert any(a0 < b1 and b0 < a1 for i, (a0, a1) in enumerate(spans) for b0, b1 in spans[i + 1 :])


@pytest.mark.slow
def test_report_reaggregates_without_running(smoke, capsys):
    before = (smoke.dir / "summary.csv").read_text()
    (smoke.dir / "summary.csv").unlink()
    code, out, _ = run_main(["ablate", "--report", str(smoke.dir), "--no-plots"], capsys)
    assert code == 0
    assert "Training outcome and cost" in out
    assert (smoke.dir / "summary.csv").read_text() == before


@pytest.mark.parametrize(
    "argv,message",
    [
        (["ablate", "nope"], "error: unknown sweep 'nope'; choose one of default, harsh, s1, s1b, s2, s3m, s3u, s4, s4b, s5, smoke"),
        (
            ["ablate", "smoke", "rollout.max_head_offpolicyness=0,-1"],
            "error: run bypass-eta-1-seed0: rollout.max_head_offpolicyness=-1 must be >= 0",
        ),
        (
            ["ablate", "smoke", "+preset=bypass,typo"],
            "error: run typo-eta0-seed0: preset=typo: no such option",
        ),
        (
            ["ablate", "smoke", "--jobs", "2", "hydra/launcher=basic"],
            "error: cannot apply hydra/launcher=basic hydra.launcher.n_jobs=2",
        ),
        (
            ["ablate", "--report", "/nonexistent/sweep"],
            "error: /nonexistent/sweep: no runs/ directory",
        ),
        (
            ["ablate", "smoke", "--against", "decoupled,segment_wise"],
            "error: --against was removed: the report compares every mode with the study's fixed baseline",
        ),
        (
            ["ablate", "smoke", "--out", "x"],
            "error: --out only applies to --report",
        ),
        (
            ["ablate", "smoke", "--no-study", "--study", "x.yaml"],
            "error: --study and --no-study contradict each other",
        ),
        (
            ["ablate", "smoke", "rollout.max_head_offpolicyness=0,4"],
            "error: study ",
        ),
        (
            ["ablate", "--report", "x", "--no-study"],
            "error: --report only aggregates an existing sweep",
        ),
        (
            ["ablate", "--report", "x", "seed=1"],
            "error: --report only aggregates an existing sweep",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, argv, message):
    code, _, err = run_main([*argv, "--dir", str(tmp_path)] if "--report" not in argv else argv, capsys)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(message), err
    assert not (tmp_path / "runs").exists()
    assert not (tmp_path / "study.json").exists() and not (tmp_path / "ablate.json").exists()


def test_a_study_that_does_not_fit_the_plan_stops_before_anything_is_written(capsys, tmp_path):
    study = tmp_path / "s.yaml"
    study.write_text("primary: {treatment: segment_wse, at: {rollout.max_head_offpolicyness: 2}}\n")
    sweep = tmp_path / "sweep"
    code, _, err = run_main(["ablate", "smoke", "--study", str(study), "--dir", str(sweep)], capsys)
    assert code == 2
    (line,) = [x for x in err.splitlines() if x.strip()]
    assert line == (
        f"error: study {study}: primary.treatment 'segment_wse' is not a mode of this sweep "
        "(bypass, decoupled, segment_wise); fix the study, pass another with --study FILE, "
        "or run without one (--no-study)"
    )
    assert not sweep.exists()
    # the primary's cell must be in the grid (η = 2 is not, here); --no-study runs without one
    code, _, err = run_main(["ablate", "smoke", "rollout.max_head_offpolicyness=0,4", "--dir", str(sweep), "--dry-run"], capsys)
    assert code == 2 and "primary.at rollout.max_head_offpolicyness=2 is not in this sweep" in err
    code, out, err = run_main(
        ["ablate", "smoke", "rollout.max_head_offpolicyness=0,4", "--dir", str(sweep), "--dry-run", "--no-study"], capsys
    )
    assert code == 0, err
    assert "study: none registered" in out and not sweep.exists()


def test_the_plan_counts_one_run_in_the_singular_and_says_when_nothing_is_swept(capsys, tmp_path):
    argv = ["ablate", "smoke", "+preset=bypass", "rollout.max_head_offpolicyness=0", "--dry-run", "--no-study"]
    code, out, err = run_main([*argv, "seed=0", "--dir", str(tmp_path / "one")], capsys)
    assert code == 0, err
    assert "  1 run (1 new); axes: none" in out.splitlines()
    code, out, err = run_main([*argv, "seed=0,1", "--dir", str(tmp_path / "two")], capsys)
    assert code == 0, err
    assert "  2 runs (2 new); axes: seed ∈ {0, 1}" in out.splitlines()


def test_a_sweep_directory_keeps_the_study_it_registered(capsys, tmp_path):
    from sdp_cli.ablate.study import Study, register

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    register(sweep, Study(margin=0.1), "earlier.yaml")
    before = (sweep / "study.json").read_text()
    code, _, err = run_main(["ablate", "smoke", "--dir", str(sweep), "--dry-run"], capsys)
    assert code == 2
    assert f"error: {sweep / 'study.json'} registered another study (metric: 'reward_last' → 'reward_last'" not in err
    assert f"error: {sweep / 'study.json'} registered another study (primary: None → " in err
    assert (sweep / "study.json").read_text() == before


def test_a_failing_run_does_not_stop_the_sweep_and_ends_in_exit_2(tmp_path):
    env = {**os.environ, "SDP_CACHE_DIR": str(tmp_path / "cache")}
    # two jobs whose data file is missing: valid config, a UserError inside each run
    # one mode: the smoke study (segment_wise − decoupled) does not fit, so none is registered
    argv = ["ablate", "smoke", "--dir", str(tmp_path / "sweep"), "--no-study", "hydra/launcher=basic"]
    argv += ["+preset=bypass", "seed=0,1", "task=gsm8k", f"task.path={tmp_path}/none.jsonl"]
    argv += ["rollout.max_head_offpolicyness=0"]
    proc = _sdp(argv, env)
    assert proc.returncode == 2
    failed = [line for line in proc.stderr.splitlines() if line.startswith("ablate: bypass-eta0-")]
    assert len(failed) == 2 and all(
        ": failed: " in line and "none.jsonl" in line for line in failed
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 2 of 2 runs did not finish (bypass-eta0-")
    assert last.endswith("fix the cause and re-run the same command (finished runs are kept)")


def test_a_run_stopped_by_a_failed_write_stops_the_sweep_from_starting_more(tmp_path):
    """A write that fails for want of room (a full disk, a quota, the file-size limit) or on a
    read-only file system fails every run after it too: the sweep used to start each of them,
    and each trained until its first write failed. Now the next ones are not started. Here a
    real file-size limit (EFBIG) fails the warm start's write of the policy in the first run."""
    env = {**os.environ, "SDP_CACHE_DIR": str(tmp_path / "cache")}
    argv = ["ablate", "smoke", "--dir", str(tmp_path / "sweep"), "--no-study", "hydra/launcher=basic"]
    argv += ["+preset=bypass", "seed=0,1,2", "rollout.max_head_offpolicyness=0"]

    def limit_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))  # the policy's weights are larger

    proc = subprocess.run(
        [sys.executable, "-m", "sdp_cli", *argv], capture_output=True, text=True, env=env, timeout=300,
        preexec_fn=limit_files,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stdout.splitlines() + proc.stderr.splitlines()
    failed = [line for line in lines if ": failed: " in line]
    assert len(failed) == 1 and "File too large" in failed[0], lines[-20:]
    assert any("the sweep starts no further runs" in line for line in lines), lines[-20:]
    assert sum(line.endswith("not started, the sweep is stopping") for line in lines) == 2, lines[-20:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 3 of 3 runs did not finish"), last
    assert last.count("bypass-eta0-") == 3 and ", ...;" not in last  # three names: all of them, no ellipsis
    assert not (tmp_path / "sweep" / ".stopping").exists()  # a re-run starts them


def _finished_state(smoke):
    return {
        p.parent.name: (p.stat().st_mtime_ns, p.read_text())
        for p in (smoke.dir / "runs").glob("*/summary.json")
    }


@pytest.mark.slow
def test_rerun_skips_finished_runs_and_resumes_interrupted_ones(smoke):
    # Interrupt one run after its step-3 checkpoint, and leave another without any checkpoint.
    resumed, restarted = _run_dir(smoke, "decoupled", 2), _run_dir(smoke, "bypass", 0)
    (resumed / "summary.json").unlink()
    shutil.rmtree(resumed / "checkpoints" / "step-000006")
    (restarted / "summary.json").unlink()
    shutil.rmtree(restarted / "checkpoints")
    untouched = _finished_state(smoke)
    assert len(untouched) == 4

    proc = _sdp(smoke.command, smoke.env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "6 runs (4 finished, 1 resumable, 1 partial)" in proc.stdout
    assert proc.stdout.count("finished earlier, skipped") == 4
    # each job says which it does: the one with a checkpoint resumes, the one without starts over
    assert f"ablate: {resumed.name}: resuming" in proc.stdout and f"ablate: {restarted.name}: training" in proc.stdout
    after = _finished_state(smoke)
    assert {name: after[name] for name in untouched} == untouched  # finished work never redone
    events = [json.loads(x) for x in (resumed / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "resumed"] == [3]
    rows = [json.loads(x) for x in (resumed / "metrics.jsonl").read_text().splitlines()]
    # the rows after the checkpoint were replaced, not duplicated
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3, 4, 5, 6]
    events = [json.loads(x)["event"] for x in (restarted / "events.jsonl").read_text().splitlines()]
    assert events.count("started") == 1 and "resumed" not in events

    # Only the launcher changes: the basic launcher finds every run finished. Without
    # --keep-checkpoints the finished runs lose their checkpoints, nothing else.
    settled = _finished_state(smoke)
    proc = _sdp([*smoke.command[:4], "hydra/launcher=basic", EXTRA], smoke.env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "6 runs (6 finished)" in proc.stdout
    assert proc.stdout.count("finished earlier, skipped") == 6
    assert _finished_state(smoke) == settled
    assert list((smoke.dir / "runs").glob("*/checkpoints")) == []
    assert len(list((smoke.dir / "runs").glob("*/metrics.jsonl"))) == 6


MARKUP = "sweep x [/] [bold] :thumbs_up:"  # "[/]" was a MarkupError, "[bold]" would be applied


@pytest.mark.slow
def test_a_path_with_rich_markup_is_printed_as_it_is(smoke, tmp_path, capsys):
    """The plan (--dry-run) and the report print the directory literally, not as markup
    ("[/]" spans two path components: a directory "sweep x [" holding "] [bold] :thumbs_up:")."""
    code, out, err = run_main(["ablate", "smoke", "--dry-run", "--dir", str(tmp_path / MARKUP / "new")], capsys)
    assert code == 0, err
    assert str(tmp_path / MARKUP / "new") in " ".join(out.split())  # rich may wrap a long path
    copy = tmp_path / MARKUP
    shutil.copytree(smoke.dir, copy, ignore=shutil.ignore_patterns("checkpoints", "plots"), dirs_exist_ok=True)
    code, out, err = run_main(["ablate", "--report", str(copy), "--no-plots"], capsys)
    assert code == 0, err
    flat = " ".join(out.split())
    assert f"sdp ablate {copy}:" in flat and f"wrote {copy / 'summary.csv'}" in flat and "👍" not in out
