"""torch's intra-op threads of the trainer and of the engine (train/session/placement.py thread_counts): the
local engine's own process, or with engine.in_process the rollout producer thread it generates
in. At η = 0 the phases alternate and the engine must not bring up a second multi-threaded
OpenMP pool (it slowed both phases about 1.5-2× on 2 cores); at η > 0 each gets its share of
the cores."""

import os
import re
from pathlib import Path

import pytest
import torch

from sdp_cli.engine.local import LocalEngine
from sdp_cli.train.session.placement import core_split, thread_counts
from sdp_cli.train.session.run import run_training
from sdp_cli.train.step.trainer import Trainer


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["rollout.max_head_offpolicyness=0"], (4, 1)),
        (["rollout.max_head_offpolicyness=4"], (2, 2)),
        (["rollout.max_head_offpolicyness=0", "train.threads=3"], (3, 1)),
        (["rollout.max_head_offpolicyness=2", "train.threads=3"], (3, 3)),
    ],
)
def test_thread_counts_of_trainer_and_producer(fast_config, monkeypatch, overrides, expected):
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    cfg, _ = fast_config(*overrides)
    assert thread_counts(cfg) == expected


@pytest.mark.parametrize("eta,expected", [(0, (4, 1)), (2, (2, 2))])
def test_a_run_generates_and_trains_with_those_threads(fast_config, monkeypatch, eta, expected):
    """What each thread really runs with: the trainer's steps in the main thread, generation in
    the producer thread (which on the old code inherited the trainer's count at η = 0)."""
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    seen: dict[str, set[int]] = {"train": set(), "generate": set()}
    step, generate = Trainer.step, LocalEngine.generate

    def counted_step(self, batch):
        seen["train"].add(torch.get_num_threads())
        return step(self, batch)

    def counted_generate(self, samples, params):
        seen["generate"].add(torch.get_num_threads())
        return generate(self, samples, params)

    monkeypatch.setattr(Trainer, "step", counted_step)
    monkeypatch.setattr(LocalEngine, "generate", counted_generate)
    before = torch.get_num_threads()
    try:
        cfg, raw = fast_config(f"rollout.max_head_offpolicyness={eta}", "train.steps=2")
        run_training(cfg, raw, overrides=[])
    finally:
        torch.set_num_threads(before)
    assert seen == {"train": {expected[0]}, "generate": {expected[1]}}


def test_the_engine_process_runs_with_its_share(fast_config, monkeypatch):
    """engine.in_process=false: the engine's own process takes the engine's count (η = 2 on 8
    cores: 4, which is not torch's default on the 2-core test machine), the trainer its own."""
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    seen: set[int] = set()
    step = Trainer.step

    def counted_step(self, batch):
        seen.add(torch.get_num_threads())
        return step(self, batch)

    monkeypatch.setattr(Trainer, "step", counted_step)
    before = torch.get_num_threads()
    try:
        cfg, raw = fast_config("engine.in_process=false", "rollout.max_head_offpolicyness=2", "train.steps=2")
        summary = run_training(cfg, raw, overrides=[])
    finally:
        torch.set_num_threads(before)
    assert seen == {4}
    log = (Path(summary["run_dir"]) / "logs" / "local_engine.log").read_text()
    assert re.findall(r"sdp local engine: pid \d+, (\d+) thread", log) == ["4"]


@pytest.mark.parametrize(
    "overrides,own,device,expected",
    [
        (["rollout.max_head_offpolicyness=2"], True, "cpu", ([0, 2], [5, 7])),
        (["rollout.max_head_offpolicyness=0"], True, "cpu", None),  # the phases alternate on every core
        (["rollout.max_head_offpolicyness=2", "train.threads=1"], True, "cpu", None),  # the user places
        (["rollout.max_head_offpolicyness=2"], False, "cpu", None),  # one process: nothing to split
        (["rollout.max_head_offpolicyness=2"], True, "cuda", None),
    ],
    ids=["split", "eta-0", "threads-set", "in-process", "gpu"],
)
def test_core_split_halves_the_cores_this_process_may_use(fast_config, monkeypatch, overrides, own, device, expected):
    # a process restricted to 4 of the machine's cores (taskset, a cgroup): the halves are of those
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {7, 0, 5, 2})
    cfg, _ = fast_config(*overrides)
    assert core_split(cfg, own_process=own, device=device) == expected


def test_one_core_is_not_split(fast_config, monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {3})
    cfg, _ = fast_config("rollout.max_head_offpolicyness=2")
    assert core_split(cfg, own_process=True, device="cpu") is None


def test_a_pinned_run_trains_on_one_half_and_generates_on_the_other(fast_config, monkeypatch, tmp_path):
    """The split as the processes see it: the trainer's step on the first half (read in the
    step), the rollout process and the engine's process it started on the second (their logs);
    the trainer's process gets every core back for what follows the loop."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one core: nothing to split")
    half = len(cores) // 2
    seen: set[tuple[int, ...]] = set()
    step = Trainer.step

    def placed_step(self, batch):
        seen.add(tuple(sorted(os.sched_getaffinity(0))))
        return step(self, batch)

    monkeypatch.setattr(Trainer, "step", placed_step)
    before = torch.get_num_threads()
    try:
        cfg, raw = fast_config("engine.in_process=false", "rollout.max_head_offpolicyness=2", "train.steps=3")
        summary = run_training(cfg, raw, overrides=[])
    finally:
        torch.set_num_threads(before)
    assert seen == {tuple(cores[:half])}
    assert sorted(os.sched_getaffinity(0)) == cores
    logs = Path(summary["run_dir"]) / "logs"
    second = ",".join(map(str, cores[half:]))
    assert re.findall(r"sdp rollout process: pid \d+, cores (\S+),", (logs / "rollout.log").read_text()) == [second]
    assert re.findall(r"sdp local engine: pid \d+, .*, cores (\S+),", (logs / "local_engine.log").read_text()) == [second]
