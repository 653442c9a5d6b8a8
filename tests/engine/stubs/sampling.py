"""How the stub servers sample: a model's ``generation_config.json`` supplies defaults for the
sampling parameters a request leaves out, as vLLM (``--generation-config auto``) and SGLang
(``--sampling-defaults model``) do, and those parameters shape the distribution tokens are
drawn from. The servers report logprobs of the unprocessed distribution whatever they are
(vLLM: raw logits; SGLang: logits / T), so a default the client does not override makes the
recorded logprobs differ from the distribution that sampled the token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

#: the sampling parameters a server takes from a model's generation_config.json
DEFAULTABLE = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)
NEUTRAL = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
}


def model_defaults(model_dir: Path) -> dict[str, Any]:
    """The defaultable parameters a model directory's generation_config.json sets."""
    path = Path(model_dir) / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    return {key: config[key] for key in DEFAULTABLE if config.get(key) is not None}


def effective(params: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """Each parameter from the request, else the model's default, else the neutral value."""
    return {key: params.get(key, defaults.get(key, NEUTRAL[key])) for key in DEFAULTABLE}


def sampling_logprobs(
    logits: torch.Tensor, params: dict[str, Any], context: list[int], output: list[int]
) -> torch.Tensor:
    """log of the distribution the next token is drawn from: penalties (repetition over the
    whole context, frequency and presence over the output), then 1/T, then min_p, top_k, top_p."""
    z = logits.clone()
    seen = torch.tensor(sorted(set(context)), dtype=torch.long)
    penalty = float(params["repetition_penalty"])
    if penalty != 1.0 and seen.numel():
        z[seen] = torch.where(z[seen] > 0, z[seen] / penalty, z[seen] * penalty)
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=z.numel()).to(z.dtype)
    z = z - float(params["frequency_penalty"]) * counts - float(params["presence_penalty"]) * (counts > 0)
    logprobs = torch.log_softmax(z / float(params["temperature"]), -1)
    keep = torch.ones_like(logprobs, dtype=torch.bool)
    if params["min_p"] > 0:
        keep &= logprobs.exp() >= float(params["min_p"]) * logprobs.exp().max()
    if 0 < int(params["top_k"]) < logprobs.numel():
        keep &= logprobs >= logprobs.topk(int(params["top_k"])).values[-1]
    if params["top_p"] < 1.0:
        order = logprobs.argsort(descending=True)
        before = logprobs[order].exp().cumsum(0) - logprobs[order].exp()  # mass above each token
        keep[order[before >= float(params["top_p"])]] = False
    return torch.log_softmax(torch.where(keep, logprobs, -torch.inf), -1)


def is_neutral(params: dict[str, Any], defaults: dict[str, Any]) -> bool:
    """Whether a request samples from softmax(z / T) itself on a server with these defaults
    (top_k ≤ 0 disables top-k in both servers' conventions)."""
    values = effective(params, defaults)
    values["top_k"] = min(int(values["top_k"]), 0) or -1
    return all(values[key] == NEUTRAL[key] for key in DEFAULTABLE if key != "temperature")
