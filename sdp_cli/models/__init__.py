"""Policies: the character tokenizer, the tiny Qwen2, its cached warm start, and loading/saving.

The names below are imported on first use, so ``import sdp_cli.models`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Policy": "sdp_cli.models.policy",
    "load_policy": "sdp_cli.models.loader",
    "load_hf_policy": "sdp_cli.models.loader",
    "save_policy": "sdp_cli.models.loader",
    "greedy_accuracy": "sdp_cli.models.evaluate",
    "greedy_decode": "sdp_cli.models.decode",
    "build_tokenizer": "sdp_cli.models.tokenizer",
    "build_tiny_model": "sdp_cli.models.tiny",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sdp_cli.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
