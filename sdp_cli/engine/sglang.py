"""``engine=sglang``: client for SGLang's native HTTP API (0.5.6 – 0.5.23).

Routes used (docs/engines.md "SGLang"): ``POST /generate`` with ``input_ids`` and
``return_logprob``; ``/pause_generation`` (mode abort) and ``/continue_generation``;
``/update_weights_from_disk`` with ``weight_version`` and ``flush_cache``;
``/update_weight_version``; ``/get_model_info``; ``/health_generate`` for readiness.

Alignment: with ``logprob_start_len = s``, ``meta_info.input_token_logprobs`` holds one
``[logprob, token_id, text]`` row per input position ``s ..``, and row 0 is always
``[null, ...]``; so to score tokens from position k, send ``s = k - 1`` and drop row 0.
Versions: ``meta_info.weight_versions`` spans (0.5.19+) or the single ``weight_version``.
SGLang 0.5.23 rejects unknown ``sampling_params`` keys, so only documented keys are sent.
Every request sends neutral values for the sampling parameters a server fills in from the
model's generation_config.json when a request leaves them out (``--sampling-defaults model``):
tokens are then drawn from softmax(z / T) itself, the distribution of the logprobs recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdp_cli.engine.base import EngineError
from sdp_cli.engine.remote import RemoteEngine, RemoteOptions
from sdp_cli.engine.remote_server import RemoteServer
from sdp_cli.engine.servers import LaunchSpec, ServerLaunch, free_port
from sdp_cli.engine.wire import (
    Segment,
    SegmentRequest,
    as_logprob,
    as_token_ids,
    expand_spans,
    malformed,
    version_label,
)

GENERATE = "/generate"
#: sampling parameters at the values that leave softmax(z / T) unchanged (top_k -1: all tokens)
NEUTRAL_SAMPLING = {
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
}


@dataclass(frozen=True)
class SGLangLaunchConfig(ServerLaunch):
    """How sdp starts an SGLang server of its own (``ServerLaunch`` and SGLang's own settings)."""

    #: fraction of GPU memory for weights and KV cache (None: SGLang chooses)
    mem_fraction_static: float | None = None
    startup_timeout_s: float = 900.0


def launch_spec(
    config: SGLangLaunchConfig, log_dir: Path, *, version: int = 0, api_key: str | None = None
) -> LaunchSpec:
    """The command and environment of an SGLang server whose weights are labelled ``version``."""
    port = config.port or free_port(config.host)
    command = config.command("sglang.launch_server", port, model_flag="--model-path", seed_flag="--random-seed")
    command += ["--weight-version", version_label(version)]
    if config.mem_fraction_static is not None:
        command += ["--mem-fraction-static", str(config.mem_fraction_static)]
    if api_key:
        command += ["--api-key", api_key]
    return config.spec(
        "SGLang server",
        command,
        port=port,
        env=dict(config.env),
        health_path="/health_generate",
        log_path=Path(log_dir) / "sglang_server.log",
        secrets=(api_key,) if api_key else (),
    )


class SGLangEngine(RemoteEngine):
    """``InferenceEngine`` over one or more SGLang servers (attach to ``base_urls``)."""

    engine_name = "sglang"

    @classmethod
    def launch(
        cls,
        config: SGLangLaunchConfig,
        log_dir: Path,
        options: RemoteOptions | None = None,
        *,
        version: int = 0,
    ) -> SGLangEngine:
        """Start an SGLang server and attach to it; ``close()`` stops it."""
        options = options or RemoteOptions()
        spec = launch_spec(config, log_dir, version=version, api_key=options.http.api_key)
        return cls._attach_launched(spec, options, version=version)

    # ------------------------------------------------------------------ dialect
    def _unavailable_hint(self) -> str:
        return "start it (python -m sglang.launch_server, see docs/engines.md) or fix engine.urls, or leave engine.urls empty to let sdp launch one"

    def _server_connect(self, server: RemoteServer) -> None:
        info = server.http.get("/get_model_info")
        if not isinstance(info, dict) or "weight_version" not in info:
            raise EngineError(
                f"{server.url}/get_model_info reports no weight_version; sdp needs SGLang 0.5.6 or newer"
            )

    def _sampling_params(
        self, max_new_tokens: int, stop_token_ids: Sequence[int], seed: int | None
    ) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "temperature": self.temperature,
            **NEUTRAL_SAMPLING,
            "stop_token_ids": list(stop_token_ids),
            "ignore_eos": self.options.ignore_eos,
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if seed is not None:
            params["sampling_seed"] = seed
        return params

    def _server_generate(
        self, server: RemoteServer, request: SegmentRequest, refresh_id: Callable[[], str]
    ) -> Segment:
        # logprob_start_len = k - 1 because row 0 of input_token_logprobs is always null.
        start = -1 if request.prefill_from is None else request.prefill_from - 1

        def body(rid: str) -> dict[str, Any]:
            return {
                "rid": rid,
                "input_ids": request.input_ids,
                "sampling_params": self._sampling_params(
                    request.max_new_tokens, request.stop_token_ids, request.seed
                ),
                "return_logprob": True,
                "logprob_start_len": start,
                "stream": False,
            }

        answer = server.http.post(
            GENERATE, body(request.request_id), refresh=lambda: body(refresh_id())
        )
        meta = _meta(server, answer)
        token_ids = as_token_ids(server, GENERATE, answer.get("output_ids"), "output_ids")
        rows = meta.get("output_token_logprobs")
        if not isinstance(rows, list):
            raise malformed(server, GENERATE, "meta_info.output_token_logprobs is missing")
        logprobs = []
        for i, row in enumerate(rows):
            if not isinstance(row, list) or len(row) < 2:
                raise malformed(server, GENERATE, f"output_token_logprobs[{i}] is {row!r}")
            if i < len(token_ids) and row[1] != token_ids[i]:
                raise malformed(
                    server,
                    GENERATE,
                    f"output_token_logprobs[{i}] is for token {row[1]}, not {token_ids[i]}",
                )
            logprobs.append(as_logprob(server, GENERATE, row[0], f"output_token_logprobs[{i}]"))
        finish = meta.get("finish_reason")
        if not isinstance(finish, dict) or not isinstance(finish.get("type"), str):
            raise malformed(server, GENERATE, f"finish_reason {finish!r}")
        if (
            finish["type"] == "abort"
            and isinstance(finish.get("status_code"), int)
            and finish["status_code"] >= 400
        ):
            # Validation failures arrive as aborts that carry an HTTP status.
            raise EngineError(
                f"{server.url}{GENERATE} rejected the request: {finish.get('message')}"
            )
        token_versions = _token_versions(server, meta, len(token_ids))
        prefill = None
        input_rows = meta.get("input_token_logprobs")
        if request.prefill_from is not None and input_rows is not None:
            # An abort during the prefill may leave the rows short: then there is no prefill.
            complete = (
                isinstance(input_rows, list) and len(input_rows) == len(request.input_ids) - start
            )
            if finish["type"] != "abort" or complete:
                prefill = _input_logprobs(server, input_rows, request.input_ids, start)
        return Segment(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=finish["type"],
            token_versions=token_versions,
            prefill_logprobs=prefill,
            prefill_version=token_versions[0] if token_versions else _label(meta),
            message=str(finish.get("message") or ""),
        )

    def _server_score(
        self, server: RemoteServer, sequence: list[int], start: int
    ) -> tuple[list[float], str | None]:
        # max_new_tokens = 0 makes a prefill-only request (docs/engines.md "SGLang").
        body = {
            "input_ids": sequence,
            "sampling_params": {
                "max_new_tokens": 0,
                "temperature": self.temperature,
                **NEUTRAL_SAMPLING,
            },
            "return_logprob": True,
            "logprob_start_len": start - 1,
            "stream": False,
        }
        answer = server.http.post(GENERATE, body)
        meta = _meta(server, answer)
        rows = meta.get("input_token_logprobs")
        if rows is None:
            raise malformed(server, GENERATE, "input_token_logprobs missing from a scoring answer")
        return _input_logprobs(server, rows, sequence, start - 1), _label(meta)

    def _server_abort_all(self, server: RemoteServer) -> None:
        # Abort mode returns every in-flight request with its partial output; continuing at once
        # lets the recompute pass score while sdp is paused.
        timeout = self.options.http.admin_timeout_s
        server.http.post("/pause_generation", {"mode": "abort"}, timeout=timeout)
        server.http.post("/continue_generation", {}, timeout=timeout)

    def _server_abort_requests(self, server: RemoteServer, request_ids: list[str]) -> None:
        # /abort_request matches by prefix; sdp's ids are fixed-length, so none prefixes another.
        for request_id in request_ids:
            server.http.post("/abort_request", {"rid": request_id, "abort_all": False}, retry=False)

    def _server_load_weights(self, server: RemoteServer, path: Path, label: str) -> None:
        timeout = self.options.http.admin_timeout_s
        # Paused, the update runs at once instead of waiting for in-flight requests. The radix
        # cache is flushed by a separate call so that a refused flush is not mistaken for a
        # failed load (0.5.23 reports both as one failure); an abort pause leaves the
        # scheduler idle, which the flush needs.
        server.http.post("/pause_generation", {"mode": "abort"}, timeout=timeout)
        try:
            answer = server.http.post(
                "/update_weights_from_disk",
                {"model_path": str(path), "weight_version": label, "flush_cache": False},
                timeout=timeout,
                retry=False,
                answer_statuses=(400,),
            )
            if not isinstance(answer, dict) or answer.get("success") is not True:
                message = answer.get("message") if isinstance(answer, dict) else answer
                raise EngineError(f"{server.url} could not load weights from {path}: {message}")
            server.http.post("/flush_cache", timeout=timeout)
        finally:
            server.http.post("/continue_generation", {}, timeout=timeout)

    def _server_set_version(self, server: RemoteServer, label: str) -> None:
        server.http.post(
            "/update_weight_version",
            {"new_version": label, "abort_all_requests": False},
            timeout=self.options.http.admin_timeout_s,
        )

    def _server_get_version(self, server: RemoteServer) -> str | None:
        info = server.http.get("/get_model_info")
        if not isinstance(info, dict) or info.get("weight_version") is None:
            raise malformed(server, "/get_model_info", "no weight_version")
        return str(info["weight_version"])


def _meta(server: RemoteServer, answer: Any) -> dict[str, Any]:
    if not isinstance(answer, dict) or not isinstance(answer.get("meta_info"), dict):
        raise malformed(server, GENERATE, "no meta_info object")
    return answer["meta_info"]


def _label(meta: dict[str, Any]) -> str | None:
    value = meta.get("weight_version")
    return None if value is None else str(value)


def _token_versions(server: RemoteServer, meta: dict[str, Any], n_tokens: int) -> list[str] | None:
    if meta.get("weight_versions") is not None:
        return expand_spans(server, GENERATE, meta["weight_versions"], n_tokens)
    label = _label(meta)
    return None if label is None else [label] * n_tokens


def _input_logprobs(
    server: RemoteServer, rows: Any, input_ids: list[int], start: int
) -> list[float]:
    """Logprobs of input positions ``start + 1 ..`` from rows that begin at ``start`` (row 0 null)."""
    expected = len(input_ids) - start
    if not isinstance(rows, list) or len(rows) != expected:
        raise malformed(
            server,
            GENERATE,
            f"input_token_logprobs has {len(rows) if isinstance(rows, list) else 'no'} rows, expected {expected}",
        )
    values = []
    for k, row in enumerate(rows[1:], start=1):
        if not isinstance(row, list) or len(row) < 2 or row[1] != input_ids[start + k]:
            raise malformed(
                server,
                GENERATE,
                f"input_token_logprobs[{k}] is {row!r}, not for token {input_ids[start + k]}",
            )
        values.append(as_logprob(server, GENERATE, row[0], f"input_token_logprobs[{k}]"))
    return values
