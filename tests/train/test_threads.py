"""torch's intra-op threads of the trainer and of the engine (train/session/run.py thread_counts): the
local engine's own process, or with engine.in_process the rollout producer thread it generates
in. At η = 0 the phases alternate and the engine must not bring up a second multi-threaded
OpenMP pool (it slowed both phases about 1.5-2× on 2 cores); at η > 0 each gets its share of
the cores."""

import re
from pathlib import Path

import pytest
import torch

from sdp_cli.engine.local import LocalEngine
from sdp_cli.train.session.run import run_training, thread_counts
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
