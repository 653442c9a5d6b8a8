"""An in-process HTTP server that answers like SGLang 0.5.x, backed by ``tiny_lm``.

Reproduces the shapes and behaviours the client relies on (docs/engines.md "SGLang"):
``/generate`` with ``input_ids`` and ``return_logprob`` (rows ``[logprob, token_id, null]``,
the first ``input_token_logprobs`` row null, stop token kept in ``output_ids``, sampled
logprobs at temperature T and prefill logprobs untempered; sampling parameters a request
leaves out come from the model's generation_config.json, ``stubs/sampling.py``), abort with
partial output,
``/generate`` blocking while paused, 400 on unknown ``sampling_params`` keys and on a
duplicate in-flight rid, prefix-matching ``/abort_request``, ``/pause_generation`` (abort),
``/continue_generation``, ``/update_weights_from_disk`` with ``weight_version``,
``/update_weight_version``, ``/flush_cache``, ``/get_model_info``, ``/health_generate``.

Test controls, all event-based: ``hold_after`` makes every request stop after that many of
its tokens and wait (until aborted or released) so a test can pause mid-generation
deterministically; ``wait_holding(n)`` returns once n requests wait there. ``inject`` makes
the next requests to a route fail (HTTP status, dropped connection, malformed JSON,
mismatched lengths). ``idle_timeout_s`` closes idle keep-alive connections like uvicorn.
"""

from __future__ import annotations

import json
import threading
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from . import sampling, tiny_lm

EOS_ID = 2
KNOWN_SAMPLING_KEYS = frozenset(
    "max_new_tokens min_new_tokens temperature top_p top_k min_p stop stop_token_ids stop_regex ignore_eos "
    "skip_special_tokens spaces_between_special_tokens no_stop_trim n frequency_penalty presence_penalty "
    "repetition_penalty logit_bias sampling_seed json_schema regex ebnf custom_params stream_interval".split()
)


@dataclass
class _Live:
    rid: str
    aborted: bool = False


@dataclass
class StubState:
    """Everything the server holds; guarded by ``cond``."""

    weights: dict[str, torch.Tensor]
    model_path: str
    #: sampling defaults from the start-up model's generation_config.json
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    weight_version: str = "default"
    report_spans: bool = True
    api_key: str | None = None
    hold_after: int | None = None
    cond: threading.Condition = field(default_factory=threading.Condition)
    paused: bool = False
    live: dict[str, _Live] = field(default_factory=dict)
    holding: set[str] = field(default_factory=set)
    closed_connections: int = 0
    faults: dict[str, list[Any]] = field(default_factory=dict)
    requests: list[tuple[str, str, Any]] = field(default_factory=list)
    auth_headers: list[str | None] = field(default_factory=list)


class SGLangStub:
    """Start with ``with SGLangStub(weights_dir) as stub:``; ``stub.url`` is its base URL."""

    def __init__(
        self,
        weights_dir: Path,
        *,
        weight_version: str = "default",
        report_spans: bool = True,
        api_key: str | None = None,
        idle_timeout_s: float | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        self.state = StubState(
            weights=tiny_lm.load_weights(weights_dir),
            model_path=str(weights_dir),
            generation_defaults=sampling.model_defaults(weights_dir),
            weight_version=weight_version,
            report_spans=report_spans,
            api_key=api_key,
        )
        handler = type("Handler", (_Handler,), {"state": self.state, "timeout": idle_timeout_s})
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.02,), daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> SGLangStub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()

    # ------------------------------------------------------------------ test controls
    def set_hold(self, tokens: int | None) -> None:
        """Requests wait after ``tokens`` tokens of their own (None: never)."""
        with self.state.cond:
            self.state.hold_after = tokens
            self.state.cond.notify_all()

    def release(self) -> None:
        self.set_hold(None)

    def wait_holding(self, n: int, timeout: float = 30.0) -> None:
        with self.state.cond:
            if not self.state.cond.wait_for(lambda: len(self.state.holding) == n, timeout):
                raise AssertionError(
                    f"expected {n} holding requests, have {len(self.state.holding)}"
                )

    def wait_new_holding(self, seen: set[str], timeout: float = 30.0) -> str:
        """The rid of a holding request not in ``seen`` (waits for one)."""
        with self.state.cond:
            if not self.state.cond.wait_for(lambda: self.state.holding - seen, timeout):
                raise AssertionError("no new holding request")
            return min(self.state.holding - seen)

    def wait_closed_connections(self, n: int, timeout: float = 30.0) -> None:
        with self.state.cond:
            if not self.state.cond.wait_for(lambda: self.state.closed_connections >= n, timeout):
                raise AssertionError(
                    f"expected {n} closed connections, have {self.state.closed_connections}"
                )

    def serve_forever(self) -> None:
        """Serve in the calling thread (the fake ``sglang.launch_server`` process)."""
        self._server.serve_forever()

    def inject(self, path: str, action: Any, times: int = 1) -> None:
        """The next ``times`` requests to ``path`` get ``action``: an HTTP status (int),
        ``"drop"`` (close without answering), ``"bad_json"`` or ``"mismatch"`` (one logprob short)."""
        with self.state.cond:
            self.state.faults.setdefault(path, []).extend([action] * times)

    def wait_requests(self, path: str, n: int, timeout: float = 30.0) -> None:
        with self.state.cond:
            if not self.state.cond.wait_for(
                lambda: len([1 for _, p, _ in self.state.requests if p == path]) >= n, timeout
            ):
                raise AssertionError(f"expected {n} requests to {path}")

    def requests_to(self, path: str) -> list[Any]:
        with self.state.cond:
            return [body for _, p, body in self.state.requests if p == path]

    @property
    def weight_version(self) -> str:
        with self.state.cond:
            return self.state.weight_version


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like uvicorn
    state: StubState

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        return

    def finish(self) -> None:
        super().finish()
        with self.state.cond:
            self.state.closed_connections += 1
            self.state.cond.notify_all()

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    # ------------------------------------------------------------------ plumbing
    def _dispatch(self, method: str) -> None:
        path = urlsplit(self.path).path
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else {}
        except json.JSONDecodeError:
            self._send(400, {"error": {"message": "invalid JSON"}})
            return
        state = self.state
        with state.cond:
            state.requests.append((method, path, body))
            state.auth_headers.append(self.headers.get("Authorization"))
            state.cond.notify_all()
            faults = state.faults.get(path)
            fault = faults.pop(0) if faults else None
        if fault == "drop":
            self.close_connection = True
            self.connection.close()
            return
        if isinstance(fault, int):
            self._send(fault, {"error": {"message": f"injected {fault}"}})
            return
        if (
            state.api_key is not None
            and self.headers.get("Authorization") != f"Bearer {state.api_key}"
        ):
            self._send(401, {"error": {"message": "Unauthorized"}})
            return
        route = ROUTES.get((method, path)) or ROUTES.get(("ANY", path))
        if route is None:
            self._send(404, {"detail": "Not Found"})
            return
        status, answer = route(self, body)
        if fault == "bad_json":
            self._send_raw(status, b'{"output_ids": [1, 2')
            return
        if fault == "mismatch" and isinstance(answer, dict) and "meta_info" in answer:
            answer["meta_info"]["output_token_logprobs"] = answer["meta_info"][
                "output_token_logprobs"
            ][:-1]
        self._send(status, answer)

    def _send(self, status: int, answer: Any) -> None:
        self._send_raw(status, b"" if answer is None else json.dumps(answer).encode())

    def _send_raw(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    # ------------------------------------------------------------------ routes
    def generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        state = self.state
        params = body.get("sampling_params") or {}
        unknown = sorted(set(params) - KNOWN_SAMPLING_KEYS)
        if unknown:
            return 400, {"error": {"message": f"unknown field: sampling_params.{unknown[0]}"}}
        input_ids = [int(t) for t in body["input_ids"]]
        rid = body.get("rid") or f"{zlib.crc32(json.dumps(body).encode()):08x}"
        max_new = int(params.get("max_new_tokens", 128))
        effective = sampling.effective(params, state.generation_defaults)
        temperature = float(effective["temperature"])
        stop_ids = set(params.get("stop_token_ids") or [])
        if not params.get("ignore_eos", False):
            stop_ids.add(EOS_ID)
        seed = params.get("sampling_seed", zlib.crc32(rid.encode()))
        gen = torch.Generator().manual_seed(int(seed))
        start = int(body.get("logprob_start_len", -1)) if body.get("return_logprob") else -1
        with state.cond:
            state.cond.wait_for(lambda: not state.paused)  # SGLang blocks new requests while paused
            if rid in state.live:
                return 400, {"error": {"message": "Duplicate request ID detected"}}
            live = state.live[rid] = _Live(rid)
            meta: dict[str, Any] = {"id": rid, "prompt_tokens": len(input_ids), "cached_tokens": 0}
            if start >= len(input_ids):
                del state.live[rid]
                state.cond.notify_all()
                finish = {
                    "type": "abort",
                    "message": "logprob_start_len too large",
                    "status_code": 400,
                }
                return 200, {
                    "text": "",
                    "output_ids": [],
                    "meta_info": {**meta, "finish_reason": finish},
                }
        tokens: list[int] = []
        rows_out: list[list[Any]] = []
        labels: list[str] = []
        finish: dict[str, Any] = {"type": "length", "length": max_new}
        if max_new == 0 and start >= 0:
            with state.cond:
                meta["input_token_logprobs"] = _prefill_rows(state.weights, input_ids, start)
        try:
            while len(tokens) < max_new:
                with state.cond:
                    while (
                        state.hold_after is not None
                        and len(tokens) >= state.hold_after
                        and not live.aborted
                    ):
                        state.holding.add(rid)
                        state.cond.notify_all()
                        state.cond.wait()
                        state.holding.discard(rid)
                    if live.aborted:
                        # held before its first step = still in the waiting queue: no prefill ran
                        message = "Aborted" if tokens else "Abort in waiting queue"
                        finish = {"type": "abort", "message": message, "status_code": None}
                        break
                    if start >= 0 and "input_token_logprobs" not in meta:
                        meta["input_token_logprobs"] = _prefill_rows(
                            state.weights, input_ids, start
                        )
                    context = input_ids + tokens
                    logits = tiny_lm.logits(state.weights, context)[-1]
                    # SGLang reports log softmax(z / T); the token is drawn after penalties,
                    # min_p, top_k and top_p
                    logprobs = torch.log_softmax(logits / temperature, -1)
                    drawn = sampling.sampling_logprobs(logits, effective, context, tokens)
                    token = int(torch.multinomial(drawn.exp(), 1, generator=gen))
                    labels.append(state.weight_version)
                tokens.append(token)
                rows_out.append([float(logprobs[token]), token, None])
                if token in stop_ids:
                    finish = {"type": "stop", "matched": token}
                    break
        finally:
            with state.cond:
                del state.live[rid]
                state.cond.notify_all()
                meta["weight_version"] = state.weight_version
        meta.update(
            finish_reason=finish, completion_tokens=len(tokens), output_token_logprobs=rows_out
        )
        if state.report_spans:
            spans: list[dict[str, Any]] = []
            for i, label in enumerate(labels):
                if spans and spans[-1]["version"] == label:
                    spans[-1]["end"] = i + 1
                else:
                    spans.append({"version": label, "start": i, "end": i + 1})
            meta["weight_versions"] = spans
        return 200, {"text": "", "output_ids": tokens, "meta_info": meta}

    def pause_generation(self, body: dict[str, Any]) -> tuple[int, Any]:
        state = self.state
        if body.get("mode", "abort") != "abort":
            return 400, {"error": {"message": "stub supports mode=abort only"}}
        with state.cond:
            state.paused = True
            for live in state.live.values():
                live.aborted = True
            state.cond.notify_all()
            state.cond.wait_for(lambda: not state.live)  # returns once every request has answered
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self.state.cond:
            self.state.paused = False
            self.state.cond.notify_all()
        return 200, {"message": "Generation continued.", "status": "ok"}

    def abort_request(self, body: dict[str, Any]) -> tuple[int, Any]:
        rid, abort_all = body.get("rid") or "", bool(body.get("abort_all"))
        with self.state.cond:
            for live in self.state.live.values():
                # SGLang matches by prefix (req.rid.startswith(rid)); an empty rid matches only with abort_all
                if abort_all or (rid and live.rid.startswith(rid)):
                    live.aborted = True
            self.state.cond.notify_all()
        return 200, None

    def update_weights_from_disk(self, body: dict[str, Any]) -> tuple[int, Any]:
        state = self.state
        path = Path(body["model_path"])
        if not (path / tiny_lm.WEIGHTS_FILE).is_file():
            return 400, {
                "success": False,
                "message": f"Failed to load weights from {path}",
                "num_paused_requests": 0,
            }
        with state.cond:
            if not state.paused:
                state.cond.wait_for(
                    lambda: not state.live
                )  # the writer lock waits for running requests
            state.weights = tiny_lm.load_weights(path)
            state.model_path = str(path)
            if body.get("weight_version") is not None:
                state.weight_version = str(body["weight_version"])
            if body.get("flush_cache", True) and state.live:
                return 400, {
                    "success": False,
                    "message": "Weights were updated, but the cache was not flushed",
                }
        return 200, {
            "success": True,
            "message": "Succeeded to update model weights.",
            "num_paused_requests": 0,
        }

    def update_weight_version(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self.state.cond:
            if body.get("abort_all_requests", True):
                for live in self.state.live.values():
                    live.aborted = True
                self.state.cond.notify_all()
            self.state.weight_version = str(body["new_version"])
        return 200, {"success": True, "message": "ok", "new_version": str(body["new_version"])}

    def flush_cache(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self.state.cond:
            if self.state.live:
                return 400, "Cache not flushed: requests are running"
        return 200, "Cache flushed."

    def get_model_info(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self.state.cond:
            return 200, {
                "model_path": self.state.model_path,
                "tokenizer_path": self.state.model_path,
                "is_generation": True,
                "weight_version": self.state.weight_version,
            }

    def health_generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        with self.state.cond:
            return (503, None) if self.state.paused else (200, None)


def _prefill_rows(
    weights: dict[str, torch.Tensor], input_ids: list[int], start: int
) -> list[list[Any]]:
    """``input_token_logprobs`` from position ``start``: row 0 is always null, row k scores
    position start + k (docs/engines.md "SGLang")."""
    scored = tiny_lm.score(weights, input_ids, 1)
    return [[None, input_ids[start], None]] + [
        [scored[p - 1], input_ids[p], None] for p in range(start + 1, len(input_ids))
    ]


ROUTES = {
    ("POST", "/generate"): _Handler.generate,
    ("POST", "/pause_generation"): _Handler.pause_generation,
    ("POST", "/continue_generation"): _Handler.continue_generation,
    ("POST", "/abort_request"): _Handler.abort_request,
    ("POST", "/update_weights_from_disk"): _Handler.update_weights_from_disk,
    ("POST", "/update_weight_version"): _Handler.update_weight_version,
    ("ANY", "/flush_cache"): _Handler.flush_cache,
    ("GET", "/get_model_info"): _Handler.get_model_info,
    ("GET", "/health_generate"): _Handler.health_generate,
}
