"""Where segment-wise η = 4 loses against decoupled η = 4: the engine's recompute pass, or the rest.

Segment-wise needs π_prox_t = π_{v+1} from the engine for every stale token, so its runs keep the
recompute pass (docs/training.md "Where each token's π_prox_t comes from"); decoupled runs keep it
only when asked (``rollout.recompute=always``, which measures both weights on the same tokens).
Three η = 4 configurations, paired by repeat (each repeat runs all three, in an order rotated by
one each repeat, like bench/train.py):

    decoupled           +preset=decoupled
    decoupled + pass    +preset=decoupled rollout.recompute=always
    segment_wise        +preset=segment_wise

(decoupled + pass generates a batch in one call, as segment-wise does: sdp's default wherever the
passes run, part of what keeping π_prox_t costs) and segment-wise / decoupled =
(decoupled + pass) / decoupled × segment-wise / (decoupled + pass).
The two comparisons, named before any run:

1. the pass's cost, (decoupled + pass) / decoupled, against issue 26's 95 %: one-sided, "below"
   when the pass alone takes more than the 5 % the target leaves segment-wise;
2. the rest (segment-wise's loss, its consume-time staleness control and its policy's answers),
   segment-wise / (decoupled + pass): equivalent to 1 within ±5 % (two one-sided tests),
   "equivalent" when both ends hold.

Holm's correction over the two. Issue 26's target itself, segment-wise / decoupled against 95 %
(bench/train.py's ``judge`` and ``verdicts``: "met", "below" or "unresolved"), is printed as a family
of its own: the primary comparison of a series run with ``--set``, which gives every run more
overrides (``--set optim.ppo_epochs=2`` doubles the trainer's work a step, so that its core, not the
engine's, is the fuller one). Each run's CPU time per step, by process, is measured as in
bench/train.py (``watch_cpu``), and its bounds on segment-wise's steps/s against decoupled's
are printed last (bench/train.py's ``cpu_budget``, a family of its own). The load average before
and after is stored: numbers measured under load are not benchmark numbers. Prints a table and
writes bench/results/pass_cost.json.

    python bench/pass_cost.py --steps 300 --repeats 8
    python bench/pass_cost.py --steps 200 --repeats 8 --set optim.ppo_epochs=2 \
        --out bench/results/pass_cost_trainer_bound.json
    python bench/pass_cost.py --judge bench/results/pass_cost.json   # the verdicts of a stored run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

from _results import write_results
from _scratch import KEEP_HELP, run_scratch
from train import (
    ALPHA,
    PROCESSES,
    TARGET_SEGMENT_VS_DECOUPLED,
    cpu_budget,
    cpu_medians,
    judge,
    rotated,
    run_once,
    verdicts,
)

from sdp_cli.ablate.stats import holm

ETA4 = "rollout.max_head_offpolicyness=4"
CONFIGS = {
    "decoupled": ["+preset=decoupled", ETA4],
    "decoupled + pass": ["+preset=decoupled", "rollout.recompute=always", ETA4],
    "segment_wise": ["+preset=segment_wise", ETA4],
}
#: the equivalence margin of the rest: within ±5 % (as a ratio, [0.95, 1/0.95])
MARGIN = TARGET_SEGMENT_VS_DECOUPLED


def paired(sps: dict[str, list[float]], a: str, b: str) -> list[float]:
    return [x / y for x, y in zip(sps[a], sps[b], strict=True)]


def decompose(sps: dict[str, list[float]]) -> dict:
    """The two comparisons from each configuration's steps/s by repeat: their paired ratios, the
    tests (``judge``) and the verdicts with Holm's correction over the two: the pass's "below" (the
    one-sided test of "under 95 %", adjusted p under α) or "not shown below"; the rest's
    "equivalent" (both one-sided tests of the margin, the larger p adjusted under α) or "not shown
    equivalent". Fewer than two repeats: no test, both "unresolved"."""
    pass_ratios = paired(sps, "decoupled + pass", "decoupled")
    rest_ratios = paired(sps, "segment_wise", "decoupled + pass")
    total_ratios = paired(sps, "segment_wise", "decoupled")
    pass_test = judge(pass_ratios, TARGET_SEGMENT_VS_DECOUPLED)
    target_test = judge(total_ratios, TARGET_SEGMENT_VS_DECOUPLED)
    target_verdict, target_p = verdicts({"target": target_test})["target"]  # a family of its own
    rest_low, rest_high = judge(rest_ratios, MARGIN), judge(rest_ratios, 1 / MARGIN)
    out = {
        "pass_cost": statistics.median(pass_ratios),
        "pass_cost_by_repeat": pass_ratios,
        "rest": statistics.median(rest_ratios),
        "rest_by_repeat": rest_ratios,
        "segment_vs_decoupled": statistics.median(total_ratios),
        "segment_vs_decoupled_by_repeat": total_ratios,
        "target_test": target_test,
        "target_verdict": target_verdict,
        "target_p": target_p,
        "pass_test": pass_test,
        "rest_test": {"low_end": rest_low, "high_end": rest_high},
        "pass_verdict": "unresolved",
        "rest_verdict": "unresolved",
        "p_holm": None,
    }
    if pass_test["p_below"] is None:
        return out
    # the pass: under the target (one-sided); the rest: both ends of the margin at once (TOST)
    p_rest = max(rest_low["p_above"], rest_high["p_below"])
    adjusted_pass, adjusted_rest = holm([pass_test["p_below"], p_rest])
    out["pass_verdict"] = "below" if adjusted_pass < ALPHA else "not shown below"
    out["rest_verdict"] = "equivalent" if adjusted_rest < ALPHA else "not shown equivalent"
    out["p_holm"] = {"pass": adjusted_pass, "rest": adjusted_rest}
    return out


def budget(rows: list[dict], cores: int) -> dict | None:
    """bench/train.py's ``cpu_budget`` (prints its lines) on segment-wise's and decoupled's runs
    here; None without CPU times."""
    as_train_rows = [
        {
            "mode": row["config"],
            "max_head_offpolicyness": 4,
            "cores": cores,
            "steps_per_second_all": row["steps_per_second_all"],
            "cpu_ms_per_step_all": row.get("cpu_ms_per_step_all"),
        }
        for row in rows
        if row["config"] in ("segment_wise", "decoupled")
    ]
    return cpu_budget(as_train_rows)


def describe(result: dict) -> list[str]:
    """The lines that say what ``decompose`` found."""
    def spread(values: list[float]) -> str:
        return f"range {100 * min(values):.1f}–{100 * max(values):.1f} %"

    def tested(low: float, high: float, p: float | None, p_name: str) -> str:
        return "one repeat: no test" if p is None else f"one-sided 95 % bounds {low:.3f} and {high:.3f}, {p_name} = {p:.2g}"

    target, p = result["target_test"], result["p_holm"]
    lines = [
        f"segment-wise η=4 is {100 * result['segment_vs_decoupled']:.1f} % of decoupled η=4 "
        f"(median of {len(result['pass_cost_by_repeat'])} paired repeats, {spread(result['segment_vs_decoupled_by_repeat'])}; "
        f"{tested(target['low'], target['high'], result['target_p'], 'p')}) against issue 26's "
        f"{100 * TARGET_SEGMENT_VS_DECOUPLED:.0f} %: {result['target_verdict']}"
    ]
    test = result["pass_test"]
    lines.append(
        f"  the recompute pass: decoupled + pass is {100 * result['pass_cost']:.1f} % of decoupled "
        f"({spread(result['pass_cost_by_repeat'])}; {tested(test['low'], test['high'], None if p is None else p['pass'], 'Holm p')}) "
        f"against the target's {100 * TARGET_SEGMENT_VS_DECOUPLED:.0f} %: {result['pass_verdict']}"
    )
    low, high = result["rest_test"]["low_end"], result["rest_test"]["high_end"]
    lines.append(
        f"  the rest: segment-wise is {100 * result['rest']:.1f} % of decoupled + pass "
        f"({spread(result['rest_by_repeat'])}; {tested(low['low'], high['high'], None if p is None else p['rest'], 'Holm p')}) "
        f"against a tie within ±{100 * (1 - MARGIN):.0f} %: {result['rest_verdict']}"
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "pass_cost.json")
    parser.add_argument("--keep-runs", action="store_true", help=KEEP_HELP)
    parser.add_argument("--judge", type=Path, metavar="JSON", help="print the verdicts of a stored run and exit")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", dest="extra",
        help="an `sdp train` override given to every run (repeatable), e.g. optim.ppo_epochs=2",
    )
    args = parser.parse_args()
    malformed = [o for o in args.extra if "=" not in o or o.startswith("=")]
    if malformed:
        raise SystemExit(f"--set {malformed[0]!r}: give KEY=VALUE, an `sdp train` override such as optim.ppo_epochs=2")
    configs = {name: [*overrides, *args.extra] for name, overrides in CONFIGS.items()}
    if args.judge is not None:
        try:
            stored = json.loads(args.judge.read_text())
            rows = stored["rows"]
            sps = {row["config"]: [float(x) for x in row["steps_per_second_all"]] for row in rows}
            missing = [name for name in CONFIGS if name not in sps]
            if missing:
                raise KeyError(f"no rows of {', '.join(missing)}")
            result = decompose(sps)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"--judge {args.judge}: not a bench/pass_cost.py result ({exc}); give a file it wrote") from None
        print("\n".join(describe(result)))
        budget(rows, stored.get("machine", {}).get("cpus") or 1)
        return
    if args.repeats < 1 or args.steps < 20:
        raise SystemExit("--repeats must be at least 1 and --steps at least 20 (the CPU window skips the first 10 steps)")
    load_before = os.getloadavg()[0]
    with run_scratch("pass", args.keep_runs) as root:
        cache = root / "cache"
        run_once(configs["decoupled"], 1, root, cache)  # the warm-start cache (and a check of --set), once for all runs

        names = list(CONFIGS)
        runs: dict[str, list[dict]] = {name: [] for name in names}
        for repeat in range(args.repeats):
            for name in rotated(names, repeat):
                runs[name].append(run_once(configs[name], args.steps, root, cache))
            print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)
    load_after = os.getloadavg()[0]

    rows = []
    header = f"{'configuration':<18}{'steps/s':>9}{'tokens/step':>13}{'CPU ms/step':>13}{'trainer':>9}{'rollout':>9}{'engine':>8}"
    print(header)
    print("-" * len(header))
    for name in names:
        config_runs = runs[name]
        cpu = [r["cpu_ms_per_step"] for r in config_runs]
        timed = [c for c in cpu if c is not None]
        roles, total = cpu_medians(timed) if timed else (dict.fromkeys(PROCESSES, math.nan), math.nan)
        row = {
            "config": name,
            "overrides": configs[name],
            "steps": args.steps,
            "repeats": args.repeats,
            "steps_per_second_all": [r["steps_per_second"] for r in config_runs],
            "tokens_per_second_all": [r["tokens_per_second"] for r in config_runs],
            "cpu_ms_per_step_all": cpu,
        }
        row["steps_per_second_median"] = statistics.median(row["steps_per_second_all"])
        tokens_per_step = statistics.median(
            t / s for t, s in zip(row["tokens_per_second_all"], row["steps_per_second_all"], strict=True)
        )
        rows.append(row)
        print(
            f"{name:<18}{row['steps_per_second_median']:>9.2f}{tokens_per_step:>13.0f}{total:>13.1f}"
            f"{roles['trainer']:>9.1f}{roles['rollout']:>9.1f}{roles['engine']:>8.1f}"
        )
    result = decompose({row["config"]: row["steps_per_second_all"] for row in rows})
    print("\n".join(describe(result)))
    result["cpu_budget"] = budget(rows, os.cpu_count() or 1)
    print(f"load average: {load_before:.1f} before, {load_after:.1f} after (2 cores: above ~0.5 the numbers are under load)")
    write_results(
        args.out,
        "pass_cost",
        config="defaults (tiny model h128-L4, arith1, B=16 groups × 8 samples, η = 4, local engine and rollout side "
        "in processes of their own)" + (f", and {' '.join(args.extra)}" if args.extra else ""),
        rows=rows,
        result=result,
        load_average={"before": load_before, "after": load_after},
    )


if __name__ == "__main__":
    main()
