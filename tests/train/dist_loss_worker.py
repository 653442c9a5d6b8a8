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
    for case in cases.FSDP_CASES if parallel == "fsdp" else cases.DISTRIBUTED_CASES:
        grads, weights, held, positions_saved = case.run(parallel)
        saved[f"{case.name}/positions_saved"] = torch.tensor(positions_saved)
        for step, named in enumerate(grads):
            for param, grad in named.items():
                saved[f"{case.name}/{step}/{param}"] = grad.contiguous()
        if parallel == "fsdp":
            saved[f"{case.name}/held_elements"] = torch.tensor(held)
            for param, value in weights.items():
                saved[f"{case.name}/weights/{param}"] = value.contiguous()
    import torch.distributed as dist

    rank = dist.get_rank()
    save_file(saved, str(Path(out_dir) / f"rank{rank}.safetensors"))


if __name__ == "__main__":
    main(*sys.argv[1:])
