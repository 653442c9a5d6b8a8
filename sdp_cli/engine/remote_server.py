"""One inference server as the remote engine sees it: its requests in flight, and the
outage/restore state machine that makes sure it runs sdp's weights (docs/reliability.md
"Engine faults").

States of a server:

    answering ──(no answer after the transport's retries, or a label sdp never sets)──▶ suspect
    suspect ──restore()──▶ answering

``restore()`` waits up to ``reconnect_timeout_s`` for the server to answer (a server sdp launched
whose process exited is started again meanwhile: ``revive``) and reads its weight-version label. sdp's own label means the weights are still there; a label sdp never sets
means it restarted: the current version's weights are reloaded (or only the label is set while
the servers still run their start-up weights); another number means another client changed the
weights, an error. Every field is guarded by the engine's condition ``cond``, which also wakes a
``pause()`` waiting for the server's requests and restores to end.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from sdp_cli.engine.base import EngineError, EngineUnavailable
from sdp_cli.engine.http import HttpServer
from sdp_cli.engine.wire import is_version_label, new_request_id, version_label

logger = logging.getLogger(__name__)


class ServerWeights(Protocol):
    """What a restore asks of the engine: the dialect's weight calls and the current weights."""

    def _server_get_version(self, server: RemoteServer) -> str | None: ...

    def _server_set_version(self, server: RemoteServer, label: str) -> None: ...

    def _server_load_weights(self, server: RemoteServer, path: Path, label: str) -> None: ...

    def current_weights(self) -> tuple[int, Path | None]:
        """The engine's version and the directory of its weights (None: start-up weights)."""
        ...


@dataclass(eq=False)
class RemoteServer:
    """One server the engine talks to: requests in flight, load, and outage state."""

    http: HttpServer
    #: the engine's name, for messages ("vllm", "sglang")
    engine_name: str = "remote"
    #: the engine's condition; every field below is read and written while holding it
    cond: threading.Condition = field(default_factory=threading.Condition)
    #: how long a server that stopped answering may take to come back
    reconnect_timeout_s: float = 300.0
    #: requests in flight (the engine sends new work to the least loaded server)
    load: int = 0
    #: ids of this client's requests in flight on the server
    request_ids: set[str] = field(default_factory=set)
    #: the server may have lost sdp's weights (it stopped answering or restarted): check its
    #: label and restore the weights before it is used again
    suspect: bool = False
    #: generation threads restoring the server now; pause() waits for them
    restoring: int = 0
    #: incremented by every restore: an abort or error that spans one was caused by it
    restore_epoch: int = 0
    #: set when the engine closes: a wait for the server to come back stops
    closed: bool = False
    #: suspect states resolved, and restores that reloaded or relabelled weights
    restore_checks: int = 0
    restores: int = 0
    #: serialises restores and weight updates of this server
    weights_lock: threading.Lock = field(default_factory=threading.Lock)
    #: starts a server sdp launched again if its process exited (``ManagedServer.revive``);
    #: None for a server sdp attached to
    revive: Callable[[], object] | None = None

    @property
    def url(self) -> str:
        return self.http.base_url

    @property
    def busy(self) -> bool:
        """Requests in flight or a restore in progress (lock held)."""
        return bool(self.request_ids) or self.restoring > 0

    # ----------------------------------------------------------------- requests
    def admit(self) -> list[str]:
        """Count a request and register its id in one step (lock held), so that a pause()
        from now on waits for it. Returns the request's id list (retries append to it)."""
        self.load += 1
        request_ids = [new_request_id()]
        self.request_ids.add(request_ids[0])
        return request_ids

    def retry_id(self, request_ids: list[str]) -> str:
        """A new id for a retry of a request, remembered so that pause() and close() abort it."""
        request_id = new_request_id()
        with self.cond:
            request_ids.append(request_id)
            self.request_ids.add(request_id)
        return request_id

    def end_request(self, request_ids: list[str]) -> None:
        """Forget a finished request (lock held); wakes a pause() waiting for it."""
        self.load -= 1
        self.request_ids.difference_update(request_ids)
        self.cond.notify_all()

    # ------------------------------------------------------------ outage and restore
    def mark_suspect(self) -> None:
        with self.cond:
            self.suspect = True

    def restore(self, weights: ServerWeights) -> None:
        """Make a suspect server run sdp's current weights under sdp's label again (see the
        module docstring); a server that goes away again stays suspect."""
        with self.weights_lock:
            if not self.suspect:
                return  # another thread restored it meanwhile
            label = self.wait_until_answering(weights)
            version, path = weights.current_weights()
            expected = version_label(version)
            if label != expected:
                if label is not None and is_version_label(label):
                    raise EngineError(
                        f"{self.url} reports weight version {label!r} while sdp is at {expected!r}; "
                        "another client may be changing this server's weights (give each run its own servers)"
                    )
                logger.warning(
                    "%s reports weight version %r, sdp is at %r (the server restarted?): %s",
                    self.url,
                    label,
                    expected,
                    f"reloading {path}" if path else "relabelling its start-up weights",
                )
                try:
                    if path is None:
                        weights._server_set_version(self, expected)
                    else:
                        weights._server_load_weights(self, path, expected)
                except EngineUnavailable:
                    return  # it went away again: still suspect, the caller tries again
                with self.cond:
                    self.restores += 1
            with self.cond:
                self.suspect = False
                self.restore_epoch += 1
                self.restore_checks += 1

    def wait_until_answering(self, weights: ServerWeights) -> str | None:
        """The server's label once it answers again; EngineUnavailable after
        ``reconnect_timeout_s`` (each try already retries with the transport's backoff)."""
        deadline = time.monotonic() + self.reconnect_timeout_s
        while True:
            try:
                return weights._server_get_version(self)
            except EngineUnavailable as exc:
                if time.monotonic() > deadline:
                    raise EngineUnavailable(
                        f"{exc}; it did not come back within engine.reconnect_timeout_s="
                        f"{self.reconnect_timeout_s:g}"
                    ) from None
            if self.revive is not None:
                try:
                    if self.revive():
                        continue  # started again: ask at once
                except EngineUnavailable as exc:
                    logger.warning("%s could not be started again: %s", self.url, exc)
            with self.cond:
                if self.cond.wait_for(lambda: self.closed, timeout=1.0):
                    raise EngineError(f"engine={self.engine_name} was closed")

    def load_weights(self, weights: ServerWeights, path: Path, label: str) -> None:
        """Load ``path`` under ``label``, waiting up to ``reconnect_timeout_s`` if the server is
        down; a load that found the server lost also counts as a restore."""
        with self.weights_lock:
            deadline = time.monotonic() + self.reconnect_timeout_s
            waited = False
            while True:
                try:
                    weights._server_load_weights(self, path, label)
                    break
                except EngineUnavailable:
                    if time.monotonic() > deadline:
                        raise
                    self.wait_until_answering(weights)
                    waited = True
            with self.cond:
                if self.suspect or waited:
                    self.restores += 1
                self.suspect = False
