"""Sharded training (``train.parallel=fsdp``; docs/training.md, "Sharded training (FSDP)").

torch's ``fully_shard`` (FSDP2) splits every parameter over the ranks: each transformer block
is one unit (its weights are all-gathered for its forward and backward, then freed), the root
holds the rest (embeddings, final norm, head). Nothing outside the trainer sees a shard:
whatever needs whole weights (the engine, checkpoints, version checkpoints, the evaluation)
gets them from a collective gather into rank 0's CPU memory, and optimizer state is written in
the layout a plain ``torch.optim`` state dict has, so an FSDP checkpoint is the same files as a
single-process or DDP one.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch

#: what every gather asks torch for: whole tensors, on rank 0 only, in CPU memory
_FULL = {"full_state_dict": True, "cpu_offload": True}


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules a Hugging Face model says must not be split (its decoder layers), in order."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def shard(model: torch.nn.Module, device: torch.device, world_size: int) -> torch.nn.Module:
    """``fully_shard`` every transformer block, then the root (in place; collective). Each moves
    its unit's shards to ``device``; a model naming no block classes is one unit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # FSDP warns that the root's outputs are views whose in-place change would skip its hooks;
    # the trainer only indexes them (train/step/response_logprobs.py), never changes them in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor", category=UserWarning)
    mesh = init_device_mesh(device.type, (world_size,))
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def meta_skeleton(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters live on the meta device (no memory) and whose buffers
    are real CPU copies (rotary tables are not in a state dict); tied parameters stay tied. Taken
    before sharding, it is what :func:`whole_model` fills with gathered weights."""
    memo: dict[int, Any] = {}
    for param in model.parameters():
        memo[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = buffer.detach().to("cpu", copy=True)
    return copy.deepcopy(model, memo)


def whole_model(skeleton: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain module holding the whole weights ``state`` (a gathered full state dict): the
    skeleton's copy with each parameter bound to its gathered tensor (no copy); a tied group is
    bound to one tensor again (the gather returns a copy under every name)."""
    model = copy.deepcopy(skeleton)
    first: dict[int, torch.nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        if id(param) not in first:
            first[id(param)] = torch.nn.Parameter(state[name], requires_grad=param.requires_grad)
        setattr(module, leaf, first[id(param)])
    return model.eval()


def full_model_state(model: torch.nn.Module, *, sharded: bool) -> dict[str, torch.Tensor]:
    """The whole weights: a sharded model's gathered to rank 0's CPU (a collective; ``{}`` on the
    other ranks), else the model's own tensors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not sharded:
        return {k: v.detach() for k, v in model.state_dict().items()}
    return get_model_state_dict(model, options=StateDictOptions(**_FULL))


def _trained_names(model: torch.nn.Module) -> list[str]:
    """Parameter names in the order the optimizer holds them (one per tied group)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, sharded: bool) -> dict[str, Any]:
    """``optimizer.state_dict()``; of a sharded model gathered whole to rank 0 (a collective;
    ``{}`` elsewhere) and keyed by parameter index like an unsharded one."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if not sharded:
        return optimizer.state_dict()
    state = get_optimizer_state_dict(model, _inner(optimizer), options=StateDictOptions(**_FULL))
    if not state:
        return {}
    index = {name: i for i, name in enumerate(_trained_names(model))}
    return {
        "state": {index[name]: entries for name, entries in state["state"].items()},
        "param_groups": [
            {**group, "params": [index[name] for name in group["params"]]} for group in state["param_groups"]
        ],
    }


def load_full_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], *, sharded: bool
) -> None:
    """Load a whole, index-keyed optimizer state (every rank passes all of it), into the shards
    when sharded."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not sharded:
        optimizer.load_state_dict(state)
        return
    names = _trained_names(model)
    keyed = {
        "state": {names[int(i)]: entries for i, entries in state["state"].items()},
        "param_groups": [{**group, "params": [names[int(i)] for i in group["params"]]} for group in state["param_groups"]],
    }
    set_optimizer_state_dict(model, _inner(optimizer), keyed, options=StateDictOptions(full_state_dict=True))


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def sharded_grad_norm(parameters: list[torch.nn.Parameter], clip: float | None) -> torch.Tensor:
    """The gradient norm over every shard (a collective), after clipping it to ``clip``."""
    if clip is not None:
        return local_tensor(torch.nn.utils.clip_grad_norm_(parameters, clip))
    return local_tensor(torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None]))


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    """A DTensor made whole (a collective), any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value
