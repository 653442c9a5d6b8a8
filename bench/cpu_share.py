"""Where the CPU goes in an η > 0 run: each process's share of a core (the trainer's, the rollout
process's and the local engine's), measured from /proc over a window of a running `sdp train`, with
the cores each is pinned to and the run's steps/s. It shows which side of the machine is full: at
η > 0 the trainer has its half of the cores and the rollout process shares the other half with the
engine's process (docs/training.md "Three processes"), so a sum near 100 % on that half means
generation and the recompute pass have no time left to get ahead of the trainer.

Linux only (/proc). Each configuration runs as its own `sdp train`, one after another, in an
order rotated each repeat. Prints a table and writes bench/results/cpu_share.json.

    python bench/cpu_share.py                          # decoupled and segment-wise at η = 4, 2 repeats
    python bench/cpu_share.py --modes segment_wise --repeats 1 --steps 1200 --window 20
    python bench/cpu_share.py --set rollout.groups_per_request=16   # Hydra overrides for every run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import write_results
from _scratch import KEEP_HELP, run_scratch

COMMON = ["run.progress=false", "run.tensorboard=false", "train.eval_samples=0", "train.checkpoint_every=0"]
#: the processes of a run, by what their command line runs
ROLES = {"rollout": "sdp_cli.train.session.rollout_process", "engine": "sdp_cli.engine.process_server"}
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid: int) -> tuple[int, int] | None:
    """(user, system) clock ticks the process has used, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]), int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)


def cores_of(pid: int) -> str:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


def descendants(root: int) -> dict[str, int]:
    """The run's rollout and engine processes, by role (those that exist yet)."""
    parents: dict[int, int] = {}
    commands: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            commands[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, ValueError, IndexError):
            continue
    found: dict[str, int] = {}
    for pid in parents:
        ancestor = parents.get(pid)
        while ancestor is not None and ancestor != root and ancestor > 1:
            ancestor = parents.get(ancestor)
        if ancestor != root:
            continue
        for role, marker in ROLES.items():
            # an argument of its own (`python -m <module>`), not text inside another one: a
            # process whose `-c` source names the other's module is not that process
            if marker in commands.get(pid, []):
                found[role] = pid
    return found


def measure(overrides: list[str], steps: int, skip: float, window: float, root: Path) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="cpu-", dir=root))
    env = dict(os.environ, SDP_CACHE_DIR=str(root / "cache"), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "sdp_cli", "train", *overrides, *COMMON, f"train.steps={steps}", f"run.dir={run_dir}"]
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            pids: dict[str, int] = {}
            deadline = time.monotonic() + 300
            while set(pids) != set(ROLES) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
                pids = descendants(proc.pid)
            if set(pids) != set(ROLES):
                raise SystemExit(f"no rollout and engine processes appeared (log: {log.name}); is η > 0?")
            # past the engine's start, the warm start and the first batches
            metrics = run_dir / "metrics.jsonl"
            while proc.poll() is None and (not metrics.exists() or metrics.stat().st_size == 0):
                time.sleep(0.2)
            time.sleep(skip)
            pids = {"trainer": proc.pid, **pids}
            before = {role: cpu_ticks(pid) for role, pid in pids.items()}
            t0 = time.monotonic()
            time.sleep(window)
            after = {role: cpu_ticks(pid) for role, pid in pids.items()}
            elapsed = time.monotonic() - t0
            cores = {role: cores_of(pid) for role, pid in pids.items()}
            if proc.poll() is not None or any(v is None for v in (*before.values(), *after.values())):
                raise SystemExit(f"the run ended inside the window: give more --steps (log: {log.name})")
        finally:
            if proc.poll() is None:
                proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"sdp train failed with exit code {proc.returncode}: see {log.name}")
    summary = json.loads((run_dir / "summary.json").read_text())
    share = {
        role: {
            "user": 100 * (after[role][0] - before[role][0]) / TICKS / elapsed,
            "system": 100 * (after[role][1] - before[role][1]) / TICKS / elapsed,
            "cores": cores[role],
        }
        for role in pids
    }
    return {"steps_per_second": summary["steps_per_second"], "window_s": elapsed, "processes": share}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="decoupled,segment_wise", help="presets, comma-separated")
    parser.add_argument("--eta", type=int, default=4, help="rollout.max_head_offpolicyness (> 0)")
    parser.add_argument("--steps", type=int, default=800, help="steps of each run (it must outlast --skip + --window)")
    parser.add_argument("--skip", type=float, default=4.0, help="seconds after the first step before the window")
    parser.add_argument("--window", type=float, default=10.0, help="seconds the CPU is measured over")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a Hydra override for every run (repeatable)"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cpu_share.json")
    parser.add_argument("--keep-runs", action="store_true", help=KEEP_HELP)
    args = parser.parse_args()
    if args.eta < 1:
        parser.error("--eta must be at least 1: at η = 0 the rollout side runs in sdp's own process")
    if args.repeats < 1 or args.window <= 0 or args.skip < 0:
        parser.error("--repeats must be at least 1, --window positive and --skip not negative")
    if not Path("/proc/self/stat").exists():
        parser.error("this benchmark reads /proc: Linux only")
    modes = [m for m in args.modes.split(",") if m]
    load_before = os.getloadavg()[0]
    with run_scratch("cpu", args.keep_runs) as root:
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for repeat in range(args.repeats):
            for mode in modes[repeat % len(modes) :] + modes[: repeat % len(modes)]:
                overrides = [f"+preset={mode}", f"rollout.max_head_offpolicyness={args.eta}", *args.set]
                runs[mode].append(measure(overrides, args.steps, args.skip, args.window, root))
            print(f"repeat {repeat + 1}/{args.repeats} done", flush=True)
    load_after = os.getloadavg()[0]

    rows = []
    print(f"\n{'mode':<14} {'steps/s':>8}  " + "  ".join(f"{r + ' % (cores)':>20}" for r in ("trainer", *ROLES)))
    for mode, measured in runs.items():
        row = {"mode": mode, "eta": args.eta, "steps": args.steps, "runs": measured}
        row["steps_per_second"] = statistics.median(r["steps_per_second"] for r in measured)
        row["cpu_percent"] = {
            role: statistics.median(r["processes"][role]["user"] + r["processes"][role]["system"] for r in measured)
            for role in ("trainer", *ROLES)
        }
        cores = {role: measured[0]["processes"][role]["cores"] for role in ("trainer", *ROLES)}
        rows.append(row)
        cells = "  ".join(f"{row['cpu_percent'][r]:>11.0f} ({cores[r]:>5})" for r in ("trainer", *ROLES))
        print(f"{mode:<14} {row['steps_per_second']:>8.2f}  {cells}")
    print("(medians over the repeats; user + system time over each run's window, 100 = one core)")
    print(f"load average: {load_before:.1f} before, {load_after:.1f} after (2 cores: above ~0.5 the numbers are under load)")
    write_results(
        args.out,
        "cpu_share",
        rows=rows,
        window_s=args.window,
        skip_s=args.skip,
        overrides=args.set,
        load_average={"before": load_before, "after": load_after},
    )


if __name__ == "__main__":
    main()
