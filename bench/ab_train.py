"""Two versions of sdp against each other: steps/s (or the wall time) of `sdp train` from two checkouts, paired.

For a change that should make training faster (or must not make it slower), bench/train.py's
ratios within one version are not enough: a change can move η = 0 and η = 4 together. This bench
runs the same configurations from a checkout *before* and one *after*, alternating which goes
first in each pair (so a drift of the machine hits both alike), and reports per configuration
the median steps/s of each and the after/before ratio: the median of the paired ratios, their
range, and a two-sided 95 % interval of their geometric mean (paired t test of the log ratios;
with Holm's correction over the configurations for the verdict "faster", "slower" or "no
difference shown"). The load average before and after is stored: numbers measured under load are
not benchmark numbers. Each run is a separate `sdp train` process with the checkout first on
``PYTHONPATH`` (its rollout and engine processes follow it), and the warm-start cache is each
checkout's own. Prints a table and writes bench/results/ab_train.json.

``--measure wall_seconds`` compares the whole command's wall time instead, from its start to its
exit (start-up included: a run of one step measures sdp's start-up); its verdicts are "shorter"
and "longer".

    python bench/ab_train.py --before /path/to/old/checkout --after . --pairs 3
    python bench/ab_train.py --before ../base --after . --etas 4 --modes segment_wise --steps 100
    python bench/ab_train.py --before ../base --after . --set +debug=fast   # Hydra overrides for every run
    python bench/ab_train.py --before ../base --after . --measure wall_seconds --steps 1 --etas 4 --modes segment_wise
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

from _results import commit_of, write_results
from _scratch import KEEP_HELP, run_scratch

from sdp_cli.ablate.stats import holm, paired_t

COMMON = ["run.progress=false", "run.tensorboard=false", "train.eval_samples=0", "train.checkpoint_every=0"]
#: the level of the interval and of the verdicts
ALPHA = 0.05


#: what a run is measured by, and the verdicts of a ratio above and below 1
MEASURES = {"steps_per_second": ("faster", "slower"), "wall_seconds": ("longer", "shorter")}


def run_once(checkout: Path, overrides: list[str], root: Path, cache: Path, measure: str = "steps_per_second") -> float:
    """One `sdp train` run of ``checkout``'s sdp: its steps/s (its summary.json's) or the wall
    seconds of the command, from its start to its exit."""
    run_dir = Path(tempfile.mkdtemp(prefix="ab-", dir=root))
    env = dict(os.environ, PYTHONPATH=str(checkout), SDP_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "sdp_cli", "train", *overrides, *COMMON, f"run.dir={run_dir}"]
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=checkout, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: {' '.join(cmd)} exited with {done.returncode}:\n{done.stderr[-3000:]}")
    if measure == "wall_seconds":
        return wall
    return float(json.loads((run_dir / "summary.json").read_text())["steps_per_second"])


def compare(before: list[float], after: list[float]) -> dict[str, float | list[float] | None]:
    """The paired ratios after/before: median, range, geometric mean and its two-sided (1 − α)
    interval and p-value (a paired t test of the log ratios; None with one pair)."""
    ratios = [a / b for a, b in zip(after, before, strict=True)]
    logs = [math.log(r) for r in ratios]
    out: dict[str, float | list[float] | None] = {
        "ratios": ratios,
        "ratio_median": statistics.median(ratios),
        "geometric_mean": math.exp(statistics.fmean(logs)),
        "low": None,
        "high": None,
        "p": None,
    }
    if len(ratios) >= 2:
        test = paired_t(logs, ALPHA)
        out.update(low=math.exp(test.low), high=math.exp(test.high), p=test.p)
    return out


def verdicts(results: list[dict], measure: str = "steps_per_second") -> None:
    """Each configuration's verdict, Holm-adjusted over the configurations (in place)."""
    above, below = MEASURES[measure]
    tested = [r for r in results if r["p"] is not None]
    for r, p in zip(tested, holm([r["p"] for r in tested]), strict=True):
        r["p_holm"] = p
        r["verdict"] = "no difference shown" if p >= ALPHA else (above if r["geometric_mean"] > 1 else below)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the checkout to compare against")
    parser.add_argument("--after", type=Path, required=True, help="the checkout of the change")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--measure", choices=list(MEASURES), default="steps_per_second")
    parser.add_argument("--modes", default="decoupled,segment_wise", help="presets, comma-separated")
    parser.add_argument("--etas", default="0,4", help="rollout.max_head_offpolicyness values, comma-separated")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a Hydra override for every run (repeatable)"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "ab_train.json")
    parser.add_argument("--keep-runs", action="store_true", help=KEEP_HELP)
    args = parser.parse_args()
    checkouts = {"before": args.before.resolve(), "after": args.after.resolve()}
    for name, path in checkouts.items():
        if not (path / "sdp_cli" / "__init__.py").is_file():
            parser.error(f"--{name} {path}: not an sdp checkout (no sdp_cli/__init__.py); give the checkout's root")
    if args.pairs < 1 or args.steps < (1 if args.measure == "wall_seconds" else 2):
        parser.error("--pairs must be at least 1 and --steps at least 2 (1 with --measure wall_seconds)")
    configs = [(m, int(e)) for m in args.modes.split(",") if m for e in args.etas.split(",") if e]
    load_before = os.getloadavg()[0]
    with run_scratch("ab", args.keep_runs) as root:
        sps: dict[tuple[str, int, str], list[float]] = {}
        for pair in range(args.pairs):
            for k, (mode, eta) in enumerate(configs):
                order = ["before", "after"] if (pair + k) % 2 == 0 else ["after", "before"]
                for which in order:
                    overrides = [
                        f"+preset={mode}", f"rollout.max_head_offpolicyness={eta}", f"train.steps={args.steps}", *args.set
                    ]
                    value = run_once(checkouts[which], overrides, root, root / f"cache-{which}", args.measure)
                    sps.setdefault((mode, eta, which), []).append(value)
            print(f"pair {pair + 1}/{args.pairs} done", file=sys.stderr)
    load_after = os.getloadavg()[0]

    rows = []
    for mode, eta in configs:
        before, after = sps[(mode, eta, "before")], sps[(mode, eta, "after")]
        rows.append({
            "mode": mode, "max_head_offpolicyness": eta, "steps": args.steps, "pairs": args.pairs,
            f"before_{args.measure}": before, f"after_{args.measure}": after,
            "before_median": statistics.median(before), "after_median": statistics.median(after),
            **compare(before, after),
        })  # fmt: skip
    verdicts(rows, args.measure)
    header = f"{'mode':<14}{'η':>3}{'before':>9}{'after':>9}{'after/before':>14}{'range':>15}{'95 % interval':>17}  verdict"
    print(f"{args.measure} (medians), after/before paired")
    print(header)
    print("-" * len(header))
    for r in rows:
        interval = "–" if r["low"] is None else f"{r['low']:.3f}–{r['high']:.3f}"
        print(
            f"{r['mode']:<14}{r['max_head_offpolicyness']:>3}{r['before_median']:>9.2f}{r['after_median']:>9.2f}"
            f"{r['ratio_median']:>13.3f}×{min(r['ratios']):>8.3f}–{max(r['ratios']):.3f}{interval:>17}  "
            + (f"{r['verdict']} (Holm p = {r['p_holm']:.2g})" if "verdict" in r else "one pair: no test")
        )
    print(f"load average: {load_before:.1f} before, {load_after:.1f} after (2 cores: above ~0.5 the numbers are under load)")
    write_results(
        args.out, "ab_train", rows=rows, measure=args.measure, overrides=args.set,
        load_average={"before": load_before, "after": load_after},
        **{name: {"path": str(path), "commit": commit_of(path)} for name, path in checkouts.items()},
    )  # fmt: skip


if __name__ == "__main__":
    main()
