"""Consume-time staleness control (docs/design.md §2–3): which rollouts are too stale to train on.

A strategy is asked about a rollout in three places: before it is enqueued
(:meth:`~StalenessControlStrategy.filter_before_enqueue`), when the version changes
(:meth:`~StalenessControlStrategy.purge_stale_samples_from_queue`) and before a batch is taken
from the cache (:meth:`~StalenessControlStrategy.filter_stale_from_cache`). Every drop is counted
per version and reported through ``on_filtered(count, version)``, which the loop wires to
``StalenessManager.on_samples_filtered``
so that each dropped rollout gives its slot back exactly once. The contract that makes this
exact: only rollouts already counted as accepted are handed to a strategy.

Items are a ``RolloutSample`` or a ``RolloutGroup``; a group is dropped if any sample is.
"""

from __future__ import annotations

import abc
import bisect
import itertools
import operator
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar

from sdp_cli.core.token_status import INVALID, UNCORRECTABLE, token_status
from sdp_cli.errors import UserError
from sdp_cli.rollout.buffers import RolloutCache, RolloutQueue
from sdp_cli.rollout.records import RolloutGroup, RolloutSample, samples_of

Item = RolloutSample | RolloutGroup
OnFiltered = Callable[[int, int], None]


class StalenessConfigError(UserError, ValueError):
    """A bad strategy name or η (a config value, so also a ``ValueError``)."""


def _check_lengths(sample: RolloutSample) -> int:
    n = len(sample.versions)
    assert (
        n
        == len(sample.proximal_t_versions)
        == len(sample.proximal_logprobs_t)
        == len(sample.old_logprobs)
    ), f"sample {sample.sample_id}: per-token lists disagree in length"
    return n


def _segment_wise_sample_reason(
    sample: RolloutSample, c: int, max_head_offpolicyness: int
) -> str | None:
    n = _check_lengths(sample)
    if n == 0:
        return None
    sid = sample.sample_id
    newest, oldest = max(sample.versions), min(sample.versions)
    if newest > c:
        return f"sample {sid}: holds a token of version {newest} > current version {c}"
    if oldest < 0:
        return f"sample {sid}: holds a token of negative version {oldest}"
    if c - oldest > max_head_offpolicyness:
        return f"sample {sid}: head lags {c - oldest} versions > η = {max_head_offpolicyness}"
    if _stale_awaiting_at_most_fill(sample, newest, c):
        return None
    return _token_reason(sample, c)


def _all_stale_with_next_version(sample: RolloutSample, newest: int, c: int) -> bool:
    """Whether every token (``newest`` the latest version) is older than ``c`` and holds
    π_{v+1}: ``token_status`` is then OK for each. The common case at η > 1, checked at C speed,
    so that ``_token_reason`` runs only for the others: the trainer's thread filters its whole
    cache at every step."""
    next_versions = map(operator.add, sample.versions, itertools.repeat(1))
    return newest < c and all(map(operator.eq, sample.proximal_t_versions, next_versions))


def _stale_awaiting_at_most_fill(sample: RolloutSample, newest: int, c: int) -> bool:
    """Whether every token is older than ``c`` and holds π_{v+1}, or is of version c − 1 and
    still holds π_{c−1} (FILL): ``token_status`` is then OK or FILL for each, and the rule keeps
    the sample. The cache's samples at η > 0, checked at C speed for versions in generation order
    (a token's version never falls), so that ``_token_reason`` runs only for the others: the
    cache is filtered at every take, and its newest groups' version c − 1 tokens wait for π_c
    until the take or the push scores them (bench/cache_filter.py)."""
    if newest >= c:
        return False
    versions, proximal = sample.versions, sample.proximal_t_versions
    if _all_stale_with_next_version(sample, newest, c):
        return True
    if newest != c - 1 or not all(map(operator.le, versions, itertools.islice(versions, 1, None))):
        return False
    fill_from = bisect.bisect_left(versions, c - 1)  # the version c − 1 tokens: the sorted tail
    next_versions = map(operator.add, versions[:fill_from], itertools.repeat(1))
    older_ok = all(map(operator.eq, itertools.islice(proximal, fill_from), next_versions))
    return older_ok and set(proximal[fill_from:]) <= {c - 1, c}


def settled_head(item: Item, c: int) -> int | None:
    """The oldest token version of ``item`` if it is *settled* at version ``c``: every sample
    holds a token, each token is older than ``c`` and holds π_{v+1}; else None. Settled stays
    settled while the item is held: no recompute pass writes a token that holds π_{v+1} (its
    targets are tokens of version L − 1 without π_L) and a finished sample's versions do not
    change. At any version c′ ≥ ``c`` the segment-wise verdict on it is then c′ − oldest > η."""
    oldest: int | None = None
    for sample in samples_of(item):
        versions = sample.versions
        if not versions or len(versions) != len(sample.proximal_t_versions):
            return None
        low = min(versions)
        if low < 0 or not _all_stale_with_next_version(sample, max(versions), c):
            return None
        oldest = low if oldest is None else min(oldest, low)
    return oldest


def _token_reason(sample: RolloutSample, c: int) -> str | None:
    """The first token whose π_prox_t breaks the rule at version ``c``, as a reason; None if none."""
    sid = sample.sample_id
    for t, (v, pv) in enumerate(zip(sample.versions, sample.proximal_t_versions)):
        status = token_status(v, pv, c)
        if status == UNCORRECTABLE and v <= c - 2:
            return (
                f"sample {sid} token {t}: version {v} has π_prox_t from version {pv}, "
                f"not {v + 1}, and the weights of version {v + 1} are gone"
            )
        if status == UNCORRECTABLE:
            return f"sample {sid} token {t}: version {v} has π_prox_t from version {pv}"
        if v == c and (status == INVALID or sample.proximal_logprobs_t[t] != sample.old_logprobs[t]):
            return f"sample {sid} token {t}: current-version token with π_prox_t ≠ π_behav"
    return None


def segment_wise_stale_reason(
    item: Item, current_version: int, max_head_offpolicyness: int
) -> str | None:
    """Why the segment-wise strategy drops ``item`` at version c, or ``None`` to keep it.

    Drop when c − min(versions) > η; when a token of version v ≤ c−2 lacks π_{v+1}
    (``proximal_t_versions != v+1``: weights v+1 are gone, it can never be corrected); when a
    token of version c−1 has ``proximal_t_versions`` outside {c−1, c}; when a token of version c
    has ``proximal_t_versions != c`` or π_prox_t ≠ π_behav; or when any version exceeds c.
    A version c−1 token still at c−1 is kept: weights c are still loaded, so the engine scores it
    when the trainer takes the batch (or the trainer fills it with
    ``rollout.proximal_t_source=trainer``).
    """
    for sample in samples_of(item):
        reason = _segment_wise_sample_reason(sample, current_version, max_head_offpolicyness)
        if reason is not None:
            return reason
    return None


class StalenessControlStrategy(abc.ABC):
    """Decides which accepted rollouts are dropped before training, and counts the drops."""

    name: ClassVar[str]

    def __init__(self, *, max_head_offpolicyness: int, on_filtered: OnFiltered | None = None):
        if max_head_offpolicyness < 0:
            raise StalenessConfigError(
                f"max_head_offpolicyness must be >= 0, got {max_head_offpolicyness}; "
                "set rollout.max_head_offpolicyness to 0 or more"
            )
        self.max_head_offpolicyness = int(max_head_offpolicyness)
        self._on_filtered = on_filtered
        self._lock = threading.Lock()
        self._filtered_by_version: Counter[int] = Counter()

    @abc.abstractmethod
    def is_sample_too_stale(self, item: Item, current_version: int) -> bool:
        """Whether ``item`` must not be trained on at ``current_version``."""

    @abc.abstractmethod
    def should_filter_before_enqueue(self) -> bool:
        """Whether the producer checks each rollout before putting it in the queue."""

    @property
    def filtered_by_version(self) -> dict[int, int]:
        """Dropped rollouts per trainer version at which they were dropped."""
        with self._lock:
            return dict(self._filtered_by_version)

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe drop counts for checkpoints."""
        with self._lock:
            return {"filtered_by_version": sorted(self._filtered_by_version.items())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (replaces the current counts)."""
        with self._lock:
            self._filtered_by_version = Counter(
                {int(v): int(n) for v, n in state["filtered_by_version"]}
            )

    def _record(self, count: int, current_version: int) -> None:
        if count == 0:
            return
        with self._lock:
            self._filtered_by_version[current_version] += count
        if self._on_filtered is not None:
            self._on_filtered(count, current_version)

    def filter_before_enqueue(self, item: Item, current_version: int) -> bool:
        """True to keep ``item``; a drop is counted and reported."""
        if not self.should_filter_before_enqueue() or not self.is_sample_too_stale(
            item, current_version
        ):
            return True
        self._record(1, current_version)
        return False

    def purge_stale_samples_from_queue(
        self, queue: RolloutQueue[Item], current_version: int
    ) -> int:
        """Drop the stale items from ``queue`` in place (order kept); return how many."""
        removed = queue.filter_inplace(
            lambda item: not self.is_sample_too_stale(item, current_version)
        )
        self._record(removed, current_version)
        return removed

    def filter_stale_from_cache(self, cache: RolloutCache[Item], current_version: int) -> int:
        """Drop the stale items from ``cache`` in place; return how many."""
        removed = cache.filter_inplace(
            lambda item: not self.is_sample_too_stale(item, current_version)
        )
        self._record(removed, current_version)
        return removed

    def settled(self, item: Item) -> bool:
        """Whether ``item`` was settled (``settled_head``) when the cache was last filtered; a
        strategy that does not keep track says False."""
        return False


class StandardStrategy(StalenessControlStrategy):
    """Classic behaviour: admission control bounds staleness, nothing is dropped later."""

    name = "standard"

    def is_sample_too_stale(self, item: Item, current_version: int) -> bool:
        return False

    def should_filter_before_enqueue(self) -> bool:
        return False


class SegmentWiseStrategy(StalenessControlStrategy):
    """Drops rollouts that cannot satisfy the segment-wise invariant (see
    :func:`segment_wise_stale_reason`), everywhere a rollout is held."""

    name = "segment_wise"

    def __init__(self, *, max_head_offpolicyness: int, on_filtered: OnFiltered | None = None):
        super().__init__(max_head_offpolicyness=max_head_offpolicyness, on_filtered=on_filtered)
        # The cache's settled items, by id, with the item (held here, so no other object takes
        # its id) and its oldest version. The cache is filtered at every take, mostly the same
        # groups again (48 of its 64 at η = 4 on the defaults' shape); a settled group's verdict
        # is one comparison (bench/cache_filter.py). Used by the thread that takes batches.
        self._settled: dict[int, tuple[Item, int]] = {}

    def filter_stale_from_cache(self, cache: RolloutCache[Item], current_version: int) -> int:
        """Drop the stale items from ``cache`` in place; return how many. An item settled at an
        earlier filter is kept while its head lags at most η (the rule's verdict on it, by
        ``settled_head``); every other item, and every drop, is judged by ``is_sample_too_stale``."""
        known, settled = self._settled, {}

        def keep(item: Item) -> bool:
            entry = known.get(id(item))
            if entry is not None and current_version - entry[1] <= self.max_head_offpolicyness:
                settled[id(item)] = entry
                return True
            if self.is_sample_too_stale(item, current_version):
                return False
            oldest = entry[1] if entry is not None else settled_head(item, current_version)
            if oldest is not None:
                settled[id(item)] = (item, oldest)
            return True

        removed = cache.filter_inplace(keep)
        self._settled = settled
        self._record(removed, current_version)
        return removed

    def settled(self, item: Item) -> bool:
        return id(item) in self._settled

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._settled = {}

    def is_sample_too_stale(self, item: Item, current_version: int) -> bool:
        return (
            segment_wise_stale_reason(item, current_version, self.max_head_offpolicyness)
            is not None
        )

    def should_filter_before_enqueue(self) -> bool:
        return True


STRATEGIES: dict[str, type[StalenessControlStrategy]] = {
    cls.name: cls for cls in (StandardStrategy, SegmentWiseStrategy)
}


def create_staleness_strategy(
    name: str, *, max_head_offpolicyness: int, on_filtered: OnFiltered | None = None
) -> StalenessControlStrategy:
    """The strategy called ``name`` (config group ``staleness``)."""
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise StalenessConfigError(
            f"unknown staleness strategy {name!r}; use one of: {', '.join(sorted(STRATEGIES))}"
        ) from None
    return cls(max_head_offpolicyness=max_head_offpolicyness, on_filtered=on_filtered)
