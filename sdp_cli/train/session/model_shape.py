"""Does a checkpoint's policy fit the model the config builds? Compared by parameter names and
shapes, read from safetensors headers and from the config's model built on the meta device, so
neither set of weights is loaded (docs/reliability.md, "What a resume checks").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from sdp_cli.config.schema import SdpConfig
from sdp_cli.models.gguf import is_gguf
from sdp_cli.tasks import Task


def saved_shapes(policy_dir: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape of every ``*.safetensors`` file of a saved model directory."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(policy_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            for name in fh.keys():
                shapes[name] = tuple(fh.get_slice(name).get_shape())
    return shapes


def _meta_model(cfg: SdpConfig, task: Task) -> torch.nn.Module | None:
    """The config's model with no storage (meta device), or None where its architecture is
    only known by loading it (a GGUF file, a model that cannot be built on the meta device)."""
    if cfg.model.kind == "hf":
        if is_gguf(cfg.model.path):
            return None
        from transformers import AutoConfig, AutoModelForCausalLM

        from sdp_cli.models.model_dir import resolve_model_dir

        try:
            config = AutoConfig.from_pretrained(resolve_model_dir(cfg.model.path or ""), local_files_only=True)
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(config)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, NotImplementedError):
            return None  # loading it (after these checks) says what is wrong in one line
    from transformers import Qwen2ForCausalLM

    from sdp_cli.models.tiny import tiny_arch, tiny_config
    from sdp_cli.models.tokenizer import build_tokenizer

    m = cfg.model
    tokenizer = build_tokenizer(m.charset or task.charset)  # as sdp_cli/models/loader.py builds it
    arch = tiny_arch(
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads or m.num_heads,
        intermediate_size=m.intermediate_size,
    )
    with torch.device("meta"):
        return Qwen2ForCausalLM(tiny_config(len(tokenizer), arch))


def shape_mismatch(saved: dict[str, tuple[int, ...]], model: torch.nn.Module) -> str | None:
    """The first difference between saved tensors and ``model``'s state, or None when they fit.
    Tied tensors (one tensor under two names, e.g. embeddings and LM head) are saved under one of
    their names, so each group of names needs one of them saved."""
    state = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for name, tensor in state.items():
        groups.setdefault(id(tensor), []).append(name)
    for name, shape in sorted(saved.items()):
        if name not in state:
            return f"{name} is not a tensor of the config's model"
        if tuple(state[name].shape) != shape:
            return f"{name} has shape {list(shape)}, the config's model {list(state[name].shape)}"
    for names in groups.values():
        if not any(n in saved for n in names):
            return f"{names[0]} of the config's model is missing"
    return None


def policy_mismatch(cfg: SdpConfig, task: Task, policy_dir: Path) -> str | None:
    """What keeps the whole-model policy saved in ``policy_dir`` from being the config's model,
    or None when it fits (or when the config's architecture is not known without loading it)."""
    model: Any = _meta_model(cfg, task)
    return None if model is None else shape_mismatch(saved_shapes(policy_dir), model)
