"""The contract every inference engine (local, vLLM, SGLang) fulfils.

The async loop and the recompute pass only ever talk to this interface. docs/design.md §2 gives the
timeline it serves: ``pause`` → recompute pass (``score`` + ``inflight_samples``) →
``update_weights`` → ``resume``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from sdp_cli.errors import EngineError, EngineUnavailable
from sdp_cli.rollout.records import RolloutSample

if TYPE_CHECKING:
    import torch

#: the errors of the contract (defined in sdp_cli/errors.py)
__all__ = [
    "EngineError",
    "EngineUnavailable",
    "InferenceEngine",
    "SamplingParams",
    "WeightUpdate",
]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. The temperature is a property of the engine, not of a
    request, because sampled and scored logprobs must use the same one."""

    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class WeightUpdate:
    """New policy weights for the engine: in memory (local engine only) or a safetensors
    directory in Hugging Face layout (every engine)."""

    version: int
    state_dict: Mapping[str, "torch.Tensor"] | None = None
    path: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.state_dict is None) == (self.path is None):
            raise ValueError("WeightUpdate needs exactly one of state_dict or path")


class InferenceEngine(abc.ABC):
    """Generates version-tagged rollouts and scores existing tokens.

    Thread-safety: ``generate`` may be called from several threads at once; ``pause``,
    ``update_weights`` and ``resume`` are called by one thread at a time (the trainer's, or the
    loop's weight pusher while the trainer trains on); ``score`` also by the rollout producer.
    """

    #: sampling temperature; ``score`` uses the same one so that sampled and scored logprobs agree
    temperature: float
    #: ``update_weights`` takes ``WeightUpdate(state_dict=...)``; otherwise only a safetensors
    #: directory the engine can read (``path``), which the trainer then writes for every push
    accepts_state_dict: bool = False
    #: files the engine's processes write their output to (for messages); none in sdp's process
    log_paths: tuple[Path, ...] = ()

    @abc.abstractmethod
    def get_version(self) -> int:
        """Number of weight updates the engine has received."""

    @abc.abstractmethod
    def set_version(self, version: int) -> None:
        """Declare the version of the loaded weights (checkpoint recovery only)."""

    @abc.abstractmethod
    def generate(self, samples: Sequence[RolloutSample], params: SamplingParams) -> None:
        """Generate a response for every sample, in place, and return when all are finished.

        Each call appends (token, logprob, version) triples to the samples and sets their
        ``finish_reason``. Samples may arrive with a partial output (it is continued). While the
        engine is paused, the call blocks with its samples partial; after a weight update it
        re-prefills them under the new weights and records π_prox_t for the tokens whose
        version is the new version − 1 (docs/design.md §2 step 4).
        """

    @abc.abstractmethod
    def pause(self) -> None:
        """Stop at a token boundary. Returns once no generation step is running."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Let paused generation continue."""

    @abc.abstractmethod
    def is_paused(self) -> bool:
        """Whether generation is currently paused."""

    @abc.abstractmethod
    def update_weights(self, update: WeightUpdate) -> None:
        """Load new weights; the engine must be paused. Its version becomes ``update.version``."""

    def stage_weights(self, update: WeightUpdate) -> WeightUpdate | None:
        """``update`` made independent of the caller's tensors (a private copy, or a file where
        the engine reads it), so that its load may run while the trainer changes its weights;
        None where this engine only loads in the caller's time (the loop then pushes
        synchronously). ``update_weights`` accepts what this returns."""
        return None

    @abc.abstractmethod
    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        """Prefill logprobs under the loaded weights at the engine's temperature.

        Returns, for each sequence ``s`` with start ``k``, the list
        ``[log p(s[t] | s[:t]) for t in range(k, len(s))]``; ``k`` must be ≥ 1.
        """

    @abc.abstractmethod
    def inflight_samples(self) -> list[RolloutSample]:
        """Samples whose generation has started but not finished (meaningful while paused)."""

    def stats(self) -> dict[str, int]:
        """Counters since start (``prefill_proximal_tokens``: tokens whose π_prox_t came from
        the re-prefill of a resumed sample; remote engines add their segment counters)."""
        return {}

    def close(self) -> None:
        """Release resources (threads, server processes, connections)."""

    def __enter__(self) -> "InferenceEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
