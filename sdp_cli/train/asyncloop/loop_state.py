"""The async loop's plain types: what it hands out (``StepRecord``), what it checkpoints
(``RolloutState`` and ``LoopCounters`` of the rollout side, ``StepTimes`` of the trainer's, the
producer RNG as JSON) and its small helpers (``sdp_cli/train/asyncloop/loop.py``, ``rollout.py``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from sdp_cli.rollout.recompute import RecomputeStats

if TYPE_CHECKING:  # the rollout process imports this module, and neither torch nor the trainer
    from sdp_cli.train.step.batch import TrainBatch
    from sdp_cli.train.step.trainer import StepOutput


class TextCodec(Protocol):
    """Prompt encoding / completion decoding (a tokenizer)."""

    def encode_prompt(self, text: str) -> list[int]: ...

    def decode_completion(self, token_ids: list[int]) -> str: ...


class LoopStopped(RuntimeError):
    """The loop was asked to stop (or its producer failed) while waiting for a batch."""


class LoopInterrupted(LoopStopped):
    """A stop was requested (``should_stop``, e.g. after a signal): the loop ended at a step
    boundary, before taking the next batch."""


@dataclass
class StepRecord:
    """What the loop hands to its observer after each step."""

    step: int
    #: the engine's version after the step's weight push: the version the push loads when it runs
    #: on (asynchronous), the one still loaded when it failed
    version: int
    metrics: dict[str, float]
    batch: TrainBatch
    output: StepOutput


@dataclass
class LoopCounters:
    """Monotone counters of the rollout side that describe the run; checkpointed with the loop
    (in one ``counters`` entry with the trainer's ``StepTimes``)."""

    groups_generated: int = 0
    groups_failed: int = 0
    samples_generated: int = 0
    tokens_generated: int = 0
    engine_faults: int = 0
    recompute_tokens: int = 0
    #: time the recompute pass took, wherever it ran (producer thread or weight push)
    recompute_seconds: float = 0.0
    #: the part of it the trainer waited for (the pass at the weight push)
    recompute_blocking_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoopCounters:
        """Its fields of a checkpoint's ``counters`` entry (which holds ``StepTimes``' too)."""
        return cls(**{name: data[name] for name in cls.__dataclass_fields__})

    def count_recompute(self, stats: RecomputeStats, seconds: float) -> None:
        """A recompute pass, wherever it ran: its tokens and its time."""
        self.recompute_tokens += stats.tokens_recomputed
        self.recompute_seconds += seconds


@dataclass
class StepTimes:
    """Where the trainer's thread spent its steps (seconds, over the run); checkpointed in the
    loop's ``counters`` entry."""

    push_seconds: float = 0.0
    train_seconds: float = 0.0
    wait_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepTimes:
        return cls(**{name: data[name] for name in cls.__dataclass_fields__})


@dataclass
class RolloutState:
    """Everything of the rollout side beyond its buffers needed to resume it exactly."""

    next_group_id: int = 0
    producer_rng: Any = None
    counters: LoopCounters = field(default_factory=LoopCounters)


@dataclass
class PassTotals:
    """What recompute passes did, summed (the mean |Δ| kept as a token-weighted sum)."""

    tokens: int = 0
    samples: int = 0
    delta_sum: float = 0.0
    seconds: float = 0.0

    def add(self, stats: RecomputeStats, seconds: float) -> None:
        self.tokens += stats.tokens_recomputed
        self.samples += stats.samples_recomputed
        self.delta_sum += stats.mean_abs_delta * stats.tokens_recomputed
        self.seconds += seconds


@contextmanager
def intra_op_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op threads for the calling thread set to ``count`` inside the block; nothing
    in a process without torch (the rollout process: its engine computes in a process of its own)."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    before = torch.get_num_threads()
    if count is None or count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def rng_state_to_json(state: Any) -> list[Any]:
    """``random.Random.getstate()`` as JSON-safe lists."""
    version, internal, gauss = state
    return [version, list(internal), gauss]


def rng_state_from_json(data: list[Any]) -> Any:
    """The inverse of :func:`rng_state_to_json`."""
    version, internal, gauss = data
    return (version, tuple(internal), gauss)
