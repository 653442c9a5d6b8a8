"""Validation of an sdp config: :func:`validate` reports the first bad value as one line naming
the key, the value and what is allowed (the schema is ``sdp_cli/config/schema.py``)."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from sdp_cli.choices import (
    CHARSETS,
    DATA_TASKS,
    ENGINE_KINDS,
    IS_LEVELS,
    KL_TYPES,
    LOSS_AGGS,
    LOSS_TYPES,
    MODEL_KINDS,
    PARALLEL_MODES,
    PROXIMAL_T_SOURCES,
    RECOMPUTE_POLICIES,
    REWARD_ERRORS,
    REWARD_POOLS,
    STALENESS_STRATEGIES,
    TASKS,
    TRACKERS,
    TRAIN_DTYPES,
    WEIGHT_ACTIONS,
)
from sdp_cli.config.modes import mode_names, reads_proximal_t
from sdp_cli.config.schema import MAX_TEMPERATURE, MIN_TEMPERATURE, LoraConfig, LossConfig, SdpConfig, TaskConfig
from sdp_cli.redact import is_loopback, redact_urls
from sdp_cli.server_url import server_url_problem


class ConfigValueError(ValueError):
    """A config value outside its allowed range; the message is one line naming the key."""


def _choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigValueError(f"{key}={value!r} is not valid; choose one of {', '.join(allowed)}")


def _positive(key: str, value: float | int | None, *, allow_none: bool = False, strict: bool = True) -> None:
    if value is None:
        if allow_none:
            return
        raise ConfigValueError(f"{key} must be set")
    if not math.isfinite(value):  # nan passes every comparison below; no key means "unbounded" by inf
        raise ConfigValueError(f"{key}={value} must be a finite number")
    if (value <= 0) if strict else (value < 0):
        raise ConfigValueError(f"{key}={value} must be {'> 0' if strict else '>= 0'}")


def _check_bypass(loss: LossConfig) -> None:
    """Refuse what bypass would ignore (docs/training.md, "bypass"): it has no behavioural log
    ratio to reject on, and with ppo_clip no behavioural weight to bound (the PPO ratio
    π_θ/π_behav is clipped by loss.clip); reinforce's importance weight π_θ/π_behav is bounded."""
    if loss.rejection.level is not None or loss.rejection.veto is not None:
        raise ConfigValueError(
            "loss.rejection needs a behavioural log ratio, which loss.mode=bypass does not have; "
            "set loss.rejection.level=null and loss.rejection.veto=null, or use mode=decoupled"
        )
    if loss.loss_type != "ppo_clip":
        return
    instead = (
        "which loss.mode=bypass with loss.loss_type=ppo_clip does not have "
        "(loss.clip bounds its ratio π_θ/π_behav)"
    )
    for key, value in (("weight_cap", loss.weight_cap), ("weight_floor", loss.weight_floor)):
        if value is not None:
            raise ConfigValueError(
                f"loss.{key}={value} bounds a behavioural weight, {instead}; "
                f"set loss.{key}=null or use loss.loss_type=reinforce"
            )
    if loss.batch_normalize:
        raise ConfigValueError(
            f"loss.batch_normalize=true normalises a behavioural weight, {instead}; "
            "set loss.batch_normalize=false or use loss.loss_type=reinforce"
        )


#: the longest timeout a key may name (30 days): longer ones overflow the OS's timers
#: (``socket.settimeout(1e300)`` raises OverflowError) and mean "never", which sdp does not offer
MAX_TIMEOUT_S = 30 * 24 * 3600.0


def _timeout(key: str, value: float) -> None:
    _positive(key, value)
    if value > MAX_TIMEOUT_S:
        raise ConfigValueError(f"{key}={value} is longer than 30 days ({MAX_TIMEOUT_S:.0f} s); choose a shorter timeout")


def _check_url(url: Any) -> None:
    """An ``engine.urls`` entry must be an http(s) URL with a host and a valid port, checked
    before any connection attempt (a typo would cost the retries; a bad port was a traceback)."""
    problem = "not text" if not isinstance(url, str) else server_url_problem(url)
    if problem is not None:
        raise ConfigValueError(
            f"engine.urls: {redact_urls(str(url))!r} is not a server URL ({problem}); "
            "give e.g. engine.urls=[http://127.0.0.1:8000]"
        )


#: the largest |seed|: 2**62 leaves room in int64 for the offsets sdp adds to it
MAX_SEED = 2**62


def validate(cfg: SdpConfig) -> None:
    """Check every value a user can set; raise ConfigValueError naming the first bad key."""
    # torch.manual_seed takes an int64, and sdp derives seeds by adding small offsets
    if not isinstance(cfg.seed, int) or abs(cfg.seed) > MAX_SEED:
        raise ConfigValueError(f"seed={cfg.seed} must be an integer between -{MAX_SEED} and {MAX_SEED} (2**62)")
    loss = cfg.loss
    _choice("loss.mode", loss.mode, mode_names())
    _choice("loss.is_level", loss.is_level, IS_LEVELS)
    _choice("loss.weight_action", loss.weight_action, WEIGHT_ACTIONS)
    _choice("loss.agg", loss.agg, LOSS_AGGS)
    _choice("loss.loss_type", loss.loss_type, LOSS_TYPES)
    _positive("loss.weight_cap", loss.weight_cap, allow_none=True)
    _positive("loss.weight_floor", loss.weight_floor, allow_none=True)
    if loss.weight_cap is not None and loss.weight_floor is not None and loss.weight_floor > loss.weight_cap:
        raise ConfigValueError(
            f"loss.weight_floor={loss.weight_floor} is above loss.weight_cap={loss.weight_cap}"
        )
    if loss.weight_action == "mask" and loss.weight_cap is None and loss.weight_floor is None:
        raise ConfigValueError("loss.weight_action=mask needs loss.weight_cap or loss.weight_floor")
    if loss.drift_clip is not None:
        if loss.mode != "segment_wise":
            raise ConfigValueError(
                f"loss.drift_clip={loss.drift_clip} needs loss.mode=segment_wise "
                "(or +preset=segment_wise_drift); set loss.drift_clip=null for other modes"
            )
        if math.isnan(loss.drift_clip) or loss.drift_clip < 1:
            raise ConfigValueError(
                f"loss.drift_clip={loss.drift_clip} must be >= 1 (1 = segment-wise, inf = decoupled)"
            )
    _positive("loss.norm_length", loss.norm_length, allow_none=True)
    _positive("loss.clip", loss.clip)
    _positive("loss.kl_coef", loss.kl_coef, strict=False)
    _choice("loss.kl_type", loss.kl_type, KL_TYPES)
    _positive("loss.entropy_coef", loss.entropy_coef, strict=False)
    _positive("loss.clip_high", loss.clip_high, allow_none=True)
    if loss.dual_clip is not None and not 1 < loss.dual_clip < math.inf:
        raise ConfigValueError(f"loss.dual_clip={loss.dual_clip} must be > 1 (or null to turn it off)")
    rej = loss.rejection
    if rej.level is not None:
        _choice("loss.rejection.level", rej.level, IS_LEVELS)
        _positive("loss.rejection.upper", rej.upper)
        _positive("loss.rejection.lower", rej.lower, allow_none=True)
        lower = rej.lower if rej.lower is not None else 1.0 / rej.upper
        if lower > rej.upper:
            raise ConfigValueError(
                f"loss.rejection.lower={lower} is above loss.rejection.upper={rej.upper}"
            )
    _positive("loss.rejection.veto", rej.veto, allow_none=True)
    if loss.mode == "bypass":
        _check_bypass(loss)

    ro = cfg.rollout
    _positive("rollout.max_head_offpolicyness", ro.max_head_offpolicyness, strict=False)
    _positive("rollout.batch_groups", ro.batch_groups)
    _positive("rollout.group_size", ro.group_size)
    _positive("rollout.max_concurrent_rollouts", ro.max_concurrent_rollouts, allow_none=True)
    _positive("rollout.groups_per_request", ro.groups_per_request)
    _positive("rollout.temperature", ro.temperature)
    if not MIN_TEMPERATURE <= ro.temperature <= MAX_TEMPERATURE:
        raise ConfigValueError(
            f"rollout.temperature={ro.temperature} is outside [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]"
        )
    _positive("rollout.max_new_tokens", ro.max_new_tokens, allow_none=True)
    _choice("rollout.recompute", ro.recompute, RECOMPUTE_POLICIES)
    _choice("rollout.proximal_t_source", ro.proximal_t_source, PROXIMAL_T_SOURCES)

    _choice("staleness.strategy", cfg.staleness.strategy, STALENESS_STRATEGIES)
    if cfg.staleness.strategy == "segment_wise" and loss.mode == "bypass":
        raise ConfigValueError(
            "staleness=segment_wise needs π_prox_t, which loss.mode=bypass never uses; "
            "use mode=segment_wise (or +preset=segment_wise)"
        )
    if ro.recompute == "never" and reads_proximal_t(loss.mode):
        raise ConfigValueError(
            f"loss.mode={loss.mode} needs the recompute pass; set rollout.recompute=auto or always"
        )

    opt = cfg.optim
    _positive("optim.lr", opt.lr)
    _positive("optim.weight_decay", opt.weight_decay, strict=False)
    for key, beta in (("optim.beta1", opt.beta1), ("optim.beta2", opt.beta2)):
        if not 0 <= beta < 1:
            raise ConfigValueError(f"{key}={beta} must be in [0, 1)")
    _positive("optim.grad_clip", opt.grad_clip, allow_none=True)
    _positive("optim.ppo_epochs", opt.ppo_epochs)
    _positive("optim.minibatches", opt.minibatches)
    if opt.minibatches > ro.batch_groups * ro.group_size:
        raise ConfigValueError(
            f"optim.minibatches={opt.minibatches} exceeds the batch size "
            f"({ro.batch_groups}·{ro.group_size} samples)"
        )

    tr = cfg.train
    _positive("train.steps", tr.steps)
    _positive("train.threads", tr.threads, allow_none=True)
    _positive("train.checkpoint_every", tr.checkpoint_every, strict=False)
    _positive("train.eval_every", tr.eval_every, strict=False)
    _positive("train.eval_samples", tr.eval_samples, strict=False)
    _timeout("train.batch_timeout_s", tr.batch_timeout_s)
    _choice("train.dtype", tr.dtype, TRAIN_DTYPES)
    _choice("train.parallel", tr.parallel, PARALLEL_MODES)
    if tr.parallel == "fsdp" and cfg.model.lora.r > 0:
        raise ConfigValueError(
            "train.parallel=fsdp with LoRA (model.lora.r > 0) is not supported; "
            "train LoRA adapters with train.parallel=ddp (the base is frozen, only the adapters train)"
        )
    _positive("train.keep_checkpoints", tr.keep_checkpoints)
    _positive("train.eval_max_new_tokens", tr.eval_max_new_tokens, allow_none=True)

    eng = cfg.engine
    _choice("engine.kind", eng.kind, ENGINE_KINDS)
    _positive("engine.max_batch_size", eng.max_batch_size)
    if not 0 <= eng.port <= 65535:
        raise ConfigValueError(f"engine.port={eng.port} must be in 0..65535")
    if eng.kind != "local" and not eng.urls and not is_loopback(eng.host) and not eng.api_key_env:
        raise ConfigValueError(
            f"engine.host={eng.host} would open the inference server to the network without a key; "
            "set engine.api_key_env to a variable holding one, or bind to 127.0.0.1"
        )
    for url in eng.urls:
        _check_url(url)
    _timeout("engine.startup_timeout_s", eng.startup_timeout_s)
    _timeout("engine.request_timeout_s", eng.request_timeout_s)
    _positive("engine.retries", eng.retries, strict=False)
    _timeout("engine.reconnect_timeout_s", eng.reconnect_timeout_s)
    _positive("engine.max_consecutive_faults", eng.max_consecutive_faults)
    _choice("engine.dtype", eng.dtype, ("float32", "bfloat16", "float16", "auto"))
    _positive("engine.max_model_len", eng.max_model_len, allow_none=True)
    _positive("engine.cpu_kv_cache_gib", eng.cpu_kv_cache_gib, allow_none=True)
    if eng.reload_method is not None:
        _choice("engine.reload_method", eng.reload_method, ("reload_weights", "reload_weights_cpu"))

    mdl = cfg.model
    _choice("model.kind", mdl.kind, MODEL_KINDS)
    if mdl.kind == "hf" and not mdl.path:
        raise ConfigValueError("model=hf needs model.path=/path/to/hf_model_dir")
    if mdl.charset is not None:
        _choice("model.charset", mdl.charset, CHARSETS)
    for key in ("hidden_size", "num_layers", "num_heads", "intermediate_size"):
        _positive(f"model.{key}", getattr(mdl, key))
    _positive("model.warm_start_batch", mdl.warm_start_batch, allow_none=True)
    _positive("model.num_kv_heads", mdl.num_kv_heads, allow_none=True)
    if mdl.num_kv_heads is not None and mdl.num_heads % mdl.num_kv_heads:
        raise ConfigValueError(
            f"model.num_heads={mdl.num_heads} must be a multiple of model.num_kv_heads={mdl.num_kv_heads}"
        )
    if mdl.hidden_size % mdl.num_heads:
        raise ConfigValueError(
            f"model.hidden_size={mdl.hidden_size} must be divisible by model.num_heads={mdl.num_heads}"
        )
    _positive("model.warm_start_steps", mdl.warm_start_steps, allow_none=True, strict=False)
    _positive("model.warm_start_lr", mdl.warm_start_lr, allow_none=True)
    if mdl.warm_start_target is not None and not 0 < mdl.warm_start_target <= 1:
        raise ConfigValueError(f"model.warm_start_target={mdl.warm_start_target} must be in (0, 1]")
    _validate_lora(mdl.lora)

    for name in cfg.run.trackers:
        _choice("run.trackers", name, TRACKERS)
    if not cfg.run.project.strip():
        raise ConfigValueError("run.project is empty; name the W&B project / MLflow experiment (default sdp)")

    _validate_task(cfg.task)


#: task keys of every task, not only the data tasks: where and how rewards run
EVERY_TASK_KEYS = ("reward_workers", "reward_pool", "reward_errors", "reward_timeout_s", "reward_max_error_rate",
                   "reward_error_window")  # fmt: skip


def _validate_task(task: TaskConfig) -> None:
    _choice("task.name", task.name, TASKS)
    if task.name not in DATA_TASKS:
        defaults = TaskConfig()
        for f in fields(TaskConfig):
            if f.name not in ("name", *EVERY_TASK_KEYS) and getattr(task, f.name) != getattr(defaults, f.name):
                raise ConfigValueError(
                    f"task.{f.name} applies to data tasks (task=dataset, task=gsm8k), not task={task.name}; remove it"
                )
    elif not task.path:
        raise ConfigValueError(f"task={task.name} needs task.path=/path/to/data.jsonl (or .json, .parquet)")
    elif task.name == "dataset" and not task.reward:
        raise ConfigValueError(
            "task=dataset needs task.reward=final_number|boxed|regex|package.module:function|path/to/file.py:function"
        )
    if task.eval_fraction is not None and not 0 < task.eval_fraction < 1:
        raise ConfigValueError(f"task.eval_fraction={task.eval_fraction} must be in (0, 1)")
    if task.eval_fraction is not None and task.eval_path is not None:
        raise ConfigValueError("set one of task.eval_path and task.eval_fraction, not both")
    _positive("task.max_prompt_tokens", task.max_prompt_tokens, allow_none=True)
    _positive("task.reward_workers", task.reward_workers)
    _choice("task.reward_pool", task.reward_pool, REWARD_POOLS)
    _choice("task.reward_errors", task.reward_errors, REWARD_ERRORS)
    _positive("task.reward_timeout_s", task.reward_timeout_s, allow_none=True)
    if not 0 <= task.reward_max_error_rate <= 1:  # nan fails it too
        raise ConfigValueError(
            f"task.reward_max_error_rate={task.reward_max_error_rate} must be in [0, 1] (1: never stop for reward errors)"
        )
    _positive("task.reward_error_window", task.reward_error_window)
    if task.system_prompt is not None and not task.chat_template:
        raise ConfigValueError("task.system_prompt is used by the chat template; set task.chat_template=true too")


def _validate_lora(lora: LoraConfig) -> None:
    _positive("model.lora.r", lora.r, strict=False)
    if lora.r == 0:
        return
    _positive("model.lora.alpha", lora.alpha, allow_none=True)
    if lora.dropout != 0:
        raise ConfigValueError(
            f"model.lora.dropout={lora.dropout} is not supported: the trainer runs without dropout, "
            "so that π_θ equals π_prox at equal weights (docs/training.md); leave it at 0"
        )
    if not lora.target_modules:
        raise ConfigValueError("model.lora.target_modules is empty; name the linear layers to adapt, e.g. [q_proj,v_proj]")
    embeddings = sorted({"lm_head", "embed_tokens"} & set(lora.target_modules))
    if embeddings:
        raise ConfigValueError(
            f"model.lora.target_modules may not include {embeddings[0]}: the embeddings stay frozen "
            "(log-probs are computed from the output embedding directly); adapt the decoder layers"
        )
