"""The inference engine of a run, built from its config (``engine.kind``; docs/engines.md).

``local`` runs a copy of the policy in-process; ``vllm`` and ``sglang`` attach to the servers of
``engine.urls`` or, with ``engine.launch``, start one on the policy. Each engine module is
imported only when its kind is asked for, and none of them imports this one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sdp_cli.choices import ENGINE_KINDS, REMOTE_ENGINE_KINDS
from sdp_cli.engine.base import InferenceEngine
from sdp_cli.errors import UserError
from sdp_cli.rundir import RunDir


def build_engine(
    cfg: Any, policy: Any, run_dir: RunDir | Path, *, device: Any = "cpu"
) -> InferenceEngine:
    """The engine of ``cfg.engine`` (``EngineConfig`` in sdp_cli/config/schema.py) at version 0;
    a resumed run declares its version with ``set_version``. ``device`` is the local engine's."""
    kind = cfg.engine.kind
    if kind == "local":
        return _local_engine(cfg, policy, device)
    if kind in REMOTE_ENGINE_KINDS:
        return _remote_engine(cfg, policy, run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir))
    raise UserError(f"engine.kind={kind!r} is not an engine; choose one of {', '.join(ENGINE_KINDS)}")


def _local_engine(cfg: Any, policy: Any, device: Any) -> InferenceEngine:
    from sdp_cli.config.schema import engine_weight_dtype
    from sdp_cli.engine.local import LocalEngine
    from sdp_cli.models.loader import DTYPES
    from sdp_cli.models.lora import merged_copy

    # its own copy (never the trainer's storage), merged under LoRA, held in engine.dtype
    # (docs/engines.md "Engine dtype")
    return LocalEngine(
        merged_copy(policy.model),
        dtype=DTYPES[engine_weight_dtype(cfg)],
        temperature=cfg.rollout.temperature,
        eos_token_id=policy.eos_token_id,
        pad_token_id=policy.pad_token_id,
        max_batch_size=cfg.engine.max_batch_size,
        seed=cfg.seed,
        device=device,
    )


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


def _remote_engine(cfg: Any, policy: Any, run_dir: RunDir) -> InferenceEngine:
    """With ``engine.urls`` attach to those servers; otherwise, with ``engine.launch``, save the
    policy to ``<run>/weights/launch`` and start one server on it, logging to ``<run>/logs``."""
    from sdp_cli.config.schema import engine_weight_dtype
    from sdp_cli.engine.http import HttpOptions
    from sdp_cli.engine.remote import RemoteOptions

    engine_cfg = cfg.engine
    options = RemoteOptions(
        temperature=float(cfg.rollout.temperature),
        allow_temperature_mismatch=bool(engine_cfg.allow_temperature_mismatch),
        reconnect_timeout_s=float(engine_cfg.reconnect_timeout_s),
        http=HttpOptions(
            request_timeout_s=float(engine_cfg.request_timeout_s),
            max_retries=int(engine_cfg.retries),
            api_key=_api_key(engine_cfg),
        ),
    )
    kind = engine_cfg.kind
    if engine_cfg.urls:
        if kind == "vllm":
            from sdp_cli.engine.vllm import VLLMEngine

            return VLLMEngine(
                list(engine_cfg.urls), options, reload_method=engine_cfg.reload_method or "reload_weights"
            )
        from sdp_cli.engine.sglang import SGLangEngine

        return SGLangEngine(list(engine_cfg.urls), options)
    if not engine_cfg.launch:
        raise UserError(
            f"engine={kind} has no engine.urls and engine.launch=false; give the server URLs or set engine.launch=true"
        )
    from sdp_cli.models.loader import save_policy

    model_dir = save_policy(policy, run_dir.launch_weights)
    common = dict(
        model=str(model_dir),
        python=engine_cfg.python,
        host=engine_cfg.host,
        port=int(engine_cfg.port),
        dtype=engine_weight_dtype(cfg),
        extra_args=tuple(engine_cfg.extra_args),
        env=dict(engine_cfg.env),
        startup_timeout_s=float(engine_cfg.startup_timeout_s),
    )
    if kind == "vllm":
        from sdp_cli.engine.vllm import VLLMEngine, VLLMLaunchConfig

        launch = VLLMLaunchConfig(
            **common,
            max_model_len=engine_cfg.max_model_len,
            enforce_eager=bool(engine_cfg.enforce_eager),
            cpu_kv_cache_gib=engine_cfg.cpu_kv_cache_gib,
        )
        return VLLMEngine.launch(launch, run_dir.logs, options)
    from sdp_cli.engine.sglang import SGLangEngine, SGLangLaunchConfig

    return SGLangEngine.launch(SGLangLaunchConfig(**common), run_dir.logs, options)
