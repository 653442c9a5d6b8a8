"""A model of a real shape without its weights, for the GPU check (tests/gpu, bench/gpu.py;
docs/engines.md "Checking on a GPU"): Qwen2.5-0.5B's architecture, randomly initialised, with
sdp's character tokenizer padded to its 151,936-token vocabulary. Nothing is downloaded.

Two things differ from a plain ``from_config``, both so that numerics show:

- **Sharper logits.** A random model's next-token distribution is nearly uniform (logit std
  ≈ 0.6 at Qwen's width: every log-prob ≈ −log V), so precision errors hide in it. The final
  norm's gain is set so the logits' standard deviation is ``LOGIT_STD`` (5: at Qwen's shape a
  next-token entropy of 3.2 nats and a max p of 0.38 on random prompts, measured on the CPU),
  about as peaked as a trained model's.
- **Every id decodes.** The tokenizer's ids beyond its characters are filler tokens ``<fN>``
  (N = the id), so any sampled id becomes text a reward function can read.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

#: Qwen/Qwen2.5-0.5B's config.json, architecture keys (hub revision of 2024-09; the token ids are
#: this tokenizer's, set in ``model_config``)
QWEN25_05B: dict = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
    "use_sliding_window": False,
    "sliding_window": 32768,
    "max_window_layers": 24,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
}
#: the same architecture at a size the CPU runs in seconds (the dry run, the CPU test of tests/gpu)
TINY: dict = {
    **QWEN25_05B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "vocab_size": 512,
    "sliding_window": 1024,
    "max_window_layers": 2,
}
SHAPES = {"qwen2.5-0.5b": QWEN25_05B, "tiny": TINY}
#: standard deviation of the logits the final norm's gain is set for (see the module docstring)
LOGIT_STD = 5.0
#: ids of sdp's character tokenizer (sdp_cli/models/tokenizer.py)
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


def model_config(shape: str) -> dict:
    """The config.json of ``shape`` with this tokenizer's special ids."""
    return {**SHAPES[shape], "model_type": "qwen2", "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}


def padded_tokenizer(vocab_size: int):
    """sdp's arith character tokenizer with filler tokens ``<fN>`` up to ``vocab_size`` ids."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from sdp_cli.models.tokenizer import build_tokenizer

    base = build_tokenizer("arith")
    spec = json.loads(base.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    vocab.update({f"<f{i}>": i for i in range(len(vocab), vocab_size)})
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        pad_token=base.pad_token,
        bos_token=base.bos_token,
        eos_token=base.eos_token,
        unk_token=base.unk_token,
        split_special_tokens=True,
    )
    tokenizer.chat_template = base.chat_template
    tokenizer.padding_side = "left"
    assert len(tokenizer) == vocab_size, f"tokenizer has {len(tokenizer)} ids, the model {vocab_size}"
    return tokenizer


def build_model(shape: str, *, seed: int = 0, device: str | torch.device = "cpu") -> torch.nn.Module:
    """A randomly initialised float32 Qwen2 of ``shape`` on ``device`` (initialised there: fast
    on a GPU), its logits sharpened to ``LOGIT_STD``, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**model_config(shape))
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(device)  # in case a transformers version builds on the CPU despite the context
    # logit_j = g · <x̂, e_j> with ‖x̂‖ = √hidden and e_j ~ N(0, σ²): std = g · σ · √hidden
    gain = LOGIT_STD / (config.initializer_range * math.sqrt(config.hidden_size))
    with torch.no_grad():
        model.model.norm.weight.fill_(gain)
    return model.eval()


def write_model_dir(path: Path, shape: str, *, seed: int = 0, device: str | torch.device = "cpu") -> Path:
    """A Hugging Face directory (config.json, safetensors, tokenizer) that ``model=hf`` loads."""
    model = build_model(shape, seed=seed, device=device)
    model.save_pretrained(path)
    padded_tokenizer(model.config.vocab_size).save_pretrained(path)
    return path


def grpo_groups(groups: int, group_size: int, prompt_len: int, response_len: int, vocab: int, seed: int):
    """``groups`` random prompts of ``prompt_len`` tokens (BOS first), each with ``group_size``
    responses of 1..``response_len`` random tokens, rewards alternating 0/1 within a group."""
    from sdp_cli.rollout.records import RolloutGroup, RolloutSample

    gen = torch.Generator().manual_seed(seed)
    out = []
    for gid in range(groups):
        prompt = [BOS_ID, *torch.randint(3, vocab, (prompt_len - 1,), generator=gen).tolist()]
        samples = []
        for i in range(group_size):
            length = int(torch.randint(1, response_len + 1, (1,), generator=gen))
            sample = RolloutSample(prompt_ids=list(prompt), group_id=gid)
            sample.append_tokens(torch.randint(3, vocab, (length,), generator=gen).tolist(), [0.0] * length, 0)
            sample.finish("length")
            sample.reward = float(i % 2)
            samples.append(sample)
        out.append(RolloutGroup(gid, samples))
    return out
