"""Multi-process training (``accelerate launch`` / ``torchrun``): rank 0 runs the rollout loop and
the engine and owns the run directory; every rank trains on its share of each batch, and DDP
averages the gradients, so all ranks hold the same weights (or, with ``train.parallel=fsdp``,
each holds its shard of them).

Rank 0 leads, the other ranks follow (``Coordinator.serve``): rank 0 sends each message as JSON
bytes over ``torch.distributed`` (never pickle): a batch to train on (``step``), a collective
every rank must join (``call``: a gather of sharded weights, the stop agreement), or the end of
the run with the exit status every rank takes. Because only rank 0 starts collectives, all
ranks run them in the same order.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from typing import Any, Callable, Mapping, NoReturn, TypeVar

import torch

from sdp_cli.errors import UserError
from sdp_cli.rollout.records import RolloutGroup
from sdp_cli.stopsignals import StopRequest
from sdp_cli.train.step.trainer_state import PlacedModel

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

    if flag("ACCELERATE_USE_FSDP"):
        raise UserError(
            "accelerate's FSDP plugin is not used by sdp (it would wrap the model that sdp shards itself); "
            "launch with torchrun --nproc_per_node N, or accelerate launch --multi_gpu, and set "
            "train.parallel=fsdp (docs/training.md \"Sharded training (FSDP)\")"
        )
    if flag("ACCELERATE_USE_DEEPSPEED"):
        raise UserError(
            "DeepSpeed is not supported; for sharded training launch with torchrun --nproc_per_node N, "
            "or accelerate launch --multi_gpu, and set train.parallel=fsdp (docs/training.md \"Sharded training (FSDP)\")"
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
        #: the collectives rank 0 may ask for by name (``call``), the same on every rank
        self._ops: dict[str, Callable[[], Any]] = {}

    def end_follower(self, code: int = 0) -> NoReturn:
        """A rank other than 0 has finished its part (rank 0 writes every output): leave now,
        with the exit status rank 0 sent (0, 1, or 128 + the signal that stopped the run).

        Its gloo threads (``pt_gloo_runloop``, ``gloo_tcp_loop``) outlive even
        ``destroy_process_group``, and the interpreter's teardown then sometimes destroys them
        while joinable: "terminate called without an active exception", SIGABRT, exit −6, and
        torchrun reports the whole run as failed (about 1 run in 8 on 2 loaded cores). This rank
        holds no file open and no other state, so skipping the teardown loses nothing."""
        assert not self.is_main, "rank 0 closes its outputs and exits normally"
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    # ---------------------------------------------------------------- protocol
    def register(self, name: str, op: Callable[[], Any]) -> None:
        """Make ``op`` (a collective) callable by name from rank 0; every rank registers it."""
        self._ops[name] = op

    def call(self, name: str) -> Any:
        """Rank 0: run the registered collective ``name`` on every rank; its result here."""
        assert self.is_main, "only rank 0 starts collectives (the others follow in serve)"
        if self.distributed:
            self.broadcast_json({"op": name})
        return self._ops[name]()

    def register_training(self, placed: PlacedModel, stop: StopRequest) -> None:
        """The collectives of a training run (every rank): gathers of the trained model's sharded
        weights and optimizer state, the weight checksum, and the stop agreement: the largest
        signal number any rank received (0: none), so that a signal reaching any rank stops all
        after the same step."""
        self.register("model_state", placed.full_model_state)
        self.register("optimizer_state", placed.full_optimizer_state)
        self.register("in_sync", lambda: self.weights_in_sync(placed.unwrapped(), sharded=placed.sharded))
        self.register("stop", lambda: self.max_over_ranks(stop.signum or 0))

    def agree_stop(self, stop: StopRequest) -> None:
        """Rank 0, at a step boundary: adopt a signal that another rank received."""
        if self.distributed and (agreed := self.call("stop")) and not stop.requested:
            stop(agreed)

    def send_batch(self, groups: list[RolloutGroup]) -> None:
        """Rank 0: hand the next batch to the other ranks."""
        if self.distributed:
            self.broadcast_json({"op": "step", "groups": [g.to_dict() for g in groups]})

    def end(self, code: int) -> None:
        """Rank 0: the run is over; the other ranks leave ``serve`` and exit with ``code``.

        They leave first, and torchrun answers a non-zero exit with SIGTERM to the ranks still
        running: this one, done with the run, ignores SIGTERM from now on so that it still prints
        its last line and exits with the same status (an ignored signal stays ignored while
        Python shuts down; a handled one reverts to the default, which kills)."""
        if self.distributed:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            self.broadcast_json({"op": "end", "code": int(code)})

    def serve(self, train: Callable[[list[RolloutGroup]], None]) -> int:
        """Other ranks: train on each batch and join each collective rank 0 sends, until it ends
        the run; returns the exit status it sent."""
        while True:
            message = self.broadcast_json()
            if message["op"] == "end":
                return int(message["code"])
            if message["op"] == "step":
                train([RolloutGroup.from_dict(g) for g in message["groups"]])
            else:
                self._ops[message["op"]]()

    def max_over_ranks(self, value: int) -> int:
        """The largest ``value`` of all ranks (an all-reduce; every rank calls it)."""
        if not self.distributed:
            return value
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.long, device=self.accelerator.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

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

    def weights_in_sync(self, model: torch.nn.Module, *, sharded: bool = False) -> bool:
        """Whether every rank holds the same weights (a checksum reduced with min and max).
        ``sharded``: every weight exists once, on one rank, so there is nothing to compare."""
        if not self.distributed or sharded:
            return True
        import torch.distributed as dist

        with torch.no_grad():
            checksum = sum(float(p.double().sum()) for p in model.parameters())
        low = torch.tensor([checksum], dtype=torch.float64, device=self.accelerator.device)
        high = low.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        return bool(low.item() == high.item())
