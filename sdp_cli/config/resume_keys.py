"""What a resume may change in a run's config, and the hash of what it may not.

A run's *structural* config is every key of the resolved config except the ones in
:data:`ALLOWED_AT_RESUME`: how long to train, how to log, when to evaluate and checkpoint, and
how to reach or start the inference server. Changing any other key (the model, the task, the
loss, the rollout shape, the optimizer, the seed, ...) in the middle of a run would leave a
run whose config.yaml describes something other than what was trained, so ``sdp train
resume=...`` refuses it (docs/reliability.md, "What a resume checks"). Every checkpoint
records :func:`config_hash` of the structural config it was trained with. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from typing import Any

#: keys (with everything under them) a resume may change; docs/reliability.md lists them
ALLOWED_AT_RESUME = (
    "resume",
    "run",  # run directory, trackers, TensorBoard, progress display, debug output
    "train.steps",
    "train.threads",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.save_optimizer",
    "train.keep_version_checkpoints",
    "train.save_batches",
    "train.eval_every",
    "train.eval_samples",
    "train.eval_max_new_tokens",
    "train.batch_timeout_s",
    "train.async_push",  # when the engine loads the weights, not which
    "train.gradient_checkpointing",
    "train.share_prefixes",
    "train.parallel",  # DDP and FSDP checkpoints are the same files (docs/training.md)
    "engine.in_process",  # where the local engine runs, not what it computes
    "engine.urls",
    "engine.launch",
    "engine.python",
    "engine.host",
    "engine.port",
    "engine.api_key_env",
    "engine.startup_timeout_s",
    "engine.request_timeout_s",
    "engine.retries",
    "engine.reconnect_timeout_s",
    "engine.max_consecutive_faults",
    "engine.extra_args",
    "engine.env",
    "engine.enforce_eager",
    "engine.cpu_kv_cache_gib",
    "engine.reload_method",
    "task.reward_workers",
    "task.reward_pool",
    "task.reward_errors",
    "task.reward_timeout_s",
    "task.reward_max_error_rate",
    "task.reward_error_window",
)


def allowed_at_resume(key: str) -> bool:
    """Whether the dotted ``key`` may take another value at a resume."""
    return any(key == a or key.startswith(f"{a}.") for a in ALLOWED_AT_RESUME)


def _leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}``; lists and empty mappings are leaves."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for name, child in value.items():
            out.update(_leaves(child, f"{prefix}{name}."))
        return out
    return {prefix[:-1]: value}


def _defaults() -> dict[str, Any]:
    from sdp_cli.config.schema import SdpConfig

    return _leaves(asdict(SdpConfig()))


def structural(config: dict[str, Any]) -> dict[str, Any]:
    """The structural leaves of a resolved config (plain data), minus those at the schema's
    default value: a key added to the schema later, with a default that changes nothing, leaves
    the structure of an older run as it was."""
    defaults = _defaults()
    return {
        key: value
        for key, value in sorted(_leaves(config).items())
        if not allowed_at_resume(key) and not (key in defaults and defaults[key] == value)
    }


def config_hash(config: dict[str, Any]) -> str:
    """sha256 of the structural config (canonical JSON), what a checkpoint records."""
    text = json.dumps(structural(config), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def changed_keys(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The structural keys whose value differs between two resolved configs, sorted."""
    old, new = structural(before), structural(after)
    return sorted(k for k in old.keys() | new.keys() if old.get(k, _MISSING) != new.get(k, _MISSING))


_MISSING = object()
