"""Issue 15 end to end on the embedded engine: `sdp train model=hf` on a tiny HF-layout model in
bfloat16 with LoRA (the acceptance smoke test), its resume and `sdp recompute` from its adapter
version checkpoints; full fine-tuning in bfloat16 without optimizer state; the evaluation budget."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import sdp_cli.analysis.recompute as rc
import sdp_cli.analysis.scorers as scorers
import sdp_cli.models.evaluate as evaluate
from sdp_cli.config.compose import compose_config
from sdp_cli.models import load_policy, save_policy
from sdp_cli.rollout.batch_file import read_batch
from sdp_cli.train.session.run import run_training

from ..fast_run import FAST, train_run

SMALL = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A tiny Qwen2 saved as a Hugging Face directory (what `model=hf` loads)."""
    path = tmp_path_factory.mktemp("hf") / "tiny-qwen2"
    save_policy(load_policy("tiny", task="arith1", warm_start_steps=0, seed=1, **SMALL), path)
    return path


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _events(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


LORA_BF16 = [
    "model=hf",
    "train.dtype=bfloat16",
    "model.lora.r=4",
    "loss.kl_coef=0.05",
    "loss.entropy_coef=0.01",
    "+preset=segment_wise",
    "train.steps=2",
    "train.checkpoint_every=1",
    "train.keep_checkpoints=1",
    "train.keep_version_checkpoints=true",
    "train.save_batches=true",
    "optim.lr=0.02",  # adjacent versions differ clearly (see the recompute test)
]
#: bf16 scores of the same weights differ with the padding of the batch they are scored in
#: (measured: 0.002 at most)
TOL_BF16 = 0.02


@pytest.fixture(scope="module")
def lora_run(hf_model, tmp_path_factory):
    return train_run(tmp_path_factory.mktemp("lora-bf16"), [*FAST, f"model.path={hf_model}", *LORA_BF16])


def test_smoke_hf_model_bf16_lora_two_steps(lora_run):
    summary = json.loads((lora_run / "summary.json").read_text())
    assert summary["steps"] == 2
    rows = [r for r in _rows(lora_run) if "loss/kl_ref" in r]
    assert len(rows) == 2
    # peft starts B at 0, so at step 1 the policy is its base: the KL to it is exactly 0
    assert rows[0]["loss/kl_ref"] == 0.0
    assert all(0 < r["loss/entropy"] < torch.log(torch.tensor(32.0)).item() for r in rows)
    # keep_checkpoints=1: only the newest, and it holds the adapters, not the model
    (checkpoint,) = (lora_run / "checkpoints").glob("step-*")
    assert checkpoint.name == "step-000002"
    assert {p.name for p in (checkpoint / "policy").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    # version checkpoints: the base once (bfloat16, what the engine ran) and adapters per version
    versions = lora_run / "versions"
    assert sorted(p.name for p in versions.iterdir()) == ["base", "v000000", "v000001", "v000002"]
    assert json.loads((versions / "base" / "config.json").read_text())["dtype"] == "bfloat16"
    adapters = load_file(versions / "v000002" / "adapter_model.safetensors")
    assert adapters and all("lora_" in k for k in adapters)


def test_recompute_scores_from_adapter_checkpoints(lora_run):
    # The engine recorded π_prox_t with its bf16 merged copy; the scorer merges each version's
    # adapters onto versions/base again. Same weights, so only bf16 padding noise may differ.
    result = rc.recompute([lora_run / "batches"], lora_run, lambda b: scorers.LocalScorer())
    assert result.work and sum(o.proximal_t.tokens for o in result.outcomes) > 0
    for outcome in result.outcomes:
        assert outcome.retagged == 0
        assert outcome.proximal_t.tokens == 0 or outcome.proximal_t.max_abs < TOL_BF16
    # the check can fail: adjacent versions differ by far more than the tolerance, so scoring
    # under a wrong version (or without the adapters) would show
    gaps = []
    for path in sorted((lora_run / "batches").glob("*.safetensors")):
        batch = read_batch(path)
        lagged = (batch.versions >= 0) & (batch.versions < batch.trainer_version)
        if bool(lagged.any()):
            gaps.append(float((batch.proximal_logprobs_t - batch.old_logprobs)[lagged].abs().max()))
    assert max(gaps) > 5 * TOL_BF16


def test_resume_of_a_lora_run_loads_its_adapters(lora_run, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(lora_run, run_dir)
    cfg, raw = compose_config([f"resume={run_dir}", "train.steps=3"])
    summary = run_training(cfg, raw, overrides=["train.steps=3"])
    assert summary["steps"] == 3
    resumed = [e for e in _events(run_dir) if e["event"] == "resumed"]
    assert resumed and resumed[0]["step"] == 2 and resumed[0]["optimizer_restarted"] is False
    # the policy continued from the adapters of step 2: its KL to the base is no longer 0
    assert _rows(run_dir)[-1]["loss/kl_ref"] > 0


def test_full_fine_tuning_bf16_without_optimizer_state_resumes_with_a_warning(hf_model, tmp_path, capsys):
    root = tmp_path / "full"
    overrides = [
        *FAST,
        "model=hf",
        f"model.path={hf_model}",
        "train.dtype=bfloat16",
        "train.steps=2",
        "train.checkpoint_every=1",
        "train.save_optimizer=false",
        "train.keep_version_checkpoints=true",
        "loss.kl_coef=0.1",
    ]
    run_dir = train_run(root, overrides)
    (checkpoint,) = sorted((run_dir / "checkpoints").glob("step-*"))[-1:]
    assert not (checkpoint / "optimizer.safetensors").exists()
    assert json.loads((checkpoint / "state.json").read_text())["optimizer"] is None
    # the checkpoint keeps the float32 master weights; version checkpoints what the engine ran
    assert {t.dtype for t in load_file(checkpoint / "policy" / "model.safetensors").values()} == {torch.float32}
    assert {t.dtype for t in load_file(run_dir / "versions" / "v000002" / "model.safetensors").values()} == {torch.bfloat16}
    capsys.readouterr()
    cfg, raw = compose_config([f"resume={run_dir}", "train.steps=3"])
    assert run_training(cfg, raw, overrides=["train.steps=3"])["steps"] == 3
    assert "holds no optimizer state (train.save_optimizer=false); AdamW restarts" in capsys.readouterr().err
    assert [e for e in _events(run_dir) if e["event"] == "resumed"][0]["optimizer_restarted"] is True


@pytest.mark.parametrize("extra, budget", [([], 3), (["train.eval_max_new_tokens=2"], 2)])
def test_evaluation_uses_the_rollout_budget_unless_told_otherwise(tmp_path, monkeypatch, extra, budget):
    seen: list[int] = []
    decode = evaluate.greedy_decode

    def spy(*args, **kwargs):
        seen.append(kwargs["max_new_tokens"])
        return decode(*args, **kwargs)

    monkeypatch.setattr(evaluate, "greedy_decode", spy)
    overrides = [*FAST, "train.steps=1", "train.checkpoint_every=0", "train.eval_samples=2", "rollout.max_new_tokens=3", *extra]
    train_run(tmp_path, overrides)
    # the run's start and end evaluations (a warm start, when one runs, evaluates before them)
    assert seen[-2:] == [budget, budget]


def test_resume_with_other_lora_settings_is_refused_in_one_line(lora_run, tmp_path):
    import shutil

    from sdp_cli.errors import UserError

    run_dir = tmp_path / "run"
    shutil.copytree(lora_run, run_dir)
    saved = (run_dir / "overrides.json").read_text()
    cfg, raw = compose_config([f"resume={run_dir}", "model.lora.r=0"])
    with pytest.raises(UserError) as err:
        run_training(cfg, raw, overrides=["model.lora.r=0"])
    message = str(err.value)
    assert "a resume cannot change model.lora.r (4 -> 0)" in message  # a structural key (resume_keys.py)
    assert "\n" not in message
    cfg, raw = compose_config([f"resume={run_dir}", "model.lora.r=8"])
    with pytest.raises(UserError, match=r"a resume cannot change model.lora.r \(4 -> 8\)"):
        run_training(cfg, raw, overrides=["model.lora.r=8"])
    # a refused resume leaves the run as it was: a plain resume afterwards works
    assert (run_dir / "overrides.json").read_text() == saved
    cfg, raw = compose_config([f"resume={run_dir}", "train.steps=3"])
    assert run_training(cfg, raw, overrides=["train.steps=3"])["steps"] == 3


def test_two_processes_train_lora_in_bf16_with_kl_and_entropy(hf_model, tmp_path):
    # DDP over the adapters: both ranks end with equal weights (else the run does not finish),
    # and the KL and entropy metrics are the whole minibatch's (summed over the ranks' shares)
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    torchrun = Path(sys.executable).parent / "torchrun"
    if shutil.which("torchrun", path=str(torchrun.parent)) is None:
        pytest.skip("torchrun not installed")
    run_dir = tmp_path / "run"
    env = dict(os.environ, SDP_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    overrides = [*FAST, f"model.path={hf_model}", *LORA_BF16[:6], "train.steps=2", "train.threads=1", f"run.dir={run_dir}"]
    cmd = [str(torchrun), "--nproc_per_node", "2", "--log-dir", str(tmp_path / "torchrun"), "-m", "sdp_cli", "train", *overrides]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    events = _events(run_dir)
    assert events[0]["processes"] == 2 and events[-1]["event"] == "finished"
    rows = [r for r in _rows(run_dir) if "loss/kl_ref" in r]
    assert len(rows) == 2 and rows[0]["loss/kl_ref"] == 0.0
    # one process on the same first batch (same seed, same engine): the first step's entropy,
    # computed before any update, is the whole minibatch's in both runs (a rank's own share
    # would be about half of it)
    single_dir = tmp_path / "single"
    single = [*overrides[:-1], f"run.dir={single_dir}"]
    done = subprocess.run([sys.executable, "-m", "sdp_cli", "train", *single], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = [r for r in _rows(single_dir) if "loss/entropy" in r][0]["loss/entropy"]
    assert rows[0]["loss/entropy"] == pytest.approx(expected, rel=1e-2)
