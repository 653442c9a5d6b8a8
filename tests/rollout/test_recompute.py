"""ProximalRecomputer: only version c−1 tokens are rescored, by absolute index, packed per call."""

import math
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdp_cli.engine.base import EngineError
from sdp_cli.rollout.buffers import RolloutCache, RolloutQueue
from sdp_cli.rollout.recompute import ProximalRecomputer, token_packs
from sdp_cli.rollout.records import RolloutGroup, RolloutSample


def lp(version, position, token):
    """The fake engine's log π_version(token at absolute position): distinct for every version,
    position and token id, so a wrong version or an off-by-one index gives a different number."""
    return -(0.1 * version + 0.001 * position + 0.00001 * token)


class FakeEngine:
    """Scores with ``lp`` under its current version and checks the ``score`` contract."""

    def __init__(self, version, inflight=()):
        self.version = version
        self.inflight = list(inflight)
        self.calls = []

    def get_version(self):
        return self.version

    def inflight_samples(self):
        return list(self.inflight)

    def score(self, sequences, starts):
        self.calls.append(([list(s) for s in sequences], list(starts)))
        out = []
        for seq, k in zip(sequences, starts):
            assert 1 <= k <= len(seq)
            out.append([lp(self.version, t, seq[t]) for t in range(k, len(seq))])
        return out


def sample(prompt, tokens_by_version, base_logprob=-2.0):
    """A sample whose output was generated in segments: ``[(version, n_tokens), ...]``;
    token ids are 100, 101, …; old logprobs are ``base_logprob``."""
    s = RolloutSample(prompt_ids=list(prompt))
    for version, n in tokens_by_version:
        start = 100 + s.output_len
        s.append_tokens(list(range(start, start + n)), [base_logprob] * n, version)
    return s


def test_only_version_c_minus_1_tokens_change_in_a_three_version_sample():
    # output versions [1, 1, 2, 2, 3, 3]; engine at c = 3
    s = sample([7, 8, 9], [(1, 2), (2, 2), (3, 2)])
    s.set_proximal_t(0, -1.5, 2)  # version-1 tokens got π_2 in their window (update 2 → 3)
    s.set_proximal_t(1, -1.25, 2)
    engine = FakeEngine(3)
    stats = ProximalRecomputer(engine).recompute_all(inflight=[s])
    P = 3
    assert s.proximal_logprobs_t == [
        -1.5,
        -1.25,  # version 1: untouched
        lp(3, P + 2, 102),
        lp(3, P + 3, 103),  # version 2 = c − 1: π_3 at absolute positions 5, 6
        -2.0,
        -2.0,  # version 3 = c: untouched (still π_behav)
    ]
    assert s.proximal_t_versions == [2, 2, 3, 3, 3, 3]
    # sent: prompt + output up to the last target (index 3), scored from absolute position 5
    assert engine.calls == [([[7, 8, 9, 100, 101, 102, 103]], [5])]
    assert (stats.samples_recomputed, stats.tokens_recomputed, stats.score_calls) == (1, 2, 1)
    # |Δ| = |lp − (−2)| for both tokens: −(0.3 + 0.005 + 0.00102) + 2 and −(0.3 + 0.006 + 0.00103) + 2
    assert stats.mean_abs_delta == pytest.approx(((2 - 0.30602) + (2 - 0.30703)) / 2)
    # a second pass has nothing to do and calls nothing
    again = ProximalRecomputer(engine).recompute_all(inflight=[s])
    assert again.tokens_recomputed == 0 and again.score_calls == 0 and len(engine.calls) == 1


def test_queue_cache_inflight_are_all_covered_once_and_idle_samples_are_not_sent():
    c = 4
    in_queue = sample([1], [(3, 2)])
    in_cache = sample([2, 2], [(2, 1), (3, 1)])
    inflight = sample([3], [(3, 1), (4, 2)])
    current_only = sample([4], [(4, 3)])  # nothing of version 3: must not be sent
    q, cache = RolloutQueue(), RolloutCache()
    q.put(RolloutGroup(0, [in_queue, current_only]))
    cache.add(in_cache)
    cache.add(inflight)  # also reachable via the engine's in-flight list: scored once
    engine = FakeEngine(c, inflight=[inflight])
    stats = ProximalRecomputer(engine).recompute_all(queue=q, cache=cache)
    assert (
        stats.samples_seen == 4 and stats.samples_recomputed == 3 and stats.tokens_recomputed == 4
    )
    sent = engine.calls[0][0]
    assert (
        [1, 100, 101] in sent and [2, 2, 100, 101] in sent and [3, 100] in sent and len(sent) == 3
    )
    assert in_cache.proximal_logprobs_t == [-2.0, lp(4, 3, 101)]  # only the version-3 token
    assert current_only.proximal_t_versions == [4, 4, 4]


def test_packing_respects_the_token_budget():
    c = 1
    samples = [sample([1, 2], [(0, 2)]) for _ in range(3)] + [sample(list(range(1, 11)), [(0, 2)])]
    engine = FakeEngine(c)
    stats = ProximalRecomputer(engine, max_tokens_per_call=10).recompute_all(inflight=samples)
    # sequence lengths 4, 4, 4, 12 with a budget of 10: [4, 4] | [4] | [12] (too long: alone)
    assert [[len(s) for s in call[0]] for call in engine.calls] == [[4, 4], [4], [12]]
    assert stats.score_calls == 3 and stats.tokens_recomputed == 8
    with pytest.raises(ValueError):
        ProximalRecomputer(engine, max_tokens_per_call=0)


def test_misbehaving_engine_is_reported():
    class Short(FakeEngine):
        def score(self, sequences, starts):
            return [row[:-1] for row in super().score(sequences, starts)]

    class Missing(FakeEngine):
        def score(self, sequences, starts):
            return []

    class NaN(FakeEngine):
        def score(self, sequences, starts):
            return [[math.nan] * (len(s) - k) for s, k in zip(sequences, starts)]

    for engine, match in (
        (Short(1), "expected 2"),
        (Missing(1), "0 results"),
        (NaN(1), "non-finite"),
    ):
        with pytest.raises(EngineError, match=match):
            ProximalRecomputer(engine).recompute_all(inflight=[sample([5], [(0, 2)])])


@given(
    segments=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1, max_size=4),
    prompt_lens=st.lists(st.integers(1, 4), min_size=4, max_size=4),
    budget=st.integers(1, 30),
    where=st.lists(st.sampled_from(["queue", "cache", "inflight"]), min_size=4, max_size=4),
)
def test_timeline_with_a_pass_at_every_update_gives_each_token_pi_v_plus_1(
    segments, prompt_lens, budget, where
):
    """Several samples generate tokens over versions 0..V (``segments[i][v]`` tokens of sample i
    at version v); before every update the pass runs. At the end (version V), each token of
    version v ≤ V − 2 must carry exactly log π_{v+1} at its absolute position, and the rest π_behav."""
    n_versions = max(len(s) for s in segments)
    samples = [RolloutSample(prompt_ids=[50 + i] * prompt_lens[i]) for i in range(len(segments))]
    engine = FakeEngine(0)
    q, cache = RolloutQueue(), RolloutCache()
    for i, s in enumerate(samples):
        {"queue": q.put, "cache": cache.add, "inflight": engine.inflight.append}[where[i]](s)
    recomputer = ProximalRecomputer(engine, max_tokens_per_call=budget)
    for v in range(n_versions):
        for i, s in enumerate(samples):
            n = segments[i][v] if v < len(segments[i]) else 0
            s.append_tokens([200 + s.output_len + k for k in range(n)], [-3.0] * n, v)
        if v < n_versions - 1:
            recomputer.recompute_all(queue=q, cache=cache)
            engine.version = v + 1
    final = engine.version
    for s in samples:
        for t, (v, tok) in enumerate(zip(s.versions, s.output_ids)):
            if v <= final - 2:
                assert s.proximal_t_versions[t] == v + 1
                assert s.proximal_logprobs_t[t] == lp(v + 1, s.prompt_len + t, tok)
            else:
                assert (s.proximal_t_versions[t], s.proximal_logprobs_t[t]) == (v, -3.0)
        # and after the trainer's fill of version final−1 tokens the strict invariant holds
        # (docs/design.md §2): a token of version v < final has π_prox_t from v + 1, a token of
        # the current version has π_prox_t = π_behav
        for t, v in enumerate(s.versions):
            if v == final - 1:
                s.set_proximal_t(t, -0.5, final)
        for t, v in enumerate(s.versions):
            assert s.proximal_t_versions[t] == (v + 1 if v < final else final)
            if v == final:
                assert s.proximal_logprobs_t[t] == s.old_logprobs[t]


def test_token_packs_fill_up_to_the_limit_and_a_longer_sequence_goes_alone():
    jobs = [SimpleNamespace(sequence=[0] * n) for n in (3, 2, 4, 1, 7, 2)]
    packs = [[len(job.sequence) for job in pack] for pack in token_packs(jobs, max_tokens=5)]
    # 3 + 2 = 5 and 4 + 1 = 5 are packs of exactly the limit; 7 > 5 is scored alone
    assert packs == [[3, 2], [4, 1], [7], [2]]
    assert list(token_packs([], max_tokens=5)) == []
