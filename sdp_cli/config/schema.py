"""The typed schema of an sdp run. Every field has a one-line docstring (shown by
``sdp train --help-config``); Hydra YAML under ``sdp_cli/conf`` fills it in.

Validation lives in ``sdp_cli/config/validation.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from sdp_cli.engines import ENGINES, engine_kind
from sdp_cli.modes import MODES, resolve_mode

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
    """token | sequence (sum over the tokens) | geometric (mean) | max (k2/k3 only); null turns the bounds
    off (a veto still applies)."""
    metric: str = "ratio"
    """ratio (π_x/π_behav) | k2 (½lr²) | k3 (e^lr − 1 − lr): what is bounded, lr = log π_x − log π_behav
    (verl's k2/k3; verl's k1 bounds are ratio bounds mirrored, docs/math.md §3)."""
    upper: float = 2.0
    """keep where the ratio (or the divergence, in nats) <= upper."""
    lower: float | None = None
    """keep where ratio >= lower; null means 1/upper (metric=ratio only)."""
    veto: float | None = None
    """drop a whole sequence if any token's ratio is below this, with or without level (verl's
    token veto); null = no veto."""


@dataclass
class LossConfig:
    """Off-policy correction and the policy loss (docs/design.md §4)."""

    mode: str = "decoupled"
    """which behavioural weight multiplies the PPO loss: a registered mode (sdp_cli/modes.py) or
    path/to/file.py:function, your own (docs/design.md "Adding a mode")."""
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
    """ppo_clip | reinforce (−A·log π_θ·w) | cispo (−sg(clip(r))·A·log π_θ·w, §9.5) | dppo (probability
    trust-region mask, §9.6; docs/math.md)."""
    ratio_level: str = "token"
    """token | sequence: the PPO ratio per token, or per sequence as exp(mean_t log π_θ/π_anchor), one
    clip decision per sequence (GSPO; AReaL/TRL call it importance_sampling_level; docs/math.md §9.3)."""
    m2_threshold: float | None = None
    """M2PO: drop the tokens with the largest squared behavioural log ratio until the batch's mean of
    it is below this (AReaL m2_threshold, 0.04 in the paper; docs/math.md §9.2); null = off."""
    opsm_delta: float | None = None
    """OPSM: zero the loss of a negative-advantage sequence whose mean log π_behav − log π_θ exceeds this,
    at every optimizer step (TRL off_policy_mask_threshold; docs/math.md §9.4); null = off."""
    dppo_kl_coef: float = 0.0
    """loss_type=dppo: weight of (log π_θ − log π_anchor)² on every token (prime-rl kl_tau, 1e-3 there;
    docs/math.md §9.6); 0 = off."""
    proximal_source: str = "forward"
    """forward (π_prox from the trainer's forward) | loglinear (A-3PO: interpolated between π_behav and
    π_θ by staleness, no forward; mode=decoupled only; AReaL prox_logp_method; docs/math.md §9.7)."""
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
    groups_per_request: int | None = None
    """prompt groups the producer sends to the engine in one generate call; null = the whole batch
    at η = 0 or when the engine runs recompute passes (segment-wise), 8 otherwise."""
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
    """torch threads; null = half the cores each for trainer and engine when rollouts overlap
    training (each process pinned to its half when the rollout side runs in its own process),
    all cores when η = 0; a set value pins nothing (the recompute pass in sdp's process, which
    runs while generation is paused, uses all cores unless this is set)."""
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
    async_push: bool = True
    """η > 0: load each step's weights into the engine on a thread of their own while the next step
    trains (engines that stage weights first: the local engine in its own process; docs/training.md)."""
    dtype: str = "float32"
    """float32 | bfloat16: bfloat16 computes under autocast with float32 master weights and optimizer
    state (a LoRA base model is stored in bfloat16); the local engine follows unless engine.dtype is set."""
    gradient_checkpointing: bool = False
    """recompute each layer's activations in backward instead of storing them (less memory, ~30% slower)."""
    share_prefixes: bool = True
    """run each distinct prompt once per training forward and its samples' responses on its KV cache
    (same result, fewer positions; off with gradient checkpointing; docs/training.md)."""
    save_optimizer: bool = True
    """store the optimizer state in checkpoints; false makes them ~3× smaller, and a resume restarts
    the optimizer with a warning."""
    keep_checkpoints: int = 2
    """resumable checkpoints kept on disk (the newest ones; the newest complete one is never deleted)."""
    eval_max_new_tokens: int | None = None
    """response budget of greedy evaluation; null = the rollout budget."""
    parallel: str = "ddp"
    """several processes (torchrun): ddp (every process holds the whole model) | fsdp (parameters,
    gradients and optimizer state sharded over the processes with torch's fully_shard; one process
    trains unsharded either way)."""


@dataclass
class EngineConfig:
    """The inference engine (group `engine`)."""

    kind: str = "local"
    """the inference engine: a registered engine (sdp_cli/engines.py)."""
    in_process: bool = False
    """local engine: run it in sdp's own process instead of its own (no start-up cost; tests, debugging)."""
    max_batch_size: int = 256
    """local engine: most sequences decoded together."""
    urls: list[str] = field(default_factory=list)
    """remote engines: attach to these running servers instead of launching one."""
    launch: bool = True
    """remote engines: start a server when no urls are given."""
    python: str = "python"
    """launched servers: the python executable of the server's virtualenv."""
    host: str = "127.0.0.1"
    """launched servers: address to bind the server to (loopback by default)."""
    port: int = 0
    """launched servers: port for the server; 0 = pick a free one."""
    dtype: str | None = None
    """dtype the engine holds the weights in and samples/scores with: float32 | bfloat16 (local engine;
    launched servers also float16, auto); null = train.dtype for the local engine, float32 for servers."""
    startup_timeout_s: float = 300.0
    """launched servers and the local engine's process: how long to wait for one to become ready."""
    request_timeout_s: float = 300.0
    """remote engines and the local engine's process: timeout of one HTTP request."""
    retries: int = 5
    """remote engines: retries (exponential backoff) on connection errors and 5xx."""
    reconnect_timeout_s: float = 300.0
    """remote engines and the local engine's process: how long one that stopped answering may take
    to come back (a launched one that exited is started again)."""
    max_consecutive_faults: int = 5
    """engine faults in a row (their groups are rejected and retried) before the run stops."""
    api_key_env: str | None = None
    """remote engines: name of the environment variable holding the API key (never logged)."""
    allow_temperature_mismatch: bool = False
    """remote engines: run at temperature != 1 although the server's logprobs are then wrong
    (vLLM: not temperature-scaled; SGLang: prefill ones not; docs/engines.md)."""
    extra_args: list[str] = field(default_factory=list)
    """launched servers: extra command-line arguments for the server."""
    env: dict[str, str] = field(default_factory=dict)
    """launched servers: extra environment variables for the server."""
    max_model_len: int | None = None
    """context length, when shorter than the model's: prompts it cannot hold beside the generation
    budget are dropped (docs/tasks.md), and a launched vLLM server is started with it; null = the model's."""
    enforce_eager: bool = True
    """launched vllm: skip torch.compile in the server (much faster start on CPU)."""
    cpu_kv_cache_gib: float | None = 1.0
    """launched vllm: KV-cache size in GiB of a CPU server (VLLM_CPU_KVCACHE_SPACE)."""
    reload_method: str | None = None
    """attached vllm: reload_weights | reload_weights_cpu (sdp's worker extension, needed for tied
    embeddings on CPU); null = reload_weights. A server sdp launches always uses reload_weights_cpu."""


@dataclass
class LoraConfig:
    """LoRA adapters (peft; install the `lora` extra)."""

    r: int = 0
    """adapter rank; 0 = full fine-tuning, > 0 trains LoRA adapters only."""
    alpha: float | None = None
    """LoRA: scaling numerator (the update is alpha/r · B·A); null = 2·r."""
    dropout: float = 0.0
    """LoRA: adapter dropout; must stay 0: the trainer runs without dropout (docs/training.md, LoRA)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """LoRA: names of the linear layers that get adapters (default: attention and MLP of Qwen2/Llama)."""


@dataclass
class ModelConfig:
    """The policy model (group `model`)."""

    kind: str = "tiny"
    """tiny (built from code + warm start) | hf (a Hugging Face model: a local directory, a hub id or a .gguf file; model.path)."""
    path: str | None = None
    """hf: the model directory (tokenizer included), a hub id (org/name), or a .gguf file
    (dequantised to float32; install the gguf extra)."""
    gguf_cache: bool = True
    """hf: a .gguf file's dequantised model kept in $SDP_CACHE_DIR/gguf (4 bytes a parameter) so later starts skip its conversion; false: convert at every start."""
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
    """The RL task (group `task`); the data keys (sdp_cli/dataset_options.py) apply to task=dataset and
    task=gsm8k (docs/tasks.md)."""

    name: str = "arith1"
    """arith1 | arith2 | runsum | gsm8k | dataset (your own data file)."""
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
    """drop prompts longer than this many tokens (counted); null = the model's context less the generation budget."""
    shuffle: bool = True
    """walk the training data in a new seeded order every epoch; false = file order."""
    digits: int | None = None
    """runsum: digits per problem, the answer-length knob (2-12); null = 6."""
    reward_workers: int = 1
    """reward functions run on this many workers, off the generation path."""
    reward_pool: str = "thread"
    """thread | process: where reward functions run (process: no GIL contention, needs picklable results)."""
    reward_errors: str = "raise"
    """raise | zero: a reward call that fails or times out stops the run, or scores 0 (counted in reward/errors)."""
    reward_timeout_s: float | None = None
    """a reward call running longer has failed (its thread is abandoned, its process killed); null = no limit."""
    reward_max_error_rate: float = 0.1
    """reward_errors=zero: stop once more than this share of the last reward_error_window calls failed."""
    reward_error_window: int = 100
    """reward_errors=zero: the number of latest reward calls the error rate is taken over."""


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
    (a mode whose weight reads π_prox_t needs it, e.g. segment_wise; ``rollout.recompute=always``
    measures it in other modes)."""
    return cfg.rollout.recompute == "always" or (
        cfg.rollout.recompute == "auto" and resolve_mode(cfg.loss.mode).reads_proximal_t
    )


#: prompt groups per generate call at η > 0 when ``rollout.groups_per_request`` is null and the
#: engine runs no recompute pass
ASYNC_GROUPS_PER_REQUEST = 8


def groups_per_request(cfg: "SdpConfig") -> int:
    """``rollout.groups_per_request``, resolved: as set, or when null the whole batch at η = 0 or
    when the engine also runs the recompute passes (``tracks_proximal_t``: segment-wise), else
    ``ASYNC_GROUPS_PER_REQUEST``. One call of B·G sequences takes sdp's engine about three
    quarters of the time of two calls of half as many (docs/benchmarks.md). At η = 0 nothing
    trains before the whole batch is generated. At η > 0 smaller calls hand finished groups to
    the trainer sooner, which pays while the engine has time to spare (decoupled on the tiny
    model: 8 groups 1–9 % faster than 16); with a recompute pass per version on the same engine
    the engine is the bottleneck, and one call per batch made segment-wise η = 4 runs 15–26 %
    faster (docs/training.md "What asynchrony buys on a CPU")."""
    ro = cfg.rollout
    if ro.groups_per_request is not None:
        return ro.groups_per_request
    whole_batch = ro.max_head_offpolicyness == 0 or tracks_proximal_t(cfg)
    return ro.batch_groups if whole_batch else ASYNC_GROUPS_PER_REQUEST


def engine_weight_dtype(cfg: "SdpConfig") -> str:
    """The dtype the engine's weights are held in (``engine.dtype``, resolved): as set, or when null
    ``train.dtype`` for the local engine and float32 for a server (docs/engines.md "Engine dtype")."""
    return engine_kind(cfg.engine.kind).weight_dtype(cfg)


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
                docs[node.target.id] = " ".join(str(nxt.value.value).split())  # one paragraph, as the table wraps it
    rows: list[tuple[str, str, str]] = []
    instance = cls()
    for f in fields(cls):
        value = getattr(instance, f.name)
        key = f"{prefix}{f.name}"
        if is_dataclass(value):
            rows.extend(field_docs(type(value), prefix=f"{key}."))
        else:
            rows.append((key, yaml_literal(value), docs.get(f.name, "") + _registered(key)))
    return rows


def _registered(key: str) -> str:
    """For a key whose values a registry holds, each registered name with its meaning, read from
    the registry (so a mode or engine registered by code is listed too); "" for other keys."""
    registry = {"loss.mode": MODES, "engine.kind": ENGINES}.get(key)
    if not registry:
        return ""
    # a docstring's first paragraph, on one line (a mode registered by code documents itself so)
    meanings = {name: " ".join(entry.doc.split("\n\n")[0].split()).rstrip(".") for name, entry in registry.items()}
    return " Registered: " + "; ".join(f"{name} — {doc}" if doc else name for name, doc in meanings.items()) + "."


def yaml_literal(value: Any) -> str:
    """``value`` as YAML writes it on one line (null, false, [a, b], 0.0001): what a user types
    in an override or a config file."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf, allow_unicode=True)
    return text.removesuffix("\n").removesuffix("\n...").strip()
