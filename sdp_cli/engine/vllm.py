"""``engine=vllm``: client for vLLM's OpenAI-compatible server in development mode.

Routes used (vLLM 0.32, docs/engines.md "vLLM"): token-in/token-out generation
``POST /inference/v1/generate`` (needs ``--enable-scale-out``; it reports per-token
``weight_versions`` spans and ``prompt_logprobs``), and the development routes
(``VLLM_SERVER_DEV_MODE=1``) ``/abort_requests``, ``/pause``, ``/resume``, ``/is_paused``,
``/collective_rpc``,
``/reset_prefix_cache``, ``/update_weight_version`` and ``/weight_info`` (the label a
restarted server reports, docs/reliability.md).

Alignment of ``prompt_logprobs``: entry 0 is null and entry i is {token id: log p(x_i | x_<i)}.
Weights are reloaded from a safetensors directory by the worker method ``reload_weights``, or
by sdp's extension ``reload_weights_cpu`` (``vllm_ext.py``), which also fixes tied-embedding
models on the CPU backend. The prefix cache is reset after every reload, which does not
invalidate it (docs/engines.md "vLLM").

Every request sends neutral values for the sampling parameters vLLM can take from the model's
generation_config.json (``--generation-config auto``; 0.32 applies them on its OpenAI routes,
not on the token route): tokens are then drawn from softmax(z / T) itself.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdp_cli.engine.base import EngineError
from sdp_cli.engine.remote import RemoteEngine, RemoteOptions
from sdp_cli.engine.remote_server import RemoteServer
from sdp_cli.engine.servers import LaunchSpec, ManagedServer, ServerLaunch, free_port
from sdp_cli.engine.wire import (
    Segment,
    SegmentRequest,
    as_logprob,
    as_token_ids,
    expand_spans,
    malformed,
    new_request_id,
)

GENERATE = "/inference/v1/generate"
#: the worker extension as the server imports it (copied next to the server log at launch)
EXTENSION_MODULE = "sdp_vllm_ext"
EXTENSION_CLASS = f"{EXTENSION_MODULE}.SdpWorkerExtension"
RELOAD_METHODS = ("reload_weights", "reload_weights_cpu")
#: sampling parameters at the values that leave softmax(z / T) unchanged (top_k 0: all tokens)
NEUTRAL_SAMPLING = {
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
}


@dataclass(frozen=True)
class VLLMLaunchConfig(ServerLaunch):
    """How sdp starts a vLLM server of its own (``ServerLaunch`` and vLLM's own settings)."""

    max_model_len: int | None = None
    #: skip torch.compile / CUDA graphs: faster start, slower decoding
    enforce_eager: bool = False
    #: KV cache size in GiB on the CPU backend (VLLM_CPU_KVCACHE_SPACE)
    cpu_kv_cache_gib: float | None = None


def launch_spec(
    config: VLLMLaunchConfig, log_dir: Path, *, api_key: str | None = None
) -> LaunchSpec:
    """The command and environment of a vLLM server with sdp's worker extension."""
    log_dir = Path(log_dir)
    ext_dir = log_dir / "vllm_ext"
    ext_dir.mkdir(parents=True, exist_ok=True)
    # Only this one file goes on the server's path: sdp's package (and its dependencies) must
    # not shadow the server virtualenv's own packages.
    shutil.copyfile(Path(__file__).with_name("vllm_ext.py"), ext_dir / f"{EXTENSION_MODULE}.py")
    port = config.port or free_port(config.host)
    command = config.command("vllm.entrypoints.openai.api_server", port)
    command += ["--enable-scale-out", "--worker-extension-cls", EXTENSION_CLASS]
    if config.max_model_len is not None:
        command += ["--max-model-len", str(config.max_model_len)]
    if config.enforce_eager:
        command.append("--enforce-eager")
    env = {"VLLM_SERVER_DEV_MODE": "1", **config.env}
    python_path = [str(ext_dir), *filter(None, [config.env.get("PYTHONPATH")])]
    env["PYTHONPATH"] = ":".join(python_path)
    if config.cpu_kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{config.cpu_kv_cache_gib:g}"
    if api_key:
        env["VLLM_API_KEY"] = api_key  # the environment, not argv: argv is visible to every user
    return config.spec(
        "vLLM server",
        command,
        port=port,
        env=env,
        health_path="/health",
        log_path=log_dir / "vllm_server.log",
        secrets=(api_key,) if api_key else (),
    )


class VLLMEngine(RemoteEngine):
    """``InferenceEngine`` over one or more vLLM servers (attach to ``base_urls``).

    ``reload_method`` is ``reload_weights_cpu`` for servers started with sdp's worker
    extension (``VLLMEngine.launch`` does that) and ``reload_weights`` otherwise.
    """

    engine_name = "vllm"

    def __init__(
        self,
        base_urls: Sequence[str],
        options: RemoteOptions | None = None,
        *,
        version: int = 0,
        reload_method: str = "reload_weights",
        managed: Sequence[ManagedServer] = (),
    ):
        if reload_method not in RELOAD_METHODS:
            raise EngineError(
                f"engine.reload_method={reload_method!r}; use one of {', '.join(RELOAD_METHODS)}"
            )
        self.reload_method = reload_method
        super().__init__(base_urls, options, version=version, managed=managed)

    @classmethod
    def launch(
        cls,
        config: VLLMLaunchConfig,
        log_dir: Path,
        options: RemoteOptions | None = None,
        *,
        version: int = 0,
    ) -> VLLMEngine:
        """Start a vLLM server with sdp's worker extension and attach to it; ``close()`` stops it."""
        options = options or RemoteOptions()
        spec = launch_spec(config, log_dir, api_key=options.http.api_key)
        return cls._attach_launched(
            spec, options, version=version, reload_method="reload_weights_cpu"
        )

    # ------------------------------------------------------------------ dialect
    def _unavailable_hint(self) -> str:
        return "start it (see docs/engines.md) or fix engine.urls, or leave engine.urls empty to let sdp launch one"

    def _server_connect(self, server: RemoteServer) -> None:
        server.http.get("/health")
        answer = server.http.get("/is_paused")
        if not isinstance(answer, dict) or "is_paused" not in answer:
            raise malformed(server, "/is_paused", "no is_paused field")

    def _sampling_params(
        self, max_tokens: int, stop_token_ids: Sequence[int], seed: int | None
    ) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            **NEUTRAL_SAMPLING,
            "logprobs": 0,
            "stop_token_ids": list(stop_token_ids),
            "ignore_eos": self.options.ignore_eos,
            "detokenize": False,
        }
        if seed is not None:
            params["seed"] = seed
        return params

    def _server_generate(
        self, server: RemoteServer, request: SegmentRequest, refresh_id: Callable[[], str]
    ) -> Segment:
        params = self._sampling_params(request.max_new_tokens, request.stop_token_ids, request.seed)
        if request.prefill_from is not None:
            params["prompt_logprobs"] = 0

        def body(request_id: str) -> dict[str, Any]:
            return {
                "request_id": request_id,
                "token_ids": request.input_ids,
                "sampling_params": params,
            }

        answer = server.http.post(
            GENERATE, body(request.request_id), refresh=lambda: body(refresh_id())
        )
        choice = _only_choice(server, answer)
        token_ids = as_token_ids(server, GENERATE, choice.get("token_ids"), "token_ids")
        content = (choice.get("logprobs") or {}).get("content")
        if not isinstance(content, list):
            raise malformed(server, GENERATE, "logprobs.content is missing")
        logprobs = []
        for i, entry in enumerate(content):
            if not isinstance(entry, dict):
                raise malformed(server, GENERATE, f"logprobs.content[{i}] is not an object")
            if i < len(token_ids) and entry.get("token_id") != token_ids[i]:
                raise malformed(
                    server,
                    GENERATE,
                    f"logprobs.content[{i}] is for token {entry.get('token_id')}, not {token_ids[i]}",
                )
            logprobs.append(
                as_logprob(server, GENERATE, entry.get("logprob"), f"logprobs.content[{i}].logprob")
            )
        spans = choice.get("weight_versions")
        token_versions = (
            None if spans is None else expand_spans(server, GENERATE, spans, len(token_ids))
        )
        finish_reason = str(choice.get("finish_reason"))
        prefill = None
        entries = answer.get("prompt_logprobs")
        if request.prefill_from is not None and entries is not None:
            # An abort during the prefill may leave the list short: then there is no prefill.
            if finish_reason != "abort" or (
                isinstance(entries, list) and len(entries) == len(request.input_ids)
            ):
                prefill = _prompt_logprobs(server, entries, request.input_ids, request.prefill_from)
        return Segment(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=finish_reason,
            token_versions=token_versions,
            prefill_logprobs=prefill,
            # the prefill ran just before the first token was sampled, under the same weights
            prefill_version=token_versions[0] if token_versions else None,
            message=str(choice.get("stop_reason") or ""),
        )

    def _server_score(
        self, server: RemoteServer, sequence: list[int], start: int
    ) -> tuple[list[float], str | None]:
        # The server insists on sampling at least one token; it is discarded.
        params = self._sampling_params(1, (), None)
        params["prompt_logprobs"] = 0
        params["ignore_eos"] = True
        body = {
            "request_id": "score-" + new_request_id(),
            "token_ids": sequence,
            "sampling_params": params,
        }
        answer = server.http.post(
            GENERATE, body, refresh=lambda: {**body, "request_id": "score-" + new_request_id()}
        )
        choice = _only_choice(server, answer)
        if answer.get("prompt_logprobs") is None:
            raise malformed(server, GENERATE, "prompt_logprobs missing from a scoring answer")
        spans = choice.get("weight_versions") or []
        label = (
            str(spans[0]["version"])
            if spans and isinstance(spans[0], dict) and "version" in spans[0]
            else None
        )
        return _prompt_logprobs(server, answer["prompt_logprobs"], sequence, start), label

    def _server_abort_all(self, server: RemoteServer) -> None:
        # An empty id list aborts every request the server tracks; each answers with its partial
        # output. Unlike /pause this acts in the API process at once (a scheduler pause waits
        # for the engine core) and leaves the server running, so scoring works while paused.
        server.http.post("/abort_requests", {}, timeout=self.options.http.admin_timeout_s)

    def _server_abort_requests(self, server: RemoteServer, request_ids: list[str]) -> None:
        # The route takes external ids, which the token-in/token-out route prefixes.
        server.http.post(
            "/abort_requests",
            {"request_ids": [f"generate-tokens-{r}" for r in request_ids]},
            retry=False,
        )

    def _server_load_weights(self, server: RemoteServer, path: Path, label: str) -> None:
        timeout = self.options.http.admin_timeout_s
        # Reloading while decoding corrupts the running requests (docs/engines.md "vLLM").
        server.http.post("/pause", params={"mode": "abort"}, timeout=timeout)
        try:
            answer = server.http.post(
                "/collective_rpc",
                {
                    "method": self.reload_method,
                    "kwargs": {"weights_path": str(path)},
                    "timeout": timeout,
                },
                timeout=timeout,
                retry=False,
            )
            if not isinstance(answer, dict) or "results" not in answer:
                raise malformed(server, "/collective_rpc", f"no results in {answer!r}")
            server.http.post("/reset_prefix_cache", timeout=timeout)
            server.http.post("/update_weight_version", {"new_version": label}, timeout=timeout)
        finally:
            server.http.post("/resume", timeout=timeout)

    def _server_set_version(self, server: RemoteServer, label: str) -> None:
        server.http.post(
            "/update_weight_version",
            {"new_version": label},
            timeout=self.options.http.admin_timeout_s,
        )

    def _server_get_version(self, server: RemoteServer) -> str | None:
        answer = server.http.get("/weight_info")
        if not isinstance(answer, dict) or not isinstance(answer.get("weight_version"), str):
            raise malformed(server, "/weight_info", "no weight_version string")
        return answer["weight_version"]


def _only_choice(server: RemoteServer, answer: Any) -> dict[str, Any]:
    if (
        not isinstance(answer, dict)
        or not isinstance(answer.get("choices"), list)
        or len(answer["choices"]) != 1
    ):
        raise malformed(server, GENERATE, "expected exactly one choice")
    choice = answer["choices"][0]
    if not isinstance(choice, dict):
        raise malformed(server, GENERATE, "choice is not an object")
    return choice


def _prompt_logprobs(
    server: RemoteServer, entries: Any, input_ids: list[int], start: int
) -> list[float]:
    """log p(x_t | x_<t) for t in [start, len(input_ids)) from vLLM's ``prompt_logprobs``."""
    if not isinstance(entries, list) or len(entries) != len(input_ids):
        raise malformed(
            server,
            GENERATE,
            f"prompt_logprobs has {len(entries) if isinstance(entries, list) else 'no'} entries for {len(input_ids)} input tokens",
        )
    values = []
    for t in range(start, len(input_ids)):
        entry = entries[t]
        item = entry.get(str(input_ids[t])) if isinstance(entry, dict) else None
        if not isinstance(item, dict):
            raise malformed(server, GENERATE, f"prompt_logprobs[{t}] lacks token {input_ids[t]}")
        values.append(as_logprob(server, GENERATE, item.get("logprob"), f"prompt_logprobs[{t}]"))
    return values
