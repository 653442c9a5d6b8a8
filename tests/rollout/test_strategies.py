"""Staleness strategies: the segment-wise rule (docs/design.md §2 as resolved in issue #3), the strict
invariant, drop counting and the factory."""

import json

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from sdp_cli.core.token_status import lacks_next_version, token_status
from sdp_cli.errors import UserError
from sdp_cli.rollout.buffers import RolloutCache, RolloutQueue
from sdp_cli.rollout.records import RolloutGroup, RolloutSample
from sdp_cli.rollout.staleness import FilteredSamplesCapacityModifier, StalenessManager
from sdp_cli.rollout.strategies import (
    SegmentWiseStrategy,
    StandardStrategy,
    create_staleness_strategy,
    _all_stale_with_next_version,
    _stale_awaiting_at_most_fill,
    _token_reason,
    segment_wise_stale_reason,
    settled_head,
)
from sdp_cli.rollout.recompute import pass_targets


def make(versions, prox_versions=None, prox_shift=None):
    """A sample with one token per entry of ``versions``; old logprob of token t is −(t+1).

    ``prox_versions`` defaults to ``versions`` (nothing recomputed); where it differs, π_prox_t is
    set to old − 0.5 (or ``prox_shift[t]``) so that a recomputed value differs from π_behav.
    """
    s = RolloutSample(prompt_ids=[1, 2])
    s.append_tokens(
        list(range(10, 10 + len(versions))),
        [-(t + 1.0) for t in range(len(versions))],
        list(versions),
    )
    if prox_versions is not None:
        for t, pv in enumerate(prox_versions):
            if pv != versions[t]:
                s.proximal_t_versions[t] = pv
                s.proximal_logprobs_t[t] = s.old_logprobs[t] - (
                    0.5 if prox_shift is None else prox_shift[t]
                )
    return s


SEG = SegmentWiseStrategy(max_head_offpolicyness=2)


def test_hand_computed_segment_wise_cases():
    c = 5
    # on-policy / c−1 pending / c−1 done / full chain: all kept
    assert not SEG.is_sample_too_stale(make([5, 5]), c)
    assert not SEG.is_sample_too_stale(make([4, 4, 5]), c)
    assert not SEG.is_sample_too_stale(make([4, 5], [5, 5]), c)
    assert not SEG.is_sample_too_stale(make([3, 4, 5], [4, 5, 5]), c)  # lag 5 − 3 = 2 ≤ η = 2
    # token of version 3 ≤ c−2 whose π_prox_t is still from version 3: window closed
    gone = make([3, 4, 5], [3, 5, 5])
    assert segment_wise_stale_reason(gone, c, 2) == (
        f"sample {gone.sample_id} token 0: version 3 has π_prox_t from version 3, not 4, "
        "and the weights of version 4 are gone"
    )
    # head lag 5 − 2 = 3 > η = 2, even with a complete π_prox_t chain
    assert "lags 3" in segment_wise_stale_reason(make([2, 3, 4], [3, 4, 4]), c, 2)
    # η = 1 drops the lag-2 chain that η = 2 keeps
    assert SegmentWiseStrategy(max_head_offpolicyness=1).is_sample_too_stale(
        make([3, 4, 5], [4, 5, 5]), c
    )
    # a version from the future
    assert "> current version 5" in segment_wise_stale_reason(make([5, 6]), c, 2)
    # current-version token whose π_prox_t differs from π_behav
    bad = make([5])
    bad.proximal_logprobs_t[0] = -0.25
    assert "π_prox_t ≠ π_behav" in segment_wise_stale_reason(bad, c, 2)
    # c−1 token with π_prox_t from a version outside {c−1, c}: its next version's weights are the
    # ones loaded, so the reason does not call them gone
    foreign = make([4], [6])
    reason = segment_wise_stale_reason(foreign, c, 2)
    assert reason == f"sample {foreign.sample_id} token 0: version 4 has π_prox_t from version 6"
    # negative version on an output token
    assert SEG.is_sample_too_stale(make([-1, 5]), c)
    # an empty sample has nothing stale
    assert not SEG.is_sample_too_stale(RolloutSample(prompt_ids=[1]), c)


def test_group_is_dropped_if_any_sample_is():
    good, bad = make([4, 5], [5, 5]), make([3, 4], [3, 4])
    assert not SEG.is_sample_too_stale(RolloutGroup(0, [good, make([5])]), 5)
    assert SEG.is_sample_too_stale(RolloutGroup(0, [good, bad]), 5)


def test_standard_never_filters():
    std = StandardStrategy(max_head_offpolicyness=0)
    ancient = make([0, 0], [0, 0])
    assert not std.is_sample_too_stale(ancient, 100)
    assert not std.should_filter_before_enqueue()
    assert std.filter_before_enqueue(ancient, 100)
    q = RolloutQueue()
    q.put(ancient)
    assert std.purge_stale_samples_from_queue(q, 100) == 0 and q.qsize() == 1
    assert std.filtered_by_version == {}


@st.composite
def histories(draw):
    """A sample generated over versions v0..v_last, consumed at c ≥ v_last, where the π_{v+1}
    window of each version v was either used (the token got π_{v+1}) or missed."""
    v0 = draw(st.integers(0, 6))
    n_versions = draw(st.integers(1, 5))
    counts = draw(st.lists(st.integers(0, 3), min_size=n_versions, max_size=n_versions))
    versions = [v0 + i for i, k in enumerate(counts) for _ in range(k)]
    c = v0 + n_versions - 1 + draw(st.integers(0, 3))
    window_used = draw(st.lists(st.booleans(), min_size=c + 2, max_size=c + 2))
    eta = draw(st.integers(0, 6))
    return versions, c, window_used, eta


def build(versions, c, window_used):
    """Apply the docs/design.md §2 timeline: a token of version v gets π_{v+1} iff its window was used
    and weights v+1 have existed (v + 1 ≤ c)."""
    s = make(versions)
    for t, v in enumerate(versions):
        if v + 1 <= c and window_used[v]:
            s.set_proximal_t(t, s.old_logprobs[t] - 0.3, v + 1)
    return s


@given(histories())
def test_segment_wise_rule_matches_the_timeline_model(h):
    versions, c, window_used, eta = h
    sample = build(versions, c, window_used)
    # oracle from the generation model, not from the rule's code: drop iff the head lags more
    # than η or a token of version ≤ c−2 missed its (now closed) window
    expected_drop = bool(versions) and (
        c - min(versions) > eta or any(not window_used[v] for v in versions if v <= c - 2)
    )
    assert (
        SegmentWiseStrategy(max_head_offpolicyness=eta).is_sample_too_stale(sample, c)
        == expected_drop
    )
    # the strict invariant (every stale token has π_{v+1}, the trainer's token status) additionally
    # needs every c−1 token filled
    strict_ok = all(window_used[v] for v in versions if v <= c - 1)
    statuses = [token_status(v, pv, c) for v, pv in zip(sample.versions, sample.proximal_t_versions)]
    assert (not any(lacks_next_version(status) for status in statuses)) == strict_ok


def test_drops_are_counted_and_give_capacity_back_through_the_manager():
    version = [5]
    mgr = StalenessManager(100, 2, 2, lambda: version[0])
    mgr.register_capacity_modifier(FilteredSamplesCapacityModifier())
    seg = create_staleness_strategy(
        "segment_wise", max_head_offpolicyness=2, on_filtered=mgr.on_samples_filtered
    )
    for _ in range(5):
        mgr.on_rollout_enqueued()
        mgr.on_rollout_submitted()
        mgr.on_rollout_accepted()
    base = mgr.get_capacity()  # (2 + 5 + 1)·2 − 5 = 11
    assert base == 11

    stale, fresh = make([3], [3]), make([5])
    assert seg.filter_before_enqueue(fresh, 5)
    assert not seg.filter_before_enqueue(stale, 5)  # one drop at version 5

    q = RolloutQueue()
    for item in (fresh, make([2]), make([5]), make([3, 4], [4, 5])):
        q.put(item)
    assert seg.purge_stale_samples_from_queue(q, 5) == 1  # lag 3 > η
    assert [s.versions for s in q.snapshot()] == [[5], [5], [3, 4]]  # order kept

    version[0] = 6
    cache = RolloutCache()
    for item in q.drain():
        cache.add(item)
    # at c = 6 the version-4 token of [3, 4] carries π_5 ✓ but 6 − 3 = 3 > η: dropped
    assert seg.filter_stale_from_cache(cache, 6) == 1
    assert cache.size() == 2

    assert seg.filtered_by_version == {5: 2, 6: 1}
    seg.filtered_by_version.clear()  # a copy: the strategy's own counts are not touched
    restored = create_staleness_strategy("segment_wise", max_head_offpolicyness=2)
    restored.load_state_dict(json.loads(json.dumps(seg.state_dict())))
    assert restored.filtered_by_version == {5: 2, 6: 1}
    assert mgr.get_stats().filtered == 3
    # (2 + 6 + 1)·2 − 5 + 3 returned = 16
    assert mgr.get_capacity() == 16


def test_factory():
    assert isinstance(
        create_staleness_strategy("standard", max_head_offpolicyness=1), StandardStrategy
    )
    seg = create_staleness_strategy("segment_wise", max_head_offpolicyness=3)
    assert isinstance(seg, SegmentWiseStrategy) and seg.max_head_offpolicyness == 3
    with pytest.raises(ValueError) as err:
        create_staleness_strategy("segmentwise", max_head_offpolicyness=1)
    assert isinstance(err.value, UserError)
    message = str(err.value)
    assert (
        "'segmentwise'" in message and "segment_wise, standard" in message and "\n" not in message
    )
    with pytest.raises(ValueError, match="max_head_offpolicyness"):
        create_staleness_strategy("standard", max_head_offpolicyness=-1)


@given(
    st.integers(0, 8),
    # per token: its lag behind c (−1: newer than c), π_prox_t's version relative to the token's
    # (mostly +1, the common case, which the whole-sample check takes), and whether π_prox_t ≠ π_behav
    st.lists(
        st.tuples(st.sampled_from([-1, 0, 1, 2, 3, 4, 9]), st.sampled_from([1, 1, 1, 0, 2, -1]), st.booleans()),
        min_size=1,
        max_size=6,
    ),
)
@example(3, [(2, 1, False), (1, 1, True)])  # every token stale with π_{v+1}: kept
@example(3, [(2, 1, False), (0, 1, False)])  # a current-version token claiming π_{c+1}: dropped
@example(3, [(2, 1, False), (1, 0, False)])  # a c−1 token still to fill: kept
@example(3, [(3, 1, False), (2, 0, False)])  # a c−2 token that missed π_{c−1}: dropped
@example(4, [(3, 1, False), (1, 0, False), (3, 2, False)])  # versions out of order, the last token's wrong: dropped
def test_the_whole_sample_check_keeps_only_what_token_by_token_keeps(c, tokens):
    # any bookkeeping at all, not only what a timeline can produce: where the whole-sample check
    # keeps a sample, the token-by-token rule finds no token to drop it for
    versions = [c - lag for lag, _, _ in tokens]
    sample = make(versions)
    for t, (_, offset, shifted) in enumerate(tokens):
        sample.proximal_t_versions[t] = versions[t] + offset
        if shifted:
            sample.proximal_logprobs_t[t] = sample.old_logprobs[t] - 0.25
    if _all_stale_with_next_version(sample, max(versions), c):
        assert _token_reason(sample, c) is None
    if _stale_awaiting_at_most_fill(sample, max(versions), c):
        assert _token_reason(sample, c) is None
    # the common cases do take the whole-sample checks: every token with π_{v+1}, and the cache's
    # newest samples, whose version c − 1 tokens (at the end) wait for π_c
    if all(0 < lag < 9 and offset == 1 for lag, offset, _ in tokens):
        assert _all_stale_with_next_version(sample, max(versions), c)
    ordered = versions == sorted(versions)
    if ordered and all(0 < lag < 9 and (offset == 1 or (lag == 1 and offset == 0)) for lag, offset, _ in tokens):
        assert _stale_awaiting_at_most_fill(sample, max(versions), c)


@st.composite
def held_caches(draw):
    """Groups held across several takes: each token of version v got π_{v+1} (its window used) or
    not, the trainer's version c, η, and for each later take how far c moves and which of the
    tokens a recompute pass may score then (``pass_targets``: version L − 1 without π_L) it does."""
    c = draw(st.integers(1, 6))
    groups = []
    for g in range(draw(st.integers(1, 5))):
        samples = []
        for _ in range(draw(st.integers(1, 3))):
            v0 = draw(st.integers(0, c))
            versions = sorted(draw(st.lists(st.integers(v0, c), max_size=4)))
            window_used = draw(st.lists(st.booleans(), min_size=c + 1, max_size=c + 1))
            samples.append(build(versions, c, window_used))
        groups.append(RolloutGroup(g, samples))
    eta = draw(st.integers(0, 4))
    takes = draw(st.lists(st.tuples(st.integers(0, 2), st.randoms(use_true_random=False)), min_size=1, max_size=5))
    return groups, c, eta, takes


@given(held_caches())
def test_the_cache_filter_remembering_settled_groups_judges_as_the_rule(h):
    """The segment-wise cache filter keeps a settled group (``settled_head``) without judging it
    again: take after take, with passes writing what they may in between, it keeps and drops
    exactly what a strategy judging every group afresh does, and a group it calls settled owes no
    pass (``RolloutSide._pass_owed`` skips those)."""
    groups, c, eta, takes = h
    remembering = SegmentWiseStrategy(max_head_offpolicyness=eta)
    ours, fresh = RolloutCache(), RolloutCache()
    for g in groups:
        ours.add(g)
        fresh.add(g)
    for step, (advance, rng) in enumerate(takes):
        if step:
            c += advance
            for loaded in (c - 1, c):  # the passes of the take and of the push
                for s in (s for g in groups for s in g.samples):
                    for t in pass_targets(s.versions, s.proximal_t_versions, loaded):
                        if rng.random() < 0.5:
                            s.set_proximal_t(t, s.old_logprobs[t] - 0.1, loaded)
        removed = remembering.filter_stale_from_cache(ours, c)
        assert removed == SegmentWiseStrategy(max_head_offpolicyness=eta).filter_stale_from_cache(fresh, c)
        assert [id(g) for g in ours.get_all()] == [id(g) for g in fresh.get_all()]
        for g in ours.get_all():
            if remembering.settled(g):
                assert settled_head(g, c) is not None
                assert not any(pass_targets(s.versions, s.proximal_t_versions, c + 1) for s in g.samples)


def test_a_group_of_version_0_tokens_can_be_settled():
    # version 0 is the first policy's: tokens of it holding π_1 settle like any others (only a
    # negative version is refused), so the first batches can be set aside ahead of their take
    assert settled_head(RolloutGroup(0, [make([0, 0], [1, 1]), make([0, 1], [1, 2])]), 2) == 0
    assert settled_head(RolloutGroup(0, [make([-1, 0], [0, 1])]), 2) is None
    assert settled_head(RolloutGroup(0, [make([0, 1], [1, 1])]), 2) is None  # token 1 lacks π_2


def test_a_settled_groups_head_is_its_oldest_sample_and_ages_out_by_it():
    # two settled samples whose oldest tokens are versions 3 and 1: the group's head is 1, so at
    # η = 3 the remembered group is dropped at c = 5 (5 − 1 > 3), not kept until c = 7 by the other
    group = RolloutGroup(0, [make([3, 3], [4, 4]), make([1, 2], [2, 3])])
    assert settled_head(group, 4) == 1
    strategy, cache = SegmentWiseStrategy(max_head_offpolicyness=3), RolloutCache()
    cache.add(group)
    assert strategy.filter_stale_from_cache(cache, 4) == 0 and strategy.settled(group)
    assert strategy.filter_stale_from_cache(cache, 5) == 1 and cache.get_all() == []


def test_a_settled_group_is_not_judged_again_until_its_head_lags_past_eta():
    judged = []

    class Counting(SegmentWiseStrategy):
        def is_sample_too_stale(self, item, current_version):
            judged.append(item.group_id)
            return super().is_sample_too_stale(item, current_version)

    settled = RolloutGroup(0, [make([3, 4], [4, 5])])  # every token holds π_{v+1}
    owing = RolloutGroup(1, [make([4, 5], [5, 5])])  # its version-5 token lacks π_6
    strategy, cache = Counting(max_head_offpolicyness=3), RolloutCache()
    cache.add(settled)
    cache.add(owing)
    assert strategy.filter_stale_from_cache(cache, 6) == 0 and judged == [0, 1]
    assert strategy.settled(settled) and not strategy.settled(owing)
    assert strategy.filter_stale_from_cache(cache, 6) == 0 and judged == [0, 1, 1]
    # at c = 7 the head of the settled group lags 7 − 3 = 4 > η: judged, and dropped
    assert strategy.filter_stale_from_cache(cache, 7) == 2 and judged == [0, 1, 1, 0, 1]
    assert cache.size() == 0 and not strategy.settled(settled)
