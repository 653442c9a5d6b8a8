"""A real run with the asynchronous weight push (docs/training.md "The weight push"): the local
engine in its own process, segment-wise, η = 3, checkpoints on the way. The push of every step
but the last runs beside the next step; nothing of what the synchronous push guarantees may be
lost: every step once with its version, a clean ledger, π_prox_t for every stale token (none
uncorrectable, no group filtered as past its window), and the engine at the trainer's version
at the end."""

import json

from ..fast_run import FAST, train_run
from ..reliability.harness import check_finished_run, metrics

STEPS = 8


def test_a_segment_wise_run_with_the_push_beside_training_keeps_every_guarantee(tmp_path):
    run = train_run(
        tmp_path,
        [*FAST, "+preset=segment_wise", "engine.in_process=false", "rollout.max_head_offpolicyness=3",
         f"train.steps={STEPS}", "train.checkpoint_every=3"],
    )  # fmt: skip
    check_finished_run(run, STEPS)
    rows = [r for r in metrics(run) if "version" in r]
    # an asynchronous push's duration is reported with the step that waited for it, the next
    # one: the pushes of steps 1 … STEPS − 1 (the last step's push runs in the trainer's thread)
    pushed_async = [r["step"] for r in rows if "time/push_async_s" in r]
    assert pushed_async == list(range(2, STEPS + 1)), pushed_async
    assert all(r["segment_wise/uncorrectable_token_fraction"] == 0.0 for r in rows)
    assert rows[-1]["staleness/filtered_groups_total"] == 0.0
    # stale tokens were trained on, each with its π_{v+1}
    assert max(r["staleness/lag_max"] for r in rows) >= 2
    assert sum(r["recompute/tokens"] for r in rows if "recompute/tokens" in r) > 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == STEPS
