"""A tiny causal language model in plain torch, stored as one safetensors file.

It stands in for the real model behind the stub servers, so logprobs are real functions of
the weights and the whole prefix (not constants): h_t = tanh(E[x_t] + mean(E[x_≤t])),
logits_t = h_t · W + b. A weight update swaps (E, W, b); scoring under given weights is a
direct computation that tests compare the engine's π_prox_t against.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

VOCAB = 24
HIDDEN = 12
WEIGHTS_FILE = "model.safetensors"


def make_weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64),
        # ×2 makes the next-token distributions peaked enough that versions differ visibly
        "head": 2.0 * torch.randn(HIDDEN, VOCAB, generator=gen, dtype=torch.float64),
        "bias": torch.randn(VOCAB, generator=gen, dtype=torch.float64),
    }


def save_weights(directory: Path, weights: dict[str, torch.Tensor]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(directory / WEIGHTS_FILE))
    return directory


def load_weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(directory) / WEIGHTS_FILE))


def logits(weights: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """[len(ids), VOCAB]: row t holds the logits of the token after ids[:t+1]."""
    emb = weights["embed"][torch.tensor(ids, dtype=torch.long)]
    counts = torch.arange(1, len(ids) + 1, dtype=emb.dtype).unsqueeze(1)
    hidden = torch.tanh(emb + emb.cumsum(0) / counts)
    return hidden @ weights["head"] + weights["bias"]


def next_logprobs(
    weights: dict[str, torch.Tensor], ids: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(z / T) of the token after ``ids``."""
    return torch.log_softmax(logits(weights, ids)[-1] / temperature, dim=-1)


def score(weights: dict[str, torch.Tensor], ids: list[int], start: int) -> list[float]:
    """[log p(ids[t] | ids[:t]) for t in range(start, len(ids))], untempered."""
    logprobs = torch.log_softmax(logits(weights, ids), dim=-1)
    return [float(logprobs[t - 1, ids[t]]) for t in range(start, len(ids))]
