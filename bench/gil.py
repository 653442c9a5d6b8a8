"""What a busy Python thread in the trainer's process costs its step, against a busy process.

At η > 0 the trainer shares its interpreter with sdp's rollout producer, score and reward
threads (the engine runs in its own process). This bench measures the mechanism on the tiny
model alone, without sdp's loop: the time of one training step (forward, backward, AdamW; one
torch thread, a batch of arith1's shape) while another *thread* of the same process holds the GIL
a given share of the time in short bursts, and while another *process* burns the same share of a
core (no GIL shared). The slope (ms of step per % of GIL duty) turns the GIL share that py-spy
measures for the producer's threads into the time they cost the trainer (docs/benchmarks.md).

Configurations alternate within each repeat so that drift of the machine hits them alike; the
load average before and after is printed and stored. Prints a table, writes bench/results/gil.json.

    python bench/gil.py                  # 40 steps per configuration, 5 repeats
    python bench/gil.py --steps 10 --repeats 1
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import threading
import time
from pathlib import Path

import torch
from _results import write_results

from sdp_cli.models.tiny import build_tiny_model

#: a busy stretch of the co-runner; it then sleeps so that it is busy ``duty`` of the time
BURST_S = 0.0005
#: (label, kind, duty): kind "thread" shares the trainer's GIL, "process" only the CPUs
CONFIGS = [
    ("alone", None, 0.0),
    ("thread 5 %", "thread", 0.05),
    ("thread 10 %", "thread", 0.10),
    ("process 10 %", "process", 0.10),
    ("process 100 %", "process", 1.0),
]


def busy(duty: float, stop) -> None:
    """Hold the CPU (and, in a thread, the GIL: pure Python) ``duty`` of the time until ``stop``."""
    pause = BURST_S * (1 - duty) / duty
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < BURST_S:
            pass
        if pause:
            time.sleep(pause)


def step_seconds(model, optimizer, ids: torch.Tensor, steps: int) -> float:
    """Median seconds of one training step over ``steps`` steps (after one warm-up step)."""
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        logits = model(input_ids=ids).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(kind: str | None, duty: float, run) -> float:
    if kind is None:
        return run()
    if kind == "thread":
        stop = threading.Event()
        worker = threading.Thread(target=busy, args=(duty, stop), daemon=True)
    else:
        stop = multiprocessing.Event()
        worker = multiprocessing.Process(target=busy, args=(duty, stop), daemon=True)
    worker.start()
    try:
        return run()
    finally:
        stop.set()
        worker.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sequences", type=int, default=128, help="arith1's batch: 16 prompts × 8 samples")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per sequence (a step near sdp's tiny η > 0 step)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gil.json")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    torch.set_num_threads(1)  # the trainer's share at η > 0 on 2 cores
    torch.manual_seed(0)
    model = build_tiny_model(64).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(3, 64, (args.sequences, args.tokens))

    samples: dict[str, list[float]] = {label: [] for label, _, _ in CONFIGS}
    for _ in range(args.repeats):
        for label, kind, duty in CONFIGS:
            seconds = measure(kind, duty, lambda: step_seconds(model, optimizer, ids, args.steps))
            samples[label].append(seconds)
    alone = statistics.median(samples["alone"])
    rows = []
    print(f"{'co-runner':<15} {'step ms':>8} {'+ms':>6} {'ms per % duty':>14}")
    for label, kind, duty in CONFIGS:
        ms = 1000 * statistics.median(samples[label])
        extra = ms - 1000 * alone
        per_point = extra / (100 * duty) if duty else None
        rows.append(
            {
                "co_runner": label,
                "kind": kind,
                "duty": duty,
                "step_ms_median": ms,
                "step_ms_all": [1000 * s for s in samples[label]],
                "extra_ms": extra,
                "extra_ms_per_percent_duty": per_point,
            }
        )
        print(f"{label:<15} {ms:8.1f} {extra:6.1f} {'' if per_point is None else f'{per_point:14.2f}'}")
    load_after = os.getloadavg()[0]
    print(f"load average (1 min): {load_before:.2f} before, {load_after:.2f} after")
    write_results(
        args.out,
        "gil",
        steps=args.steps,
        repeats=args.repeats,
        sequences=args.sequences,
        tokens=args.tokens,
        burst_s=BURST_S,
        load_average_before=load_before,
        load_average_after=load_after,
        rows=rows,
    )


if __name__ == "__main__":
    main()
