"""Benchmark: wall time of `sdp --help` and `sdp COMMAND --help` (target: under 1 s each).

Each command runs as a fresh process (so imports are paid every time), repeated; the table shows
the median and the worst run. Writes bench/results/cli.json.

    python bench/cli.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _results import write_results

COMMANDS = [[], ["train"], ["inspect-weights"], ["recompute"], ["ablate"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cli.json")
    args = parser.parse_args()
    sdp = str(Path(sys.executable).parent / "sdp")
    subprocess.run([sdp, "--help"], capture_output=True, check=True)  # warm the file cache once
    rows = []
    for command in COMMANDS:
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            subprocess.run([sdp, *command, "--help"], capture_output=True, check=True)
            times.append(time.perf_counter() - start)
        rows.append({"command": " ".join(["sdp", *command, "--help"]), "median_s": statistics.median(times), "max_s": max(times)})
    width = max(len(r["command"]) for r in rows)
    print(f"{'command':<{width}}  {'median s':>9}  {'max s':>7}")
    for r in rows:
        print(f"{r['command']:<{width}}  {r['median_s']:>9.3f}  {r['max_s']:>7.3f}")
    write_results(args.out, "cli", repeats=args.repeats, rows=rows)


if __name__ == "__main__":
    main()
