"""Sharded training (``train.parallel=fsdp``; docs/training.md, "Sharded training (FSDP)") with two
gloo processes on CPU: the same update as one process, and a real `sdp train` under torchrun
that checkpoints whole weights and resumes."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from . import cases
from .conftest import FAST

TORCHRUN = Path(sys.executable).parent / "torchrun"
needs_torchrun = pytest.mark.skipif(
    shutil.which("torchrun", path=str(TORCHRUN.parent)) is None, reason="torchrun not installed"
)


@needs_torchrun
def test_a_sharded_step_equals_the_single_process_step(tmp_path):
    """Every optimizer step's whole gradient (gathered from the shards, after clipping) and the
    weights after the step equal one process's on the same batch (≤ 1e-5), on both ranks: FSDP's
    reduce-scatter averages like DDP, so the ×world-size scaling of the per-rank loss still gives
    the global token mean; a rank with no row of a minibatch still joins every all-gather."""
    worker = Path(__file__).with_name("dist_loss_worker.py")
    done = subprocess.run(
        [str(TORCHRUN), "--nproc_per_node", "2", "--log-dir", str(tmp_path / "torchrun"), str(worker), str(tmp_path), "fsdp"],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(2)]
    torch.set_num_threads(1)
    for case in cases.FSDP_CASES:
        name, minibatches = case.name, case.minibatches
        reference, weights, whole, _ = case.run()
        if case.shared_prompts:  # every process ran its shard's distinct prompts once, or none did
            assert all((float(saved[f"{name}/positions_saved"]) > 0) == case.ranks_share for saved in ranks), name
        held = [int(saved[f"{name}/held_elements"]) for saved in ranks]
        assert sum(held) == whole and max(held) < whole, f"{name}: not sharded, {held} of {whole} elements"
        assert len(reference) == 2 * minibatches, name
        for step, named in enumerate(reference):
            for param, grad in named.items():
                for rank, saved in enumerate(ranks):
                    torch.testing.assert_close(
                        saved[f"{name}/{step}/{param}"], grad, rtol=0, atol=1e-5,
                        msg=lambda m: f"{name} step {step} {param} rank {rank}: {m}",
                    )  # fmt: skip
        gathered = {k.split("/", 2)[2]: v for k, v in ranks[0].items() if k.startswith(f"{name}/weights/")}
        assert sorted(gathered) == sorted(weights), name  # whole weights under the unsharded names
        # 1e-4, not the gradients' 1e-5: the key bias's gradient is 0 in exact arithmetic (softmax
        # ignores a shift shared by every key), and Adam scales its float noise up to steps of the
        # learning rate's size, which the fused kernel rounds differently over shards than whole
        for param, value in weights.items():
            torch.testing.assert_close(gathered[param], value, rtol=0, atol=1e-4, msg=lambda m: f"{name} {param}: {m}")
        assert not any(k.startswith(f"{name}/weights/") for k in ranks[1]), "the gather lands on rank 0 only"


def _torchrun_train(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    # torchrun's logs in the warm-start cache's directory (a test's own): by default it leaves a
    # torchelastic_* directory in /tmp per run
    log_dir = Path(env["SDP_CACHE_DIR"]).parent / "torchrun"
    cmd = [str(TORCHRUN), "--nproc_per_node", "2", "--log-dir", str(log_dir), "-m", "sdp_cli", "train", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


@needs_torchrun
def test_sdp_train_fsdp_checkpoints_the_ddp_layout_and_resumes(tmp_path):
    """`sdp train train.parallel=fsdp` under torchrun: the checkpoint and version checkpoint hold
    whole weights and optimizer state under DDP's names, shapes and dtypes, and equal DDP's run
    on the same batches (η = 0 and one seed make the batches the same; the entropy and KL terms
    give a gradient although the tiny model's reward is 0); then the run resumes sharded, with
    the optimizer state loaded into the shards (Adam's step count goes on from 2 to 4)."""
    env = dict(os.environ, SDP_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    common = ["+debug=fast", "train.steps=2", "train.threads=1", "rollout.max_head_offpolicyness=0",
              "loss.entropy_coef=0.01", "loss.kl_coef=0.1", "train.keep_version_checkpoints=true",
              "train.save_batches=true"]  # fmt: skip
    runs = {}
    for parallel in ("ddp", "fsdp"):
        runs[parallel] = tmp_path / parallel
        done = _torchrun_train([*common, f"train.parallel={parallel}", f"run.dir={runs[parallel]}"], env)
        assert done.returncode == 0, done.stderr[-3000:]
    ddp, fsdp = (runs[p] / "checkpoints" / "step-000002" for p in ("ddp", "fsdp"))
    for step in (1, 2):  # the precondition of comparing values
        name = f"batches/step-{step:06d}.safetensors"
        batch_ddp, batch_fsdp = _tensors(runs["ddp"] / name), _tensors(runs["fsdp"] / name)
        assert all(torch.equal(batch_ddp[k], batch_fsdp[k]) for k in batch_ddp), (
            "the DDP and FSDP runs drew different batches"
        )
    for rel in ("policy/model.safetensors", "optimizer.safetensors", "../../versions/v000002/model.safetensors"):
        a, b = _tensors(ddp / rel), _tensors(fsdp / rel)
        assert sorted(a) == sorted(b), rel
        for key in a:
            assert (a[key].shape, a[key].dtype) == (b[key].shape, b[key].dtype), f"{rel} {key}"
            torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-5, msg=lambda m: f"{rel} {key}: {m}")
    assert (ddp / "policy" / "config.json").read_text() == (fsdp / "policy" / "config.json").read_text()
    ddp_state, fsdp_state = (json.loads((c / "state.json").read_text())["optimizer"] for c in (ddp, fsdp))
    assert fsdp_state == ddp_state  # param groups (indices, hyperparameters) and scalars

    done = _torchrun_train([f"resume={runs['fsdp']}", "train.steps=4"], env)
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(x) for x in (runs["fsdp"] / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "resumed"] == [2] and events[-1]["event"] == "finished"
    rows = [json.loads(x) for x in (runs["fsdp"] / "metrics.jsonl").read_text().splitlines() if x]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    optimizer = _tensors(runs["fsdp"] / "checkpoints" / "step-000004" / "optimizer.safetensors")
    steps = {float(v) for k, v in optimizer.items() if k.endswith(".step")}
    assert steps == {4.0}, steps  # 4 steps × 1 epoch × 1 minibatch: the moments came back from step 2


def test_lora_with_fsdp_is_refused_in_one_line():
    from sdp_cli.config.compose import compose_config
    from sdp_cli.errors import UserError

    with pytest.raises(UserError) as err:
        compose_config(["+debug=fast", "model.lora.r=4", "train.parallel=fsdp"])
    message = str(err.value)
    assert "\n" not in message and "train.parallel=fsdp" in message and "train.parallel=ddp" in message


def test_fsdp_in_one_process_trains_whole_and_says_so(tmp_path, capsys):
    from .. import fast_run

    run_dir = fast_run.train_run(tmp_path, [*FAST, "train.steps=2", "train.parallel=fsdp"])
    assert "train.parallel=fsdp in one process: nothing to shard" in capsys.readouterr().err
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    assert [r["step"] for r in rows] == [1, 2]


@pytest.mark.parametrize("name", ["fsdp.yaml", "multi_gpu.yaml"])
def test_the_example_accelerate_configs_start_plain_processes(name):
    """The shipped configs load in accelerate as multi-GPU launches without its FSDP plugin (which
    ``check_launch`` refuses); the sharding comes from train.parallel=fsdp."""
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(Path(__file__).parents[2] / "examples" / "accelerate" / name))
    assert config.distributed_type == "MULTI_GPU" and not config.fsdp_config and config.mixed_precision == "no"


def test_each_decoder_layer_is_its_own_unit():
    """FSDP units: the layers the model's ``_no_split_modules`` names (Qwen2DecoderLayer), so a
    forward all-gathers one layer at a time; the root keeps embeddings, norm and head."""
    from sdp_cli.train.step.sharding import transformer_blocks

    model = cases.tiny_model()
    assert transformer_blocks(model) == list(model.model.layers) and len(model.model.layers) == 1


@needs_torchrun
def test_sdp_train_fsdp_in_bfloat16_with_gradient_checkpointing_kl_and_evaluation(tmp_path):
    """The memory options compose with sharding: bfloat16 autocast, recomputed layers, a sharded
    frozen reference for the KL term, and greedy evaluation on rank 0's gathered copy."""
    env = dict(os.environ, SDP_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    run_dir = tmp_path / "run"
    done = _torchrun_train(["+debug=fast", "train.steps=2", "train.threads=1", "train.parallel=fsdp",
                            "train.dtype=bfloat16", "train.gradient_checkpointing=true", "loss.kl_coef=0.1",
                            "loss.entropy_coef=0.01", "train.eval_samples=4", f"run.dir={run_dir}"], env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Warning" not in done.stderr, done.stderr[-3000:]
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "eval"] == [0, 2] and events[-1]["event"] == "finished"
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    steps = [r for r in rows if "loss/grad_norm" in r]
    assert len(steps) == 2 and all(0 < r["loss/grad_norm"] < 1e3 for r in steps)
    # the reference is the initial policy (stored in bfloat16, so step 1's KL is rounding only)
    assert abs(steps[0]["loss/kl_ref"]) < 1e-5 < steps[1]["loss/kl_ref"]
