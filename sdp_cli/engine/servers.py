"""Launching, restarting and stopping inference servers (vLLM, SGLang, the local engine's process).

sdp can run the server itself, typically from another virtualenv (the server's Python is
configurable), or attach to one that is already running. ``ServerLaunch`` holds what every
launched server takes (the engines' launch configs extend it); ``ManagedServer`` runs one. A
launched server writes its output to a log file; readiness is a health route answering 200, and
a process that exits during startup is reported at once with the end of its log. A launched
server whose process exited (a crash, a kill) is started again on the same port by ``revive``,
which the engine calls when the server stops answering (docs/reliability.md "Engine faults").
A server that knows nothing of sdp (vLLM, SGLang) runs under ``server_guard.py``, which ends it
when sdp is gone (a kill -9 included), with a temporary directory of its own (``TMPDIR``) that is
removed once it has ended, however it ended: vLLM leaves its ZMQ sockets and a torch.distributed
store there even when it is stopped cleanly. sdp's own engine process does both itself.

A server's first start may take a process started ahead of it (``prestarted``: sdp's engine
process, which imports while sdp loads the policy, docs/engines.md "The local engine's process");
a restart always starts a new one.
"""

from __future__ import annotations

import getpass
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from sdp_cli.engine.base import EngineUnavailable
from sdp_cli.fileio import open_in_place

logger = logging.getLogger(__name__)

#: runs a launched server and ends it when sdp is gone (a script: only the standard library)
GUARD = Path(__file__).with_name("server_guard.py")


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
    #: the server ends itself once sdp is gone and keeps its files to a scratch directory sdp
    #: gave it (sdp's local engine process); otherwise it runs under server_guard.py
    watches_parent: bool = False
    #: seconds a server is given to exit after SIGTERM before it is killed
    stop_grace_s: float = 20.0

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


@dataclass(frozen=True)
class ServerLaunch:
    """What every server sdp launches takes; each engine's launch config adds its own fields."""

    #: model directory (Hugging Face layout) or hub id the server loads at start
    model: str
    #: Python interpreter of the virtualenv that has the server installed
    python: str = sys.executable
    host: str = "127.0.0.1"
    #: 0 picks a free port
    port: int = 0
    dtype: str = "auto"
    seed: int = 0
    #: further command-line flags for the server
    extra_args: tuple[str, ...] = ()
    #: further environment variables for the server
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 600.0

    def command(self, module: str, port: int, *, model_flag: str = "--model", seed_flag: str = "--seed") -> list[str]:
        """``python -m module`` with the model, address, dtype and seed flags (the server's names)."""
        return [
            self.python, "-m", module,
            model_flag, self.model,
            "--host", self.host,
            "--port", str(port),
            "--dtype", self.dtype,
            seed_flag, str(self.seed),
        ]  # fmt: skip

    def spec(
        self,
        label: str,
        command: list[str],
        *,
        port: int,
        env: Mapping[str, str],
        health_path: str,
        log_path: Path,
        secrets: Sequence[str] = (),
        watches_parent: bool = False,
    ) -> LaunchSpec:
        """The ``LaunchSpec`` of ``command`` (``extra_args`` go last, so they may override a flag)."""
        return LaunchSpec(
            label=label,
            command=[*command, *self.extra_args],
            env=env,
            host=self.host,
            port=port,
            health_path=health_path,
            log_path=log_path,
            startup_timeout_s=self.startup_timeout_s,
            secrets=tuple(secrets),
            watches_parent=watches_parent,
        )


def _scratch_dir(env: Mapping[str, str]) -> Path:
    """A new temporary directory for one server process, inside the one it would use otherwise
    (its ``TMPDIR``, else ours). torch keeps its compile caches in ``torchinductor_<user>`` there
    (some of its code finds it from the temporary directory alone, whatever
    ``TORCHINDUCTOR_CACHE_DIR`` says, e.g. its precompiled C++ headers): a link of that name to
    the shared one keeps them shared between starts."""
    base = env.get("TMPDIR") or tempfile.gettempdir()
    try:
        scratch = Path(tempfile.mkdtemp(prefix="sdp-server-", dir=base))
    except OSError as exc:
        raise EngineUnavailable(
            f"cannot make the server's temporary directory in {base}: {exc.strerror}; "
            "set TMPDIR (or engine.env.TMPDIR) to a writable directory"
        ) from None
    # the name torch gives it (torch/_inductor/runtime/cache_dir_utils.py default_cache_dir)
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    cache = "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)
    try:
        os.makedirs(os.path.join(base, cache), exist_ok=True)
        os.symlink(os.path.join(base, cache), scratch / cache)
    except OSError:
        pass  # no shared cache: the server builds its own in its directory
    return scratch


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the server binds it right after)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


#: a process started ahead of a server's launch, told to run it: ``(spec, env)`` (the environment
#: the launch would give a new process) -> the process, or None when it cannot (a new one starts)
Prestarted = Callable[[LaunchSpec, Mapping[str, str]], "subprocess.Popen[bytes] | None"]


class ManagedServer:
    """A server process started by sdp; ``revive()`` starts it again if it exited, ``stop()`` (or
    the context manager) ends it for good. ``prestarted``: what the first start takes instead of
    a new process, if it can (see the module docstring)."""

    def __init__(self, spec: LaunchSpec, *, prestarted: Prestarted | None = None):
        self.spec = spec
        self._prestarted = prestarted
        self._process: subprocess.Popen[bytes] | None = None
        #: set by stop(): no revive, and a start in progress gives up
        self._stopped = threading.Event()
        #: serialises revives (every thread that finds the server gone may ask for one)
        self._revive_lock = threading.Lock()
        #: times the process was started again after it exited
        self.restarts = 0
        #: pid -> the temporary directory that process was given (removed when it has ended)
        self._scratch: dict[int, Path] = {}

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
        if shutil.which(spec.command[0], path=env.get("PATH")) is None:
            raise EngineUnavailable(
                f"cannot start the {spec.label} ({self._redacted(spec.command[:1])}: not found, or not executable); "
                "set engine.python to the server virtualenv's python"
            )
        prestarted, self._prestarted = self._prestarted, None  # the first start only
        if not self._launch(env, prestarted):
            self._launch(env, None)
        return self

    def _launch(self, env: dict[str, str], prestarted: Prestarted | None) -> bool:
        """Start the process (the one ``prestarted`` hands over, where it does) and wait until it
        answers. False, with the log saying so, when the process started ahead ended as it took
        the launch (killed between the check that it lives and the handover): the caller then
        starts a new process, as it would have without one."""
        spec = self.spec
        env = dict(env)
        # the log is in the run directory: never written through a link (sdp_cli/fileio.py)
        with open_in_place(spec.log_path, "ab") as log:
            command, scratch = spec.command, None
            if not spec.watches_parent:
                scratch = _scratch_dir(env)
                env["TMPDIR"] = str(scratch)
                command = [
                    sys.executable, "-I", str(GUARD),
                    "--parent-pid", str(os.getpid()), "--scratch", str(scratch),
                    "--grace-s", repr(spec.stop_grace_s), "--", *command,
                ]  # fmt: skip
            process = prestarted(spec, env) if prestarted is not None and scratch is None else None
            handed = process
            try:
                # Its own session, so stop() can end the server's worker processes too, and a
                # Ctrl-C at the terminal reaches sdp only (which stops the server at its end).
                process = process or subprocess.Popen(
                    command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                )
            except OSError as exc:
                if scratch is not None:
                    shutil.rmtree(scratch, ignore_errors=True)
                raise EngineUnavailable(
                    f"cannot start the {spec.label} ({self._redacted(spec.command[:1])}: {exc.strerror}); "
                    "set engine.python to the server virtualenv's python"
                ) from None
        if scratch is not None:
            self._scratch[process.pid] = scratch
        self._process = process
        try:
            self._wait_ready(process)
        except EngineUnavailable:
            ended_itself = process.poll() is not None
            self._end_failed(process)
            if process is not handed or not ended_itself:
                raise
            with open_in_place(spec.log_path, "ab") as log:
                log.write(f"sdp: the process {process.pid} started ahead ended with code {process.returncode} "
                          "as it took the launch; a new process starts\n".encode())  # fmt: skip
            return False
        except BaseException:
            self._end_failed(process)
            raise
        return True

    def _end_failed(self, process: subprocess.Popen[bytes]) -> None:
        """End a process whose start failed and forget it."""
        self._end(process)
        if self._process is process:
            self._process = None

    def _wait_ready(self, process: subprocess.Popen[bytes]) -> None:
        spec = self.spec
        deadline = time.monotonic() + spec.startup_timeout_s
        url = spec.base_url + spec.health_path
        with httpx.Client(timeout=httpx.Timeout(5.0)) as client:
            while True:
                if self._stopped.is_set():
                    raise EngineUnavailable(f"the {spec.label} was stopped while it started")
                try:
                    if client.get(url).status_code == 200:
                        logger.info("%s ready at %s", spec.label, spec.base_url)
                        return
                except httpx.TransportError:
                    pass  # not listening yet
                try:
                    code = process.wait(timeout=spec.poll_interval_s)
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

    def revive(self) -> bool:
        """Start the server again, on the same port, if its process has exited (or an earlier
        revive failed); True if it did. Raises EngineUnavailable when the new process does not
        become ready (``start``). Call it on a started server only."""
        with self._revive_lock:
            process = self._process
            if self._stopped.is_set() or (process is not None and process.poll() is None):
                return False
            logger.warning(
                "%s (pid %s) exited with code %s; starting it again (log: %s): %s",
                self.spec.label, process and process.pid, process and process.returncode,
                self.spec.log_path, self.log_tail(),
            )  # fmt: skip
            self.restarts += 1
            if process is not None:
                self._discard_scratch(process)
            self.start()
            return True

    def log_tail(self, lines: int = 3) -> str:
        """The last lines of the server's log, joined into one line."""
        try:
            text = self.spec.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        tail = [line.strip() for line in text.strip().splitlines()[-lines:]]
        return self._redacted(" | ".join(tail)) if tail else "(empty log)"

    def stop(self) -> None:
        """Terminate the server's process group; kill it if it has not exited after the spec's
        ``stop_grace_s``."""
        self._stopped.set()
        process, self._process = self._process, None
        if process is not None:
            self._end(process)

    def _end(self, process: subprocess.Popen[bytes]) -> None:
        """SIGTERM the process group of ``process``, then SIGKILL after ``stop_grace_s``; reaps it
        and removes its temporary directory."""
        try:
            if process.poll() is not None:
                return
            for sig, wait_s in ((signal.SIGTERM, self.spec.stop_grace_s), (signal.SIGKILL, 10.0)):
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
        finally:
            self._discard_scratch(process)

    def _discard_scratch(self, process: subprocess.Popen[bytes]) -> None:
        scratch = self._scratch.pop(process.pid, None)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)

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
