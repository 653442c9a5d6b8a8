"""Does a treatment's gap to the baseline change between two sweeps of the same seeds?

The paired difference-in-differences of study S2 (docs/results.md "S2"): for every seed present
in both run tables, (treatment − baseline) in sweep A minus (treatment − baseline) in sweep B,
then the paired t test and its interval over those seeds (sdp_cli/ablate/stats.py). Cells are
matched by η, or, with ``--eta A B``, the first table's cells at η = A against the second's at
η = B (the same table may be given twice: does the gap change with staleness?); runs with extra
axes are left out.

    python scripts/interaction.py docs/results/s1/runs.csv docs/results/s2/runs.csv \\
        --treatment segment_wise --baseline decoupled --metric acc_end
    python scripts/interaction.py docs/results/s1b/runs.csv docs/results/s1b/runs.csv --eta 16 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sdp_cli.ablate.records import RunValues, read_runs_csv
from sdp_cli.ablate.stats import minimum_detectable_effect, paired_t
from sdp_cli.errors import UserError


def gaps(runs: list[RunValues], treatment: str, baseline: str, metric: str) -> dict[tuple[int, int], float]:
    """(η, seed) → treatment − baseline in ``metric``, where both runs have a value."""
    values = {(r.mode, r.max_head_offpolicyness, r.seed): r.values.get(metric) for r in runs if not r.extra}
    out = {}
    for (mode, eta, seed), value in values.items():
        other = values.get((baseline, eta, seed))
        if mode == treatment and value is not None and other is not None:
            out[(eta, seed)] = value - other
    return out


def at_eta(gaps_by_cell: dict[tuple[int, int], float], eta: int) -> dict[tuple[int, int], float]:
    """The gaps of one η, keyed (0, seed) so that cells of different η pair by seed."""
    return {(0, seed): gap for (cell_eta, seed), gap in gaps_by_cell.items() if cell_eta == eta}


def interaction(first: dict[tuple[int, int], float], second: dict[tuple[int, int], float]) -> list[float]:
    """Per (η, seed) in both: the first sweep's gap minus the second's, in key order."""
    return [first[key] - second[key] for key in sorted(first.keys() & second.keys())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--treatment", default="segment_wise")
    parser.add_argument("--baseline", default="decoupled")
    parser.add_argument("--metric", default="acc_end")
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--power", type=float, default=0.8)
    parser.add_argument("--eta", type=int, nargs=2, metavar=("A", "B"), help="the first table at η = A, the second at η = B")
    args = parser.parse_args(argv)
    try:
        runs = [read_runs_csv(path) for path in (args.first, args.second)]
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    first, second = (gaps(r, args.treatment, args.baseline, args.metric) for r in runs)
    if args.eta:
        first, second = at_eta(first, args.eta[0]), at_eta(second, args.eta[1])
    differences = interaction(first, second)
    if len(differences) < 2:
        print("error: fewer than two seeds have both modes in both tables; nothing to test", file=sys.stderr)
        return 2
    test = paired_t(differences, args.alpha)
    mde = minimum_detectable_effect(test.sd, test.n, args.alpha, args.power)
    mean_first = sum(first[k] for k in first.keys() & second.keys()) / test.n
    mean_second = sum(second[k] for k in first.keys() & second.keys()) / test.n
    print(f"{args.treatment} − {args.baseline} in {args.metric}, {test.n} paired seeds")
    where = [f" at η = {eta}" for eta in args.eta] if args.eta else ["", ""]
    print(f"  {args.first}{where[0]}: {mean_first:+.4f}   {args.second}{where[1]}: {mean_second:+.4f}")
    print(f"  difference of the gaps {test.mean:+.4f}, {1 - args.alpha:.0%} CI [{test.low:+.4f}, {test.high:+.4f}], "
          f"p = {test.p:.3g}, MDE {mde:.4f} at power {args.power:g}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
