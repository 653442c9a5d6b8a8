"""An in-process HTTP server that answers ``POST /inference/v1/generate`` like vLLM 0.32, backed
by ``tiny_lm`` (docs/engines.md "vLLM"): ``choices[0].token_ids``, raw sampled logprobs
(log softmax(z), unscaled by T: ``--logprobs-mode raw_logprobs``), ``weight_versions`` spans and
``prompt_logprobs`` (entry 0 null, entry i keyed by the token id). Sampling parameters a
request leaves out come from the model's generation_config.json (``stubs/sampling.py``).
Also ``/health``, ``/is_paused``, ``/update_weight_version`` and ``/weight_info``, enough for
the client to attach; pause, abort and reload are tested against the real server.
"""

from __future__ import annotations

import json
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from . import sampling, tiny_lm


class VLLMStub:
    """Start with ``with VLLMStub(model_dir) as stub:``; ``stub.url`` is its base URL."""

    def __init__(self, model_dir: Path):
        self.weights = tiny_lm.load_weights(model_dir)
        self.defaults = sampling.model_defaults(model_dir)
        self.version = "default"
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"stub": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.02,), daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> VLLMStub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self.bodies.append(body)
        params = body["sampling_params"]
        effective = sampling.effective(params, self.defaults)
        ids = [int(t) for t in body["token_ids"]]
        seed = params.get("seed", zlib.crc32(body["request_id"].encode()))
        gen = torch.Generator().manual_seed(int(seed))
        tokens: list[int] = []
        content = []
        for _ in range(int(params["max_tokens"])):
            logits = tiny_lm.logits(self.weights, ids + tokens)[-1]
            raw = torch.log_softmax(logits, -1)  # what raw_logprobs mode reports
            drawn = sampling.sampling_logprobs(logits, effective, ids + tokens, tokens)
            token = int(torch.multinomial(drawn.exp(), 1, generator=gen))
            tokens.append(token)
            content.append({"token_id": token, "logprob": float(raw[token])})
            if token in params.get("stop_token_ids", []):
                break
        answer: dict[str, Any] = {
            "request_id": f"generate-tokens-{body['request_id']}",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop" if len(tokens) < params["max_tokens"] else "length",
                    "token_ids": tokens,
                    "weight_versions": [{"version": self.version, "start": 0, "end": len(tokens)}],
                    "logprobs": {"content": content},
                }
            ],
        }
        if params.get("prompt_logprobs") is not None:
            scored = tiny_lm.score(self.weights, ids, 1)
            answer["prompt_logprobs"] = [None] + [
                {str(ids[t]): {"logprob": scored[t - 1], "rank": 1}} for t in range(1, len(ids))
            ]
        return answer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    stub: VLLMStub

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        return

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == "/health":
            self._send(200, None)
        elif path == "/is_paused":
            self._send(200, {"is_paused": False})
        elif path == "/weight_info":
            self._send(200, {"weight_version": self.stub.version})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else {}
        if path == "/update_weight_version":
            self.stub.version = str(body["new_version"])
            self._send(200, {"success": True})
        elif path == "/inference/v1/generate":
            self._send(200, self.stub.generate(body))
        else:
            self._send(404, {"detail": "Not Found"})

    def _send(self, status: int, answer: Any) -> None:
        data = b"" if answer is None else json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
