"""What a run trains and serves, made from a loaded policy: precision, LoRA adapters, gradient
checkpointing, the frozen KL reference and the local engine's copy (docs/training.md,
"Precision and memory" and "LoRA").

Precision (``train.dtype``): full fine-tuning keeps float32 master weights and AdamW state and
computes under bfloat16 autocast; a LoRA base never changes, so it is stored in bfloat16 itself
(its float32 adapters are the only trained weights). The local engine runs its own copy in
``engine.dtype`` (null: ``train.dtype``): in bfloat16 it holds the rounded master weights, as a
bfloat16 inference server loading the pushed weights would. Casts keep computed buffers such as
RoPE's ``inv_freq`` in float32, as a loader does (``models.precision.cast_weights``).

What is written where: resumable checkpoints hold the master weights (float32), or only the
adapters under LoRA (the base is rebuilt from the config on resume); version checkpoints
(``versions/vNNNNNN``, for ``sdp recompute``) hold what the engine ran: the weights in the
engine's dtype, or under LoRA the adapters plus one copy of the base in ``versions/base``, also
in the engine's dtype (so ``sdp recompute`` needs no config to score in it).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from sdp_cli.config.schema import SdpConfig, engine_weight_dtype
from sdp_cli.cpuinfo import CPUINFO, flags_of, read_cpuinfo
from sdp_cli.engines import engine_kind
from sdp_cli.errors import UserError
from sdp_cli.models.lora import apply_lora, is_adapter_dir, is_lora, load_adapters, save_adapters
from sdp_cli.models.precision import DTYPES, cast_weights
from sdp_cli.tasks import DatasetTask, Task


def engine_dtype(cfg: SdpConfig) -> torch.dtype | None:
    """The dtype the engine holds its weights in and version checkpoints are written in
    (``engine.dtype`` resolved; None for a server's ``auto``: the weights' own dtype)."""
    name = engine_weight_dtype(cfg)
    return None if name == "auto" else DTYPES[name]


#: /proc/cpuinfo flags of native bfloat16 arithmetic: x86 AVX-512 BF16 and AMX, Arm's BF16 extension
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def native_bf16(cpuinfo: Path = CPUINFO) -> bool | None:
    """Whether this CPU has bfloat16 instructions (a ``flags``/``Features`` line of ``cpuinfo``
    names one of ``NATIVE_BF16_FLAGS``); None without ``cpuinfo`` (not Linux: unknown, so no note;
    torch's public CPU probe names vector widths, not bf16)."""
    text = read_cpuinfo(cpuinfo)
    if text is None:
        return None
    return any(flag in flags_of(text) for flag in NATIVE_BF16_FLAGS)


def bf16_note(cfg: SdpConfig, device: torch.device | str) -> str | None:
    """The one line ``sdp train`` prints at the start when bfloat16 will be emulated: train.dtype
    or the local engine's dtype is bfloat16, on a CPU without bf16 instructions (docs/real-models.md)."""
    # an engine that is no server runs sdp's own torch code on this machine
    local = not engine_kind(cfg.engine.kind).server and engine_weight_dtype(cfg) == "bfloat16"
    if torch.device(device).type != "cpu" or not (cfg.train.dtype == "bfloat16" or local):
        return None
    if native_bf16() is not False:
        return None
    return (
        "note: this CPU has no bfloat16 instructions (avx512_bf16, amx_bf16 or Arm bf16), so bfloat16 is "
        "emulated and slower than float32 (SmolLM2 LoRA: 20 s a step against 11 s); "
        "train.dtype=float32 engine.dtype=float32 avoids it"
    )


def load_for_training(
    cfg: SdpConfig,
    load: Callable[[Path | None], Any],
    *,
    checkpoint_policy: Path | None = None,
    version_base: Path | None = None,
) -> tuple[Any, torch.nn.Module | None]:
    """The trainable policy and the frozen KL reference (or None). ``load(path)`` loads the
    configured policy (``path=None``) or a saved whole model; ``checkpoint_policy`` is the policy
    directory of the checkpoint a resume starts from. With ``version_base`` (``versions/base``,
    rank 0 keeping version checkpoints) a LoRA run writes its base there once."""
    lora = cfg.model.lora.r > 0
    if checkpoint_policy is not None and is_adapter_dir(checkpoint_policy) != lora:
        saved = "LoRA adapters" if is_adapter_dir(checkpoint_policy) else "a whole model"
        raise UserError(
            f"{checkpoint_policy} holds {saved} but model.lora.r={cfg.model.lora.r}; "
            "resume with the model.lora settings the run was started with"
        )
    policy = load(None if lora else checkpoint_policy)
    if lora and version_base is not None and not version_base.is_dir():
        _save_base(policy, version_base, engine_dtype(cfg))
    initial = (lambda: load(None)) if checkpoint_policy is not None else None
    reference = build_reference(policy, cfg, load_initial=initial)
    prepare_policy(policy, cfg, adapters=checkpoint_policy if lora else None)
    return policy, reference


def _save_base(policy: Any, target: Path, dtype: torch.dtype) -> None:
    """Write the LoRA base once, whole or not at all: into a temporary sibling renamed into
    place (named ``.v…`` so that crash recovery removes a torn one, sdp_cli/train/session/recovery.py)."""
    from sdp_cli.models import save_policy

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".v-base-", dir=target.parent))
    try:
        save_policy(policy, tmp / "model", dtype=dtype)
        os.rename(tmp / "model", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_checkpoint_policy(policy: Any, directory: Path) -> None:
    """The policy part of a resumable checkpoint: master weights, or the adapters under LoRA."""
    if is_lora(policy.model):
        save_adapters(policy.model, directory)
        return
    from sdp_cli.models import save_policy

    save_policy(policy, directory)


def save_version(policy: Any, cfg: SdpConfig, directory: Path) -> None:
    """A version checkpoint: the weights the engine ran (``engine_dtype``), or the adapters."""
    if is_lora(policy.model):
        save_adapters(policy.model, directory)
        return
    from sdp_cli.models import save_policy

    save_policy(policy, directory, dtype=engine_dtype(cfg))


def prepare_policy(policy: Any, cfg: SdpConfig, *, adapters: Path | None = None) -> Any:
    """``policy`` made trainable as the config says (in place): LoRA adapters (loaded from
    ``adapters`` on resume) on a base in ``train.dtype``, and gradient checkpointing."""
    lora = cfg.model.lora
    if cfg.train.gradient_checkpointing:
        enable_gradient_checkpointing(policy.model)
    if lora.r > 0:
        cast_weights(policy.model, DTYPES[cfg.train.dtype])
        policy.model = apply_lora(
            policy.model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules
        )
        if adapters is not None:
            load_adapters(policy.model, adapters)
    return policy


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer in backward. Non-reentrant: the inputs need no gradient, so
    frozen embeddings (LoRA) work as they are."""
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)  # the name since transformers 5.x
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def build_reference(
    policy: Any, cfg: SdpConfig, *, load_initial: Callable[[], Any] | None = None
) -> torch.nn.Module | None:
    """The frozen reference policy of the KL term, or None when there is none to build: no KL
    term, or LoRA (the trainer disables the adapters instead). It is the initial model: a copy
    of ``policy`` in a fresh run (call before training), ``load_initial()`` on resume."""
    if cfg.loss.kl_coef == 0 or cfg.model.lora.r > 0:
        return None
    model = load_initial().model if load_initial is not None else copy.deepcopy(policy.model)
    # frozen: no master copy needed, so it is stored in the compute dtype
    return cast_weights(model, DTYPES[cfg.train.dtype]).requires_grad_(False).eval()


def load_policy_from(
    cfg: SdpConfig, task: Task, *, path: Path | None = None, progress: Callable[[str], None] | None = None
) -> Any:
    """The policy of the config, or the one saved at ``path`` (a checkpoint's policy dir);
    ``progress`` follows a warm start that is not cached yet, or a GGUF file's conversion."""
    from sdp_cli.models import load_policy

    if path is not None:
        return load_policy("hf", path=str(path))
    if cfg.model.kind == "hf":
        # the model's tokenizer that task setup loaded to render the prompts, not read again
        tokenizer = task.tokenizer if isinstance(task, DatasetTask) else None
        return load_policy("hf", path=cfg.model.path, tokenizer=tokenizer, gguf_cache=cfg.model.gguf_cache, progress=progress)
    m = cfg.model
    return load_policy(
        "tiny",
        task=task,
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads or m.num_heads,
        intermediate_size=m.intermediate_size,
        charset=m.charset,
        warm_start_steps=m.warm_start_steps,
        warm_start_lr=m.warm_start_lr,
        warm_start_batch=m.warm_start_batch,
        warm_start_target=m.warm_start_target,
        seed=cfg.seed,
        progress=progress,
    )


def describe_policy(policy: Any) -> str:
    """``name (N M parameters)`` of a loaded policy, for the start display."""
    count = sum(p.numel() for p in policy.model.parameters())
    return f"{policy.name}, {count / 1e6:.1f} M parameters"


class WholePolicy:
    """The policy with whole weights, for whatever needs them on rank 0 (the engine, checkpoints,
    version checkpoints, the evaluation; docs/training.md "Sharded training (FSDP)"): the trained
    policy itself, or under sharding a copy rebuilt from the weights gathered to rank 0 by
    ``gather`` (a collective the other ranks join), kept until the trainer's version changes or
    ``release`` frees it."""

    def __init__(self, policy: Any, trainer: Any, gather: Callable[[], dict[str, torch.Tensor]]):
        self.trained = policy
        self.trainer = trainer
        self.gather = gather
        self._copy: tuple[int, Any] | None = None

    def get(self) -> Any:
        if not self.trainer.placed.sharded:
            return self.trained
        version = self.trainer.version
        if self._copy is None or self._copy[0] != version:
            from sdp_cli.train.step.sharding import whole_model

            self._copy = None  # free the previous copy before gathering the next
            model = whole_model(self.trainer.placed.skeleton, self.gather())
            self._copy = (version, dataclasses.replace(self.trained, model=model))
        return self._copy[1]

    def weights(self) -> dict[str, torch.Tensor]:
        """The whole weights an engine loads (``Trainer.weights`` when unsharded)."""
        return self.get().model.state_dict() if self.trainer.placed.sharded else self.trainer.weights()

    def release(self) -> None:
        self._copy = None
