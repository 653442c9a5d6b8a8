"""A fault-injecting HTTP proxy on loopback, between sdp and a real inference server.

It forwards every request to ``upstream`` (headers included, so an API key passes through)
and applies scheduled faults to chosen requests: an error status instead of an answer, a
connection dropped before or in the middle of the answer, a slow answer, malformed or truncated
JSON, or an answer edited so that it is wrong in one specific way (token and logprob lengths
disagree, a non-finite logprob, a foreign weight-version label). Every fault and every clean
generation answer is timestamped, which gives the time sdp needed to recover from each fault.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

#: what each fault does to the request it hits
KINDS = {
    "status": "answer the given status instead of forwarding",
    "status_after": "forward (the server does the work), then answer the given status",
    "drop": "close the connection without forwarding or answering",
    "cut": "forward, then close the connection halfway through the answer",
    "delay": "wait `seconds` before forwarding",
    "garbage": "forward, then answer 200 with a body that is not JSON",
    "truncated_json": "forward, then answer 200 with the first half of the JSON (consistent length)",
    "drop_logprob": "forward, then remove the last logprob: token and logprob lengths disagree",
    "nan_logprob": "forward, then make the first logprob NaN",
    "label": "forward, then replace every weight-version label with `label`",
}


def is_generation(body: dict[str, Any]) -> bool:
    return not str(body.get("request_id", "")).startswith("score-")


def is_scoring(body: dict[str, Any]) -> bool:
    return str(body.get("request_id", "")).startswith("score-")


@dataclass
class Rule:
    path: str
    kind: str
    after: int  # matching requests let through before the fault
    remaining: int  # hits still to inject
    match: Callable[[dict[str, Any]], bool]
    params: dict[str, Any]
    name: str
    seen: int = 0  # matching requests that reached this rule


@dataclass
class Hit:
    name: str
    path: str
    time: float
    request_id: str = ""


@dataclass
class ProxyLog:
    hits: list[Hit] = field(default_factory=list)
    #: times of generation answers passed through untouched with status 200
    clean: list[float] = field(default_factory=list)


class FaultProxy:
    """``with FaultProxy(upstream) as proxy:``; point sdp at ``proxy.url``."""

    def __init__(self, upstream: str):
        self.upstream = urlsplit(upstream)
        self.rules: list[Rule] = []
        self.log = ProxyLog()
        self.lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"proxy": self})
        self.server = _Server(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def plan(
        self,
        path: str,
        kind: str,
        *,
        after: int = 0,
        times: int = 1,
        match: Callable[[dict[str, Any]], bool] = lambda body: True,
        name: str = "",
        **params: Any,
    ) -> None:
        """Hit ``times`` requests to ``path`` (whose JSON body satisfies ``match``) with ``kind``,
        after letting ``after`` of them through; ``name`` labels the hits. A hit that finds
        nothing to edit (an error answer, no tokens) is given back to the next request."""
        assert kind in KINDS, kind
        with self.lock:
            self.rules.append(Rule(path, kind, after, times, match, params, name or kind))

    def _choose(self, path: str, body: dict[str, Any]) -> Rule | None:
        with self.lock:
            for rule in self.rules:
                if rule.path != path or not rule.match(body):
                    continue
                rule.seen += 1
                if rule.seen > rule.after and rule.remaining > 0:
                    rule.remaining -= 1
                    self.log.hits.append(Hit(rule.name, path, time.time(), str(body.get("request_id", ""))))
                    return rule
            return None

    def _refund(self, rule: Rule) -> None:
        with self.lock:
            rule.remaining += 1
            self.log.hits.pop(max(i for i, h in enumerate(self.log.hits) if h.name == rule.name))

    def pending(self) -> list[str]:
        """Planned faults that no request has hit yet."""
        with self.lock:
            return [f"{r.name} ({r.remaining} left)" for r in self.rules if r.remaining > 0]

    def recovery_times(self) -> list[tuple[str, float | None]]:
        """For each planned fault (all its hits are one episode): its name and the seconds from
        its last hit to the next clean generation answer."""
        with self.lock:
            clean = sorted(self.log.clean)
            out = []
            for rule in self.rules:
                last = max((h.time for h in self.log.hits if h.name == rule.name), default=None)
                later = [t for t in clean if last is not None and t > last]
                out.append((rule.name, later[0] - last if later else None))
            return out


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that timed out and closed its end is one of the faults under test


class _Handler(BaseHTTPRequestHandler):
    proxy: FaultProxy
    protocol_version = "HTTP/1.1"  # keep-alive, like uvicorn

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._handle(b"")

    def do_POST(self) -> None:
        self._handle(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

    def _handle(self, raw: bytes) -> None:
        proxy = self.proxy
        path = urlsplit(self.path).path
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        rule = proxy._choose(path, body if isinstance(body, dict) else {})
        kind = rule.kind if rule else None
        if kind == "status":
            return self._reply(rule.params["status"], b'{"error": "injected by the fault proxy"}')
        if kind == "drop":
            self.close_connection = True
            return
        if kind == "delay":
            time.sleep(rule.params["seconds"])
        status, headers, data = self._forward(raw)
        if kind == "status_after":
            return self._reply(rule.params["status"], b'{"error": "injected after the work was done"}')
        if kind == "cut":
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        if kind == "garbage":
            data = b"<html>502 Bad Gateway from a confused load balancer</html>"
        elif kind == "truncated_json":
            data = data[: len(data) // 2]
        elif kind in ("drop_logprob", "nan_logprob", "label"):
            if status == 200 and _has_tokens(data):
                data = _edit(json.loads(data), kind, rule.params)
            else:  # nothing to edit in an error or an empty answer: the fault waits
                proxy._refund(rule)
        elif status == 200 and path.endswith("/generate") and is_generation(body):
            with proxy.lock:
                proxy.log.clean.append(time.time())
        self._reply(status, data, headers.get("Content-Type", "application/json"))

    def _forward(self, raw: bytes) -> tuple[int, dict[str, str], bytes]:
        up = self.proxy.upstream
        conn = http.client.HTTPConnection(up.hostname, up.port, timeout=600)
        try:
            headers = {
                k: v
                for k, v in self.headers.items()
                if k.lower() not in ("host", "content-length", "connection")
            }
            conn.request(self.command, self.path, body=raw or None, headers=headers)
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            conn.close()

    def _reply(self, status: int, data: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _has_tokens(data: bytes) -> bool:
    try:
        choice = json.loads(data)["choices"][0]
        return bool(choice["token_ids"]) and bool(choice.get("weight_versions"))
    except (ValueError, KeyError, IndexError, TypeError):
        return False


def _edit(answer: dict[str, Any], kind: str, params: dict[str, Any]) -> bytes:
    choice = answer["choices"][0]
    content = choice["logprobs"]["content"]
    if kind == "drop_logprob":
        content.pop()
    elif kind == "nan_logprob":
        content[0]["logprob"] = float("nan")
    else:
        for span in choice.get("weight_versions") or []:
            span["version"] = params["label"]
    return json.dumps(answer).encode()
