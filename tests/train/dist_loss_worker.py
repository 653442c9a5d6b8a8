"""One process of the two-process gradient test (``torchrun --nproc_per_node 2 <this> OUT``):
runs every case of ``cases.DISTRIBUTED_CASES`` and saves this rank's gradients to OUT."""

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from tests.train import cases  # noqa: E402


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    saved = {}
    rank = None
    for name, loss, n_rows, minibatches in cases.DISTRIBUTED_CASES:
        grads = cases.distributed_case_gradients(loss, n_rows, minibatches)
        for step, named in enumerate(grads):
            for param, grad in named.items():
                saved[f"{name}/{step}/{param}"] = grad.contiguous()
    import torch.distributed as dist

    rank = dist.get_rank()
    save_file(saved, str(Path(out_dir) / f"rank{rank}.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1])
