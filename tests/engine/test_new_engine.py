"""A new engine is one registered build function plus one YAML (docs/design.md "Adding an engine"):
toy engines registered here train two steps through `sdp train`'s own code, with nothing under
sdp_cli/train/ naming them. What the trainer does differently for an engine comes from the
engine's capability flags (``accepts_state_dict``: an in-memory state dict, or a safetensors
directory written for every push), never from its name.

The toy engine draws every token uniformly from the vocabulary: log π_behav = −log V exactly,
and its scores are −log V too, so every number it hands the trainer is known by hand."""

from __future__ import annotations

import json
import math
import random
import re
import threading
from pathlib import Path

import pytest
import torch

from sdp_cli.config.compose import compose_config, config_source
from sdp_cli.engine.base import InferenceEngine, SamplingParams, WeightUpdate
from sdp_cli.engines import ENGINES, register_engine, unregister
from sdp_cli.errors import UserError
from sdp_cli.rollout.batch_file import read_batch
from sdp_cli.train.session.run import run_training

from ..fast_run import FAST


class UniformEngine(InferenceEngine):
    """Every token uniform over the vocabulary; pause waits for the running call to end."""

    def __init__(self, vocab_size: int, eos_token_id: int, *, accepts_state_dict: bool):
        self.temperature = 1.0
        self.accepts_state_dict = accepts_state_dict
        self.vocab_size, self.eos = vocab_size, eos_token_id
        self.version = 0
        self.updates: list[WeightUpdate] = []
        self.scored = 0
        self._cond = threading.Condition()
        self._paused = self._busy = False
        self._rng = random.Random(0)

    def get_version(self) -> int:
        return self.version

    def set_version(self, version: int) -> None:
        self.version = version

    def generate(self, samples, params: SamplingParams) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._paused)
            self._busy = True
        try:
            for sample in samples:
                while sample.output_len < params.max_new_tokens and not sample.is_finished:
                    token = self._rng.randrange(self.vocab_size)
                    sample.append_tokens([token], [-math.log(self.vocab_size)], self.version)
                    if token == self.eos:
                        sample.finish("stop")
                if not sample.is_finished:
                    sample.finish("length")
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def pause(self) -> None:
        with self._cond:
            self._paused = True
            self._cond.wait_for(lambda: not self._busy)

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def is_paused(self) -> bool:
        return self._paused

    def update_weights(self, update: WeightUpdate) -> None:
        assert self._paused, "the trainer pauses before it pushes"
        self.updates.append(update)
        self.version = update.version

    def score(self, sequences, starts):
        self.scored += sum(len(s) - k for s, k in zip(sequences, starts))
        return [[-math.log(self.vocab_size)] * (len(s) - k) for s, k in zip(sequences, starts)]

    def inflight_samples(self):
        return []


@pytest.fixture
def toy_engines(tmp_path):
    """``uniform`` takes state dicts, ``uniform_disk`` safetensors directories; the built engines
    are kept for the test. A config dir with engine/uniform*.yaml."""
    built: list[UniformEngine] = []
    for name, in_memory in (("uniform", True), ("uniform_disk", False)):

        def build(cfg, policy, run_dir, *, device, threads, in_memory=in_memory):
            engine = UniformEngine(policy.model.config.vocab_size, policy.eos_token_id, accepts_state_dict=in_memory)
            built.append(engine)
            return engine

        register_engine(name)(build)
        (tmp_path / "conf" / "engine").mkdir(parents=True, exist_ok=True)
        (tmp_path / "conf" / "engine" / f"{name}.yaml").write_text(f"kind: {name}\n")
    try:
        yield built
    finally:
        for name in ("uniform", "uniform_disk"):
            unregister(name)  # the registry is process-wide: leave it as it was


@pytest.mark.parametrize("name", ["uniform", "uniform_disk"])
def test_a_registered_engine_with_one_yaml_trains_two_steps(tmp_path, toy_engines, name):
    source = config_source(tmp_path / "conf", None)
    overrides = [
        *FAST, f"engine={name}", "+preset=segment_wise", "train.steps=2", "train.save_batches=true",
        f"run.dir={tmp_path}/run",
    ]  # fmt: skip
    cfg, raw = compose_config(overrides, source=source)
    assert cfg.engine.kind == name
    summary = run_training(cfg, raw, overrides=overrides, source=source)
    (engine,) = toy_engines
    run = Path(summary["run_dir"])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss/pg_loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    # a push after each step: versions 1 and 2, in memory or as a directory the trainer wrote
    assert [u.version for u in engine.updates] == [1, 2]
    if name == "uniform":
        assert all(u.state_dict is not None and u.path is None for u in engine.updates)
    else:
        assert [u.path for u in engine.updates] == [run / "weights" / f"v{v:06d}" for v in (1, 2)]
        assert all((u.path / "model.safetensors").is_file() for u in engine.updates[1:])
    # every token the trainer trained on came from the toy: log π_behav = −log V, version 0 or 1
    for step in (1, 2):
        batch = read_batch(run / "batches" / f"step-{step:06d}.safetensors")
        response = batch.versions >= 0
        assert response.any()
        assert torch.allclose(batch.old_logprobs[response], torch.tensor(-math.log(engine.vocab_size)))
        assert set(batch.versions[response].tolist()) <= {0, step - 1}


def test_an_unregistered_engine_is_refused_in_one_line():
    with pytest.raises(UserError, match=r"^engine.kind='uniform' is not valid; choose one of local, vllm, sglang$"):
        compose_config([*FAST, "engine.kind=uniform"])


def test_nothing_under_train_names_an_engine():
    """train/ asks the registry (``engines.engine_kind``) and the engine's flags, never a name."""
    import sdp_cli

    names = "|".join(re.escape(n) for n in ENGINES)
    pattern = re.compile(rf"""(kind\s*[!=]=|in\s*\(|==)\s*["']({names})["']|["']({names})["']\s*(==|!=)""")
    train = Path(sdp_cli.__file__).parent / "train"
    hits = [f"{p.name}: {line.strip()}" for p in sorted(train.glob("*.py")) for line in p.read_text().splitlines() if pattern.search(line)]
    assert hits == []
