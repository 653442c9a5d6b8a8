"""Benchmark: what a slow reward function costs `sdp train`, and which reward pool hides it.

Runs the example task (examples/own_task, +preset=quick: tiny model, segment-wise, η = 2) with a
reward function that takes COST ms per completion, either sleeping (like a call to a remote
verifier: the GIL is free) or spinning in Python (like parsing: the GIL is held), on
task.reward_pool=thread with 1 and 2 workers and task.reward_pool=process with 2 workers, next
to a free reward. Each configuration is a separate `sdp train` process with the warm start
already cached; steps/s and generated tokens/s come from the run's summary.json. Prints a
table and writes bench/results/rewards.json.

    python bench/rewards.py                 # 40 steps, 3 ms per completion, 3 repeats
    python bench/rewards.py --steps 20 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _results import write_results

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "own_task"
REWARD = '''import time


def score(prompt, completion, record, cost_ms=0.0, kind="sleep"):
    if kind == "sleep":
        time.sleep(cost_ms / 1000)
    else:
        end = time.perf_counter() + cost_ms / 1000
        while time.perf_counter() < end:
            pass
    return float(completion.strip() == record["answer"])
'''
POOLS = [("thread", 1), ("thread", 2), ("process", 2)]
COMMON = ["run.progress=false", "run.tensorboard=false", "train.eval_samples=0", "train.checkpoint_every=0"]


def run_once(extra: list[str], steps: int, root: Path, cache: Path, reward: Path) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="bench-", dir=root))
    env = dict(os.environ, SDP_CACHE_DIR=str(cache), PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "sdp_cli", "train", "--config-dir", "conf", "task=larger", "+preset=quick",
           f"task.reward={reward}:score", *COMMON, *extra, f"train.steps={steps}", f"run.dir={run_dir}"]  # fmt: skip
    subprocess.run(cmd, env=env, cwd=EXAMPLE, check=True, capture_output=True, text=True)
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cost-ms", type=float, default=3.0)
    args = parser.parse_args()
    configs = [("free", "thread", 1, 0.0), ("free", "process", 2, 0.0)]
    configs += [(kind, pool, workers, args.cost_ms) for kind in ("sleep", "cpu") for pool, workers in POOLS]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root, cache = Path(tmp), Path(tmp) / "cache"
        reward = root / "cost_reward.py"
        reward.write_text(REWARD)
        run_once([], 2, root, cache, reward)  # fill the warm-start cache
        results: dict[int, list[dict]] = {i: [] for i in range(len(configs))}
        for _ in range(args.repeats):  # interleaved, so that load from elsewhere hits every config alike
            for i, (kind, pool, workers, cost) in enumerate(configs):
                extra = [f"task.reward_pool={pool}", f"task.reward_workers={workers}",
                         f"+task.reward_kwargs.cost_ms={cost}", f"+task.reward_kwargs.kind={'sleep' if kind == 'free' else kind}"]  # fmt: skip
                results[i].append(run_once(extra, args.steps, root, cache, reward))
        for i, (kind, pool, workers, cost) in enumerate(configs):
            runs = results[i]
            row = {
                "reward": kind,
                "cost_ms": cost,
                "pool": pool,
                "workers": workers,
                "steps_per_second": statistics.median(r["steps_per_second"] for r in runs),
                "tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs),
            }
            rows.append(row)
            print(
                f"{kind:>5} {cost:4.1f} ms  {pool:>7} x{workers}  "
                f"{row['steps_per_second']:6.2f} steps/s  {row['tokens_per_second']:7.0f} tokens/s",
                flush=True,
            )
    write_results(REPO / "bench" / "results" / "rewards.json", "rewards", steps=args.steps,
                  repeats=args.repeats, samples_per_step=32, rows=rows)  # fmt: skip


if __name__ == "__main__":
    main()
