"""torch's intra-op threads of the trainer and of the rollout producer (train/session/run.py
thread_counts): at η = 0 the phases alternate and the producer must not bring up a second
multi-threaded OpenMP pool (it slowed both phases about 1.5-2× on 2 cores); at η > 0 each
worker gets its share of the cores."""

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
