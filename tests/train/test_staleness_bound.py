"""The staleness bound on the real AsyncLoop (docs/design.md §3), not on a simulation.

A real `sdp train` run on the embedded engine, at several η: every sample the trainer consumes
at trainer version c has c − min(token versions) ≤ η, and the staleness manager's invariant

    (accepted − filtered) + running ≤ (η + v + 1)·B   and   running ≤ max_concurrent

holds after every admission of the producer and after every training step (v = the loaded
version at that instant). The checks wrap the real loop's methods; nothing else changes.
"""

import threading
from pathlib import Path

import pytest

from sdp_cli.rollout.staleness import StalenessManager
from sdp_cli.train.asyncloop.loop import AsyncLoop
from sdp_cli.train.session.run import run_training

from .conftest import FAST

STEPS = 8


class Watch:
    """What the wrapped methods saw: per consumed sample (c, min version), invariant breaches."""

    def __init__(self):
        self.lock = threading.Lock()
        self.lags: list[int] = []
        self.breaches: list[str] = []
        self.admissions = 0

    def check_manager(self, mgr: StalenessManager, where: str) -> None:
        # stats copied under the manager's lock; the version changes only in the trainer thread,
        # at a push, and capacity can only grow then, so reading it next to the copy is safe
        stats = mgr.get_stats()
        version = int(mgr._version_provider())
        bound = (mgr.max_head_offpolicyness + version + 1) * mgr.consumer_batch_size
        live = stats.accepted - stats.filtered + stats.running
        with self.lock:
            if live > bound:
                self.breaches.append(f"{where}: live {live} > (η + {version} + 1)·B = {bound} ({stats})")
            if stats.running > mgr.max_concurrent_rollouts:
                self.breaches.append(f"{where}: running {stats.running} > {mgr.max_concurrent_rollouts}")


def _watched_run(tmp_path, monkeypatch, overrides):
    from sdp_cli.config.compose import compose_config

    watch = Watch()
    try_submit, run_step = StalenessManager.try_submit, AsyncLoop.run_step

    def checked_submit(self):
        admitted = try_submit(self)
        with watch.lock:
            watch.admissions += admitted
        watch.check_manager(self, "after an admission")
        return admitted

    def checked_step(self):
        record = run_step(self)
        c = record.batch.trainer_version
        with watch.lock:
            watch.lags.extend(c - min(s.versions) for s in record.batch.samples)
        watch.check_manager(self.rollout.manager, f"after step {record.step}")
        return record

    monkeypatch.setattr(StalenessManager, "try_submit", checked_submit)
    monkeypatch.setattr(AsyncLoop, "run_step", checked_step)
    cfg, raw = compose_config([*FAST, f"run.root={tmp_path}/runs", f"train.steps={STEPS}", *overrides])
    summary = run_training(cfg, raw, overrides=[])
    assert summary["steps"] == STEPS and Path(summary["run_dir"]).is_dir()
    return watch


@pytest.mark.parametrize(
    "eta,preset",
    [(0, "decoupled"), (1, "decoupled"), (3, "decoupled"), (1, "segment_wise"), (3, "segment_wise")],
)
def test_consumed_samples_lag_at_most_eta_and_capacity_holds_at_every_step(tmp_path, monkeypatch, eta, preset):
    watch = _watched_run(tmp_path, monkeypatch, [f"+preset={preset}", f"rollout.max_head_offpolicyness={eta}"])
    # B = 4 groups of 4 samples per step (+debug=fast)
    assert len(watch.lags) == STEPS * 4 * 4
    assert max(watch.lags) <= eta, sorted(watch.lags)[-5:]
    assert min(watch.lags) >= 0
    assert watch.admissions >= STEPS * 4  # every consumed group was admitted under the checks
    assert watch.breaches == []
