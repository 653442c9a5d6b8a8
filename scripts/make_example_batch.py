"""Make ``sdp_cli/data/example_batch.safetensors``, the batch ``sdp inspect-weights --example`` reads.

Runs a short, real segment-wise training run on CPU (the tiny model on two-digit addition, about a
minute) with staleness up to η = 4 and a throttled producer, so that batches hold tokens of
several lags and some sequences span a weight update (several segments). It then keeps the saved
batch with the most distinct lags of which at least one is ≥ 2 (ties: the larger maximum lag, then
more multi-segment sequences) and copies it, validated, into the package. The async run is not
bit-for-bit reproducible (thread timing decides the lags), so a re-run gives a similar, not an
identical, batch.

    .venv/bin/python scripts/make_example_batch.py            # writes sdp_cli/data/example_batch.safetensors
    .venv/bin/python scripts/make_example_batch.py --out x.safetensors

The run directory and the model cache (SDP_CACHE_DIR) live in a temporary directory unless
SDP_CACHE_DIR is set, so nothing accumulates under ~/.cache.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from sdp_cli.fileio import atomic_write_bytes
from sdp_cli.rollout.batch_file import SavedBatch, read_batch
from sdp_cli.rundir import RunDir

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "sdp_cli" / "data" / "example_batch.safetensors"
TRAIN_OVERRIDES = [
    "+preset=segment_wise",
    "task=arith2",
    "train.steps=12",
    "train.save_batches=true",
    "rollout.max_head_offpolicyness=4",
    # a small, throttled producer: batches mix lags instead of all running η versions ahead
    "rollout.batch_groups=8",
    "rollout.max_concurrent_rollouts=4",
    "rollout.groups_per_request=1",
    "rollout.max_new_tokens=12",
    "train.eval_samples=20",
    "run.progress=false",
    "run.tensorboard=false",
]


def _score(batch: SavedBatch) -> tuple[int, int, int]:
    """(distinct lags, max lag, sequences spanning several versions) over the loss tokens."""
    padded = batch.to_padded()
    lags = (batch.trainer_version - padded.versions)[padded.mask]
    versions = padded.versions.masked_fill(~padded.mask, -1)
    newest = versions.max(1).values
    oldest = padded.versions.masked_fill(~padded.mask, 2**62).min(1).values
    spanning = int(((newest != oldest) & padded.mask.any(1)).sum())
    return int(torch.unique(lags).numel()), int(lags.max()), spanning


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the example batch")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="sdp-example-") as tmp:
        env = dict(os.environ)
        env.setdefault("SDP_CACHE_DIR", str(Path(tmp) / "cache"))
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "sdp_cli", "train", *TRAIN_OVERRIDES, f"run.dir={run_dir}"]
        print("running:", " ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, check=True, env=env)
        candidates = []
        for path in sorted(RunDir(run_dir).batches.glob("*.safetensors")):
            lags, max_lag, spanning = _score(read_batch(path))
            print(f"{path.name}: {lags} distinct lags, max lag {max_lag}, {spanning} multi-segment sequences")
            if max_lag >= 2:
                candidates.append(((lags, max_lag, spanning), path))
        if not candidates:
            sys.exit("no batch holds a token with lag >= 2; re-run (the lags depend on thread timing)")
        _, best = max(candidates, key=lambda c: c[0])
        atomic_write_bytes(args.out, best.read_bytes())  # a stop mid-copy leaves the old batch
    batch = read_batch(args.out)
    print(
        f"wrote {args.out} ({args.out.stat().st_size} bytes) from {best.name}: "
        f"{batch.num_sequences} sequences, trainer version {batch.trainer_version}, score {_score(batch)}"
    )


if __name__ == "__main__":
    main()
