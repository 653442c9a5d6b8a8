"""Benchmark of what a segment-wise take costs the rollout side before the batch leaves: the
cache's staleness filter (``SegmentWiseStrategy.filter_stale_from_cache``) and the check whether
the push in flight still owes a cached token its π_{c−1} (``RolloutSide._pass_owed``), per take,
at several answer lengths.

The cache is simulated in its steady state at η = 4 on the defaults' shape (B = 16 groups of 8,
four batches held, as a 60-step run held them on 2026-11-29): before each take the trainer's
version c moves on by one, the producer adds B groups whose tokens are of version c − 1 and still
hold π_{c−1} (they wait for π_c), the pass of the push scores the tokens of version c − 2 under
weights c − 1, and the take removes the B oldest groups. Two ways of judging are timed on the same
caches:

- ``token by token``: the rule as it was until 2026-11-29: one whole-sample check at C speed for
  samples whose every token holds π_{v+1}, the rule token by token for the others, every group
  judged at every take, and every group's tokens looked through for a pass still owed;
- ``now``: sdp's strategy, which keeps a sample whose version c − 1 tail waits for π_c after a
  check at C speed, remembers the groups that are settled (every token older and holding π_{v+1})
  and judges those again by their head's lag alone, and whose settled groups the pass check skips.

Both must keep the same groups at every take (checked). Prints a table and writes
bench/results/cache_filter.json.

    python bench/cache_filter.py
    python bench/cache_filter.py --lengths 3,300 --takes 50
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from _results import write_results

from sdp_cli.rollout.buffers import RolloutCache
from sdp_cli.rollout.recompute import pass_targets
from sdp_cli.rollout.records import RolloutGroup, RolloutSample
from sdp_cli.rollout.strategies import (
    SegmentWiseStrategy,
    StandardStrategy,
    _all_stale_with_next_version,
    _token_reason,
)

ETA = 4
BATCH_GROUPS = 16
GROUP_SIZE = 8
HELD_BATCHES = 4


class TokenByToken(StandardStrategy):
    """The segment-wise rule as it was judged until 2026-11-29 (see the module docstring)."""

    def is_sample_too_stale(self, item, current_version):
        for sample in item.samples:
            versions = sample.versions
            if not versions:
                continue
            newest, oldest = max(versions), min(versions)
            if newest > current_version or oldest < 0 or current_version - oldest > ETA:
                return True
            if _all_stale_with_next_version(sample, newest, current_version):
                continue
            if _token_reason(sample, current_version) is not None:
                return True
        return False


def new_group(group_id: int, version: int, tokens: int) -> RolloutGroup:
    samples = []
    for i in range(GROUP_SIZE):
        sample_id = group_id * GROUP_SIZE + i
        sample = RolloutSample(prompt_ids=[1, 2, 3], group_id=group_id, sample_id=sample_id)
        sample.append_tokens([5] * tokens, [-1.0] * tokens, version)
        samples.append(sample)
    return RolloutGroup(group_id, samples)


def score_pass(groups: list[RolloutGroup], loaded: int) -> None:
    """The pass under weights ``loaded``: π_loaded for every token of version loaded − 1."""
    for group in groups:
        for sample in group.samples:
            for t in pass_targets(sample.versions, sample.proximal_t_versions, loaded):
                sample.set_proximal_t(t, sample.old_logprobs[t] - 0.1, loaded)


def pass_owed(groups: list[RolloutGroup], loaded: int, settled) -> bool:
    return any(
        pass_targets(s.versions, s.proximal_t_versions, loaded)
        for g in groups
        if not settled(g)
        for s in g.samples
    )


def measure(tokens: int, takes: int, warmup: int) -> dict:
    strategies = {
        "token_by_token": TokenByToken(max_head_offpolicyness=ETA),
        "now": SegmentWiseStrategy(max_head_offpolicyness=ETA),
    }
    caches = {name: RolloutCache() for name in strategies}
    times: dict[str, dict[str, list[float]]] = {name: {"filter": [], "pass_owed": []} for name in strategies}
    c, next_id, held = 0, 0, []
    for take in range(warmup + takes):
        c += 1
        fresh = [new_group(next_id + i, c - 1, tokens) for i in range(BATCH_GROUPS)]
        next_id += BATCH_GROUPS
        held += fresh
        score_pass(held, c - 1)
        kept = None
        for name, strategy in strategies.items():
            cache = caches[name]
            for group in fresh:
                cache.add(group)
            t0 = time.perf_counter()
            strategy.filter_stale_from_cache(cache, c)
            t1 = time.perf_counter()
            pass_owed(cache.get_all(), c - 1, strategy.settled)
            t2 = time.perf_counter()
            if take >= warmup:
                times[name]["filter"].append(t1 - t0)
                times[name]["pass_owed"].append(t2 - t1)
            ids = [g.group_id for g in cache.get_all()]
            assert kept is None or ids == kept, f"the two ways kept different groups at take {take}"
            kept = ids
        if len(held) > HELD_BATCHES * BATCH_GROUPS - BATCH_GROUPS:
            for cache in caches.values():
                cache.take_first_n(BATCH_GROUPS)
            held = held[BATCH_GROUPS:]
    row = {"tokens": tokens, "groups_held": HELD_BATCHES * BATCH_GROUPS, "takes": takes}
    for name in strategies:
        for part, values in times[name].items():
            row[f"{name}_{part}_ms"] = 1000 * statistics.median(values)
    return row


def lengths(text: str) -> list[int]:
    """``--lengths``: positive integers, comma-separated."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive token counts, comma-separated (e.g. 3,300)")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--lengths", type=lengths, default="3,16,100,300", help="tokens per answer, comma-separated"
    )
    parser.add_argument("--takes", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cache_filter.json")
    args = parser.parse_args()
    if args.takes < 1:
        parser.error(f"--takes {args.takes}: give 1 or more")
    rows = [measure(n, args.takes, warmup=HELD_BATCHES + 1) for n in args.lengths]
    header = (
        f"{'tokens':>7}{'filter: token by token':>24}{'now':>8}{'pass check: all':>18}{'now':>8}"
        "   (ms per take, medians)"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['tokens']:>7}{r['token_by_token_filter_ms']:>24.3f}{r['now_filter_ms']:>8.3f}"
            f"{r['token_by_token_pass_owed_ms']:>18.3f}{r['now_pass_owed_ms']:>8.3f}"
        )
    write_results(
        args.out,
        "cache_filter",
        config=f"η = {ETA}, {HELD_BATCHES} batches of {BATCH_GROUPS} groups × {GROUP_SIZE} held, steady state",
        rows=rows,
    )


if __name__ == "__main__":
    main()
