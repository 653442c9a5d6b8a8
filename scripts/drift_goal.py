"""The drift-clip study's goal check (issue 16, docs/results.md) from finished sweep reports.

For each sweep directory (after `sdp ablate --report DIR`), each drift-clipped mode κ and each η:
the difference of its mean final reward to the better of decoupled and segment_wise, in that
baseline's standard errors of the difference (Welch: √(s₁²/n₁ + s₂²/n₂)), and its own ESS.
(A stricter reading, in standard errors of the baseline's mean alone, is printed too.) The goal holds for κ when Δ ≥ −1 SE at every η of every sweep and ESS ≥ 0.85 at η = 8.
Then the per-seed final rewards of every mode. Reads DIR/runs.csv only.

    python scripts/drift_goal.py /work/sweeps/default /work/sweeps/harsh
"""

from __future__ import annotations

import csv
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from sdp_cli.ablate.stats import welch

BASELINES = ("decoupled", "segment_wise")


def load(sweep: Path) -> dict[tuple[str, int], list[dict[str, str]]]:
    cells: dict[tuple[str, int], list[dict[str, str]]] = defaultdict(list)
    with (sweep / "runs.csv").open() as f:
        for row in csv.DictReader(f):
            cells[row["mode"], int(row["eta"])].append(row)
    return cells


def main(paths: list[str]) -> None:
    verdict: dict[str, list[str]] = defaultdict(list)
    strict_verdict: dict[str, list[str]] = defaultdict(list)
    for path in map(Path, paths):
        cells = load(path)
        etas = sorted({eta for _, eta in cells})
        kappas = sorted({m for m, _ in cells if m not in BASELINES})
        print(f"\n## {path.name}: Δ reward to the better of {', '.join(BASELINES)} (Δ/SE), ESS of the drift weight\n")
        print("| mode | " + " | ".join(f"η = {e}" for e in etas) + " |")
        print("|---|" + "---|" * len(etas))
        for mode in kappas:
            out = []
            for eta in etas:
                runs = cells.get((mode, eta))
                bases = [b for b in BASELINES if (b, eta) in cells]
                if not runs or not bases:
                    out.append("–")
                    continue
                rewards = [float(r["reward_last"]) for r in runs]
                best = max(bases, key=lambda b: statistics.fmean(float(r["reward_last"]) for r in cells[b, eta]))
                base = [float(r["reward_last"]) for r in cells[best, eta]]
                diff = welch(rewards, base)
                m, mb = statistics.fmean(rewards), statistics.fmean(base)
                ratio = diff.difference / diff.standard_error if diff.standard_error else 0.0
                ess = statistics.fmean(float(r["w_drift_ess"]) for r in runs)
                out.append(f"{m - mb:+.3f} ({ratio:+.1f} SE) vs {best[:3]}, ESS {ess:.3f}")
                if ratio < -1.0:
                    verdict[mode].append(f"{path.name} η={eta}: {ratio:+.1f} SE")
                # the stricter reading: in standard errors of the baseline's mean alone
                sb = statistics.stdev(base) if len(base) > 1 else 0.0
                strict = (m - mb) / (sb / math.sqrt(len(base))) if sb else 0.0
                if strict < -1.0:
                    strict_verdict[mode].append(f"{path.name} η={eta}: {strict:+.1f} SE(baseline)")
                if eta == 8 and ess < 0.85:
                    verdict[mode].append(f"{path.name} η=8: ESS {ess:.3f} < 0.85")
            print(f"| {mode} | " + " | ".join(out) + " |")
        print(f"\n### {path.name}: final reward per seed (seeds 0, 1, 2, ...)\n")
        print("| mode | η | per-seed reward | mean |")
        print("|---|---|---|---|")
        for (mode, eta), runs in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            runs = sorted(runs, key=lambda r: int(r["seed"]))
            values = [float(r["reward_last"]) for r in runs]
            print(f"| {mode} | {eta} | {' '.join(f'{v:.3f}' for v in values)} | {statistics.fmean(values):.3f} |")
    print("\n## Goal (Δ ≥ −1 SE everywhere, ESS ≥ 0.85 at η = 8)\n")
    modes = sorted({m for p in paths for m, _ in load(Path(p)) if m not in BASELINES})
    for mode in modes:
        misses = verdict.get(mode, [])
        print(f"- {mode}: " + ("met" if not misses else "not met: " + "; ".join(misses)))
    print("\nStricter, with the SE of the better baseline's mean instead of the SE of the difference:\n")
    for mode in modes:
        misses = strict_verdict.get(mode, [])
        print(f"- {mode}: " + ("reward part met" if not misses else "not met: " + "; ".join(misses)))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python scripts/drift_goal.py SWEEP_DIR [SWEEP_DIR ...]")
    main(sys.argv[1:])
