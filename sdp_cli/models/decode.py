"""Greedy decoding with a KV cache, for evaluation.

Not ``generate()``: its generation_config defaults (top-k 50 when sampling, repetition settings
read from the checkpoint) differ between models and transformers versions. Prompts are
left-padded in a batch; position ids come from the attention mask so that padding does not shift
positions, which makes a batched decode equal to decoding each prompt alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from sdp_cli.models.kv_cache import returned_cache, with_cache


@dataclass(frozen=True)
class Decoded:
    """One greedy completion: its tokens without the stop token, and whether it stopped."""

    token_ids: list[int]
    stopped: bool


@torch.no_grad()
def greedy_decode(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    batch_size: int = 64,
    max_length: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[Decoded]:
    """Argmax-decode up to ``max_new_tokens`` after each prompt, stopping a row at ``eos_id``, or
    (not stopped) once prompt + completion reach ``max_length`` tokens (the model's context);
    ``progress(done, total)`` follows every batch of prompts."""
    assert max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {max_new_tokens}"
    assert all(len(p) > 0 for p in prompts), "every prompt needs at least one token"
    assert max_length is None or all(len(p) < max_length for p in prompts), "a prompt fills the context"
    results: list[Decoded] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        budgets = [max_new_tokens if max_length is None else min(max_new_tokens, max_length - len(p)) for p in chunk]
        results.extend(_decode_batch(model, chunk, budgets, eos_id, pad_id, max_length))
        if progress is not None:
            progress(len(results), len(prompts))
    return results


def _decode_batch(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    budgets: list[int],
    eos_id: int,
    pad_id: int,
    max_length: int | None,
) -> list[Decoded]:
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

    outputs: list[list[int]] = [[] for _ in prompts]
    stopped = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    past = None
    budget = torch.tensor(budgets, device=device)
    for step in range(max(budgets)):
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **with_cache(past),
        )
        past = returned_cache(out)
        next_ids = out.logits[:, -1].argmax(-1)
        for row in (~stopped & (budget > step)).nonzero().flatten().tolist():
            token = int(next_ids[row])
            if token == eos_id:
                stopped[row] = True
            else:
                outputs[row].append(token)
        if bool((stopped | (budget <= step + 1)).all()):
            break
        # Finished rows keep decoding (their tokens are ignored) so the batch stays rectangular;
        # a row past its budget stays at the last position of the context (absolute position
        # embeddings have no row beyond it). A row within its budget never reaches it.
        input_ids = next_ids[:, None]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(prompts), 1))], dim=1)
        position_ids = position_ids[:, -1:] + 1
        if max_length is not None:
            position_ids = position_ids.clamp(max=max_length - 1)
    return [Decoded(tokens, bool(done)) for tokens, done in zip(outputs, stopped.tolist())]
