"""HTTP transport for the remote engines: timeouts, retries with backoff, keep-alive, auth.

One ``HttpServer`` per server base URL. It speaks JSON, retries what is safe to retry
(connection failures and 5xx answers) with exponential backoff, and turns every failure into an
``EngineError`` whose one-line message names the address and what to do. The API key travels in
the ``Authorization`` header only; it is never part of a message, a log line or a ``repr``.

Keep-alive: uvicorn (vLLM, SGLang) closes idle connections after 5 s, so a pooled connection
that sat idle through a trainer step may be dead when it is reused. The pool drops idle
connections after ``keepalive_expiry_s`` (below 5 s), and a request that still meets a closed
connection fails before the server saw it and is retried.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from sdp_cli.engine.base import EngineError, EngineUnavailable
from sdp_cli.engine.loopback_http import LoopbackClient, LoopbackResponse

logger = logging.getLogger(__name__)

#: HTTP statuses worth retrying: the server is overloaded, restarting or behind a failing proxy
RETRY_STATUSES = frozenset({500, 502, 503, 504})


@dataclass(frozen=True)
class HttpOptions:
    """Timeouts, retries and credentials of every request to a remote engine server."""

    #: seconds to open a TCP connection
    connect_timeout_s: float = 10.0
    #: seconds to wait for a generation or scoring answer (long responses take minutes)
    request_timeout_s: float = 600.0
    #: seconds to wait for admin calls; loading a large checkpoint from disk takes minutes
    admin_timeout_s: float = 900.0
    #: extra attempts after a connection failure or a 5xx answer (0 = no retry)
    max_retries: int = 3
    #: delay before the first retry; doubles on each further retry
    backoff_initial_s: float = 0.5
    #: upper bound of the retry delay
    backoff_max_s: float = 8.0
    #: idle pooled connections are dropped after this long (uvicorn closes them after 5 s)
    keepalive_expiry_s: float = 2.0
    #: connections kept per server
    max_connections: int = 256
    #: sent as ``Authorization: Bearer <key>``; never logged
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        for name in (
            "connect_timeout_s",
            "request_timeout_s",
            "admin_timeout_s",
            "keepalive_expiry_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("need 0 <= backoff_initial_s <= backoff_max_s")

    def backoff(self, attempt: int) -> float:
        """Delay before retry number ``attempt`` (0-based): initial · 2^attempt, capped."""
        return min(self.backoff_initial_s * (2.0**attempt), self.backoff_max_s)


class HttpServer:
    """JSON over HTTP to one server, safe to share between threads."""

    def __init__(
        self,
        base_url: str,
        options: HttpOptions,
        *,
        label: str = "server",
        unavailable_hint: str = "check that the server is running and the address is right",
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] | None = None,
        loopback: bool = False,
    ):
        self.base_url = base_url.rstrip("/")
        self.options = options
        self.label = label
        self._hint = unavailable_hint
        self._closed = threading.Event()
        # Interruptible wait: close() wakes a thread that is backing off.
        self._sleep = sleep if sleep is not None else self._closed.wait
        headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        # sdp's own engine process: a lean client, whose requests hold sdp's GIL a third as long
        # (sdp_cli/engine/loopback_http.py); the same retries and errors as below
        self._client: httpx.Client | LoopbackClient
        if loopback:
            if transport is not None:
                raise ValueError("a loopback HttpServer takes no httpx transport")
            self._client = LoopbackClient(
                self.base_url,
                headers=headers,
                connect_timeout_s=options.connect_timeout_s,
                read_timeout_s=options.request_timeout_s,
            )
        else:
            self._client = httpx.Client(
                base_url=self.base_url,
                headers=headers,
                timeout=httpx.Timeout(options.request_timeout_s, connect=options.connect_timeout_s),
                limits=httpx.Limits(
                    max_connections=options.max_connections,
                    max_keepalive_connections=options.max_connections,
                    keepalive_expiry=options.keepalive_expiry_s,
                ),
                transport=transport,
            )

    def __repr__(self) -> str:
        return f"HttpServer({self.base_url!r})"

    def get(self, path: str, *, timeout: float | None = None, retry: bool = True) -> Any:
        return self.request("GET", path, timeout=timeout, retry=retry)

    def post(
        self,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        retry: bool = True,
        refresh: Callable[[], Mapping[str, Any]] | None = None,
        answer_statuses: Collection[int] = (),
    ) -> Any:
        return self.request(
            "POST", path, body=body, params=params, timeout=timeout, retry=retry, refresh=refresh,
            answer_statuses=answer_statuses,
        )  # fmt: skip

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        retry: bool = True,
        refresh: Callable[[], Mapping[str, Any]] | None = None,
        answer_statuses: Collection[int] = (),
    ) -> Any:
        """Send one request and return its decoded JSON (``None`` for an empty body).

        ``refresh`` builds the body of each retry (a generation retry needs a fresh request
        id: servers reject a duplicate of one they may still be running). Answers with a
        status in ``answer_statuses`` are decoded and returned instead of raising (for routes
        whose error answers carry a message the caller reports).
        """
        where = f"{method} {self.base_url}{path}"
        attempts = 1 + (self.options.max_retries if retry else 0)
        last_failure = ""
        unreachable = False  # the last attempt never reached the server
        for attempt in range(attempts):
            if self._closed.is_set():
                raise EngineError(f"{where}: the engine was closed")
            if attempt > 0:
                delay = self.options.backoff(attempt - 1)
                logger.info(
                    "%s failed (%s); retry %d/%d in %.1f s",
                    where,
                    last_failure,
                    attempt,
                    attempts - 1,
                    delay,
                )
                self._sleep(delay)
                if refresh is not None:
                    body = refresh()
            try:
                response = self._client.request(
                    method,
                    path,
                    json=None if body is None else dict(body),
                    params=None if params is None else dict(params),
                    # None would disable every timeout: without one, use the client's
                    timeout=httpx.USE_CLIENT_DEFAULT
                    if timeout is None
                    else httpx.Timeout(timeout, connect=self.options.connect_timeout_s),
                )
            except httpx.TimeoutException as exc:
                if isinstance(exc, (httpx.ConnectTimeout, httpx.PoolTimeout)):
                    last_failure = f"connection timed out after {self.options.connect_timeout_s} s"
                    unreachable = True
                    continue
                # A read timeout means the server took the request and is slow: retrying adds load.
                raise EngineError(
                    f"{where} got no answer within {timeout or self.options.request_timeout_s} s; "
                    "raise engine.request_timeout_s or check the server's log"
                ) from None
            except httpx.TransportError as exc:
                if self._closed.is_set():
                    raise EngineError(f"{where}: the engine was closed") from None
                last_failure = _describe_transport_error(exc)
                unreachable = isinstance(exc, httpx.ConnectError)
                continue
            if response.status_code in RETRY_STATUSES:
                last_failure = f"HTTP {response.status_code}: {_excerpt(response.text)}"
                unreachable = False
                continue
            return self._decode(where, response, answer_statuses)
        if unreachable:
            raise EngineUnavailable(
                f"cannot reach the {self.label} at {self.base_url} ({last_failure}); {self._hint}"
            )
        raise EngineError(f"{where} failed after {attempts} attempt(s): {last_failure}")

    def _decode(
        self, where: str, response: httpx.Response | LoopbackResponse, answer_statuses: Collection[int] = ()
    ) -> Any:
        if response.status_code >= 400 and response.status_code not in answer_statuses:
            _raise_for_status(where, response)
        if not response.content.strip():
            return None
        try:
            return response.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise EngineError(
                f"{where} answered malformed JSON: {_excerpt(response.text)}"
            ) from None

    def close(self) -> None:
        self._closed.set()
        self._client.close()


def _raise_for_status(where: str, response: httpx.Response | LoopbackResponse) -> None:
    status, text = response.status_code, _excerpt(response.text)
    if status in (401, 403):
        raise EngineError(
            f"{where} was refused with HTTP {status} ({text}); set engine.api_key to the server's key "
            "and check the server flags in docs/engines.md"
        )
    if status == 404:
        raise EngineError(
            f"{where} answered HTTP 404: the server lacks this route; check its version and flags in docs/engines.md"
        )
    raise EngineError(f"{where} answered HTTP {status}: {text}")


def _describe_transport_error(exc: httpx.TransportError) -> str:
    if isinstance(exc, httpx.ConnectError):
        return str(exc) or "connection failed"
    if isinstance(exc, httpx.RemoteProtocolError):
        return f"server closed the connection: {exc}"
    return f"{type(exc).__name__}: {exc}"


def _excerpt(text: str, limit: int = 300) -> str:
    """A one-line excerpt of a server answer for error messages."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit] + "…"
