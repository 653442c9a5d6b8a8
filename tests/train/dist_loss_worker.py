"""One process of the multi-process gradient tests (``torchrun --nproc_per_node 2 <this> OUT
[fsdp]``): runs every case of ``cases.DISTRIBUTED_CASES`` (DDP) or ``cases.FSDP_CASES`` (sharded)
and saves this rank's gradients (whole; with fsdp also rank 0's weights after the step) to OUT."""

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from tests.train import cases  # noqa: E402


def main(out_dir: str, parallel: str = "ddp") -> None:
    torch.set_num_threads(1)
    saved = {}
    rank = None
    runs = (
        [(name, loss, rows, mbs, clip) for name, loss, rows, mbs, clip in cases.FSDP_CASES]
        if parallel == "fsdp"
        else [(name, loss, rows, mbs, None) for name, loss, rows, mbs in cases.DISTRIBUTED_CASES]
    )
    for name, loss, n_rows, minibatches, clip in runs:
        grads, weights, held = cases.distributed_case_run(loss, n_rows, minibatches, parallel=parallel, grad_clip=clip)
        for step, named in enumerate(grads):
            for param, grad in named.items():
                saved[f"{name}/{step}/{param}"] = grad.contiguous()
        if parallel == "fsdp":
            saved[f"{name}/held_elements"] = torch.tensor(held)
            for param, value in weights.items():
                saved[f"{name}/weights/{param}"] = value.contiguous()
    import torch.distributed as dist

    rank = dist.get_rank()
    save_file(saved, str(Path(out_dir) / f"rank{rank}.safetensors"))


if __name__ == "__main__":
    main(*sys.argv[1:])
