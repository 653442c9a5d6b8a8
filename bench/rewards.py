"""Benchmark: what a slow reward function costs `sdp train`, and which reward pool hides it.

Runs the example task (examples/own_task, +preset=quick: tiny model, segment-wise, η = 2) with a
reward function that takes COST ms per completion, either sleeping (like a call to a remote
verifier: the GIL is free) or spinning in Python (like parsing: the GIL is held), on
task.reward_pool=thread with 1 and 2 workers and task.reward_pool=process with 2 workers, next
to a free reward. Each configuration is a separate `sdp train` process with the warm start
already cached; steps/s and generated tokens/s come from the run's summary.json.

Those runs are bound by the reward; the second part isolates the producer, where scoring in the
producer thread used to stall generation: AsyncLoop alone with an engine whose generate call
sleeps 40 ms (a remote server's latency, GIL free) and arith1 with a reward sleeping COST ms per
completion, counting groups scored per second over 6 s (thread pools only). Prints both tables
and writes bench/results/rewards.json.

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
import time
from pathlib import Path

from _results import write_results

from sdp_cli.config.schema import SdpConfig
from sdp_cli.engine.base import InferenceEngine
from sdp_cli.tasks.arith import AdditionTask
from sdp_cli.train.asyncloop.loop import AsyncLoop

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


class RemoteLikeEngine(InferenceEngine):
    """Every generate call takes ``latency`` seconds (GIL free) and answers one token."""

    temperature = 1.0

    def __init__(self, latency: float):
        self.latency = latency

    def get_version(self) -> int:
        return 0

    def set_version(self, version: int) -> None:
        pass

    def generate(self, samples, params) -> None:
        time.sleep(self.latency)
        for sample in samples:
            sample.append_tokens([7], [-0.5], 0)
            sample.finish_reason = "stop"

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def is_paused(self) -> bool:
        return False

    def update_weights(self, update) -> None:
        pass

    def score(self, sequences, starts):
        return [[0.0] * (len(s) - k) for s, k in zip(sequences, starts)]

    def inflight_samples(self):
        return []


class SlowAddition(AdditionTask):
    """arith1 whose reward sleeps ``cost`` seconds per completion."""

    def __init__(self, cost: float):
        super().__init__("arith1", 0, 9, 4)
        self.cost = cost

    def reward(self, completion, item, *, stopped):
        time.sleep(self.cost)
        return 1.0


class _Codec:
    def encode_prompt(self, text):
        return [1, 2]

    def decode_completion(self, token_ids):
        return "x"


def producer_rate(cost_ms: float, workers: int, seconds: float = 6.0) -> float:
    """Groups the producer has generated and scored per second (no trainer: η unbounded)."""
    cfg = SdpConfig()
    cfg.rollout.batch_groups, cfg.rollout.group_size, cfg.rollout.groups_per_request = 8, 4, 8
    cfg.rollout.max_head_offpolicyness = 10**6
    cfg.task.reward_workers = workers
    loop = AsyncLoop(cfg, engine=RemoteLikeEngine(0.04), trainer=None, task=SlowAddition(cost_ms / 1000),
                     codec=_Codec(), pad_token_id=0, stop_token_ids=(2,), max_new_tokens=1,
                     push_weights=lambda version: None)  # fmt: skip
    loop.start()
    time.sleep(1.0)
    g0, t0 = loop.state.counters.groups_generated, time.perf_counter()
    time.sleep(seconds)
    g1, t1 = loop.state.counters.groups_generated, time.perf_counter()
    loop.stop()
    return (g1 - g0) / (t1 - t0)


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
    producer = []
    for cost in (0.0, args.cost_ms):
        for workers in (1, 2):
            rate = statistics.median(producer_rate(cost, workers) for _ in range(args.repeats))
            producer.append({"cost_ms": cost, "pool": "thread", "workers": workers, "groups_per_second": rate})
            print(f"producer: {cost:4.1f} ms  thread x{workers}  {rate:6.1f} groups/s", flush=True)
    write_results(REPO / "bench" / "results" / "rewards.json", "rewards", steps=args.steps,
                  repeats=args.repeats, samples_per_step=32, rows=rows, producer=producer)  # fmt: skip


if __name__ == "__main__":
    main()
