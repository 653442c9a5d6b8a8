"""Launching and stopping inference servers (vLLM, SGLang).

sdp can run the server itself, typically from another virtualenv (the server's Python is
configurable), or attach to one that is already running. A launched server writes its output
to a log file in the run directory; readiness is a health route answering 200, and a process
that exits during startup is reported at once with the end of its log.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from sdp_cli.engine.base import EngineUnavailable
from sdp_cli.fileio import open_in_place

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to start one server process and to know when it is ready."""

    #: what the server is, for messages ("vLLM server")
    label: str
    #: may hold an API key (SGLang takes it only as a flag): never in the repr
    command: list[str] = field(repr=False)
    #: variables added to the parent's environment (may hold an API key: never in the repr)
    env: Mapping[str, str] = field(repr=False)
    host: str
    port: int
    #: GET route that answers 200 once the server can generate
    health_path: str
    log_path: Path
    startup_timeout_s: float = 600.0
    #: seconds between readiness probes (the wait also watches for the process exiting)
    poll_interval_s: float = 0.5
    #: command-line values hidden in logs (API keys)
    secrets: Sequence[str] = field(default=(), repr=False)

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the server binds it right after)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class ManagedServer:
    """A server process started by sdp; ``stop()`` (or the context manager) ends it."""

    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return self.spec.base_url

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> ManagedServer:
        """Start the process and return once its health route answers 200."""
        spec = self.spec
        if spec.port == 0:
            raise ValueError("LaunchSpec.port must be a real port; use free_port()")
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        logger.info(
            "starting %s: %s (log: %s)", spec.label, self._redacted(spec.command), spec.log_path
        )
        env = {**os.environ, **spec.env}
        # the log is in the run directory: never written through a link (sdp_cli/fileio.py)
        with open_in_place(spec.log_path, "ab") as log:
            try:
                # Its own session, so stop() can end the server's worker processes too.
                self._process = subprocess.Popen(
                    spec.command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                )
            except OSError as exc:
                raise EngineUnavailable(
                    f"cannot start the {spec.label} ({self._redacted(spec.command[:1])}: {exc.strerror}); "
                    "set engine.python to the server virtualenv's python"
                ) from None
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        spec = self.spec
        assert self._process is not None
        deadline = time.monotonic() + spec.startup_timeout_s
        url = spec.base_url + spec.health_path
        with httpx.Client(timeout=httpx.Timeout(5.0)) as client:
            while True:
                try:
                    if client.get(url).status_code == 200:
                        logger.info("%s ready at %s", spec.label, spec.base_url)
                        return
                except httpx.TransportError:
                    pass  # not listening yet
                try:
                    code = self._process.wait(timeout=spec.poll_interval_s)
                except subprocess.TimeoutExpired:
                    code = None
                if code is not None:
                    raise EngineUnavailable(
                        f"the {spec.label} exited with code {code} during startup: {self.log_tail()}; "
                        f"full log in {spec.log_path}"
                    )
                if time.monotonic() > deadline:
                    raise EngineUnavailable(
                        f"the {spec.label} at {spec.base_url} was not ready after {spec.startup_timeout_s:.0f} s; "
                        f"see {spec.log_path} or raise engine.startup_timeout_s"
                    )

    def log_tail(self, lines: int = 3) -> str:
        """The last lines of the server's log, joined into one line."""
        try:
            text = self.spec.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        tail = [line.strip() for line in text.strip().splitlines()[-lines:]]
        return self._redacted(" | ".join(tail)) if tail else "(empty log)"

    def stop(self, grace_s: float = 20.0) -> None:
        """Terminate the server's process group; kill it if it has not exited after ``grace_s``."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                return
            try:
                process.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                logger.warning(
                    "%s (pid %d) ignored signal %s", self.spec.label, process.pid, sig.name
                )

    def _redacted(self, value: Sequence[str] | str) -> str:
        text = value if isinstance(value, str) else " ".join(value)
        for secret in self.spec.secrets:
            if secret:
                text = text.replace(secret, "***")
        return text

    def __enter__(self) -> ManagedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
