"""Benchmark of `sdp train` on the tiny model (local engine and rollout side in processes of their
own, docs/training.md "Three processes"): steps/s and
tokens/s for η = 0 (synchronous) vs η = 4 (asynchronous), and the share of wall time spent in
the segment-wise recompute pass: in total (mostly ahead of the weight push, overlapping
training) and the part the trainer waited for at weight pushes.

Each configuration runs as a separate `sdp train` process (so thread settings do not leak)
with the warm start already cached; the numbers come from the run's summary.json, whose clock
times the training loop alone (not setup, the initial evaluation, setup's garbage collection or
closing the engine). Prints a table and writes bench/results/train.json.
The split of the wall time (the trainer's steps, waiting for a batch) sums metrics.jsonl's
time/train_s and time/wait_s. For each mode the bench also runs η = 0 with the trainer on the
threads it gets when η > 0 (half the cores), which gives the async ceiling: the most any η > 0
can gain over η = 0 on this machine, even if generation and the recompute pass cost the trainer
nothing, = (η = 0 seconds per step) / (the trainer's step on its η > 0 share of the cores).
A second table splits each configuration's step into parts (``step_parts``): the trainer's
step here and alone, waiting, the trainer's part of the push and the rest, so that at η > 0 the
distance to the ceiling is shown by cause, with the speedup left without the sharing and the
waiting (what a trainer that nothing slows and that never waits for a batch would reach). The last
lines check the targets of issue 26: η = 4
at least 1.15× η = 0 for both modes (at least 93 % of the ceiling), segment-wise η = 4 within
5 % of decoupled η = 4. Every repeat runs all six configurations one after another, in an order
rotated each repeat, and each ratio is
the median of its per-repeat ratios (runs paired within a repeat), printed with their range: a
drift of the machine between configurations would otherwise enter the ratios. Each target is
also judged by a test (``judge``): the paired repeats' log-ratios against the target's, one-sided
at α = 0.05 with Holm's correction over the three targets, so a verdict says "met", "below" or
"unresolved" and, when unresolved, the ratio the design could have told from the target. A last
line compares segment-wise η = 4 with decoupled η = 4 per generated token (``per_token_ratio``): each
mode's answers are as long as its own policy makes them, so a step is not the same work in both. Each run's
CPU time per step is measured too (``watch_cpu``: user + system time of the trainer's, the rollout and the
engine processes, from /proc, over its steps after the tenth), and the last lines say whether segment-wise
η = 4's work per step could reach 95 % of decoupled η = 4's steps/s on this machine at all, with every core
busy all the time, and at decoupled's own use of the cores (``cpu_budget``), and how busy each mode kept the
trainer's core and the rollout and engine's (the fuller one decides what the recompute pass costs). The load
average before and after is printed and stored: numbers measured under load are not benchmark numbers.

    python bench/train.py            # 60 steps per configuration, 5 repeats
    python bench/train.py --steps 20 --repeats 1
    python bench/train.py --in-process   # engine and rollout side in sdp's process (engine.in_process)
    python bench/train.py --set rollout.groups_per_request=16   # Hydra overrides for every run
    python bench/train.py --judge bench/results/train.json     # the verdicts of a stored run, again
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import write_results
from _scratch import KEEP_HELP, run_scratch
from cpu_share import TICKS, cpu_ticks, descendants

from sdp_cli.ablate.stats import holm, minimum_detectable_effect, paired_t, student_t_cdf, student_t_sf
from sdp_cli.rundir import RunDir

CONFIGS = [
    ("decoupled", 0, ["+preset=decoupled", "rollout.max_head_offpolicyness=0"]),
    ("decoupled", 4, ["+preset=decoupled", "rollout.max_head_offpolicyness=4"]),
    ("segment_wise", 0, ["+preset=segment_wise", "rollout.max_head_offpolicyness=0"]),
    ("segment_wise", 4, ["+preset=segment_wise", "rollout.max_head_offpolicyness=4"]),
]
#: the loop's timed parts of each step in metrics.jsonl: the trainer's step, waiting for a batch,
#: the trainer's part of the weight push
TIMED = ("time/train_s", "time/wait_s", "time/push_s")
COMMON = ["run.progress=false", "run.tensorboard=false", "train.eval_samples=0", "train.checkpoint_every=0"]


#: issue 26's targets: η = 4 over η = 0 for each mode, and segment-wise η = 4 over decoupled η = 4
TARGET_SPEEDUP = 1.15
TARGET_SEGMENT_VS_DECOUPLED = 0.95
#: one-sided level of each target's test (Holm's correction over the three), and the power at
#: which the design's detectable ratio is quoted
ALPHA = 0.05
POWER = 0.8


def run_once(overrides: list[str], steps: int, root: Path, cache: Path) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="bench-", dir=root))
    env = dict(os.environ, SDP_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "sdp_cli", "train", *overrides, *COMMON, f"train.steps={steps}", f"run.dir={run_dir}"]
    log_path = run_dir.parent / f"{run_dir.name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            cpu = watch_cpu(proc, run_dir / "metrics.jsonl", skip_rows=min(CPU_SKIP_ROWS, steps // 4))
        finally:
            if proc.poll() is None:  # interrupted: the run does not outlive the bench
                proc.terminate()
            proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
    run = RunDir(run_dir)
    summary = json.loads(run.summary.read_text())
    steps = [json.loads(line) for line in run.metrics.read_text().splitlines() if line.strip()]
    # where the wall time goes: the trainer's steps, and waiting for batches (shares of the wall)
    for key in TIMED:
        summary[key] = sum(row[key] for row in steps) / summary["wall_seconds"]
    # the loop's own work per step: between two rows of metrics.jsonl, what the three timed
    # parts leave (the run's start and end, e.g. its last checkpoint, fall outside these rows)
    if len(steps) >= 2:
        between = (steps[-1]["time"] - steps[0]["time"]) / (len(steps) - 1)
        timed = statistics.fmean(sum(row[k] for k in TIMED) for row in steps[1:])
        summary["loop_seconds_per_step"] = between - timed
    summary["cpu_ms_per_step"] = cpu
    return summary


#: rows of metrics.jsonl (steps) a run makes before its CPU is counted: the pipeline filling up
CPU_SKIP_ROWS = 10
#: seconds between two looks at a running run's metrics.jsonl and CPU ticks
CPU_POLL_S = 0.05


def watch_cpu(proc: subprocess.Popen, metrics: Path, *, skip_rows: int) -> dict[str, float] | None:
    """The CPU time per step of each process of a running `sdp train` (its own, and the rollout
    and engine processes below it: ``cpu_share.descendants``), in ms, over the steps
    from its ``skip_rows``-th row of ``metrics`` to its last; returns when the run has ended.

    User + system ticks are read each time new rows have appeared, so the window closes at the
    last step, before the run's end (its last checkpoint, stopping the producer) adds CPU but no
    step. None when the run made no step after ``skip_rows`` or a process of the window was
    replaced (an engine restart: its ticks went with it)."""
    rows, offset = 0, 0
    pids: dict[str, int] | None = None
    first: tuple[int, dict] | None = None
    last: tuple[int, dict] | None = None
    while proc.poll() is None:
        time.sleep(CPU_POLL_S)
        try:
            with open(metrics, "rb") as f:
                f.seek(offset)
                chunk = f.read()
        except FileNotFoundError:
            continue
        offset += len(chunk)
        new_rows = chunk.count(b"\n")
        if not new_rows:
            continue
        rows += new_rows
        if pids is None:  # by the first step the rollout and engine processes run
            pids = {"trainer": proc.pid, **descendants(proc.pid)}
        snapshot = (rows, {role: cpu_ticks(pid) for role, pid in pids.items()})
        if first is None and rows > skip_rows:
            first = snapshot
        last = snapshot
    if pids is None or first is None or last is None or last[0] == first[0]:
        return None
    if any(first[1][role] is None or last[1][role] is None for role in pids):
        return None
    steps = last[0] - first[0]
    return {role: 1000.0 * (sum(last[1][role]) - sum(first[1][role])) / TICKS / steps for role in pids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "train.json")
    parser.add_argument("--keep-runs", action="store_true", help=KEEP_HELP)
    parser.add_argument("--in-process", action="store_true", help="run the local engine and the rollout side in sdp's process")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a Hydra override for every run (repeatable)"
    )
    parser.add_argument("--judge", type=Path, metavar="JSON", help="print the verdicts of a stored run and exit")
    args = parser.parse_args()
    if args.judge is not None:
        try:
            rows = json.loads(args.judge.read_text())["rows"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"--judge {args.judge}: not a bench/train.py result ({exc}); give a file it wrote") from None
        check_targets(rows)
        return
    engine = (["engine.in_process=true"] if args.in_process else []) + args.set
    load_before = os.getloadavg()[0]

    with run_scratch("train", args.keep_runs) as root:
        cache = root / "cache"
        # warm the warm-start cache once so that no configuration pays for it
        run_once([*CONFIGS[0][2], *engine], 1, root, cache)

        # the trainer's step on the threads it gets when η > 0 (train/session/placement.py thread_counts)
        half = max(1, (os.cpu_count() or 1) // 2)
        plan = [(mode, eta, overrides, False) for mode, eta, overrides in CONFIGS]
        plan += [(mode, eta, overrides, True) for mode, eta, overrides in CONFIGS if eta == 0]
        # Every repeat runs every configuration, in an order rotated by one each repeat: a drift of
        # the machine then hits all configurations alike, and the ratios pair runs of one repeat.
        runs: dict[tuple[str, int, bool], list[dict]] = {}
        for repeat in range(args.repeats):
            for mode, eta, overrides, alone in rotated(plan, repeat):
                threads = [f"train.threads={half}"] if alone else []
                summary = run_once([*overrides, *engine, *threads], args.steps, root, cache)
                runs.setdefault((mode, eta, alone), []).append(summary)
            print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)
    alone = {
        mode: statistics.median(r["time/train_s"] * r["wall_seconds"] / r["steps"] for r in runs[(mode, 0, True)])
        for mode, eta, _ in CONFIGS
        if eta == 0
    }

    rows = []
    for mode, eta, _ in CONFIGS:
        config_runs = runs[(mode, eta, False)]
        sps = [r["steps_per_second"] for r in config_runs]
        tps = [r["tokens_per_second"] for r in config_runs]
        rows.append(
            {
                "mode": mode,
                "max_head_offpolicyness": eta,
                "steps": args.steps,
                "repeats": args.repeats,
                "steps_per_second_median": statistics.median(sps),
                "steps_per_second_all": sps,
                "seconds_per_step_median": statistics.median(r["wall_seconds"] / r["steps"] for r in config_runs),
                "tokens_per_second_median": statistics.median(tps),
                "tokens_per_second_all": tps,
                "cpu_ms_per_step_all": [r["cpu_ms_per_step"] for r in config_runs],
                "cores": os.cpu_count() or 1,
                "recompute_share_median": statistics.median(r["recompute_share"] for r in config_runs),
                "recompute_blocking_share_median": statistics.median(r["recompute_blocking_share"] for r in config_runs),
                "train_share_median": statistics.median(r["time/train_s"] for r in config_runs),
                "wait_share_median": statistics.median(r["time/wait_s"] for r in config_runs),
                "trainer_step_seconds_half_cores": alone[mode],
                "step_parts_ms": step_parts(config_runs, alone[mode], overlapped=eta > 0),
                "lag_note": "all tokens lag 0" if eta == 0 else "tokens lag up to η",
            }
        )

    header = (
        f"{'mode':<14}{'η':>3}{'steps/s':>10}{'tokens/s':>11}{'recompute share':>17}{'trainer blocked':>17}"
        f"{'training':>10}{'waiting':>9}{'async ceiling':>15}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        # At η > 0 the trainer's step runs on half the cores while generation takes the rest:
        # however well the rest is hidden, a step takes at least the trainer's step there.
        ceiling = ""
        if r["max_head_offpolicyness"] == 0:
            r["async_ceiling"] = r["seconds_per_step_median"] / r["trainer_step_seconds_half_cores"]
            ceiling = f"{r['async_ceiling']:.2f}×"
        print(
            f"{r['mode']:<14}{r['max_head_offpolicyness']:>3}{r['steps_per_second_median']:>10.2f}"
            f"{r['tokens_per_second_median']:>11.0f}{100 * r['recompute_share_median']:>16.1f}%"
            f"{100 * r['recompute_blocking_share_median']:>16.1f}%"
            f"{100 * r['train_share_median']:>9.1f}%{100 * r['wait_share_median']:>8.1f}%"
            f"{ceiling:>15}"
        )
    speedup_without_sharing(rows)
    print_step_parts(rows)
    load_after = os.getloadavg()[0]
    targets = check_targets(rows)
    print(f"load average: {load_before:.1f} before, {load_after:.1f} after (2 cores: above ~0.5 the numbers are under load)")
    write_results(
        args.out,
        "train",
        config="defaults (tiny model h128-L4, arith1, B=16 groups × 8 samples, local engine "
        + ("and rollout side in sdp's process)" if args.in_process else "and rollout side in processes of their own)")
        + "".join(f", {o}" for o in args.set),
        rows=rows,
        targets=targets,
        load_average={"before": load_before, "after": load_after},
    )


#: the parts of a step, in the order they are printed (``step_parts``)
PARTS = ("step", "trainer_alone", "trainer", "sharing", "waiting", "push", "loop", "start_end")


def step_parts(runs: list[dict], alone_s: float, *, overlapped: bool) -> dict[str, float | None]:
    """Where a configuration's step goes, ms per step (medians over its runs): the whole step;
    the trainer's step (batch assembly included, ``time/train_s``) here and alone on its η > 0
    share of the cores; ``sharing``, the difference: what running beside generation, the
    recompute pass and the other processes' and threads' work costs the trainer's step; waiting for a batch; the
    trainer's part of the weight push (``time/push_s``); ``loop``, the loop's own work between
    steps (metrics, logging: ``run_once``'s ``loop_seconds_per_step``); and ``start_end``, the
    rest: the run's start and end (its last checkpoint, stopping the producer) spread over its
    steps. step = trainer + waiting + push + loop + start_end, so at η > 0 (``overlapped``) the
    loss to the ceiling, step − trainer_alone, is the sum of the five other parts. At η = 0 the
    trainer has every core to itself and ``sharing`` is None."""

    def per_step(run: dict, key: str) -> float:
        return 1000.0 * run[key] * run["wall_seconds"] / run["steps"]

    def median(values) -> float:
        return statistics.median(list(values))

    parts = {
        "step": median(1000.0 * r["wall_seconds"] / r["steps"] for r in runs),
        "trainer_alone": 1000.0 * alone_s,
        "trainer": median(per_step(r, "time/train_s") for r in runs),
        "waiting": median(per_step(r, "time/wait_s") for r in runs),
        "push": median(per_step(r, "time/push_s") for r in runs),
        "loop": median(1000.0 * r["loop_seconds_per_step"] for r in runs),
    }
    parts["start_end"] = parts["step"] - parts["trainer"] - parts["waiting"] - parts["push"] - parts["loop"]
    shared: dict[str, float | None] = {**parts, "sharing": parts["trainer"] - parts["trainer_alone"] if overlapped else None}
    return {name: shared[name] for name in PARTS}


def speedup_without_sharing(rows: list[dict]) -> None:
    """For each η > 0 row, the speedup over its mode's η = 0 step if sharing the machine and
    waiting for batches cost nothing (``speedup_without_sharing``), an estimate from the parts;
    the push, the loop's own work and the run's start and end stay."""
    sync = {r["mode"]: r["step_parts_ms"]["step"] for r in rows if r["max_head_offpolicyness"] == 0}
    for r in rows:
        p = r["step_parts_ms"]
        if r["max_head_offpolicyness"] > 0 and r["mode"] in sync:
            r["speedup_without_sharing"] = sync[r["mode"]] / (p["step"] - p["sharing"] - p["waiting"])


def print_step_parts(rows: list[dict]) -> None:
    """The parts of each configuration's step, and for η > 0 its loss to the ceiling by part."""
    print()
    header = f"{'ms per step (medians)':<20}" + "".join(f"{name.replace('_', ' '):>15}" for name in PARTS)
    print(header)
    print("-" * len(header))
    for r in rows:
        label = f"{r['mode']} η={r['max_head_offpolicyness']}"
        values = [r["step_parts_ms"][name] for name in PARTS]
        print(f"{label:<20}" + "".join(f"{'–':>15}" if v is None else f"{v:>15.1f}" for v in values))
    for r in rows:
        if r["max_head_offpolicyness"] > 0:
            p = r["step_parts_ms"]
            print(
                f"{r['mode']} η={r['max_head_offpolicyness']}: {p['step'] - p['trainer_alone']:.1f} ms per step above the "
                f"trainer's step alone (the ceiling's): sharing the machine {p['sharing']:.1f}, "
                f"waiting {p['waiting']:.1f}, the push {p['push']:.1f}, the loop {p['loop']:.1f}, the run's start "
                f"and end {p['start_end']:.1f}"
                + (
                    f"; without the sharing and the waiting {r['speedup_without_sharing']:.2f}× η=0"
                    if "speedup_without_sharing" in r
                    else ""
                )
            )
    print()


def judge(ratios: list[float], target: float) -> dict[str, float | int | None]:
    """A target on a ratio, tested on its paired repeats: the paired t test of log(ratio_i) −
    log(target) (ratios multiply, so their logs are what a t test averages). Returns the geometric
    mean, the one-sided (1 − α) bounds (the ratio is above ``low`` and below ``high``, each at
    level α), the one-sided p-values of "above the target" and "below the target", and the
    ratios the design tells from the target with power ``POWER`` (the target times exp(∓MDE)).
    Fewer than two repeats: the p-values and bounds are None."""
    n = len(ratios)
    out: dict[str, float | int | None] = {"n": n, "geometric_mean": math.exp(statistics.fmean(map(math.log, ratios)))}
    if n < 2:
        return {**out, "low": None, "high": None, "p_above": None, "p_below": None, "detectable": None}
    # the two-sided 1 − 2α interval: its ends are the one-sided (1 − α) bounds
    test = paired_t([math.log(r) - math.log(target) for r in ratios], 2 * ALPHA)
    if test.se == 0.0:  # every repeat gave the same ratio
        p_above, p_below = (0.0 if test.mean > 0 else 1.0), (0.0 if test.mean < 0 else 1.0)
    else:
        p_above, p_below = student_t_sf(test.t, test.dof), student_t_cdf(test.t, test.dof)
    mde = minimum_detectable_effect(test.sd, n, 2 * ALPHA, POWER)  # one-sided α
    return {
        **out,
        "low": target * math.exp(test.low),
        "high": target * math.exp(test.high),
        "p_above": p_above,
        "p_below": p_below,
        "detectable": (target * math.exp(-mde), target * math.exp(mde)),
    }


def verdicts(judged: dict[str, dict]) -> dict[str, tuple[str, float | None]]:
    """Each target's verdict and its Holm-adjusted p-value (over the targets, per side): "met"
    or "below" where that side's adjusted p is under α, else "unresolved" (with the smaller
    adjusted p of the two sides); None without a test."""
    names = [name for name, j in judged.items() if j["p_above"] is not None]
    adjusted = {
        side: dict(zip(names, holm([judged[name][side] for name in names]), strict=True))
        for side in ("p_above", "p_below")
    }
    out: dict[str, tuple[str, float | None]] = {name: ("unresolved", None) for name in judged}
    for name in names:
        above, below = adjusted["p_above"][name], adjusted["p_below"][name]
        if above < ALPHA:
            out[name] = ("met", above)
        elif below < ALPHA:
            out[name] = ("below", below)
        else:
            out[name] = ("unresolved", min(above, below))
    return out


def check_targets(rows: list[dict]) -> dict[str, float | bool | list[float] | dict]:
    """Print and return issue 26's ratios, each next to the ceiling of its mode. A ratio is taken
    within each repeat (runs of one repeat ran minutes apart); the median of those is printed with
    their range, and the verdict is the test's (``judge``, ``verdicts``)."""
    sps = {(r["mode"], r["max_head_offpolicyness"]): r["steps_per_second_all"] for r in rows}
    ceiling = {r["mode"]: r["async_ceiling"] for r in rows if r["max_head_offpolicyness"] == 0}
    out: dict[str, float | bool | list[float] | dict] = {}

    def paired(a: tuple[str, int], b: tuple[str, int]) -> list[float]:
        return [x / y for x, y in zip(sps[a], sps[b], strict=True)]

    targets = {
        "decoupled_speedup": (paired(("decoupled", 4), ("decoupled", 0)), TARGET_SPEEDUP),
        "segment_wise_speedup": (paired(("segment_wise", 4), ("segment_wise", 0)), TARGET_SPEEDUP),
        "segment_vs_decoupled_eta4": (paired(("segment_wise", 4), ("decoupled", 4)), TARGET_SEGMENT_VS_DECOUPLED),
    }
    judged = {name: judge(ratios, target) for name, (ratios, target) in targets.items()}
    verdict = verdicts(judged)

    def tested(name: str) -> str:
        j, (said, p) = judged[name], verdict[name]
        if p is None:
            return "one repeat: no test"
        text = f"{said} (Holm p = {p:.2g}; one-sided 95 % bounds {j['low']:.3f} and {j['high']:.3f})"
        if said == "unresolved":
            low, high = j["detectable"]
            text += f"; these repeats tell a ratio below {low:.3f} or above {high:.3f} from the target, with power {POWER}"
        return text

    for mode in ("decoupled", "segment_wise"):
        name = f"{mode}_speedup"
        ratios = targets[name][0]
        speedup = statistics.median(ratios)
        out[name], out[f"{name}_by_repeat"] = speedup, ratios
        out[f"{mode}_share_of_ceiling"] = speedup / ceiling[mode]
        out[f"{name}_met"] = verdict[name][0] == "met"
        print(
            f"{mode}: η=4 is {speedup:.2f}× η=0 (median of {len(ratios)} paired repeats, range "
            f"{min(ratios):.2f}–{max(ratios):.2f}; target ≥ {TARGET_SPEEDUP}×), {100 * speedup / ceiling[mode]:.0f} % "
            f"of the ceiling {ceiling[mode]:.2f}× — {tested(name)}"
        )
    name = "segment_vs_decoupled_eta4"
    ratios = targets[name][0]
    ratio = statistics.median(ratios)
    out[name], out[f"{name}_by_repeat"] = ratio, ratios
    out["segment_vs_decoupled_met"] = verdict[name][0] == "met"
    print(
        f"segment-wise η=4 is {100 * ratio:.1f} % of decoupled η=4 (median of paired repeats, range "
        f"{100 * min(ratios):.1f}–{100 * max(ratios):.1f} %; target ≥ {100 * TARGET_SEGMENT_VS_DECOUPLED:.0f} %) — "
        f"{tested(name)}"
    )
    out["tests"] = {
        name: {**judged[name], "target": targets[name][1], "verdict": verdict[name][0], "p_holm": verdict[name][1]}
        for name in targets
    }
    per_token = per_token_ratio(rows)
    if per_token is not None:
        out.update(per_token)
    budget = cpu_budget(rows)
    if budget is not None:
        out.update(budget)
    return out


def eta4_pair(rows: list[dict]) -> tuple[dict, dict]:
    """The rows of segment-wise η = 4 and decoupled η = 4 ({} for one that is missing)."""
    by = {(r["mode"], r["max_head_offpolicyness"]): r for r in rows}
    return by.get(("segment_wise", 4), {}), by.get(("decoupled", 4), {})


def per_token_ratio(rows: list[dict]) -> dict[str, float | list[float]] | None:
    """Segment-wise η = 4 against decoupled η = 4 per generated token, paired by repeat, and how
    many more tokens a step of segment-wise generated: each mode's answers are as long as its own
    policy makes them, so a step of one mode is not the same work as a step of the other. A
    diagnostic printed under the targets, not one of them. None for results without per-repeat
    token rates (written before they were stored)."""
    seg, dec = eta4_pair(rows)
    if "tokens_per_second_all" not in seg or "tokens_per_second_all" not in dec:
        return None
    ratios = [a / b for a, b in zip(seg["tokens_per_second_all"], dec["tokens_per_second_all"], strict=True)]
    per_step = [
        (ts / ss) / (td / sd)
        for ts, ss, td, sd in zip(
            seg["tokens_per_second_all"], seg["steps_per_second_all"],
            dec["tokens_per_second_all"], dec["steps_per_second_all"], strict=True,
        )
    ]  # fmt: skip
    ratio, longer = statistics.median(ratios), statistics.median(per_step)
    print(
        f"per generated token, segment-wise η=4 is {100 * ratio:.1f} % of decoupled η=4 (median of paired repeats, "
        f"range {100 * min(ratios):.1f}–{100 * max(ratios):.1f} %), its steps generating {100 * (longer - 1):+.1f} % "
        "tokens (each mode's answers are as long as its policy makes them; a diagnostic, not a target)"
    )
    return {
        "segment_vs_decoupled_eta4_per_token": ratio,
        "segment_vs_decoupled_eta4_per_token_by_repeat": ratios,
        "segment_vs_decoupled_eta4_tokens_per_step": longer,
    }


#: the processes of a run whose CPU time ``watch_cpu`` counts
PROCESSES = ("trainer", "rollout", "engine")


def cpu_medians(runs: list[dict[str, float]]) -> tuple[dict[str, float], float]:
    """Over runs (``watch_cpu``'s results), each process's median ms of CPU per step, and the median
    of the runs' totals (not the sum of the processes' medians)."""
    roles = {role: statistics.median(run.get(role, 0.0) for run in runs) for role in PROCESSES}
    return roles, statistics.median(sum(run.values()) for run in runs)


def rotated(plan: list, repeat: int) -> list:
    """``plan`` in the order of repeat ``repeat``: rotated by one each repeat, so that a drift of
    the machine hits every configuration alike."""
    shift = repeat % len(plan)
    return plan[shift:] + plan[:shift]


def cpu_budget(rows: list[dict]) -> dict | None:
    """Whether the machine's cores can do segment-wise η = 4's work at 95 % of decoupled η = 4's
    steps/s. A run's CPU time per step (``watch_cpu``, all its processes) bounds its steps/s by
    what its cores give: cores × 1000 / (ms per step) with every core busy all the time, and
    with the processes as sdp places them (the trainer on one half of the cores, the rollout and
    engine processes on the other: ``sdp_cli/train/session/placement.py``) the fuller half's.
    A third ratio needs no bound on either mode's overlap: decoupled's CPU per step over
    segment-wise's, the fraction of decoupled's steps/s segment-wise reaches if it keeps the cores
    as busy as decoupled kept them. Per repeat, each of the three over decoupled's measured steps/s
    is judged against the target like the targets are (``judge``, Holm over the three, apart from
    the three targets): "below" all cores says that no overlap, however perfect, brings this work
    within the target on this machine; "below" as placed, that the fuller half of the cores
    cannot; "below" at decoupled's core use, that segment-wise would have to keep the cores busier
    than decoupled does. Each mode's use of each half (its CPU per step there × steps/s, median
    over runs) is printed and stored as ``{mode}_cores_busy``. None for results without CPU times
    (written before they were measured) or with a run that has none."""
    seg, dec = eta4_pair(rows)
    cpu = {"segment_wise": seg.get("cpu_ms_per_step_all"), "decoupled": dec.get("cpu_ms_per_step_all")}
    if any(not runs or any(run is None for run in runs) for runs in cpu.values()):
        return None
    cores = seg["cores"]
    half = max(1, cores // 2)
    rest = cores - half  # the cores of the rollout and engine processes; none on one core: nothing placed apart

    def all_cores(run: dict) -> float:
        return 1000.0 * cores / sum(run.values())

    def beside(run: dict) -> float:  # ms a step of the processes placed beside the trainer
        return run.get("rollout", 0.0) + run.get("engine", 0.0)

    def as_placed(run: dict) -> float:  # the fuller half decides; no processes of its own or no rest: nothing placed
        other = beside(run)
        if not other or not rest:
            return all_cores(run)
        return min(1000.0 * half / run["trainer"], 1000.0 * rest / other)

    def busy(run: dict, sps: float) -> dict[str, float]:  # share of each half's core time the run used
        beside_cores = rest or half  # one core: both shares are of that core
        return {"trainer": run["trainer"] * sps / (1000.0 * half), "rollout_engine": beside(run) * sps / (1000.0 * beside_cores)}

    trainers = "the trainer's core" if half == 1 else f"the trainer's {half} cores"
    out: dict = {}
    for mode, runs in cpu.items():
        roles, total = cpu_medians(runs)
        out[f"{mode}_cpu_ms_per_step"] = {**roles, "total": total}
        print(
            f"{mode} η=4 uses {total:.1f} ms of CPU per step (the trainer {roles['trainer']:.1f}, the rollout process "
            f"{roles['rollout']:.1f}, the engine {roles['engine']:.1f}; medians): with all {cores} cores busy that "
            f"work allows at most {1000.0 * cores / total:.2f} steps/s, as sdp places the processes {as_placed(roles):.2f}"
        )
        # which half is the fuller one decides whether segment-wise's recompute pass costs steps
        sps_all = (seg if mode == "segment_wise" else dec)["steps_per_second_all"]
        shares = [busy(run, sps) for run, sps in zip(runs, sps_all, strict=True)]
        used = {half_name: statistics.median(s[half_name] for s in shares) for half_name in ("trainer", "rollout_engine")}
        out[f"{mode}_cores_busy"] = used
        print(
            f"{mode} η=4 keeps {trainers} {100 * used['trainer']:.0f} % busy and the rollout and engine's "
            f"{100 * used['rollout_engine']:.0f} % (medians over runs of CPU per step × steps/s)"
        )
    bounds = {
        name: [bound(run) / sps for run, sps in zip(cpu["segment_wise"], dec["steps_per_second_all"], strict=True)]
        for name, bound in (("all_cores", all_cores), ("as_placed", as_placed))
    }
    bounds["equal_use"] = [sum(d.values()) / sum(s.values()) for s, d in zip(cpu["segment_wise"], cpu["decoupled"], strict=True)]
    judged = {name: judge(ratios, TARGET_SEGMENT_VS_DECOUPLED) for name, ratios in bounds.items()}
    verdict = verdicts(judged)  # Holm over the three bounds
    meaning = {"below": "beyond this machine for this work", "met": "within the cores' reach", "unresolved": "unresolved"}
    how = {
        "all_cores": "with every core busy all the time",
        "as_placed": f"as sdp places the processes (the trainer on {half} of the {cores} cores, the rollout and engine "
        "processes on the rest)",
        "equal_use": "with the cores as busy as decoupled kept them",
    }
    meanings = {name: meaning for name in bounds}
    meanings["equal_use"] = {**meaning, "below": "only with the cores busier than decoupled keeps them"}
    for name, ratios in bounds.items():
        j, (said, p) = judged[name], verdict[name]
        test = (
            "one repeat: no test"
            if p is None
            else f"one-sided 95 % bounds {j['low']:.3f} and {j['high']:.3f}, Holm p = {p:.2g} over the three bounds"
        )
        print(
            f"segment-wise η=4's work per step, {how[name]}, allows at most {100 * statistics.median(ratios):.1f} % of "
            f"decoupled η=4's steps/s (median of paired repeats, range {100 * min(ratios):.1f}–{100 * max(ratios):.1f} %; "
            f"{test}) against the target's {100 * TARGET_SEGMENT_VS_DECOUPLED:.0f} %: {meanings[name][said]}"
        )
        key = "segment_vs_decoupled_cpu_bound" + {"all_cores": "", "as_placed": "_as_placed", "equal_use": "_equal_use"}[name]
        out[key], out[f"{key}_by_repeat"] = statistics.median(ratios), ratios
        out[f"{key}_test"] = {**j, "verdict": said, "p_holm": p}
    return out


if __name__ == "__main__":
    main()
