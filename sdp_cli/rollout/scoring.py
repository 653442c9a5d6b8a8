"""What the recompute pass needs of an inference engine.

``sdp_cli.engine.base.InferenceEngine`` fulfils it; the rollout package depends on this small
protocol instead of the engine package, which itself depends on rollout records.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from sdp_cli.rollout.records import RolloutSample


class ScoringEngine(Protocol):
    """An engine that can score tokens under its loaded weights (docs/design.md §2 step 2)."""

    def get_version(self) -> int:
        """Number of weight updates the engine has received."""
        ...

    def inflight_samples(self) -> list[RolloutSample]:
        """Samples whose generation has started but not finished (meaningful while paused)."""
        ...

    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        """``[log p(s[t] | s[:t]) for t in range(k, len(s))]`` for each sequence s, start k."""
        ...
