"""StalenessManager and FilteredSamplesCapacityModifier: admission formula (docs/design.md §3),
modifier order and the concurrency cap, exact return of dropped slots, checkpoint state."""

import json
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdp_cli.rollout.staleness import (
    CapacityModifier,
    FilteredSamplesCapacityModifier,
    RolloutStat,
    StalenessManager,
)


class Version:
    """A settable version provider."""

    def __init__(self, v: int = 0):
        self.v = v

    def __call__(self) -> int:
        return self.v


def run_one(mgr: StalenessManager, accept: bool = True) -> None:
    mgr.on_rollout_enqueued()
    mgr.on_rollout_submitted()
    if accept:
        mgr.on_rollout_accepted()
    else:
        mgr.on_rollout_rejected()


def test_admission_formula_hand_computed():
    version = Version(0)
    mgr = StalenessManager(
        max_concurrent_rollouts=100,
        consumer_batch_size=4,
        max_head_offpolicyness=1,
        version_provider=version,
    )
    # (η + v + 1)·B − (accepted + running) = (1 + 0 + 1)·4 − 0 = 8; concurrency 100 − 0
    assert mgr.get_capacity() == 8
    for _ in range(3):
        mgr.on_rollout_enqueued()
        mgr.on_rollout_submitted()
    # 8 − 3 running = 5; concurrency 100 − 3 = 97 → 5
    assert mgr.get_capacity() == 5
    mgr.on_rollout_accepted()
    mgr.on_rollout_rejected()
    # accepted 1, running 1: 8 − 2 = 6 (the rejected rollout freed its slot)
    assert mgr.get_capacity() == 6
    version.v = 2
    # (1 + 2 + 1)·4 − 2 = 14
    assert mgr.get_capacity() == 14
    assert mgr.get_stats() == RolloutStat(
        enqueued=0, submitted=3, accepted=1, rejected=1, running=1, filtered=0
    )


def test_concurrency_limit_and_its_floor_of_one():
    mgr = StalenessManager(
        max_concurrent_rollouts=2,
        consumer_batch_size=8,
        max_head_offpolicyness=4,
        version_provider=Version(0),
    )
    assert mgr.get_capacity() == 2  # min(2 − 0, 5·8)
    mgr.on_rollout_enqueued()
    mgr.on_rollout_submitted()
    assert mgr.get_capacity() == 1  # 2 − 1 running
    zero = StalenessManager(
        max_concurrent_rollouts=0,
        consumer_batch_size=0,
        max_head_offpolicyness=0,
        version_provider=Version(0),
    )
    # max(1, 0) = 1 concurrent; B = max(1, 0) = 1 → (0 + 0 + 1)·1 = 1
    assert zero.get_capacity() == 1


class Affine(CapacityModifier):
    def __init__(self, mul: int, add: int):
        self.mul, self.add = mul, add
        self.seen: list[tuple[int, int, RolloutStat]] = []

    def modify_capacity(self, base_capacity, current_version, stats):
        self.seen.append((base_capacity, current_version, stats))
        return base_capacity * self.mul + self.add


def test_modifiers_run_in_registration_order_before_the_concurrency_cap():
    mgr = StalenessManager(1000, 4, 1, Version(0))
    double, minus3 = Affine(2, 0), Affine(1, -3)
    mgr.register_capacity_modifier(double)
    mgr.register_capacity_modifier(minus3)
    # base 8 → ×2 = 16 → −3 = 13 (the reverse order would give (8 − 3)·2 = 10)
    assert mgr.get_capacity() == 13
    assert double.seen[-1][:2] == (8, 0) and minus3.seen[-1][:2] == (16, 0)

    capped = StalenessManager(3, 4, 1, Version(0))
    capped.register_capacity_modifier(Affine(1, 1000))
    assert capped.get_capacity() == 3  # min(3 − 0, 8 + 1000): the modifier cannot lift the cap
    capped.on_rollout_enqueued()
    capped.on_rollout_submitted()
    assert capped.get_capacity() == 2


def test_lifecycle_misuse_is_an_assertion():
    mgr = StalenessManager(4, 4, 0, Version(0))
    with pytest.raises(AssertionError):
        mgr.on_rollout_submitted()  # nothing enqueued
    with pytest.raises(AssertionError):
        mgr.on_rollout_accepted()  # nothing running
    with pytest.raises(AssertionError):
        mgr.on_samples_filtered(1)  # nothing accepted to drop
    with pytest.raises(ValueError):
        StalenessManager(4, 4, -1, Version(0))


def test_try_submit_respects_capacity():
    mgr = StalenessManager(10, 2, 0, Version(0))
    for _ in range(5):
        mgr.on_rollout_enqueued()
    # capacity (0 + 0 + 1)·2 = 2: exactly two submissions succeed
    assert [mgr.try_submit() for _ in range(4)] == [True, True, False, False]
    assert mgr.get_stats().enqueued == 3 and mgr.get_stats().running == 2


def test_dropped_rollout_slot_returns_once_and_stays_back():
    version = Version(0)
    mgr = StalenessManager(2, 2, 0, version)
    mod = FilteredSamplesCapacityModifier()
    mgr.register_capacity_modifier(mod)
    run_one(mgr)
    run_one(mgr)
    assert mgr.get_capacity() == 0  # (0+0+1)·2 − 2 accepted
    mgr.on_samples_filtered(1, version=0)
    assert mgr.get_capacity() == 1  # −0 + credit 1
    run_one(mgr)  # the replacement rollout is admitted and finishes
    # accepted 3: 2 − 3 + 1 = 0 — the credit did not vanish when the replacement started
    assert mgr.get_capacity() == 0
    version.v = 1  # the trainer consumed the two live rollouts
    # (0 + 1 + 1)·2 − 3 + 1 = 2; min(2 − 0, 2) = 2. A decayed credit would give 1.
    assert mgr.get_capacity() == 2
    assert mod.get_filtered_count() == 1 and mod.get_version_stats() == {0: 1}


def test_state_dict_round_trips_through_json():
    version = Version(2)
    mgr = StalenessManager(6, 4, 1, version)
    mod = FilteredSamplesCapacityModifier()
    mgr.register_capacity_modifier(mod)
    for i in range(7):
        run_one(mgr, accept=i != 3)
    mgr.on_rollout_enqueued()
    mgr.on_rollout_enqueued()
    mgr.on_rollout_submitted()
    mgr.on_samples_filtered(2, version=1)
    mgr.on_samples_filtered(1, version=2)
    state = json.loads(json.dumps(mgr.state_dict()))

    restored = StalenessManager(6, 4, 1, version)
    restored_mod = FilteredSamplesCapacityModifier()
    restored.register_capacity_modifier(restored_mod)
    restored.load_state_dict(state)
    assert restored.get_stats() == mgr.get_stats()
    assert restored.get_capacity() == mgr.get_capacity()
    assert restored_mod.get_version_stats() == {1: 2, 2: 1}
    assert restored_mod.get_filtered_count() == 3

    dropped = StalenessManager(6, 4, 1, version)
    dropped.register_capacity_modifier(FilteredSamplesCapacityModifier())
    dropped.load_state_dict(state, drop_inflight=True)
    stats = dropped.get_stats()
    # the one running rollout becomes rejected (1 + 1 = 2); the waiting input is forgotten
    assert (stats.running, stats.enqueued, stats.rejected) == (0, 0, 2)

    with pytest.raises(ValueError, match="modifier"):
        StalenessManager(6, 4, 1, version).load_state_dict(state)


def test_modifier_credit_and_guards():
    mod = FilteredSamplesCapacityModifier()
    mod.on_samples_filtered(4, version=7)
    mod.on_samples_filtered(1)
    assert mod.get_filtered_count() == 5 and mod.get_version_stats() == {7: 4}
    assert mod.modify_capacity(-2, 0, RolloutStat()) == 3  # −2 + a credit of 4 + 1
    with pytest.raises(AssertionError):
        mod.on_samples_filtered(-1)


def test_concurrent_try_submit_never_overshoots():
    mgr = StalenessManager(
        max_concurrent_rollouts=7,
        consumer_batch_size=5,
        max_head_offpolicyness=0,
        version_provider=Version(0),
    )
    for _ in range(200):
        mgr.on_rollout_enqueued()
    wins = []
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        wins.append(sum(mgr.try_submit() for _ in range(50)))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # min(7 − 0, (0+0+1)·5) = 5 submissions in total, however the threads interleave
    assert sum(wins) == 5


@given(
    ops=st.lists(
        st.sampled_from(["submit", "submit", "accept", "reject", "drop", "advance"]),
        min_size=10,
        max_size=80,
    ),
    max_conc=st.integers(0, 6),
    batch=st.integers(1, 4),
    eta=st.integers(0, 3),
)
def test_capacity_matches_the_live_rollout_model(ops, max_conc, batch, eta):
    """Against an independent model that never counts dropped rollouts at all:
    capacity = min(max(1, max_conc) − running, (η + v + 1)·B − live_accepted − running)."""
    version = Version(0)
    mgr = StalenessManager(max_conc, batch, eta, version)
    mgr.register_capacity_modifier(FilteredSamplesCapacityModifier())
    live = running = enqueued = droppable = 0
    for op in ops:
        expected = min(max(1, max_conc) - running, (eta + version.v + 1) * batch - live - running)
        if op == "submit":  # one more input waits, then try to start one
            mgr.on_rollout_enqueued()
            enqueued += 1
            assert mgr.try_submit() == (expected > 0)
            if expected > 0:
                enqueued, running = enqueued - 1, running + 1
        elif op == "accept" and running:
            mgr.on_rollout_accepted()
            running, live, droppable = running - 1, live + 1, droppable + 1
        elif op == "reject" and running:
            mgr.on_rollout_rejected()
            running -= 1
        elif op == "drop" and droppable:
            mgr.on_samples_filtered(1, version=version.v)
            live, droppable = live - 1, droppable - 1
        elif op == "advance":
            version.v += 1
        expected = min(max(1, max_conc) - running, (eta + version.v + 1) * batch - live - running)
        assert mgr.get_capacity() == expected
        assert running <= max(1, max_conc)
