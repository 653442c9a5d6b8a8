"""The inference engine of a run, built from its config (``engine.kind``; docs/engines.md).

``build_engine`` looks the kind up in the engine registry (``sdp_cli/engines.py``) and calls its
build function; those of the built-in engines are here. ``local`` runs a copy of the policy in
its own process (``sdp_cli/engine/process.py``), or with ``engine.in_process`` in sdp's;
``vllm`` and ``sglang`` attach to the servers of ``engine.urls`` or, with ``engine.launch``,
start one on the policy. Each engine module is imported only when its kind is asked for, and
none of them imports this one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sdp_cli.engine.base import InferenceEngine
from sdp_cli.engines import engine_kind
from sdp_cli.errors import UserError
from sdp_cli.rundir import RunDir


def build_engine(
    cfg: Any, policy: Any, run_dir: RunDir | Path, *, device: Any = "cpu", threads: int | None = None
) -> InferenceEngine:
    """The engine of ``cfg.engine`` (``EngineConfig`` in sdp_cli/config/schema.py) at version 0;
    a resumed run declares its version with ``set_version``. ``device`` is where a local engine
    runs the model, ``threads`` its torch threads in its own process (None: torch's default)."""
    build = engine_kind(cfg.engine.kind).builder()
    run_dir = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    return build(cfg, policy, run_dir, device=device, threads=threads)


def build_local(cfg: Any, policy: Any, run_dir: RunDir, *, device: Any, threads: int | None) -> InferenceEngine:
    """``engine=local``: its own copy of the policy (never the trainer's storage), merged under
    LoRA, held in engine.dtype (docs/engines.md "Engine dtype"), in its own process unless
    ``engine.in_process`` (``prepare_local`` then ``start_local``, which ``sdp train`` runs in the
    rollout process: docs/training.md "Three processes")."""
    if not cfg.engine.in_process:
        return start_local(cfg, prepare_local(cfg, policy, run_dir, device=device, threads=threads), run_dir)
    from sdp_cli.engine.local import LocalEngine
    from sdp_cli.models.lora import merged_copy
    from sdp_cli.models.precision import DTYPES

    return LocalEngine(
        merged_copy(policy.model),
        dtype=DTYPES[engine_kind(cfg.engine.kind).weight_dtype(cfg)],
        device=device,
        temperature=cfg.rollout.temperature,
        eos_token_id=policy.eos_token_id,
        pad_token_id=policy.pad_token_id,
        max_batch_size=cfg.engine.max_batch_size,
        seed=cfg.seed,
    )


def prepare_local(
    cfg: Any, policy: Any, run_dir: RunDir, *, device: Any, threads: int | None, scratch: Path | None = None
) -> dict[str, Any]:
    """The first half of ``engine=local`` in its own process, where the policy is: its weights
    written where the process starts from (``ProcessEngine.prepare``; into ``scratch``, the
    rollout process's directory, when given), and what ``start_local`` needs of the policy, as
    plain data."""
    from sdp_cli.engine.process import ProcessEngine
    from sdp_cli.models.precision import DTYPES

    push_dtype = DTYPES[engine_kind(cfg.engine.kind).weight_dtype(cfg)]
    scratch, attn = ProcessEngine.prepare(policy, scratch, push_dtype=push_dtype)
    return {
        "scratch": str(scratch),
        "attn_implementation": attn,
        "eos_token_ids": _ids(policy.eos_token_id),
        "pad_token_id": int(policy.pad_token_id),
        "device": str(device),
        "threads": threads,
    }


def warm_local(scratch: Path, *, threads: int | None, model_type: str | None) -> Any:
    """The engine's process started ahead of ``start_local`` on the rollout process's scratch
    directory, importing (``WarmProcess``)."""
    from sdp_cli.engine.process import WarmProcess

    return WarmProcess(scratch, threads=threads, model_type=model_type)


def start_local(cfg: Any, recipe: dict[str, Any], run_dir: RunDir, *, warm: Any = None) -> InferenceEngine:
    """The second half: start the engine's process on what ``prepare_local`` wrote and attach
    (in the process that uses the engine; in ``warm``, from ``warm_local``, if it can)."""
    from sdp_cli.engine.process import ProcessEngine, ProcessLaunchConfig, local_http_options
    from sdp_cli.engine.remote import RemoteOptions

    engine_cfg = cfg.engine
    launch = ProcessLaunchConfig(
        model="",  # the scratch directory's launch/ (ProcessEngine.launch_prepared)
        dtype=engine_kind(engine_cfg.kind).weight_dtype(cfg),
        seed=cfg.seed,
        startup_timeout_s=float(engine_cfg.startup_timeout_s),
        temperature=float(cfg.rollout.temperature),
        eos_token_ids=tuple(recipe["eos_token_ids"]),
        pad_token_id=int(recipe["pad_token_id"]),
        max_batch_size=int(engine_cfg.max_batch_size),
        threads=recipe["threads"],
        device=recipe["device"],
        attn_implementation=recipe["attn_implementation"],
    )
    options = RemoteOptions(
        temperature=float(cfg.rollout.temperature),
        reconnect_timeout_s=float(engine_cfg.reconnect_timeout_s),
        http=local_http_options(float(engine_cfg.request_timeout_s)),
    )
    return ProcessEngine.launch_prepared(launch, Path(recipe["scratch"]), run_dir.logs, options, warm=warm)


def _ids(value: int | Any) -> list[int]:
    return [int(value)] if isinstance(value, int) else [int(t) for t in value]


def _api_key(engine_cfg: Any) -> str | None:
    """The API key from the variable ``engine.api_key_env`` names (never from the config)."""
    if not engine_cfg.api_key_env:
        return None
    api_key = os.environ.get(engine_cfg.api_key_env)
    if not api_key:
        raise UserError(
            f"engine.api_key_env={engine_cfg.api_key_env}, but that environment variable is empty; "
            "export the key in it or unset engine.api_key_env"
        )
    return api_key


def _server_options(cfg: Any) -> Any:
    """The ``RemoteOptions`` of a server engine from ``engine.*``."""
    from sdp_cli.engine.http import HttpOptions
    from sdp_cli.engine.remote import RemoteOptions

    engine_cfg = cfg.engine
    return RemoteOptions(
        temperature=float(cfg.rollout.temperature),
        allow_temperature_mismatch=bool(engine_cfg.allow_temperature_mismatch),
        reconnect_timeout_s=float(engine_cfg.reconnect_timeout_s),
        http=HttpOptions(
            request_timeout_s=float(engine_cfg.request_timeout_s),
            max_retries=int(engine_cfg.retries),
            api_key=_api_key(engine_cfg),
        ),
    )


def _server_launch(cfg: Any, policy: Any, run_dir: RunDir) -> dict[str, Any] | None:
    """The ``ServerLaunch`` fields of a server to start (the policy saved to
    ``<run>/weights/launch`` for it), or None with ``engine.urls`` (attach to those)."""
    from sdp_cli.config.schema import engine_weight_dtype

    engine_cfg = cfg.engine
    if engine_cfg.urls:
        return None
    if not engine_cfg.launch:
        raise UserError(
            f"engine={engine_cfg.kind} has no engine.urls and engine.launch=false; "
            "give the server URLs or set engine.launch=true"
        )
    from sdp_cli.models.loader import save_policy

    model_dir = save_policy(policy, run_dir.launch_weights)
    return dict(
        model=str(model_dir),
        python=engine_cfg.python,
        host=engine_cfg.host,
        port=int(engine_cfg.port),
        dtype=engine_weight_dtype(cfg),
        extra_args=tuple(engine_cfg.extra_args),
        env=dict(engine_cfg.env),
        startup_timeout_s=float(engine_cfg.startup_timeout_s),
    )


def build_vllm(cfg: Any, policy: Any, run_dir: RunDir, **_: Any) -> InferenceEngine:
    """``engine=vllm``: attach to ``engine.urls`` or launch a server on the policy."""
    from sdp_cli.engine.vllm import VLLMEngine, VLLMLaunchConfig

    engine_cfg, options = cfg.engine, _server_options(cfg)
    common = _server_launch(cfg, policy, run_dir)
    if common is None:
        return VLLMEngine(
            list(engine_cfg.urls), options, reload_method=engine_cfg.reload_method or "reload_weights"
        )
    launch = VLLMLaunchConfig(
        **common,
        max_model_len=engine_cfg.max_model_len,
        enforce_eager=bool(engine_cfg.enforce_eager),
        cpu_kv_cache_gib=engine_cfg.cpu_kv_cache_gib,
    )
    return VLLMEngine.launch(launch, run_dir.logs, options)


def build_sglang(cfg: Any, policy: Any, run_dir: RunDir, **_: Any) -> InferenceEngine:
    """``engine=sglang``: attach to ``engine.urls`` or launch a server on the policy."""
    from sdp_cli.engine.sglang import SGLangEngine, SGLangLaunchConfig

    options = _server_options(cfg)
    common = _server_launch(cfg, policy, run_dir)
    if common is None:
        return SGLangEngine(list(cfg.engine.urls), options)
    return SGLangEngine.launch(SGLangLaunchConfig(**common), run_dir.logs, options)
