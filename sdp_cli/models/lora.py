"""LoRA adapters through peft (the optional extra ``sdp-cli[lora]``; docs/training.md, "LoRA").

The trainer trains the adapters of a ``PeftModel``; everything outside the trainer sees merged
weights, W' = W + (α/r)·B·A per adapted layer, computed in float32 and stored in the base
weight's dtype (``merged_state_dict``), under the base model's own parameter names. Adapter
directories hold only the adapters (``adapter_config.json`` + ``adapter_model.safetensors``,
the layout ``peft.PeftModel.from_pretrained`` reads); the base they belong to is kept apart.
peft is imported on first use, so a plain install never needs it.
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch

from sdp_cli.errors import UserError
from sdp_cli.fileio import written_by_safetensors

EXTRA_HINT = "pip install 'sdp-cli[lora]'"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_NAME = "default"


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise UserError(f"model.lora.r > 0 needs peft, which is not installed; install the lora extra: {EXTRA_HINT}") from None
    return peft


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a peft model (without importing peft when nobody else did)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def is_adapter_dir(path: str | Path) -> bool:
    """Whether ``path`` holds LoRA adapters rather than a whole model."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def apply_lora(
    model: torch.nn.Module,
    *,
    r: int,
    alpha: float | None,
    dropout: float,
    target_modules: Sequence[str],
) -> torch.nn.Module:
    """Wrap ``model`` in LoRA adapters of rank ``r`` (α defaults to 2r); only they train.

    peft keeps the adapters in float32 when the base is half precision. ``model`` is changed in
    place (its adapted layers are replaced) and must not be used on its own afterwards.
    """
    peft = _peft()
    config = peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=int(r),
        lora_alpha=float(2 * r if alpha is None else alpha),
        lora_dropout=float(dropout),
        target_modules=list(target_modules),
    )
    try:
        with warnings.catch_warnings():
            # peft calls a transformers API that transformers 5 deprecates
            warnings.simplefilter("ignore", FutureWarning)
            return peft.get_peft_model(model, config)
    except ValueError as err:
        first = (str(err).strip().splitlines() or [""])[0]
        raise UserError(
            f"model.lora.target_modules={list(target_modules)} does not fit the model ({first}); "
            "name its linear layers, e.g. [q_proj,k_proj,v_proj,o_proj]"
        ) from None


def _lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    return {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights an engine runs: ``model.state_dict()`` of a plain model; for a LoRA model the
    base's parameter names with W + (α/r)·B·A in every adapted layer (module docstring)."""
    if not is_lora(model):
        return {name: tensor.detach() for name, tensor in model.state_dict().items()}
    base = model.get_base_model()
    merged: dict[str, torch.Tensor] = {}
    for name, tensor in base.state_dict().items():
        if ".lora_" not in name:
            merged[name.replace(".base_layer.", ".")] = tensor.detach()
    for name, layer in _lora_layers(model).items():
        weight = layer.base_layer.weight
        delta = layer.get_delta_weight(ADAPTER_NAME)
        merged[f"{name}.weight"] = (weight.float() + delta.float()).to(weight.dtype)
    return merged


def merge_into_base(model: torch.nn.Module) -> torch.nn.Module:
    """The plain base model of a LoRA ``model`` holding its merged weights (``model`` is used up)."""
    if not is_lora(model):
        return model
    merged = merged_state_dict(model)
    plain = model.unload()
    plain.load_state_dict(merged)
    return plain


def merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain copy of ``model`` with merged weights (an engine's own copy; ``model`` is untouched)."""
    return merge_into_base(copy.deepcopy(model))


def save_adapters(model: torch.nn.Module, directory: str | Path) -> Path:
    """Write the adapters of ``model`` (config + safetensors) into ``directory``; like
    ``save_policy``, through a temporary sibling so no reader sees a partly written file."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.peft_config[ADAPTER_NAME].save_pretrained(str(tmp))
        tensors = {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(model).items()}
        with written_by_safetensors(tmp / ADAPTER_WEIGHTS):
            save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        for item in sorted(tmp.iterdir()):
            os.replace(item, target / item.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_adapters(model: torch.nn.Module, directory: str | Path) -> None:
    """Load adapter weights saved by ``save_adapters`` into the LoRA ``model``, strictly."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = Path(directory) / ADAPTER_WEIGHTS
    try:
        tensors = load_file(str(path))
        result = set_peft_model_state_dict(model, tensors)
    except (OSError, RuntimeError, ValueError) as err:
        first = (str(err).strip().splitlines() or [""])[0]
        raise UserError(
            f"{path}: adapters do not fit the model ({first}); resume with the model.lora settings the run used"
        ) from None
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if missing or result.unexpected_keys:
        example = (missing or result.unexpected_keys)[0]
        raise UserError(
            f"{path}: adapters do not fit the model (e.g. {example}); resume with the model.lora settings the run used"
        )


def load_merged(base: torch.nn.Module, directory: str | Path) -> torch.nn.Module:
    """``base`` (a plain model) with the adapters of ``directory`` merged in (``base`` is used up).

    The adapter config is JSON and the weights are read with safetensors (``load_adapters``),
    never through a loader that could fall back to a pickle file."""
    peft = _peft()
    try:
        config = peft.LoraConfig.from_pretrained(str(directory))
    except (OSError, ValueError, TypeError) as err:
        first = (str(err).strip().splitlines() or [""])[0]
        raise UserError(f"{directory}: cannot read its {ADAPTER_CONFIG} ({first}); pass adapters saved by sdp train") from None
    config.inference_mode = True
    # the adapters were trained on a base loaded from elsewhere (model.path); this is its copy
    config.base_model_name_or_path = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        wrapped = peft.get_peft_model(base, config)
    load_adapters(wrapped, directory)
    return merge_into_base(wrapped)
