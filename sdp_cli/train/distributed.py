"""Multi-process training (``accelerate launch`` / ``torchrun``): rank 0 runs the rollout loop and
the engine and owns the run directory; every rank trains on its share of each batch, and DDP
averages the gradients, so all ranks hold the same weights.

Rank 0 sends each batch's groups to the other ranks as JSON bytes over ``torch.distributed``
(never pickle); ``None`` tells them the run is over.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Mapping, TypeVar

import torch

from sdp_cli.errors import UserError
from sdp_cli.rollout.records import RolloutGroup

T = TypeVar("T")

#: variables by which a launcher tells each process the size of the group (torchrun; MPI)
_WORLD_SIZE_VARS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def check_launch(env: Mapping[str, str]) -> None:
    """Refuse launches that would silently train wrongly (docs/training.md "Several processes"):
    ``accelerate launch --use_fsdp`` / ``--use_deepspeed`` (the trainer would hold shards, rank 0
    pushes and saves whole weights) and ``accelerate launch --cpu --num_processes N`` (N > 1),
    which without ``--mpirun_hostfile`` starts ONE process with a rendezvous address but no
    world size, so it would train alone."""
    def flag(name: str) -> bool:
        return env.get(name, "").lower() in ("1", "true", "yes")

    for name, what in (("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed")):
        if flag(name):
            raise UserError(
                f"{what} sharding is not supported: rank 0 pushes and saves whole weights, which a sharded "
                "model does not hold (docs/training.md \"Several processes\"); launch data-parallel "
                "training instead (accelerate launch --multi_gpu, or torchrun --nproc_per_node N)"
            )
    if flag("ACCELERATE_USE_CPU") and "MASTER_ADDR" in env and not any(v in env for v in _WORLD_SIZE_VARS):
        raise UserError(
            "accelerate launch --cpu --num_processes N starts only one process here; launch N CPU "
            "processes with torchrun --nproc_per_node N -m sdp_cli train ... instead"
        )


class Coordinator:
    """Who does what across the processes of one run (a single process is the trivial case)."""

    def __init__(self, accelerator: Any):
        self.accelerator = accelerator

    def end_follower(self) -> None:
        """A rank other than 0 has finished its part (rank 0 writes every output): leave now.

        Its gloo threads (``pt_gloo_runloop``, ``gloo_tcp_loop``) outlive even
        ``destroy_process_group``, and the interpreter's teardown then sometimes destroys them
        while joinable: "terminate called without an active exception", SIGABRT, exit −6, and
        torchrun reports the whole run as failed (about 1 run in 8 on 2 loaded cores). This rank
        holds no file open and no other state, so skipping the teardown loses nothing."""
        assert not self.is_main, "rank 0 closes its outputs and exits normally"
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    @property
    def is_main(self) -> bool:
        return bool(self.accelerator.is_main_process)

    @property
    def num_processes(self) -> int:
        return int(self.accelerator.num_processes)

    @property
    def distributed(self) -> bool:
        return self.num_processes > 1

    def broadcast_json(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (JSON-serialisable data only)."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        device = self.accelerator.device
        if self.is_main:
            payload = torch.frombuffer(bytearray(json.dumps(obj).encode("utf-8")), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.long, device=device)
        else:
            size = torch.zeros(1, dtype=torch.long, device=device)
        dist.broadcast(size, src=0)
        data = payload.to(device) if self.is_main else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        dist.broadcast(data, src=0)
        return json.loads(bytes(data.cpu().tolist()).decode("utf-8"))

    def main_first(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0, then on the other ranks (e.g. filling a shared cache once)."""
        if self.distributed and not self.is_main:
            self.broadcast_json()
        result = fn()
        if self.distributed and self.is_main:
            self.broadcast_json("done")
        return result

    def send_batch(self, groups: list[RolloutGroup] | None) -> None:
        """Rank 0: hand the next batch (or the end of the run) to the other ranks."""
        if self.distributed:
            self.broadcast_json(None if groups is None else [g.to_dict() for g in groups])

    def receive_batch(self) -> list[RolloutGroup] | None:
        """Other ranks: the next batch, or None when rank 0 has finished."""
        data = self.broadcast_json()
        return None if data is None else [RolloutGroup.from_dict(g) for g in data]

    def weights_in_sync(self, model: torch.nn.Module) -> bool:
        """Whether every rank holds the same weights (a checksum reduced with min and max)."""
        if not self.distributed:
            return True
        import torch.distributed as dist

        with torch.no_grad():
            checksum = sum(float(p.double().sum()) for p in model.parameters())
        low = torch.tensor([checksum], dtype=torch.float64, device=self.accelerator.device)
        high = low.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        return bool(low.item() == high.item())
