"""The lean loopback client under ``HttpServer`` (engine=local), against a real server on
loopback: answers, keep-alive per thread, many threads at once, and every failure mapped to what
``HttpServer`` retries or reports (sdp_cli/engine/loopback_http.py)."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from sdp_cli.engine.base import EngineError, EngineUnavailable
from sdp_cli.engine.http import HttpOptions, HttpServer
from sdp_cli.engine.loopback_http import LoopbackClient
from sdp_cli.engine.servers import free_port


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int = 0):
        super().__init__(("127.0.0.1", port), _Handler)
        self.lock = threading.Lock()
        self.connections = 0
        self.sockets: list[socket.socket] = []
        self.seen: list[dict] = []
        #: how the next requests are answered: "ok", "drop" (close without answering), "slow"
        self.behaviour: list[str] = []

    def kill(self) -> None:
        """What a killed process leaves: no listener, every connection closed."""
        self.shutdown()
        self.server_close()
        for sock in self.sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def setup(self) -> None:
        super().setup()
        with self.server.lock:
            self.server.connections += 1
            self.server.sockets.append(self.connection)

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        self._answer(None)

    def do_POST(self) -> None:  # noqa: N802
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._answer(json.loads(raw))

    def _answer(self, body) -> None:
        with self.server.lock:
            how = self.server.behaviour.pop(0) if self.server.behaviour else "ok"
            self.server.seen.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        if how == "drop":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if how == "slow":
            time.sleep(1.0)
        data = json.dumps({"path": self.path, "echo": body, "thread": threading.get_ident()}).encode()
        self.send_response(200 if how != "error" else 503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server():
    srv = _Server()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.kill()


def _url(srv: _Server) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


def _http(srv_url: str, **options) -> HttpServer:
    defaults = dict(connect_timeout_s=2.0, request_timeout_s=5.0, max_retries=2, backoff_initial_s=0.01, backoff_max_s=0.02)
    return HttpServer(srv_url, HttpOptions(**{**defaults, **options}, api_key="k3y"), loopback=True)


def test_json_round_trip_with_key_params_and_one_connection_per_thread(server):
    http = _http(_url(server))
    assert http.post("/generate", {"a": [1, 2.5, None]}) == {"path": "/generate", "echo": {"a": [1, 2.5, None]}, "thread": http.get("/health")["thread"]}
    assert http.get("/weight_version")["path"] == "/weight_version"
    assert http.post("/x", {"b": 1}, params={"n": 3, "s": "a b"})["path"] == "/x?n=3&s=a+b"
    assert {s["auth"] for s in server.seen} == {"Bearer k3y"}
    assert server.connections == 1  # kept alive across the four requests
    http.close()


def test_many_threads_at_once_each_get_their_own_answers(server):
    http = _http(_url(server))
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for i in range(25):
                body = {"worker": worker, "i": i, "payload": list(range(i))}
                assert http.post("/generate", body)["echo"] == body
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert len(server.seen) == 12 * 25
    assert server.connections <= 12
    http.close()


def test_nothing_listening_is_unavailable_after_the_retries():
    http = _http(f"http://127.0.0.1:{free_port('127.0.0.1')}")
    with pytest.raises(EngineUnavailable, match="cannot reach the server .*connection refused"):
        http.get("/health")


def test_a_slow_answer_is_a_read_timeout_not_a_retry(server):
    server.behaviour = ["slow"]
    http = _http(_url(server))
    with pytest.raises(EngineError, match="got no answer within 0.3 s"):
        http.post("/generate", {}, timeout=0.3)
    assert len(server.seen) == 1  # a read timeout is not retried: the server took the request
    assert http.post("/generate", {"after": 1})["echo"] == {"after": 1}  # a new connection works


def test_a_connection_closed_under_a_request_is_retried(server):
    server.behaviour = ["drop"]
    http = _http(_url(server))
    assert http.post("/generate", {"n": 1})["echo"] == {"n": 1}
    assert [s["body"] for s in server.seen] == [{"n": 1}, {"n": 1}]


def test_a_restarted_server_is_reached_again_through_a_new_connection(server):
    port = server.server_address[1]
    http = _http(_url(server))
    assert http.get("/health")["path"] == "/health"
    server.kill()  # the kept-alive connection is now dead
    again = _Server(port)
    threading.Thread(target=again.serve_forever, daemon=True).start()
    try:
        # not retried (as an abort by ids is not): the dead connection is found before it is
        # used, as httpx's pool does, so the request is sent once, on a new connection
        assert http.post("/abort", {"v": 2}, retry=False)["echo"] == {"v": 2}
        assert [s["body"] for s in again.seen] == [{"v": 2}]
        assert again.connections == 1
    finally:
        again.kill()


def test_5xx_answers_are_retried_then_reported(server):
    server.behaviour = ["error", "error", "error"]
    http = _http(_url(server))
    with pytest.raises(EngineError, match="failed after 3 attempt"):
        http.post("/generate", {})


def test_close_ends_every_threads_connection(server):
    client = LoopbackClient(_url(server), headers={}, connect_timeout_s=1.0, read_timeout_s=1.0)
    threads = [threading.Thread(target=client.request, args=("GET", "/health")) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(client._open) == 4
    client.close()
    assert not client._open


def test_a_loopback_server_takes_no_transport_and_only_plain_http():
    with pytest.raises(ValueError, match="no httpx transport"):
        HttpServer("http://127.0.0.1:1", HttpOptions(), loopback=True, transport=httpx.MockTransport(lambda r: None))
    with pytest.raises(ValueError, match="plain http"):
        LoopbackClient("https://127.0.0.1:1", headers={}, connect_timeout_s=1.0, read_timeout_s=1.0)
