"""The typed schema of an sdp run. Every field has a one-line docstring (shown by
``sdp train --help-config``); Hydra YAML under ``sdp_cli/conf`` fills it in.

Validation lives in :func:`validate`, which reports the first bad value as one line naming the
key, the value and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
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
    MODES,
    PROXIMAL_T_SOURCES,
    RECOMPUTE_POLICIES,
    REWARD_POOLS,
    STALENESS_STRATEGIES,
    TASKS,
    TRACKERS,
    TRAIN_DTYPES,
    WEIGHT_ACTIONS,
)

#: the linear layers of Qwen2 / Llama-style decoder blocks (attention and MLP)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: rollout.temperature bounds (also checked in batch headers): vLLM raises a temperature below
#: 0.01 to 0.01 (a warning in the server's log), so the logprobs would not be those of the
#: configured one; above 100 sampling is uniform for any practical logit range: a typo
MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 100.0


@dataclass
class RejectionConfig:
    """Rejection sampling on the behavioural log ratio (masks tokens; independent of the weights)."""

    level: str | None = None
    """token | sequence | geometric; null turns the ratio bounds off (a veto still applies)."""
    upper: float = 2.0
    """keep where ratio <= upper."""
    lower: float | None = None
    """keep where ratio >= lower; null means 1/upper."""
    veto: float | None = None
    """drop a whole sequence if any token's ratio is below this, with or without level (verl's
    token veto); null = no veto."""


@dataclass
class LossConfig:
    """Off-policy correction and the policy loss (docs/design.md §4)."""

    mode: str = "decoupled"
    """bypass | decoupled | segment_wise: which behavioural weight multiplies the PPO loss."""
    is_level: str = "token"
    """token | sequence | geometric aggregation of the behavioural weight (group `is_agg`)."""
    weight_cap: float | None = 5.0
    """upper bound of the behavioural weight; null = none."""
    weight_floor: float | None = None
    """lower bound of the behavioural weight; null = none."""
    weight_action: str = "truncate"
    """truncate (clamp into [floor, cap]) | mask (weight 0 outside, token still in the denominator)."""
    batch_normalize: bool = False
    """divide the bounded weights by their batch mean."""
    rejection: RejectionConfig = field(default_factory=RejectionConfig)
    """rejection sampling; off by default."""
    clip: float = 0.2
    """PPO clip range ε."""
    clip_high: float | None = None
    """upper clip range (clip-higher); null = same as clip."""
    dual_clip: float | None = None
    """dual-clip constant c > 1 for negative advantages; null = off."""
    agg: str = "token-mean"
    """token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm."""
    norm_length: int | None = None
    """seq-mean-token-sum-norm: the constant length L of Σ_i s_i / (L · sequences per optimizer
    step) (docs/math.md §5.2); null = rollout.max_new_tokens (the task's budget by default)."""
    loss_type: str = "ppo_clip"
    """ppo_clip | reinforce (−A·log π_θ·w)."""
    scale_adv_by_std: bool = True
    """GRPO advantages divide by the group std; false gives Dr.GRPO."""
    drift_clip: float | None = None
    """segment_wise only: κ >= 1 multiplies the weight by the drift factor π_prox/π_{v+1} clipped
    into [1/κ, κ] (1 = segment-wise, inf = decoupled); null = off."""
    kl_coef: float = 0.0
    """weight of the KL to a frozen reference policy (the initial model); 0 = off, no reference built."""
    kl_type: str = "low_var_kl"
    """k1 | k2 | k3 | low_var_kl: the per-token KL estimator (verl's kl_penalty; k3 = low_var_kl)."""
    entropy_coef: float = 0.0
    """weight of the entropy bonus (entropy of π_θ at the rollout temperature); 0 = off."""


@dataclass
class RolloutConfig:
    """Rollout production, admission and the recompute pass (docs/design.md §2–3)."""

    max_head_offpolicyness: int = 2
    """η: how many versions a rollout may lag; 0 = synchronous on-policy training."""
    batch_groups: int = 16
    """B: prompt groups per training batch."""
    group_size: int = 8
    """samples per prompt (GRPO group)."""
    max_concurrent_rollouts: int | None = None
    """groups in flight at once; null = 2·batch_groups."""
    groups_per_request: int = 8
    """prompt groups the producer sends to the engine in one generate call."""
    temperature: float = 1.0
    """sampling temperature in [0.01, 100]; the trainer and the recompute pass use the same one."""
    max_new_tokens: int | None = None
    """response budget; null = the task's default."""
    recompute: str = "auto"
    """auto (segment_wise only) | always (also in other modes, for measurement) | never."""
    proximal_t_source: str = "engine"
    """where π_prox_t of tokens one version stale comes from: engine (scored by the inference
    engine, like π_behav, so their numeric mismatch cancels) | trainer (the trainer's π_prox:
    no engine scoring at batch time, but trainer/engine mismatch enters the weight of those tokens)."""


@dataclass
class StalenessConfig:
    """Consume-time staleness control (group `staleness`). The bound η is not here: it is
    ``rollout.max_head_offpolicyness``, which admission control uses whatever the strategy."""

    strategy: str = "standard"
    """standard (no filtering) | segment_wise (drop samples that break the invariant of docs/design.md §2, or lag > η = rollout.max_head_offpolicyness)."""


@dataclass
class OptimConfig:
    """AdamW and PPO update schedule."""

    lr: float = 1e-4
    """learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW β1."""
    beta2: float = 0.999
    """AdamW β2."""
    grad_clip: float | None = 1.0
    """max gradient norm; null = no clipping."""
    ppo_epochs: int = 1
    """passes over each batch."""
    minibatches: int = 1
    """optimizer steps per epoch (the batch is split into this many minibatches)."""


@dataclass
class TrainConfig:
    """Run length, seeding, threads and what gets written."""

    steps: int = 300
    """training steps (= weight versions produced)."""
    threads: int | None = None
    """torch threads; null = one per worker when rollouts overlap training, all cores when η = 0
    (the recompute pass, which runs while generation is paused, uses all cores unless this is set)."""
    checkpoint_every: int = 50
    """write a resumable checkpoint every N steps (0 = only at the end)."""
    keep_version_checkpoints: bool = False
    """also keep the weights of every version (for sdp recompute's exact decomposition)."""
    save_batches: bool = False
    """write every training batch in the sdp batch format (for sdp inspect-weights)."""
    eval_every: int = 0
    """greedy evaluation every N steps (0 = only at start and end)."""
    eval_samples: int = 200
    """prompts in each greedy evaluation."""
    batch_timeout_s: float = 600.0
    """give up (with a resumable checkpoint) if no batch arrives for this long."""
    dtype: str = "float32"
    """float32 | bfloat16: bfloat16 computes under autocast with float32 master weights and optimizer
    state (a LoRA base model is stored in bfloat16); the local engine then runs bfloat16 weights."""
    gradient_checkpointing: bool = False
    """recompute each layer's activations in backward instead of storing them (less memory, ~30% slower)."""
    save_optimizer: bool = True
    """store the optimizer state in checkpoints; false makes them ~3× smaller, and a resume restarts
    the optimizer with a warning."""
    keep_checkpoints: int = 2
    """resumable checkpoints kept on disk (the newest ones; the newest complete one is never deleted)."""
    eval_max_new_tokens: int | None = None
    """response budget of greedy evaluation; null = the rollout budget."""


@dataclass
class EngineConfig:
    """The inference engine (group `engine`)."""

    kind: str = "local"
    """local (embedded) | vllm | sglang."""
    max_batch_size: int = 256
    """local engine: most sequences decoded together."""
    urls: list[str] = field(default_factory=list)
    """remote engines: attach to these running servers instead of launching one."""
    launch: bool = True
    """remote engines: start a server when no urls are given."""
    python: str = "python"
    """remote engines: the python executable of the server's virtualenv."""
    host: str = "127.0.0.1"
    """remote engines: address to bind a launched server to (loopback by default)."""
    port: int = 0
    """remote engines: port for a launched server; 0 = pick a free one."""
    dtype: str = "float32"
    """remote engines: weight dtype of a launched server."""
    startup_timeout_s: float = 300.0
    """remote engines: how long to wait for a launched server to become ready."""
    request_timeout_s: float = 300.0
    """remote engines: timeout of one HTTP request."""
    retries: int = 5
    """remote engines: retries (exponential backoff) on connection errors and 5xx."""
    reconnect_timeout_s: float = 300.0
    """remote engines: how long a server that stopped answering may take to come back."""
    max_consecutive_faults: int = 5
    """engine faults in a row (their groups are rejected and retried) before the run stops."""
    api_key_env: str | None = None
    """remote engines: name of the environment variable holding the API key (never logged)."""
    allow_temperature_mismatch: bool = False
    """remote engines: run at temperature != 1 although the server's logprobs are then wrong
    (vLLM: not temperature-scaled; SGLang: prefill ones not; docs/engines.md)."""
    extra_args: list[str] = field(default_factory=list)
    """remote engines: extra command-line arguments for a launched server."""
    env: dict[str, str] = field(default_factory=dict)
    """remote engines: extra environment variables for a launched server."""
    max_model_len: int | None = None
    """vllm: context length of a launched server; null = the model's."""
    enforce_eager: bool = True
    """vllm: skip torch.compile in a launched server (much faster start on CPU)."""
    cpu_kv_cache_gib: float | None = 1.0
    """vllm: KV-cache size in GiB of a launched CPU server (VLLM_CPU_KVCACHE_SPACE)."""
    reload_method: str | None = None
    """vllm: reload_weights | reload_weights_cpu (sdp's worker extension, needed for tied
    embeddings on CPU); null = reload_weights_cpu for a launched server, reload_weights otherwise."""


@dataclass
class LoraConfig:
    """LoRA adapters (peft; install the `lora` extra)."""

    r: int = 0
    """adapter rank; 0 = full fine-tuning, > 0 trains LoRA adapters only."""
    alpha: float | None = None
    """scaling numerator (the update is alpha/r · B·A); null = 2·r."""
    dropout: float = 0.0
    """adapter dropout; must stay 0: the trainer runs without dropout (docs/training.md, LoRA)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """names of the linear layers that get adapters (default: attention and MLP of Qwen2/Llama)."""


@dataclass
class ModelConfig:
    """The policy model (group `model`)."""

    kind: str = "tiny"
    """tiny (built from code + warm start) | hf (a local Hugging Face model directory)."""
    path: str | None = None
    """hf: the model directory (tokenizer included), a hub id (org/name), or a .gguf file
    (dequantised to float32; install the gguf extra)."""
    hidden_size: int = 128
    """tiny: hidden size."""
    num_layers: int = 4
    """tiny: transformer layers."""
    num_heads: int = 4
    """tiny: attention heads."""
    num_kv_heads: int | None = None
    """tiny: key/value heads (grouped-query attention); null = num_heads."""
    intermediate_size: int = 512
    """tiny: MLP width."""
    charset: str | None = None
    """tiny: character set of the built-in tokenizer (arith | ascii); null = the task's."""
    warm_start_steps: int | None = None
    """tiny: supervised warm-start steps (0 = none); null = the task's default."""
    warm_start_lr: float | None = None
    """tiny: warm-start learning rate; null = the task's default."""
    warm_start_batch: int | None = None
    """tiny: warm-start batch size; null = the task's default."""
    warm_start_target: float | None = None
    """tiny: stop the warm start early at this greedy accuracy; null = the task's default."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters; off unless lora.r > 0."""


@dataclass
class TaskConfig:
    """The RL task (group `task`); the data keys apply to task=dataset and task=gsm8k (docs/tasks.md)."""

    name: str = "arith1"
    """arith1 | arith2 | gsm8k | dataset (your own data file)."""
    path: str | None = None
    """dataset, gsm8k: the training data, a .jsonl, .json or .parquet file."""
    prompt_key: str | None = None
    """record field with the prompt, a string or a list of chat messages; null = prompt (gsm8k: question)."""
    answer_key: str | None = None
    """record field with the reference answer (built-in rewards, tiny-model warm start); null = answer."""
    prompt_template: str | None = None
    """format the prompt from record fields, e.g. 'Q: {question} A:'; null = the prompt field as is."""
    chat_template: bool = False
    """render the prompt with the tokenizer's chat template (user message, generation prompt)."""
    system_prompt: str | None = None
    """chat_template only: a system message put first."""
    reward: str | None = None
    """final_number | boxed | regex | package.module:function | path/to/file.py:function; null = the task's."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """keyword arguments for the reward function, e.g. {pattern: '^\\d+$'} for regex."""
    require_stop: bool = True
    """a completion that ran out of tokens scores 0 without calling the reward function."""
    eval_path: str | None = None
    """held-out data for greedy evaluation (same format as path)."""
    eval_fraction: float | None = None
    """hold out this share of path's records for evaluation (the same records in every run)."""
    max_prompt_tokens: int | None = None
    """drop prompts longer than this many tokens (the count of dropped prompts is reported)."""
    shuffle: bool = True
    """walk the training data in a new seeded order every epoch; false = file order."""
    reward_workers: int = 1
    """reward functions run on this many workers, off the generation path."""
    reward_pool: str = "thread"
    """thread | process: where reward functions run (process: no GIL contention, needs picklable results)."""


@dataclass
class RunConfig:
    """Where the run writes and how it reports."""

    root: str = "runs"
    """parent directory of run directories."""
    name: str | None = None
    """run directory name; null = <timestamp>-<mode>-<task>."""
    dir: str | None = None
    """explicit run directory (overrides root/name)."""
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    """experiment trackers getting every step's scalars and the config: tensorboard | wandb | mlflow
    (wandb, mlflow: install the extra of that name; their servers and keys come from their own
    environment variables)."""
    project: str = "sdp"
    """W&B project and MLflow experiment the run logs to."""
    tensorboard: bool = True
    """false leaves tensorboard out of run.trackers (the older switch; run.trackers=[] does the same)."""
    progress: bool = True
    """live progress display in the terminal."""
    debug: bool = False
    """print the full traceback of a failure in your code (e.g. a reward function) besides the one line."""


def tracks_proximal_t(cfg: "SdpConfig") -> bool:
    """Whether the run keeps π_prox_t = π_{v+1} for stale tokens: the recompute pass runs
    (segment_wise needs it; ``rollout.recompute=always`` measures it in other modes)."""
    return cfg.rollout.recompute == "always" or (
        cfg.rollout.recompute == "auto" and cfg.loss.mode == "segment_wise"
    )


@dataclass
class SdpConfig:
    """A whole training run."""

    seed: int = 0
    """seed of every random number generator."""
    resume: str | None = None
    """continue the run in this run directory from its latest checkpoint."""
    loss: LossConfig = field(default_factory=LossConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    run: RunConfig = field(default_factory=RunConfig)


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


def validate(cfg: SdpConfig) -> None:
    """Check every value a user can set; raise ConfigValueError naming the first bad key."""
    loss = cfg.loss
    _choice("loss.mode", loss.mode, MODES)
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
    if ro.recompute == "never" and loss.mode == "segment_wise":
        raise ConfigValueError(
            "loss.mode=segment_wise needs the recompute pass; set rollout.recompute=auto or always"
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
    _positive("train.batch_timeout_s", tr.batch_timeout_s)
    _choice("train.dtype", tr.dtype, TRAIN_DTYPES)
    _positive("train.keep_checkpoints", tr.keep_checkpoints)
    _positive("train.eval_max_new_tokens", tr.eval_max_new_tokens, allow_none=True)

    eng = cfg.engine
    _choice("engine.kind", eng.kind, ENGINE_KINDS)
    _positive("engine.max_batch_size", eng.max_batch_size)
    if not 0 <= eng.port <= 65535:
        raise ConfigValueError(f"engine.port={eng.port} must be in 0..65535")
    _positive("engine.startup_timeout_s", eng.startup_timeout_s)
    _positive("engine.request_timeout_s", eng.request_timeout_s)
    _positive("engine.retries", eng.retries, strict=False)
    _positive("engine.reconnect_timeout_s", eng.reconnect_timeout_s)
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


def _validate_task(task: TaskConfig) -> None:
    _choice("task.name", task.name, TASKS)
    if task.name not in DATA_TASKS:
        defaults = TaskConfig()
        for f in fields(TaskConfig):
            if f.name not in ("name", "reward_workers", "reward_pool") and getattr(task, f.name) != getattr(defaults, f.name):
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


def field_docs(cls: type = SdpConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default as YAML, docstring) for every leaf field, read from the source docstrings."""
    import ast
    import inspect

    docs: dict[str, str] = {}
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                docs[node.target.id] = str(nxt.value.value)
    rows: list[tuple[str, str, str]] = []
    instance = cls()
    for f in fields(cls):
        value = getattr(instance, f.name)
        key = f"{prefix}{f.name}"
        if is_dataclass(value):
            rows.extend(field_docs(type(value), prefix=f"{key}."))
        else:
            rows.append((key, yaml_literal(value), docs.get(f.name, "")))
    return rows


def yaml_literal(value: Any) -> str:
    """``value`` as YAML writes it on one line (null, false, [a, b], 0.0001): what a user types
    in an override or a config file."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf, allow_unicode=True)
    return text.removesuffix("\n").removesuffix("\n...").strip()
