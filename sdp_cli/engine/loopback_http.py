"""A lean HTTP/1.1 client for sdp's own engine process on loopback (``engine=local``).

``HttpServer`` (``sdp_cli/engine/http.py``) keeps its timeouts, retries and error messages; this
client only replaces httpx underneath it for the local engine's process. The reason is CPU in
sdp's interpreter, not the network: httpx spent 0.66 ms of the caller's CPU per loopback request
against 0.20 ms for the standard library's ``http.client``, and with the engine in its own process
every request of the rollout producer holds the GIL that the trainer's step needs (docs/benchmarks.md,
``bench/gil.py``: each percent of the GIL another thread holds costs the one-thread step 1–2 ms).

What it does: one keep-alive connection per calling thread (the producer, the scoring pool and
the trainer each have theirs), JSON bodies, the same ``request(method, path, json=, params=,
timeout=)`` call and response fields (``status_code``, ``content``, ``text``, ``json()``) that
``HttpServer`` uses of httpx, and failures raised as the httpx exceptions ``HttpServer`` already
tells apart: ``ConnectError`` (nothing listens: the process is gone or restarting),
``ConnectTimeout``, ``ReadTimeout`` (the process took the request and is slow) and
``RemoteProtocolError`` (the connection closed under a request, e.g. the process was killed). A
connection that failed is closed and the next request opens a new one; an idle one the server
closed (a restarted process) is found and replaced before it is used.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode, urlsplit

import httpx


class LoopbackResponse:
    """The fields of an answer that ``HttpServer`` reads."""

    def __init__(self, status_code: int, content: bytes):
        self.status_code = status_code
        self.content = content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


class LoopbackClient:
    """JSON over HTTP/1.1 to one ``http://host:port`` server, one connection per thread."""

    def __init__(self, base_url: str, *, headers: Mapping[str, str], connect_timeout_s: float, read_timeout_s: float):
        parts = urlsplit(base_url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"the loopback client speaks plain http://host:port, not {base_url!r}")
        self._host = parts.hostname
        self._port = parts.port or 80
        self._prefix = parts.path.rstrip("/")
        self._headers = dict(headers)
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._local = threading.local()
        # every thread's connection, so that close() ends them all
        self._lock = threading.Lock()
        self._open: set[http.client.HTTPConnection] = set()

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,  # noqa: A002 (httpx's name, which HttpServer passes)
        params: Mapping[str, Any] | None = None,
        timeout: Any = None,
    ) -> LoopbackResponse:
        connect_s, read_s = self._timeouts(timeout)
        target = self._prefix + path + (f"?{urlencode(params)}" if params else "")
        body = None if json is None else _dumps(json)
        headers = dict(self._headers)
        if body is not None:
            headers["Content-Type"] = "application/json"
        connection = self._connection(connect_s)
        try:
            connection.request(method, target, body=body, headers=headers)
            if connection.sock is not None:
                connection.sock.settimeout(read_s)
            response = connection.getresponse()
            content = response.read()
        except BaseException as exc:
            connecting = connection.sock is None  # the connection was never made
            self._drop(connection)
            mapped = _as_httpx(exc, connecting=connecting)
            if mapped is exc:
                raise
            raise mapped from exc
        if response.will_close:
            self._drop(connection)
        return LoopbackResponse(response.status, content)

    def close(self) -> None:
        with self._lock:
            connections, self._open = list(self._open), set()
        for connection in connections:
            connection.close()

    def _timeouts(self, timeout: Any) -> tuple[float, float]:
        if isinstance(timeout, httpx.Timeout):
            return (timeout.connect or self._connect_timeout_s, timeout.read or self._read_timeout_s)
        return self._connect_timeout_s, self._read_timeout_s

    def _connection(self, connect_s: float) -> http.client.HTTPConnection:
        connection = getattr(self._local, "connection", None)
        if connection is not None and connection.sock is not None and _closed_by_peer(connection.sock):
            # an idle connection has nothing to read unless the server closed it (a restarted
            # process): drop it before it is used, as httpx's pool does
            self._drop(connection)
            connection = None
        if connection is None:
            connection = http.client.HTTPConnection(self._host, self._port, timeout=connect_s)
            self._local.connection = connection
            with self._lock:
                self._open.add(connection)
        return connection

    def _drop(self, connection: http.client.HTTPConnection) -> None:
        connection.close()
        if getattr(self._local, "connection", None) is connection:
            self._local.connection = None
        with self._lock:
            self._open.discard(connection)


def _closed_by_peer(sock: socket.socket) -> bool:
    """An idle keep-alive socket is readable only at EOF (or an error): the server closed it."""
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


def _dumps(body: Any) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _as_httpx(exc: BaseException, *, connecting: bool) -> BaseException:
    """The httpx exception ``HttpServer`` handles for a failure of the socket layer; anything
    else (a KeyboardInterrupt, a bug) as it is."""
    if isinstance(exc, socket.timeout):  # TimeoutError
        return httpx.ConnectTimeout("timed out connecting") if connecting else httpx.ReadTimeout("timed out")
    if isinstance(exc, ConnectionRefusedError):
        return httpx.ConnectError(f"connection refused ({exc.strerror or exc})")
    if isinstance(exc, (http.client.HTTPException, ConnectionError)):
        return httpx.RemoteProtocolError(f"{type(exc).__name__}: {exc}")
    if isinstance(exc, OSError):
        return httpx.ConnectError(str(exc)) if connecting else httpx.ReadError(f"{type(exc).__name__}: {exc}")
    return exc
