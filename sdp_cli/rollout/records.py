"""Rollout records: one generated response with the policy version of every token.

Index ``t`` of every per-token list refers to output token ``t`` (prompt tokens carry no
logprobs or versions here; the batch file format adds them back with version -1).

Ownership: a sample is mutated by one party at a time. The engine appends tokens while it
generates; the recompute pass patches ``proximal_logprobs_t`` only while generation is paused;
the trainer reads it after it has been taken out of the cache. The pause protocol
(docs/design.md §2) is what makes this exclusive, so the record itself holds no lock.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

from sdp_cli.choices import FINISH_REASONS

_sample_ids = itertools.count()


def _next_sample_id() -> int:
    return next(_sample_ids)


@dataclass
class RolloutSample:
    """A prompt and its (possibly partial) response, token by token.

    Attributes:
        prompt_ids: prompt token ids.
        output_ids: generated token ids.
        old_logprobs: log π_behav(token) under the distribution it was sampled from.
        versions: engine version (number of weight updates received) that produced each token.
        proximal_logprobs_t: log π_{v+1}(token) once recomputed; initialised to ``old_logprobs``.
        proximal_t_versions: the version whose weights produced ``proximal_logprobs_t[t]``;
            initialised to ``versions`` (a token scored by its own version has w = 1).
        reward: scalar reward once the response is finished and scored.
        group_id: the prompt group this sample belongs to (GRPO advantages are per group).
        finish_reason: ``"stop"`` or ``"length"`` when finished, ``None`` while in flight.
        sample_id: process-unique id, used to detect loss or duplication.
        meta: task data needed to score the sample (e.g. the reference answer).
    """

    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    old_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    proximal_logprobs_t: list[float] = field(default_factory=list)
    proximal_t_versions: list[int] = field(default_factory=list)
    reward: float | None = None
    group_id: int = 0
    finish_reason: str | None = None
    sample_id: int = field(default_factory=_next_sample_id)
    meta: dict[str, Any] = field(default_factory=dict)

    # ----------------------------------------------------------------- building
    def append_tokens(
        self, token_ids: Sequence[int], logprobs: Sequence[float], version: int | Sequence[int]
    ) -> None:
        """Append generated tokens; π_prox_t starts as the behaviour logprob of the same version."""
        if len(token_ids) != len(logprobs):
            raise ValueError(
                f"append_tokens: {len(token_ids)} token ids but {len(logprobs)} logprobs"
            )
        if isinstance(version, int):
            token_versions = [version] * len(token_ids)
        else:
            token_versions = [int(v) for v in version]
            if len(token_versions) != len(token_ids):
                raise ValueError(
                    f"append_tokens: {len(token_ids)} token ids but {len(token_versions)} versions"
                )
        self.output_ids.extend(int(t) for t in token_ids)
        self.old_logprobs.extend(float(x) for x in logprobs)
        self.versions.extend(token_versions)
        self.proximal_logprobs_t.extend(float(x) for x in logprobs)
        self.proximal_t_versions.extend(token_versions)

    def set_proximal_t(self, index: int, logprob: float, version: int) -> None:
        """Record log π_version(token ``index``); ``version`` must be the token's version + 1."""
        assert version == self.versions[index] + 1, (
            f"proximal_t for token {index} of version {self.versions[index]} "
            f"must come from version {self.versions[index] + 1}, got {version}"
        )
        self.proximal_logprobs_t[index] = float(logprob)
        self.proximal_t_versions[index] = int(version)

    def finish(self, reason: str) -> None:
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason must be one of {FINISH_REASONS}, got {reason!r}")
        self.finish_reason = reason

    # ------------------------------------------------------------------ queries
    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_len(self) -> int:
        return len(self.output_ids)

    @property
    def input_ids(self) -> list[int]:
        """Prompt followed by the output so far."""
        return [*self.prompt_ids, *self.output_ids]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def check_consistent(self) -> None:
        """Raise ``ValueError`` if the per-token lists disagree in length or hold non-finite values."""
        n = len(self.output_ids)
        lengths = {
            "old_logprobs": len(self.old_logprobs),
            "versions": len(self.versions),
            "proximal_logprobs_t": len(self.proximal_logprobs_t),
            "proximal_t_versions": len(self.proximal_t_versions),
        }
        for name, length in lengths.items():
            if length != n:
                raise ValueError(f"sample {self.sample_id}: {name} has {length} entries, output has {n}")
        for name in ("old_logprobs", "proximal_logprobs_t"):
            if not all(math.isfinite(x) for x in getattr(self, name)):
                raise ValueError(f"sample {self.sample_id}: {name} holds a non-finite value")

    # ------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (used by checkpoints; never pickled)."""
        return {
            "prompt_ids": list(self.prompt_ids),
            "output_ids": list(self.output_ids),
            "old_logprobs": list(self.old_logprobs),
            "versions": list(self.versions),
            "proximal_logprobs_t": list(self.proximal_logprobs_t),
            "proximal_t_versions": list(self.proximal_t_versions),
            "reward": self.reward,
            "group_id": self.group_id,
            "finish_reason": self.finish_reason,
            "sample_id": self.sample_id,
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RolloutSample":
        sample = cls(
            prompt_ids=[int(x) for x in data["prompt_ids"]],
            output_ids=[int(x) for x in data["output_ids"]],
            old_logprobs=[float(x) for x in data["old_logprobs"]],
            versions=[int(x) for x in data["versions"]],
            proximal_logprobs_t=[float(x) for x in data["proximal_logprobs_t"]],
            proximal_t_versions=[int(x) for x in data["proximal_t_versions"]],
            reward=None if data.get("reward") is None else float(data["reward"]),
            group_id=int(data.get("group_id", 0)),
            finish_reason=data.get("finish_reason"),
            sample_id=int(data["sample_id"]) if "sample_id" in data else _next_sample_id(),
            meta=dict(data.get("meta", {})),
        )
        sample.check_consistent()
        return sample


@dataclass
class RolloutGroup:
    """The samples drawn for one prompt (GRPO group). This is the unit the buffer,
    the staleness manager and the staleness strategies count: one group = one rollout."""

    group_id: int
    samples: list[RolloutSample]

    def __iter__(self) -> Iterator[RolloutSample]:
        return iter(self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    def to_dict(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "samples": [s.to_dict() for s in self.samples]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RolloutGroup":
        return cls(
            group_id=int(data["group_id"]),
            samples=[RolloutSample.from_dict(s) for s in data["samples"]],
        )


def samples_of(item: RolloutSample | RolloutGroup | Iterable[RolloutSample]) -> list[RolloutSample]:
    """The samples inside a buffer item, whether it is one sample or a group."""
    if isinstance(item, RolloutSample):
        return [item]
    return list(item)
