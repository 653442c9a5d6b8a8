"""What the threads of a remote engine share: the pause switch, the version and the counters,
all under one condition (the producer's generate threads, the trainer's pause / recompute /
weight update, and close() run concurrently)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from sdp_cli.engine.base import EngineError
from sdp_cli.rollout.records import RolloutSample


@dataclass(eq=False)
class RemoteState:
    """Every field is read and written while holding ``cond``."""

    #: the engine's name, for messages ("vllm", "sglang")
    engine_name: str
    #: the weight version the servers run; tokens generated now are tagged with it
    version: int = 0
    cond: threading.Condition = field(default_factory=threading.Condition)
    #: directory of the current version's weights; None while the servers run their start-up
    #: weights, which sdp takes to be the version the engine started at
    weights_path: Path | None = None
    paused: bool = False
    closed: bool = False
    #: incremented by every pause(): an abort with an unchanged epoch was not ours
    pause_epoch: int = 0
    #: samples of running generate() calls, by id (what the recompute pass must cover)
    inflight: dict[int, RolloutSample] = field(default_factory=dict)
    #: segments answered, resubmissions, aborted segments, tokens whose π_prox_t came from a
    #: resubmission's prefill
    counters: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("segments", "resubmissions", "aborted_segments", "prefill_proximal_tokens"), 0
        )
    )

    def wait_running(self) -> None:
        """Block while paused (lock held by the caller); raise once the engine is closed."""
        while self.paused and not self.closed:
            self.cond.wait()
        self.raise_if_closed()

    def raise_if_closed(self) -> None:
        if self.closed:
            raise EngineError(f"engine={self.engine_name} was closed")
