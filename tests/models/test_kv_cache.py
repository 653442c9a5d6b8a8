"""The KV cache keyword follows the installed transformers (``past_key_values`` up to 5.23,
``cache`` from 5.24), and sdp's incremental forwards use it without a deprecation warning."""

import inspect
import warnings

import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM

from sdp_cli.engine.base import SamplingParams
from sdp_cli.engine.local import LocalEngine
from sdp_cli.models.decode import greedy_decode
from sdp_cli.models.kv_cache import CACHE_NAME
from sdp_cli.models.tiny import build_tiny_model
from sdp_cli.rollout.records import RolloutSample


def test_the_cache_keyword_is_one_the_installed_models_take_and_return():
    assert CACHE_NAME in inspect.signature(Qwen2ForCausalLM.forward).parameters
    model = build_tiny_model(24, seed=0, num_layers=1)
    out = model(input_ids=torch.tensor([[3, 4, 5]]), use_cache=True)
    assert getattr(out, CACHE_NAME) is not None


def test_generation_scoring_and_greedy_decode_raise_no_deprecation_warning():
    # a keyword transformers has renamed warns on every call (FutureWarning): make that an error
    model = build_tiny_model(24, seed=0, num_layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = LocalEngine(model, temperature=1.0, eos_token_id=2, pad_token_id=0, seed=0)
        samples = [RolloutSample(prompt_ids=[3, 4, 5]) for _ in range(3)]
        engine.generate(samples, SamplingParams(max_new_tokens=6))
        assert all(s.is_finished for s in samples)
        engine.score([[3, 4, 5, 6, 7]], [3])
        decoded = greedy_decode(model, [[3, 4], [5, 6, 7]], max_new_tokens=4, eos_id=2, pad_id=0, batch_size=2)
    assert len(decoded) == 2
