"""Load a policy (a tiny warm-started model or a Hugging Face model) and save one.

``load_policy("tiny", task="arith1")`` builds the tiny Qwen2 of ``sdp_cli.models.tiny`` and warm
starts it on the task (cached, ``sdp_cli.models.warm_start``). ``load_policy("hf", path=...)``
loads a local model directory, or a Hugging Face hub id (``org/name``) whose safetensors weights
and tokenizer files are downloaded into the Hugging Face cache (``HF_HOME``; nothing is
downloaded with ``HF_HUB_OFFLINE=1``, the cached snapshot is used). ``save_policy`` writes a
directory that ``load_policy("hf", ...)`` and a vLLM server can load.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from sdp_cli.choices import MODEL_KINDS
from sdp_cli.errors import UserError, WriteFailed, write_fix
from sdp_cli.fileio import written_by_safetensors
from sdp_cli.models.context import TINY_CONTEXT
from sdp_cli.models.gguf import dequantised_note, is_gguf
from sdp_cli.models.gguf_cache import load_gguf_cached
from sdp_cli.models.model_dir import is_hub_id, resolve_model_dir
from sdp_cli.models.policy import Policy
from sdp_cli.models.precision import DTYPES, cast_weights
from sdp_cli.models.tiny import build_tiny_model, tiny_arch
from sdp_cli.models.tokenizer import CHARSETS, build_tokenizer, load_tokenizer
from sdp_cli.models.warm_start import default_settings, warm_start
from sdp_cli.rundir import parse_step_name, run_part
from sdp_cli.safetensors_layout import LayoutError, check_directory
from sdp_cli.tasks import build_task
from sdp_cli.tasks.base import Task

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_policy(
    kind: str,
    *,
    task: str | Task | None = None,
    path: str | Path | None = None,
    seed: int = 0,
    warm_start_steps: int | None = None,
    warm_start_lr: float | None = None,
    warm_start_batch: int | None = None,
    warm_start_target: float | None = None,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 4,
    intermediate_size: int = 512,
    max_positions: int = TINY_CONTEXT,
    charset: str | None = None,
    cache_dir: str | Path | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    progress: Callable[[str], None] | None = None,
    tokenizer: Any = None,
    gguf_cache: bool = True,
) -> Policy:
    """The policy of ``kind``.

    ``tiny``: needs ``task`` (a name or a Task). The charset defaults to the task's (another one
    must cover the task's characters); the warm-start settings default to
    ``warm_start.default_settings(task.name)``; ``warm_start_steps=0`` skips the warm start
    (random init, nothing cached); ``warm_start_target=1.0`` runs every step unless the policy is
    already perfect. ``hf``: needs ``path``, a local model directory; the tiny and
    warm-start arguments are ignored. ``dtype`` and ``device`` apply to both kinds; ``dtype="auto"``
    keeps the dtype the weights were saved in. ``progress`` gets a short line at each step of a warm
    start that is not cached yet, and while a GGUF file is converted. ``tokenizer``: for ``hf``, the
    tokenizer of ``path`` if the caller has loaded it already (``load_hf_policy``).
    ``gguf_cache``: a GGUF file's dequantised copy is read from and written to sdp's cache
    (``sdp_cli.models.gguf_cache``).
    """
    if dtype not in DTYPES and dtype != "auto":
        raise UserError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)} or auto")
    if kind == "hf":
        if path is None:
            raise UserError("model kind 'hf' needs a path; set model.path to a model directory or a hub id (org/name)")
        policy = load_hf_policy(path, tokenizer=tokenizer, gguf_cache=gguf_cache, progress=progress)
    elif kind == "tiny":
        if task is None:
            raise UserError("model kind 'tiny' needs a task to warm start on; set task (e.g. arith1)")
        task_obj = build_task(task) if isinstance(task, str) else task
        arch = tiny_arch(
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            intermediate_size=intermediate_size,
            max_positions=max_positions,
        )
        defaults = default_settings(task_obj.name)
        steps = defaults.steps if warm_start_steps is None else warm_start_steps
        lr = defaults.lr if warm_start_lr is None else warm_start_lr
        batch_size = defaults.batch_size if warm_start_batch is None else warm_start_batch
        target = defaults.target if warm_start_target is None else warm_start_target
        if steps < 0 or batch_size < 1 or not lr > 0:
            raise UserError(
                f"warm start needs steps >= 0, batch_size >= 1 and lr > 0, got {steps}, {batch_size}, {lr}; "
                "fix the model settings"
            )
        if target is not None and not 0.0 < target <= 1.0:
            raise UserError(f"warm start target accuracy must be in (0, 1], got {target}; 1.0 runs every step")
        charset = charset or task_obj.charset
        if charset != task_obj.charset:
            _check_charset_covers(task_obj, charset)
        policy = _tiny_policy(task_obj, arch, charset, steps, lr, batch_size, target, seed, cache_dir, progress)
    else:
        raise UserError(f"unknown model kind {kind!r}; choose one of {', '.join(MODEL_KINDS)}")
    policy.model.to(device=device)
    if dtype in DTYPES:  # as from_pretrained(dtype=…) casts: RoPE's inv_freq stays float32
        cast_weights(policy.model, DTYPES[dtype])
    return policy


def _check_charset_covers(task: Task, charset: str) -> None:
    """A charset other than the task's own must hold every character of the task's problems."""
    if charset not in CHARSETS:
        raise UserError(f"unknown charset {charset!r}; choose one of {', '.join(sorted(CHARSETS))}")
    used = {c for item in task.sample(random.Random(0), 64) for c in item.prompt + item.answer}
    missing = sorted(used - set(CHARSETS[charset]))
    if missing:
        raise UserError(
            f"charset {charset!r} lacks characters that task {task.name!r} uses (e.g. {missing[0]!r}); "
            f"use charset {task.charset!r} or leave it unset"
        )


def _tiny_policy(
    task: Task,
    arch: dict[str, Any],
    charset: str,
    steps: int,
    lr: float,
    batch_size: int,
    target: float | None,
    seed: int,
    cache_dir: str | Path | None,
    progress: Callable[[str], None] | None,
) -> Policy:
    if steps == 0:
        tokenizer = build_tokenizer(charset)
        model = build_tiny_model(len(tokenizer), seed=seed, **arch)
        name = f"tiny-qwen2:{task.name}:init:seed{seed}"
        return Policy(model, tokenizer, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id, name)
    entry, info = warm_start(
        task,
        arch=arch,
        charset=charset,
        steps=steps,
        lr=lr,
        batch_size=batch_size,
        target=target,
        seed=seed,
        cache_dir=cache_dir,
        progress=progress,
    )
    policy = load_hf_policy(entry)
    policy.name = f"tiny-qwen2:{task.name}:ws{steps}:{info['key'][:12]}"
    policy.warm_start_accuracy = (info["validation_accuracy"], info["validation_n"])
    return policy


def _model_dir_fix(path: str | Path) -> str:
    if is_hub_id(path):
        return f"the hub model {path} needs safetensors weights, config.json and tokenizer files"
    in_run = _sdp_run_part(Path(path).expanduser())
    if in_run is not None:  # a new run started from a trained one
        run, source = in_run
        return (
            f"it is part of the sdp run {run}: `sdp export {source} DIR` writes its policy as a model "
            f"directory for model.path=DIR (resume={run} continues that run)"
        )
    return "point model.path at a directory written by save_pretrained (config.json, *.safetensors, tokenizer files)"


def _sdp_run_part(directory: Path) -> tuple[Path, Path] | None:
    """(the run, what ``sdp export`` takes) when ``directory`` is an sdp run, one of its
    checkpoints (or a checkpoint's ``policy/``) or one of its versions; else None."""
    in_checkpoint = directory.name == "policy" and parse_step_name(directory.parent.name) is not None
    source = directory.parent if in_checkpoint else directory
    part = run_part(source)
    return None if part is None else (part[0].path, source)


def check_hf_model_dir(path: str | Path) -> Path:
    """The model directory ``path`` names (a hub id resolved from the local cache), checked file by
    file without loading it: config.json, complete safetensors weights (no pickle) and tokenizer
    files. Bad ones are one line, so ``sdp train`` refuses them before it writes anything."""
    directory = resolve_model_dir(path)
    fix = _model_dir_fix(path)
    if not directory.is_dir():
        raise UserError(f"model directory {directory} does not exist; {fix}")
    if not (directory / "config.json").is_file():
        raise UserError(f"model directory {directory} has no config.json; {fix}")
    if not any(directory.glob("*.safetensors")):
        if any(directory.glob("*.bin")):
            raise UserError(
                f"model directory {directory} has only .bin (pickle) weights, which sdp does not load; "
                "re-save the model with save_pretrained to get safetensors"
            )
        raise UserError(f"model directory {directory} has no *.safetensors weights; {fix}")
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        raise UserError(
            f"model directory {directory} has no tokenizer files; "
            "save the tokenizer into it with tokenizer.save_pretrained"
        )
    try:  # a truncated or corrupt weight file is named here, not by the library's traceback
        check_directory(directory)
    except (LayoutError, OSError) as err:
        raise UserError(
            f"model directory {directory}: {err}; copy or save the model again (save_pretrained)"
        ) from None
    return directory


def load_hf_policy(
    path: str | Path, *, tokenizer: Any = None, gguf_cache: bool = True, progress: Callable[[str], None] | None = None
) -> Policy:
    """A Hugging Face causal LM with its tokenizer (safetensors weights only) from a local
    directory or a hub id (``resolve_model_dir``), or from a GGUF file (``sdp_cli.models.gguf``,
    dequantised to float32; ``gguf_cache``: through its copy in sdp's cache,
    ``sdp_cli.models.gguf_cache``, ``progress`` following its conversion). ``tokenizer``: the one
    of ``path``, already loaded (task setup loads it to render prompts), else it is loaded here."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    if is_gguf(path):
        model, tokenizer, cached = load_gguf_cached(path, tokenizer=tokenizer, cache=gguf_cache, progress=progress)
        policy = _policy(model, tokenizer, Path(path).expanduser(), str(Path(path).expanduser().resolve()))
        policy.load_note = dequantised_note(path) + (f"; {cached}" if cached else "")
        return policy
    directory = check_hf_model_dir(path)
    hub = is_hub_id(path)
    try:
        if tokenizer is None:
            tokenizer = load_tokenizer(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, use_safetensors=True)
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as err:
        first_line = (str(err).strip().splitlines() or [""])[0]
        raise UserError(
            f"cannot load model directory {directory}: {type(err).__name__}: {first_line}; {_model_dir_fix(path)}"
        ) from None
    return _policy(model, tokenizer, directory, str(path) if hub else str(directory.resolve()))


def _policy(model: Any, tokenizer: Any, source: Path, name: str) -> Policy:
    """The Policy of a loaded model and tokenizer, with the stop and pad ids they define."""
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        config_eos = model.config.eos_token_id
        eos_id = config_eos[0] if isinstance(config_eos, (list, tuple)) else config_eos
    if eos_id is None:
        raise UserError(f"model {source} defines no EOS token; set eos_token in its tokenizer_config.json")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    return Policy(model.eval(), tokenizer, int(eos_id), int(pad_id), tokenizer.bos_token_id, name)


def save_policy(policy: Policy, directory: str | Path, *, dtype: torch.dtype | None = None) -> Path:
    """Write ``policy`` as a Hugging Face directory (safetensors weights, config, tokenizer).

    A LoRA policy is written merged (``sdp_cli.models.lora.merged_state_dict``): a whole model any
    engine loads. ``dtype`` casts the weights, and the config's dtype, on the way out.

    Files are written to a temporary sibling directory and then moved into ``directory`` one by
    one with ``os.replace``, so a reader (e.g. a server reloading weights) never sees a partly
    written file. Existing files with other names are left alone.
    """
    target = Path(directory).expanduser()
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise WriteFailed(f"cannot create {target} ({err.strerror}); {write_fix(err)} or choose another directory", err, target) from None
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        with written_by_safetensors(tmp, shown_as=target):
            _save_model(policy.model, tmp, dtype)
        policy.tokenizer.save_pretrained(tmp)
        for item in sorted(tmp.iterdir()):
            os.replace(item, target / item.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _save_model(model: torch.nn.Module, directory: Path, dtype: torch.dtype | None) -> None:
    """``save_pretrained`` of the merged weights, cast to ``dtype`` (see ``save_policy``)."""
    from sdp_cli.models.lora import is_lora, merged_state_dict

    lora = is_lora(model)
    if not lora and dtype in (None, model.dtype):
        model.save_pretrained(directory)
        return
    state = merged_state_dict(model)
    if dtype is not None:
        # one cast per storage, so tied weights stay one tensor (saved once)
        casts: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
        for name, tensor in state.items():
            key = (tensor.data_ptr(), tuple(tensor.shape))
            if key not in casts:
                casts[key] = tensor.to(dtype)
            state[name] = casts[key]
    (model.get_base_model() if lora else model).save_pretrained(directory, state_dict=state)
    if dtype is not None:
        config_path = directory / "config.json"
        config = json.loads(config_path.read_text())
        config["dtype"] = str(dtype).removeprefix("torch.")
        config_path.write_text(json.dumps(config, indent=2) + "\n")
