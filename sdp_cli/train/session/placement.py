"""Where a run computes on the CPU: torch's threads of the trainer and of the engine, and which
cores each process runs on (docs/training.md "Staleness and threads"). Torch-free.

``thread_counts`` gives each side its share of the cores. ``core_split`` goes one step further
when sdp places the processes itself (η > 0, the rollout side in its own process, on the CPU,
``train.threads`` unset): the trainer's process is pinned to one half of the cores this process
may use and the rollout process, with the engine's process it starts, to the other half, so that
the scheduler never puts generation on the trainer's core (a one-thread trainer's step waited for
the core it was moved off; η = 4 steps were 1–3 % shorter pinned in five of five paired runs,
2026-11-29). A set ``train.threads`` means the user places the processes (several runs on one
machine, as `sdp ablate` runs them): nothing is pinned then. The pinning itself:
`sdp_cli/processes.py` `pin_process`.
"""

from __future__ import annotations

import os
from typing import Any


def thread_counts(cfg: Any) -> tuple[int, int]:
    """torch's intra-op threads of (the trainer, the engine): the local engine's process, or with
    ``engine.in_process`` the rollout producer thread it generates in.

    η > 0: generation and training overlap, so each gets its own half of the cores (or
    ``train.threads`` each). η = 0: the two phases alternate; the trainer takes every core (or
    ``train.threads``) and the engine one thread. A second multi-threaded OpenMP pool taking
    turns with the trainer's on the same cores slows both phases: measured on 2 cores in one
    process, the trainer's step took 0.105 s instead of 0.051 s and generation 0.040 s instead of
    0.028 s (docs/training.md "Staleness and threads")."""
    cores = os.cpu_count() or 1
    overlap = cfg.rollout.max_head_offpolicyness > 0
    if cfg.train.threads is not None:
        trainer = cfg.train.threads
    else:
        trainer = max(1, cores // 2) if overlap else cores
    return trainer, trainer if overlap else 1


def core_split(cfg: Any, *, own_process: bool, device: str) -> tuple[list[int], list[int]] | None:
    """The cores of (the trainer's process, the rollout process and its engine's) when sdp places
    them (see the module docstring): the first and the second half of the cores this process may
    run on. None: the operating system places them."""
    if (
        not own_process
        or device != "cpu"
        or cfg.rollout.max_head_offpolicyness == 0
        or cfg.train.threads is not None
    ):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    half = len(cores) // 2
    return cores[:half], cores[half:]
