"""The tiny Qwen2 model of the LocalEngine tests and their reference: how a trainer computes
logprobs, one full forward of the unpadded sequence and log_softmax(logits / T) gathered at the
next tokens (docs/design.md §4). It shares no code with the engine's padded, KV-cached loop."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from sdp_cli.rollout.records import RolloutSample

VOCAB = 32
EOS = 31
PAD = 0


def tiny_model(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    # initializer_range 0.1 makes next-token distributions clearly non-uniform (max p ≈ 0.15,
    # min p ≈ 0.003 on the probe prompt), so wrong positions or temperatures show in the logprobs
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        initializer_range=0.1,
    )
    return Qwen2ForCausalLM(config).eval()


def model_with(state: dict[str, torch.Tensor]) -> Qwen2ForCausalLM:
    """A tiny model holding the weights `state`."""
    model = tiny_model()
    model.load_state_dict(state)
    return model


def reference_logprobs(
    model: torch.nn.Module, ids: list[int], start: int, temperature: float
) -> list[float]:
    """log p(ids[t] | ids[:t]) for t ≥ start from one unpadded full forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return [logprobs[t - 1, ids[t]].item() for t in range(start, len(ids))]


def prompts(lengths: list[int], seed: int = 1) -> list[RolloutSample]:
    """One sample a length, its prompt drawn uniformly from the non-pad, non-EOS tokens."""
    g = torch.Generator().manual_seed(seed)
    return [
        RolloutSample(prompt_ids=torch.randint(1, EOS, (n,), generator=g).tolist()) for n in lengths
    ]
