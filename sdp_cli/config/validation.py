"""Validation of an sdp config: :func:`validate` reports the first bad value as one line naming
the key, the value and what is allowed (the schema is ``sdp_cli/config/schema.py``)."""

from __future__ import annotations

import math
import os
import types
import typing
from dataclasses import fields, is_dataclass
from typing import Any

from sdp_cli.choices import (
    CHARSETS,
    DATA_TASKS,
    IS_LEVELS,
    KL_TYPES,
    LOSS_AGGS,
    LOSS_TYPES,
    MODEL_KINDS,
    PARALLEL_MODES,
    PROXIMAL_SOURCES,
    PROXIMAL_T_SOURCES,
    RATIO_LEVELS,
    RECOMPUTE_POLICIES,
    REJECTION_LEVELS,
    REJECTION_METRICS,
    REWARD_ERRORS,
    REWARD_POOLS,
    STALENESS_STRATEGIES,
    TASKS,
    TRACKERS,
    TRAIN_DTYPES,
    WEIGHT_ACTIONS,
)
from sdp_cli.config.schema import MAX_TEMPERATURE, MIN_TEMPERATURE, LoraConfig, LossConfig, SdpConfig, TaskConfig
from sdp_cli.dataset_options import DATASET_OPTIONS
from sdp_cli.engines import engine_dtypes, engine_kind, engine_names
from sdp_cli.errors import UserError
from sdp_cli.modes import Mode, resolve_mode
from sdp_cli.user_code import is_code_spec
from sdp_cli.redact import is_loopback, redact_urls
from sdp_cli.server_url import server_url_problem


class ConfigValueError(ValueError):
    """A config value outside its allowed range; the message is one line naming the key."""


def _choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigValueError(f"{key}={value!r} is not valid; choose one of {', '.join(allowed)}")


def _mode(value: str) -> Mode | None:
    """The registered mode ``loss.mode`` names; None for a function of yours, whose form is
    checked here and which is imported when the run starts (``load_mode``), after a resume has
    checked that the command line names it (train/session/start.py ``refuse_saved_programs``)."""
    if is_code_spec(value):
        target, _, attr = value.rpartition(":")
        if not target or not attr.isidentifier():
            raise ConfigValueError(f"loss.mode={value}: expected package.module:function or path/to/file.py:function")
        return None
    try:
        return resolve_mode(value)
    except UserError as err:
        raise ConfigValueError(str(err)) from None


def load_mode(cfg: SdpConfig) -> Mode:
    """The run's mode, a function of yours imported and tried now (sdp_cli/modes.py), with the
    settings that depend on what it reads checked against it; one-line UserError otherwise."""
    mode = resolve_mode(cfg.loss.mode)
    try:
        check_mode_settings(cfg, mode)
    except ConfigValueError as err:
        raise UserError(str(err)) from None
    return mode


def check_mode_settings(cfg: SdpConfig, mode: Mode) -> None:
    """What depends on the mode's entry: κ only for a mode that takes it, A-3PO only for decoupled,
    rejection and bounds only with a weight, the recompute pass for a mode that reads π_prox_t."""
    loss, ro = cfg.loss, cfg.rollout
    if loss.drift_clip is not None and not mode.takes_drift_clip:
        raise ConfigValueError(
            f"loss.drift_clip={loss.drift_clip} needs loss.mode=segment_wise "
            "(or +preset=segment_wise_drift); set loss.drift_clip=null for other modes"
        )
    if loss.proximal_source != "forward" and mode.name != "decoupled":
        raise ConfigValueError(
            f"loss.proximal_source=loglinear (A-3PO) approximates the decoupled π_prox; loss.mode={loss.mode} "
            "does not use it: use mode=decoupled (or +preset=a3po), or loss.proximal_source=forward"
        )
    if not mode.has_weight:
        _check_without_weight(loss)
    if cfg.staleness.strategy == "segment_wise" and not mode.has_weight:
        raise ConfigValueError(
            f"staleness=segment_wise needs π_prox_t, which loss.mode={loss.mode} never uses; "
            "use mode=segment_wise (or +preset=segment_wise)"
        )
    if ro.recompute == "never" and mode.reads_proximal_t:
        raise ConfigValueError(
            f"loss.mode={loss.mode} needs the recompute pass; set rollout.recompute=auto or always"
        )


def _positive(key: str, value: float | int | None, *, allow_none: bool = False, strict: bool = True) -> None:
    if value is None:
        if allow_none:
            return
        raise ConfigValueError(f"{key} must be set")
    if not math.isfinite(value):  # nan passes every comparison below; no key means "unbounded" by inf
        raise ConfigValueError(f"{key}={value} must be a finite number")
    if (value <= 0) if strict else (value < 0):
        raise ConfigValueError(f"{key}={value} must be {'> 0' if strict else '>= 0'}")


def _check_sequence_ratio(loss: LossConfig) -> None:
    """A sequence-level PPO ratio (GSPO) decides per sequence: it needs the PPO clip, and every token
    of a sequence in the loss or out of it together (docs/math.md §5.4)."""
    if loss.ratio_level != "sequence":
        return
    if loss.loss_type != "ppo_clip":
        raise ConfigValueError(
            f"loss.ratio_level=sequence is the ratio of the PPO clip; loss.loss_type={loss.loss_type} has none: "
            "use loss.loss_type=ppo_clip or loss.ratio_level=token"
        )
    if loss.rejection.level == "token":
        raise ConfigValueError(
            "loss.ratio_level=sequence clips whole sequences, but loss.rejection.level=token drops single "
            "tokens from them; use loss.rejection.level=sequence or geometric, or loss.ratio_level=token"
        )
    if loss.m2_threshold is not None:
        raise ConfigValueError(
            "loss.ratio_level=sequence clips whole sequences, but loss.m2_threshold (M2PO) drops single tokens "
            "from them; set loss.m2_threshold=null or loss.ratio_level=token"
        )


def _check_rejection(loss: LossConfig) -> None:
    """The bounds of ``loss.rejection`` (docs/math.md §3): a ratio in [lower, upper], or a divergence
    (k2, k3; verl's) at most upper, aggregated per sequence by sum, mean or max."""
    rej = loss.rejection
    _choice("loss.rejection.metric", rej.metric, REJECTION_METRICS)
    if rej.level is None:
        if rej.metric != "ratio":
            raise ConfigValueError(
                f"loss.rejection.metric={rej.metric} is bounded only with a level; "
                "set loss.rejection.level (token, sequence, geometric or max) or loss.rejection.metric=ratio"
            )
        return
    _choice("loss.rejection.level", rej.level, REJECTION_LEVELS)
    _positive("loss.rejection.upper", rej.upper)
    if rej.metric != "ratio":
        if rej.lower is not None:
            raise ConfigValueError(
                f"loss.rejection.lower={rej.lower} bounds a ratio, but loss.rejection.metric={rej.metric} is a "
                "divergence, bounded by loss.rejection.upper only; set loss.rejection.lower=null"
            )
        return
    if rej.level == "max":
        raise ConfigValueError(
            "loss.rejection.level=max takes a sequence's largest divergence, which a ratio is not; "
            "use loss.rejection.metric=k2 or k3, or level=token to bound every token's ratio"
        )
    _positive("loss.rejection.lower", rej.lower, allow_none=True)
    lower = rej.lower if rej.lower is not None else 1.0 / rej.upper
    if lower > rej.upper:
        raise ConfigValueError(f"loss.rejection.lower={lower} is above loss.rejection.upper={rej.upper}")


def _check_loss_variant(loss: LossConfig) -> None:
    """What only some policy losses have (docs/math.md §5.1, §9.5, §9.6): the dual clip bounds the
    PPO clip's loss, the DPPO penalty belongs to DPPO."""
    if loss.dual_clip is not None and loss.loss_type != "ppo_clip":
        raise ConfigValueError(
            f"loss.dual_clip bounds the PPO clip's loss, which loss.loss_type={loss.loss_type} does not have; "
            "set loss.dual_clip=null or loss.loss_type=ppo_clip"
        )
    _positive("loss.dppo_kl_coef", loss.dppo_kl_coef, strict=False)
    if loss.dppo_kl_coef and loss.loss_type != "dppo":
        raise ConfigValueError(
            f"loss.dppo_kl_coef={loss.dppo_kl_coef} is DPPO's penalty; set loss.loss_type=dppo or loss.dppo_kl_coef=0"
        )


def _check_proximal_source(cfg: SdpConfig) -> None:
    """A-3PO's interpolated π_prox (docs/math.md §9.7) replaces the decoupled π_prox inside each
    optimizer step; what needs the batch's π_prox before the update cannot have it."""
    loss = cfg.loss
    _choice("loss.proximal_source", loss.proximal_source, PROXIMAL_SOURCES)
    if loss.proximal_source == "forward":
        return
    needs_batch_prox = (
        ("loss.rejection", loss.rejection.level is not None or loss.rejection.veto is not None),
        ("loss.m2_threshold", loss.m2_threshold is not None),
        ("rollout.recompute=always", cfg.rollout.recompute == "always"),
    )
    for key, used in needs_batch_prox:
        if used:
            raise ConfigValueError(
                f"{key} reads the batch's π_prox before the update, which loss.proximal_source=loglinear "
                "(A-3PO) never computes; turn it off or use loss.proximal_source=forward"
            )


def _check_without_weight(loss: LossConfig) -> None:
    """Refuse what a mode without a weight (bypass) would ignore (docs/training.md, "bypass"): it
    has no behavioural log ratio to reject on, and with ppo_clip no behavioural weight to bound
    (the PPO ratio π_θ/π_behav is clipped by loss.clip); reinforce's importance weight
    π_θ/π_behav is bounded (cispo and dppo bound π_θ/π_behav by loss.clip, as ppo_clip does)."""
    if loss.rejection.level is not None or loss.rejection.veto is not None:
        raise ConfigValueError(
            f"loss.rejection needs a behavioural log ratio, which loss.mode={loss.mode} does not have; "
            "set loss.rejection.level=null and loss.rejection.veto=null, or use mode=decoupled"
        )
    if loss.m2_threshold is not None:
        raise ConfigValueError(
            f"loss.m2_threshold (M2PO) masks by the behavioural log ratio, which loss.mode={loss.mode} does not "
            "have; set loss.m2_threshold=null or use mode=decoupled"
        )
    if loss.loss_type == "reinforce":
        return
    instead = (
        f"which loss.mode={loss.mode} with loss.loss_type={loss.loss_type} does not have "
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

# Upper bounds of the numbers a user sets (docs/reliability.md, "Config input limits"): an
# absurd count failed late or crashed (train.threads=20000 in libgomp after the run directory
# was made, 50000 a segfault). Counts of threads and workers follow the machine's CPUs, sizes
# that take memory the machine's memory, the rest fixed bounds well above any real use.
#: torch threads per CPU: more only oversubscribe the cores
THREADS_PER_CPU = 4
#: reward workers per CPU (an I/O-bound reward function may use more than one per core)
REWARD_WORKERS_PER_CPU = 8
#: any integer of the config; larger ones overflow the 32-bit fields of libraries (OpenMP, CUDA)
MAX_INT = 2**31 - 1
#: tokens of one sequence (prompt or response): the longest context of any model, 1 Mi
MAX_TOKENS = 1 << 20
#: samples per training batch or engine batch (batch_groups·group_size); twice that in flight
MAX_SAMPLES = 1 << 16
#: engine.retries: the backoff doubles per retry (2.0**1024 overflows); 8 s apart at most
MAX_RETRIES = 100
#: model.lora.r: at most the width of the widest layers; a larger rank is no longer low-rank
MAX_LORA_RANK = 4096
#: bytes per parameter to train the tiny model: float32 weights, gradients, AdamW's two moments
TRAIN_BYTES_PER_PARAMETER = 16

#: fixed upper bounds of single keys (None values are unset and not checked)
COUNT_BOUNDS: dict[str, int] = {
    "rollout.max_new_tokens": MAX_TOKENS,
    "train.eval_max_new_tokens": MAX_TOKENS,
    "loss.norm_length": MAX_TOKENS,
    "engine.max_model_len": MAX_TOKENS,
    "task.max_prompt_tokens": MAX_TOKENS,
    "engine.max_batch_size": MAX_SAMPLES,
    "model.warm_start_batch": MAX_SAMPLES,
    "engine.retries": MAX_RETRIES,
    "model.lora.r": MAX_LORA_RANK,
}


def machine_cpus() -> int:
    """CPUs of this machine (``os.cpu_count``)."""
    return os.cpu_count() or 1


def machine_memory_bytes() -> int:
    """Physical memory of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _value(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _integer_keys(cls: type, prefix: str = "") -> list[str]:
    """Dotted keys of every ``int`` / ``int | None`` field of the schema dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    keys: list[str] = []
    for f in fields(cls):
        hint = hints[f.name]
        if is_dataclass(hint):
            keys += _integer_keys(hint, f"{prefix}{f.name}.")
        elif hint is int or (typing.get_origin(hint) in (typing.Union, types.UnionType) and int in typing.get_args(hint)):
            keys.append(f"{prefix}{f.name}")
    return keys


def _per_cpu(key: str, value: int | None, per_cpu: int) -> None:
    cpus = machine_cpus()
    if value is not None and value > per_cpu * cpus:
        raise ConfigValueError(
            f"{key}={value} is more than {per_cpu} per CPU ({per_cpu * cpus} on this machine's {cpus} CPUs); "
            f"choose at most {per_cpu * cpus}"
        )


def _samples(what: str, groups_key: str, groups: int, group_size: int, bound: int) -> None:
    if groups * group_size > bound:
        raise ConfigValueError(
            f"{groups_key}={groups} × rollout.group_size={group_size} = {groups * group_size} samples {what} "
            f"is more than {bound}; use fewer or smaller groups"
        )


def _tiny_model_parameters(mdl: Any) -> int:
    """A lower bound of the tiny model's parameters: L·(4·h² + 3·h·i) (attention with as many
    key/value heads as query heads, a gated MLP; embeddings left out)."""
    h, i = mdl.hidden_size, mdl.intermediate_size
    return mdl.num_layers * (4 * h * h + 3 * h * i)


def _check_integer_sizes(cfg: SdpConfig) -> None:
    """Every integer but the seed within ±``MAX_INT`` (checked first: the other checks may turn
    one into a float, which a 400-digit integer overflows)."""
    for key in _integer_keys(SdpConfig):
        value = _value(cfg, key)
        if isinstance(value, int) and key != "seed" and abs(value) > MAX_INT:
            raise ConfigValueError(f"{key}={value} is more than {MAX_INT} (2**31 - 1) in size; choose a smaller number")


def _check_bounds(cfg: SdpConfig) -> None:
    """The upper bounds of docs/reliability.md, "Config input limits"; one line naming the key."""
    for key, bound in COUNT_BOUNDS.items():
        value = _value(cfg, key)
        if value is not None and value > bound:
            raise ConfigValueError(f"{key}={value} is more than {bound}, the most sdp takes; choose a smaller number")
    _per_cpu("train.threads", cfg.train.threads, THREADS_PER_CPU)
    _per_cpu("task.reward_workers", cfg.task.reward_workers, REWARD_WORKERS_PER_CPU)
    ro = cfg.rollout
    _samples("per batch", "rollout.batch_groups", ro.batch_groups, ro.group_size, MAX_SAMPLES)
    if ro.max_concurrent_rollouts is not None:
        _samples("in flight", "rollout.max_concurrent_rollouts", ro.max_concurrent_rollouts, ro.group_size, 2 * MAX_SAMPLES)
    memory = machine_memory_bytes()
    kv = cfg.engine.cpu_kv_cache_gib
    if kv is not None and kv * 2**30 > memory:
        raise ConfigValueError(
            f"engine.cpu_kv_cache_gib={kv} is more than this machine's memory ({memory / 2**30:.0f} GiB); choose less"
        )
    mdl = cfg.model
    if mdl.kind == "tiny":
        params = _tiny_model_parameters(mdl)
        need = params * TRAIN_BYTES_PER_PARAMETER
        if need > memory:
            raise ConfigValueError(
                f"the tiny model (model.hidden_size={mdl.hidden_size}, model.num_layers={mdl.num_layers}, "
                f"model.intermediate_size={mdl.intermediate_size}) has at least {params / 1e9:.1f} G parameters, "
                f"{need / 2**30:.0f} GiB to train, more than this machine's {memory / 2**30:.0f} GiB; make it smaller"
            )


def validate(cfg: SdpConfig) -> None:
    """Check every value a user can set; raise ConfigValueError naming the first bad key."""
    _check_integer_sizes(cfg)
    # torch.manual_seed takes an int64, and sdp derives seeds by adding small offsets
    if not isinstance(cfg.seed, int) or abs(cfg.seed) > MAX_SEED:
        raise ConfigValueError(f"seed={cfg.seed} must be an integer between -{MAX_SEED} and {MAX_SEED} (2**62)")
    loss = cfg.loss
    mode = _mode(loss.mode)
    _choice("loss.is_level", loss.is_level, IS_LEVELS)
    _choice("loss.weight_action", loss.weight_action, WEIGHT_ACTIONS)
    _choice("loss.agg", loss.agg, LOSS_AGGS)
    _choice("loss.loss_type", loss.loss_type, LOSS_TYPES)
    _choice("loss.ratio_level", loss.ratio_level, RATIO_LEVELS)
    _check_sequence_ratio(loss)
    _positive("loss.m2_threshold", loss.m2_threshold, allow_none=True)
    _positive("loss.weight_cap", loss.weight_cap, allow_none=True)
    _positive("loss.weight_floor", loss.weight_floor, allow_none=True)
    if loss.weight_cap is not None and loss.weight_floor is not None and loss.weight_floor > loss.weight_cap:
        raise ConfigValueError(
            f"loss.weight_floor={loss.weight_floor} is above loss.weight_cap={loss.weight_cap}"
        )
    if loss.weight_action == "mask" and loss.weight_cap is None and loss.weight_floor is None:
        raise ConfigValueError("loss.weight_action=mask needs loss.weight_cap or loss.weight_floor")
    if loss.drift_clip is not None:
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
    _check_rejection(loss)
    _positive("loss.rejection.veto", loss.rejection.veto, allow_none=True)
    _check_loss_variant(loss)
    _positive("loss.opsm_delta", loss.opsm_delta, allow_none=True, strict=False)
    _check_proximal_source(cfg)

    ro = cfg.rollout
    _positive("rollout.max_head_offpolicyness", ro.max_head_offpolicyness, strict=False)
    _positive("rollout.batch_groups", ro.batch_groups)
    _positive("rollout.group_size", ro.group_size)
    _positive("rollout.max_concurrent_rollouts", ro.max_concurrent_rollouts, allow_none=True)
    _positive("rollout.groups_per_request", ro.groups_per_request, allow_none=True)
    _positive("rollout.temperature", ro.temperature)
    if not MIN_TEMPERATURE <= ro.temperature <= MAX_TEMPERATURE:
        raise ConfigValueError(
            f"rollout.temperature={ro.temperature} is outside [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]"
        )
    _positive("rollout.max_new_tokens", ro.max_new_tokens, allow_none=True)
    _choice("rollout.recompute", ro.recompute, RECOMPUTE_POLICIES)
    _choice("rollout.proximal_t_source", ro.proximal_t_source, PROXIMAL_T_SOURCES)

    _choice("staleness.strategy", cfg.staleness.strategy, STALENESS_STRATEGIES)
    if mode is not None:  # a mode of yours is checked when it is loaded (load_mode)
        check_mode_settings(cfg, mode)

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
    _choice("engine.kind", eng.kind, engine_names())
    kind = engine_kind(eng.kind)
    _positive("engine.max_batch_size", eng.max_batch_size)
    if not 0 <= eng.port <= 65535:
        raise ConfigValueError(f"engine.port={eng.port} must be in 0..65535")
    if kind.launches(cfg) and not is_loopback(eng.host) and not eng.api_key_env:
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
    if eng.dtype is not None:
        _choice("engine.dtype", eng.dtype, engine_dtypes())
    if eng.dtype not in (None, *kind.dtypes):
        why = "is for launched servers" if eng.dtype in engine_dtypes(servers=True) else "is not one it runs"
        null = f"means {kind.default_dtype}" if kind.default_dtype else "follows train.dtype"
        raise ConfigValueError(
            f"engine.dtype={eng.dtype} {why}; the {kind.name} engine runs {' or '.join(kind.dtypes)} (null {null})"
        )
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
    _check_bounds(cfg)


def _validate_task(task: TaskConfig) -> None:
    _choice("task.name", task.name, TASKS)
    if task.digits is not None and task.name != "runsum":
        raise ConfigValueError(f"task.digits applies to task=runsum, not task={task.name}; remove it")
    if task.digits is not None and not 2 <= task.digits <= 12:
        raise ConfigValueError(f"task.digits={task.digits} must be in [2, 12]")
    if task.name not in DATA_TASKS:
        defaults = TaskConfig()
        for f in fields(TaskConfig):
            if f.name in DATASET_OPTIONS and getattr(task, f.name) != getattr(defaults, f.name):
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
