"""Two (and three) gloo processes compute the gradient of a single-process step (docs/math.md
§5.2).

Every process divides its shard's loss by the count of the whole minibatch and DDP averages
the gradients; a process without a row of a minibatch contributes an exact 0. The gradients of
every optimizer step must equal those of one process on the same batch (≤ 1e-6), for every
aggregation, for REINFORCE's batch-normalised weights, and when a process gets no row (with
three processes and two rows, the old stand-in — a duplicate of the first row — counted that
row twice), and when groups share a prompt that each process's shard runs once.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from . import cases

TORCHRUN = Path(sys.executable).parent / "torchrun"


@pytest.mark.skipif(shutil.which("torchrun", path=str(TORCHRUN.parent)) is None, reason="torchrun not installed")
@pytest.mark.parametrize("processes", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_several_processes_compute_the_single_process_gradient(tmp_path, processes):
    worker = Path(__file__).with_name("dist_loss_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [str(TORCHRUN), "--nproc_per_node", str(processes), "--log-dir", str(tmp_path / "torchrun"), str(worker), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(processes)]
    torch.set_num_threads(1)
    for case in cases.DISTRIBUTED_CASES:
        name = case.name
        reference = case.run()[0]
        assert len(reference) == 2 * case.minibatches, name
        if case.shared_prompts:  # every process ran its shard's distinct prompts once, or none did
            shared = {float(saved[f"{name}/positions_saved"]) > 0 for saved in ranks}
            assert shared == {case.ranks_share} if processes == 2 else len(shared) == 1, name
        for step, named in enumerate(reference):
            for param, grad in named.items():
                for rank, saved in enumerate(ranks):
                    got = saved[f"{name}/{step}/{param}"]
                    torch.testing.assert_close(
                        got, grad, rtol=0, atol=1e-6, msg=lambda m: f"{name} step {step} {param} rank {rank}: {m}"
                    )
