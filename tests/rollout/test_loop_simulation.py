"""Acceptance tests for the rollout buffer as a whole (issue #3): queue + cache + staleness
manager + segment-wise strategy under concurrent producers, and a deterministic simulation
proving that aggressive filtering never deadlocks the producer.

The bound checked throughout (docs in sdp_cli/rollout/staleness.py): a dropped rollout stays in
``accepted`` and its slot is returned by the credit, so the *live* rollouts obey AReaL's bound

    (accepted − filtered) + running ≤ (η + v + 1)·B,   and   running ≤ max_concurrent.
"""

import queue as std_queue
import random
import threading
import time

import pytest

from sdp_cli.rollout.buffers import RolloutCache, RolloutQueue
from sdp_cli.rollout.records import RolloutGroup, RolloutSample
from sdp_cli.rollout.staleness import (
    FilteredSamplesCapacityModifier,
    StalenessManager,
)
from sdp_cli.rollout.strategies import SegmentWiseStrategy, segment_wise_stale_reason


class RecordingStrategy(SegmentWiseStrategy):
    """The real segment-wise strategy, also remembering which groups it dropped (every True
    answer of ``is_sample_too_stale`` inside the strategy is exactly one drop). With
    ``drop_every=k`` it also drops every k-th group, like a reward filter would."""

    def __init__(self, drop_every=None, **kwargs):
        super().__init__(**kwargs)
        self.drop_every = drop_every
        self.dropped: list[int] = []
        self._ids_lock = threading.Lock()

    def is_sample_too_stale(self, item, current_version):
        stale = super().is_sample_too_stale(item, current_version)
        stale = stale or (self.drop_every is not None and item.group_id % self.drop_every == 0)
        if stale:
            with self._ids_lock:
                self.dropped.append(item.group_id)
        return stale


def live_bound_holds(stats, eta, version, batch):
    return stats.accepted - stats.filtered + stats.running <= (eta + version + 1) * batch


def simulate(
    *,
    seed,
    eta=1,
    batch=4,
    max_conc=6,
    target_versions=40,
    max_len=9,
    drop_every=None,
):
    """Tick-based single-threaded loop. Each running rollout emits one token per tick at the
    current version; no recompute pass runs, so a rollout whose tokens cross two version changes
    before consumption is dropped (aggressive segment-wise filtering). Returns (final version,
    rollouts dropped, the modifier's remaining credit), or raises ``RuntimeError('deadlock ...')``."""
    rng = random.Random(seed)
    version = [0]
    mgr = StalenessManager(max_conc, batch, eta, lambda: version[0])
    modifier = FilteredSamplesCapacityModifier()
    mgr.register_capacity_modifier(modifier)
    strategy = RecordingStrategy(
        drop_every=drop_every, max_head_offpolicyness=eta, on_filtered=mgr.on_samples_filtered
    )
    q: RolloutQueue[RolloutGroup] = RolloutQueue()
    cache: RolloutCache[RolloutGroup] = RolloutCache()
    running: list[tuple[RolloutGroup, int]] = []
    started, consumed = [], []
    next_id = 0
    mgr.on_rollout_enqueued()
    for tick in range(50_000):
        # producer: start as many rollouts as capacity allows
        while mgr.try_submit():
            group = RolloutGroup(next_id, [RolloutSample(prompt_ids=[1])])
            started.append(next_id)
            next_id += 1
            running.append((group, rng.randint(1, max_len)))
            mgr.on_rollout_enqueued()
        stats = mgr.get_stats()
        assert stats.running <= max_conc, "capacity exceeded the concurrency limit"
        assert mgr.get_capacity() <= max_conc - stats.running
        assert live_bound_holds(stats, eta, version[0], batch), (stats, version[0])
        # the same bound from the test's own bookkeeping, independent of the manager's counters
        live = len(started) - len(strategy.dropped)
        assert live <= (eta + version[0] + 1) * batch, (live, version[0])
        # engine: one token per running rollout
        still = []
        for group, length in running:
            group.samples[0].append_tokens([7], [-1.0], version[0])
            if group.samples[0].output_len >= length:
                mgr.on_rollout_accepted()
                if strategy.filter_before_enqueue(group, version[0]):
                    q.put(group)
            else:
                still.append((group, length))
        running = still
        # trainer: every 3rd tick, try to take a batch
        if tick % 3 == 0:
            for item in q.drain():
                cache.add(item)
            strategy.filter_stale_from_cache(cache, version[0])
            if cache.size() >= batch:
                taken = cache.take_first_n(batch)
                for group in taken:
                    assert segment_wise_stale_reason(group, version[0], eta) is None
                consumed.extend(g.group_id for g in taken)
                version[0] += 1
                strategy.purge_stale_samples_from_queue(q, version[0])
                if version[0] >= target_versions:
                    break
        if not running and q.qsize() + cache.size() < batch and mgr.get_capacity() <= 0:
            raise RuntimeError(f"deadlock at version {version[0]}, tick {tick}: {mgr.get_stats()}")
    # bookkeeping: every started rollout is in exactly one place
    held = [g.group_id for g in q.snapshot() + cache.get_all()] + [g.group_id for g, _ in running]
    assert sorted(consumed + strategy.dropped + held) == started
    stats = mgr.get_stats()
    assert stats.filtered == len(strategy.dropped) > 0, "the simulation must actually drop rollouts"
    return version[0], len(strategy.dropped), modifier.get_filtered_count()


@pytest.mark.parametrize("seed", range(6))
def test_aggressive_filtering_never_deadlocks(seed):
    reached, dropped, credit = simulate(seed=seed)
    assert reached == 40
    assert dropped >= 5  # filtering really was aggressive
    assert credit == dropped  # every dropped slot is still returned at the end


@pytest.mark.parametrize("seed", range(4))
def test_filtering_plus_a_reward_filter_never_deadlocks(seed):
    reached, dropped, _ = simulate(seed=seed, drop_every=3)
    # 40 versions consume 160 live groups; with ids 0..N−1 and every third dropped,
    # N − ⌈N/3⌉ ≥ 160 needs N ≥ 240, so at least ⌈240/3⌉ = 80 drops
    assert reached == 40 and dropped >= 80


def test_stress_many_producers_one_consumer():
    eta, batch, max_conc, n_producers, target_batches = 1, 4, 8, 6, 40
    lock = threading.Lock()
    version = [0]
    mgr = StalenessManager(max_conc, batch, eta, lambda: version[0])
    mgr.register_capacity_modifier(FilteredSamplesCapacityModifier())
    strategy = RecordingStrategy(max_head_offpolicyness=eta, on_filtered=mgr.on_samples_filtered)
    q: RolloutQueue[RolloutGroup] = RolloutQueue(maxsize=16)
    cache: RolloutCache[RolloutGroup] = RolloutCache()
    stop = threading.Event()
    started, rejected, violations = [], [], []
    ids = iter(range(10**9))

    def producer(seed):
        rng = random.Random(seed)
        while not stop.is_set():
            mgr.on_rollout_enqueued()
            while not mgr.try_submit():
                if stop.is_set():
                    return
                time.sleep(0.0002)
            with lock:
                gid = next(ids)
                started.append(gid)
            group = RolloutGroup(gid, [RolloutSample(prompt_ids=[1, 2]) for _ in range(2)])
            for _ in range(rng.randint(1, 6)):
                for s in group.samples:
                    s.append_tokens([rng.randint(3, 50)], [-1.0], version[0])
                time.sleep(rng.random() * 0.001)
            stats, v = mgr.get_stats(), version[0]  # v read after: it only grows, so this is safe
            if stats.running > max_conc or not live_bound_holds(stats, eta, v, batch):
                violations.append((stats, v))
            if rng.random() < 0.05:
                with lock:
                    rejected.append(gid)
                mgr.on_rollout_rejected()
                continue
            mgr.on_rollout_accepted()
            if strategy.filter_before_enqueue(group, version[0]):
                q.put(group, timeout=10)

    threads = [
        threading.Thread(target=producer, args=(k,), daemon=True) for k in range(n_producers)
    ]
    for t in threads:
        t.start()
    consumed: list[int] = []
    deadline = time.monotonic() + 60
    try:
        while version[0] < target_batches:
            assert time.monotonic() < deadline, f"no progress (deadlock?): {mgr.get_stats()}"
            try:
                cache.add(q.get(timeout=0.05))
            except std_queue.Empty:
                pass
            for item in q.drain():
                cache.add(item)
            strategy.filter_stale_from_cache(cache, version[0])
            if cache.size() < batch:
                continue
            taken = cache.take_first_n(batch)
            for group in taken:
                # consumed groups respect the consume-time rule at the version that trains them
                assert segment_wise_stale_reason(group, version[0], eta) is None
            consumed.extend(g.group_id for g in taken)
            # the consumer alone moves the version, so here the bound is checked at a fixed v
            stats = mgr.get_stats()
            assert stats.running <= max_conc
            assert live_bound_holds(stats, eta, version[0], batch), (stats, version[0])
            version[0] += 1
            strategy.purge_stale_samples_from_queue(q, version[0])
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
    assert not violations, violations[:3]
    # the run exercised every path (about 25 drops and 10 rejections are typical)
    assert strategy.dropped and rejected
    held = [g.group_id for g in q.drain() + cache.get_all()]
    everything = consumed + strategy.dropped + rejected + held
    assert len(everything) == len(set(everything)), "a rollout was duplicated"
    assert sorted(everything) == sorted(started), "a rollout was lost"
    stats = mgr.get_stats()
    assert stats.running == 0
    assert stats.rejected == len(rejected)
    assert stats.filtered == len(strategy.dropped)
    assert stats.accepted == len(consumed) + len(strategy.dropped) + len(held)
