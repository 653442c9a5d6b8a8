"""Admission control: how many rollouts may start now (docs/design.md §3, AReaL's rule).

With η = ``max_head_offpolicyness`` (the config key ``rollout.max_head_offpolicyness``),
B = ``consumer_batch_size`` and v the current version::

    staleness_capacity = (η + v + 1)·B − (accepted + running)
    adjusted           = modifiers applied in registration order to staleness_capacity
    capacity           = min(max(1, max_concurrent) − running, adjusted)

Because the concurrency limit is applied last, no modifier can lift capacity above it.
Rollouts start only while ``capacity > 0``.

Consume-time drops. A rollout dropped by a staleness strategy was already counted in
``accepted`` (the loop accepts a rollout when it finishes, the strategy may drop it later), so
the staleness term no longer frees its slot when the trainer consumes a batch. Such a drop is
reported with :meth:`StalenessManager.on_samples_filtered`; the manager counts it in
``RolloutStat.filtered`` ("dropped, still inside ``accepted``") and forwards it to the
modifiers. :class:`FilteredSamplesCapacityModifier` (the loop registers it) returns the slot as
a credit that persists, since the dropped rollout stays inside ``accepted`` for good: each drop
frees exactly one slot, once.

Invariant kept at every instant (checked by the stress tests)::

    (accepted − filtered) + running ≤ (η + v + 1)·B   and   running ≤ max(1, max_concurrent)

Lock order: manager → modifier. Modifiers and the version provider are called while the
manager's lock is held and must not call back into the manager.
"""

from __future__ import annotations

import abc
import copy
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class RolloutStat:
    """Rollout counters (one rollout = one ``RolloutGroup``).

    Attributes:
        enqueued: inputs waiting to be submitted.
        submitted: rollouts ever submitted (cumulative).
        accepted: rollouts that finished and were kept (cumulative, minus compactions).
        rejected: rollouts that finished and were thrown away, or dropped and compacted.
        running: rollouts submitted and not yet finished.
        filtered: rollouts dropped at consume time that are still counted in ``accepted``.
    """

    enqueued: int = 0
    submitted: int = 0
    accepted: int = 0
    rejected: int = 0
    running: int = 0
    filtered: int = 0


class CapacityModifier(abc.ABC):
    """Adjusts the staleness capacity; the manager applies the concurrency limit afterwards."""

    @abc.abstractmethod
    def modify_capacity(self, base_capacity: int, current_version: int, stats: RolloutStat) -> int:
        """Return the adjusted staleness capacity."""

    def on_samples_filtered(self, count: int, version: int | None = None) -> None:
        """``count`` accepted rollouts were dropped at consume time (default: ignored)."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state for checkpoints (default: stateless)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""


class FilteredSamplesCapacityModifier(CapacityModifier):
    """Gives back the slots of rollouts dropped after they were accepted.

    Semantics: ``credit`` rises by ``count`` on :meth:`on_samples_filtered` and
    :meth:`modify_capacity` returns ``base + credit``. The credit is *not* touched when rollouts
    are admitted or batches consumed — the dropped rollouts stay inside ``accepted`` for good,
    so a credit that decayed there would take their slots away again (the deadlock of the
    AReaL fork this design started from, which decremented the credit on every consumed batch).
    Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._credit = 0
        self._by_version: Counter[int] = Counter()

    def on_samples_filtered(self, count: int, version: int | None = None) -> None:
        assert count >= 0, f"filtered count must be >= 0, got {count}"
        with self._lock:
            self._credit += count
            if version is not None:
                self._by_version[version] += count

    def modify_capacity(self, base_capacity: int, current_version: int, stats: RolloutStat) -> int:
        with self._lock:
            return base_capacity + self._credit

    def get_filtered_count(self) -> int:
        """Current credit: dropped rollouts whose slots the counters do not free."""
        with self._lock:
            return self._credit

    def get_version_stats(self) -> dict[int, int]:
        """Dropped rollouts per version at which they were dropped (cumulative)."""
        with self._lock:
            return dict(self._by_version)

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"credit": self._credit, "by_version": sorted(self._by_version.items())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._credit = int(state["credit"])
            self._by_version = Counter({int(v): int(n) for v, n in state["by_version"]})


class StalenessManager:
    """Counts rollouts through their lifecycle and answers how many may start now.

    Lifecycle of one rollout: ``on_rollout_enqueued`` → ``on_rollout_submitted`` (or
    :meth:`try_submit`, which checks capacity and submits atomically) → ``on_rollout_accepted``
    or ``on_rollout_rejected``; later, optionally, ``on_samples_filtered`` when an accepted
    rollout is dropped at consume time (never for a rejected one: its slot is already free).
    """

    def __init__(
        self,
        max_concurrent_rollouts: int,
        consumer_batch_size: int,
        max_head_offpolicyness: int,
        version_provider: Callable[[], int],
    ):
        if max_head_offpolicyness < 0:
            raise ValueError(f"max_head_offpolicyness must be >= 0, got {max_head_offpolicyness}")
        self.max_concurrent_rollouts = max(1, int(max_concurrent_rollouts))
        self.consumer_batch_size = max(1, int(consumer_batch_size))
        self.max_head_offpolicyness = int(max_head_offpolicyness)
        self._version_provider = version_provider
        self._lock = threading.Lock()
        self._stat = RolloutStat()
        self._modifiers: list[CapacityModifier] = []

    # ------------------------------------------------------------------ modifiers
    def register_capacity_modifier(self, modifier: CapacityModifier) -> None:
        """Append ``modifier``; modifiers run in registration order on the staleness capacity."""
        with self._lock:
            self._modifiers.append(modifier)

    # ------------------------------------------------------------------ lifecycle
    def on_rollout_enqueued(self) -> None:
        with self._lock:
            self._stat.enqueued += 1

    def on_rollout_submitted(self) -> None:
        with self._lock:
            self._submit_locked()

    def try_submit(self) -> bool:
        """Submit one enqueued rollout if capacity allows; check and count in one step so that
        concurrent producers can never overshoot the bound."""
        with self._lock:
            if self._capacity_locked() <= 0:
                return False
            self._submit_locked()
            return True

    def _submit_locked(self) -> None:
        assert self._stat.enqueued > 0, (
            "on_rollout_submitted without a matching on_rollout_enqueued"
        )
        self._stat.enqueued -= 1
        self._stat.submitted += 1
        self._stat.running += 1

    def on_rollout_accepted(self) -> None:
        with self._lock:
            assert self._stat.running > 0, "on_rollout_accepted with no running rollout"
            self._stat.running -= 1
            self._stat.accepted += 1

    def on_rollout_rejected(self) -> None:
        with self._lock:
            assert self._stat.running > 0, "on_rollout_rejected with no running rollout"
            self._stat.running -= 1
            self._stat.rejected += 1

    def on_samples_filtered(self, count: int, version: int | None = None) -> None:
        """``count`` accepted rollouts were dropped at consume time (strategy callback)."""
        assert count >= 0, f"filtered count must be >= 0, got {count}"
        with self._lock:
            assert self._stat.filtered + count <= self._stat.accepted, (
                f"{self._stat.filtered + count} rollouts filtered but only "
                f"{self._stat.accepted} accepted: drop only accepted rollouts"
            )
            self._stat.filtered += count
            for modifier in self._modifiers:
                modifier.on_samples_filtered(count, version)

    # ------------------------------------------------------------------- queries
    def get_capacity(self) -> int:
        """How many rollouts may start now (may be ≤ 0)."""
        with self._lock:
            return self._capacity_locked()

    def _capacity_locked(self) -> int:
        version = int(self._version_provider())
        stat = self._stat
        staleness = (self.max_head_offpolicyness + version + 1) * self.consumer_batch_size - (
            stat.accepted + stat.running
        )
        if self._modifiers:  # a copy for them only: the producer asks at every round
            snapshot = copy.copy(stat)  # flat ints: asdict's recursive copy is not needed
            for modifier in self._modifiers:
                staleness = int(modifier.modify_capacity(staleness, version, snapshot))
        return min(self.max_concurrent_rollouts - stat.running, staleness)

    def get_stats(self) -> RolloutStat:
        """A consistent copy of the counters."""
        with self._lock:
            return copy.copy(self._stat)

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Exact counters and modifier states, JSON-safe."""
        with self._lock:
            return {
                "stats": asdict(self._stat),
                "modifiers": [m.state_dict() for m in self._modifiers],
            }

    def load_state_dict(self, state: dict[str, Any], *, drop_inflight: bool = False) -> None:
        """Restore :meth:`state_dict` output (register the same modifiers first).

        ``drop_inflight=True`` is for a resume that does not restore the rollouts that were
        running or waiting when the checkpoint was taken: they are counted as rejected (their
        slots come back) and the queue of waiting inputs is emptied.
        """
        names = {f.name for f in fields(RolloutStat)}
        stats = state["stats"]
        if set(stats) != names:
            raise ValueError(
                f"staleness state has counters {sorted(stats)}, expected {sorted(names)}"
            )
        with self._lock:
            if len(state["modifiers"]) != len(self._modifiers):
                raise ValueError(
                    f"staleness state has {len(state['modifiers'])} modifier states but "
                    f"{len(self._modifiers)} modifiers are registered"
                )
            self._stat = RolloutStat(**{k: int(v) for k, v in stats.items()})
            for modifier, modifier_state in zip(self._modifiers, state["modifiers"]):
                modifier.load_state_dict(modifier_state)
            if drop_inflight:
                self._stat.rejected += self._stat.running
                self._stat.running = 0
                self._stat.enqueued = 0
