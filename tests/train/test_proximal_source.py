"""π_prox_t has one source, the engine, whatever the thread timing (docs/training.md).

The engine double below reports every logprob δ away from what it computes — sampled, scored
and re-prefilled alike — as a bf16 server's numerics differ from an fp32 trainer's. π_behav and
π_prox_t then both carry δ, which cancels in the segment-wise weight log π_prox_t − log π_behav.
A π_prox_t filled from the trainer's π_prox would not carry it, and the weight would be off by δ.
Each test forces a different interleaving of the producer's recompute pass, the trainer's batch
taking and the weight push, then checks every stale token of every saved batch against the
trainer-numerics ratio π_{v+1}/π_v computed from the per-version checkpoints.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from sdp_cli.engine.local import LocalEngine
from sdp_cli.models import load_policy
from sdp_cli.rollout.batch_file import read_batch
from sdp_cli.train.session import run as run_module
from sdp_cli.train.asyncloop.producer import RolloutProducer
from sdp_cli.train.session.run import run_training

DELTA = -0.25  # negative keeps every reported logprob ≤ 0


class OffsetEngine(LocalEngine):
    """A local engine whose reported logprobs are all shifted by ``DELTA``."""

    def _target_logprobs(self, logits, targets):  # scoring and re-prefill
        return [[lp + DELTA for lp in row] for row in super()._target_logprobs(logits, targets)]

    def _sample_and_advance(self, batch):  # sampling
        rows = [(s, s.output_len) for s in batch.rows if s is not None]
        super()._sample_and_advance(batch)
        for sample, before in rows:
            for t in range(before, sample.output_len):
                sample.old_logprobs[t] += DELTA
                sample.proximal_logprobs_t[t] += DELTA  # a new token's π_prox_t is its π_behav


def _offset_engine_factory(step_delay_s: float = 0.0):
    def build(cfg, policy, run_dir, *, device="cpu", threads=None):
        import copy

        callback = (lambda: time.sleep(step_delay_s)) if step_delay_s else None
        return OffsetEngine(
            copy.deepcopy(policy.model),
            temperature=cfg.rollout.temperature,
            eos_token_id=policy.eos_token_id,
            pad_token_id=policy.pad_token_id,
            max_batch_size=cfg.engine.max_batch_size,
            seed=cfg.seed,
            device=device,
            step_callback=callback,
        )

    return build


def _trainer_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0]


def _check_run(run_dir: Path, *, source: str) -> dict[int, int]:
    """Every stale token's weight against the trainer-numerics π_{v+1}/π_v; tokens checked by lag."""
    models: dict[int, torch.nn.Module] = {}

    def model(version: int):
        if version not in models:
            models[version] = load_policy("hf", path=run_dir / "versions" / f"v{version:06d}").model
        return models[version]

    checked: dict[int, int] = {}
    for path in sorted((run_dir / "batches").glob("*.safetensors")):
        batch = read_batch(path)
        c = batch.trainer_version
        bounds = batch.cu_seqlens.tolist()
        for i in range(batch.num_sequences):
            lo, hi = bounds[i], bounds[i + 1]
            ids, ver = batch.input_ids[lo:hi], batch.versions[lo:hi]
            weight = batch.proximal_logprobs_t[lo:hi] - batch.old_logprobs[lo:hi]
            for v in sorted(set(ver[ver >= 0].tolist()) - {c}):
                sel = (ver == v).nonzero()[:, 0]
                # the target of position t is predicted from column t - 1
                expected = (_trainer_logprobs(model(v + 1), ids) - _trainer_logprobs(model(v), ids))[sel - 1]
                lag = c - v
                if source == "trainer" and lag == 1:
                    # documented trade-off: the trainer's π_prox over the engine's π_behav
                    torch.testing.assert_close(weight[sel], expected - DELTA, rtol=0, atol=1e-4)
                else:
                    torch.testing.assert_close(weight[sel], expected, rtol=0, atol=1e-4)
                checked[lag] = checked.get(lag, 0) + len(sel)
    return checked


def _train(tmp_path: Path, monkeypatch, *overrides: str, step_delay_s: float = 0.0) -> Path:
    from ..fast_run import FAST

    monkeypatch.setattr(run_module, "build_engine", _offset_engine_factory(step_delay_s))
    run_dir = tmp_path / "run"
    args = [
        *FAST,
        "+preset=segment_wise",
        "train.checkpoint_every=0",
        "train.save_batches=true",
        "train.keep_version_checkpoints=true",
        # The tiny warm start earns no reward, so its gradient is zero: AdamW's decoupled decay
        # (weights × 0.97 per step) makes every version differ from the last, so π_{v+1}/π_v ≠ 1
        # and a π_prox_t left at π_behav (weight 0) cannot pass for the right one.
        "optim.lr=3e-3",
        "optim.weight_decay=10",
        f"run.dir={run_dir}",
        *overrides,
    ]
    from sdp_cli.config.compose import compose_config

    cfg, raw = compose_config(args)
    run_training(cfg, raw, overrides=args)
    return run_dir


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SDP_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "sdp-cache"))


@pytest.mark.parametrize("eta", [1, 2])
def test_natural_timing_never_puts_the_offset_in_the_weight(tmp_path, monkeypatch, eta):
    run_dir = _train(tmp_path, monkeypatch, f"rollout.max_head_offpolicyness={eta}", "train.steps=6")
    assert _check_run(run_dir, source="engine").get(1, 0) > 0


def test_trainer_takes_batches_before_the_producer_scores_them(tmp_path, monkeypatch):
    # No recompute ahead: every lag-1 token reaches the trainer unscored, so the take-time pass
    # (or, before it existed, the trainer's own π_prox) is what gives it π_prox_t. The producer
    # is told the version's pass is done, as the real one says: a pass left due forever would
    # send it round its loop without waiting, holding the GIL against the trainer (50 s here).
    monkeypatch.setattr(RolloutProducer, "_recompute_ahead", lambda self: setattr(self, "_recomputed_for", self.version()))
    run_dir = _train(tmp_path, monkeypatch, "rollout.max_head_offpolicyness=2", "train.steps=6")
    checked = _check_run(run_dir, source="engine")
    assert checked.get(1, 0) > 0 and sum(n for lag, n in checked.items() if lag >= 2) > 0


def test_samples_in_flight_across_updates_take_the_reprefill(tmp_path, monkeypatch):
    # A slow decode loop keeps samples in flight across weight updates: their earlier tokens
    # get π_{v+1} from the re-prefill after resume (the engine's own numerics).
    run_dir = _train(
        tmp_path,
        monkeypatch,
        "rollout.max_head_offpolicyness=2",
        "train.steps=5",
        "rollout.groups_per_request=1",
        step_delay_s=0.02,
    )
    _check_run(run_dir, source="engine")
    rows = [__import__("json").loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("recompute/tokens_prefill", 0) for r in rows) > 0


def test_trainer_source_is_explicit_and_consistent(tmp_path, monkeypatch):
    # rollout.proximal_t_source=trainer: every lag-1 token takes the trainer's π_prox, on every
    # step (the offset is in their weight, always), older tokens keep the engine's π_{v+1}.
    run_dir = _train(
        tmp_path,
        monkeypatch,
        "rollout.max_head_offpolicyness=2",
        "train.steps=6",
        "rollout.proximal_t_source=trainer",
    )
    assert _check_run(run_dir, source="trainer").get(1, 0) > 0
