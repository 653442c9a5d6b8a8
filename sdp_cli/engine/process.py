"""``engine=local``: sdp's own engine in its own process, spoken to as a remote engine.

The process (``sdp_cli/engine/process_server.py``) runs a ``LocalEngine`` with its own
interpreter and torch threads. The rollout side reaches it (from the rollout process: docs/training.md
"Three processes") through ``RemoteEngine``, the path the vLLM and SGLang clients take: segments, versions checked
against labels, pause by abort and resubmission with re-prefill, restores after an outage. This
dialect sends batches (``batched_requests``): one request per round of segments, decoded by the
engine as one batch, and one scoring request per pass.

Weights (docs/engines.md "The local engine's process"): the start-up policy and every push are
safetensors files in a scratch directory on tmpfs (``/dev/shm``, else the temporary directory),
written by sdp (``prepare``; a push by sdp's process into its slot, ``WeightSlots``, or here from a
state dict) and read by the process; nothing is pickled. The current version's file stays until
a newer one is loaded, so that a restarted process gets it again. The process is launched like a
server (``servers.ManagedServer``): loopback only, a random token in its environment, a log in
``<run>/logs/local_engine.log``; a process that exited is started again when it stops answering.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdp_cli.engine.base import EngineError, WeightUpdate
from sdp_cli.engine.http import HttpOptions
from sdp_cli.engine.process_server import TOKEN_ENV
from sdp_cli.engine.remote import RemoteEngine, RemoteOptions
from sdp_cli.engine.remote_server import RemoteServer
from sdp_cli.engine.servers import LaunchSpec, ManagedServer, ServerLaunch, free_port
from sdp_cli.engine.wire import (
    Segment,
    SegmentRequest,
    as_logprobs,
    as_token_ids,
    expand_spans,
    malformed,
)
from sdp_cli.errors import UserError
from sdp_cli.faults import fault_point
from sdp_cli.fileio import open_in_place
from sdp_cli.processes import SCRATCH_ENV, make_scratch, sdp_pythonpath

LOG_NAME = "local_engine.log"
#: the file a weight push writes (the layout ``_local_weights.read_safetensors_dir`` reads)
WEIGHTS_FILE = "model.safetensors"
#: the scratch directory's start-up weights (``ProcessEngine.prepare``)
LAUNCH_DIR = "launch"
#: what the process runs (``python -m``)
SERVER_MODULE = "sdp_cli.engine.process_server"


@dataclass(frozen=True)
class ProcessLaunchConfig(ServerLaunch):
    """How sdp starts its local engine's process (``ServerLaunch`` with sdp's python, on loopback,
    and the ``LocalEngine`` settings)."""

    temperature: float = 1.0
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    max_batch_size: int = 256
    #: torch threads of the process (None: torch's default, every core)
    threads: int | None = None
    device: str = "cpu"
    #: the policy's attention implementation (the process builds the same model)
    attn_implementation: str | None = None
    startup_timeout_s: float = 300.0


def local_http_options(request_timeout_s: float) -> HttpOptions:
    """The transport to the process: loopback, so a lost process shows at once (two quick
    retries); its token is added at launch."""
    return HttpOptions(
        connect_timeout_s=5.0,
        request_timeout_s=request_timeout_s,
        max_retries=2,
        backoff_initial_s=0.05,
        backoff_max_s=0.2,
    )


def check_scratch_room(scratch: Path, policy: Any, push_dtype: Any = None) -> None:
    """One line before anything is written when the file system of ``scratch`` cannot hold the
    copies of the weights a run keeps there (``weight_file.bytes_kept``): a container's /dev/shm
    is 64 MB unless it is given more, and a full one fails the first push."""
    from sdp_cli.engine.weight_file import WeightSlots, bytes_kept

    need = bytes_kept(policy.model.state_dict(), push_dtype)
    try:
        found = os.statvfs(scratch)
    except OSError:
        return  # (a file system that cannot say: the writes will)
    free = found.f_bavail * found.f_frsize
    if free < need:
        mb = 1 << 20
        raise UserError(
            f"the local engine's weight files need {-(-need // mb)} MB in {scratch.parent} (the start's "
            f"and {WeightSlots.SLOTS} pushes'), which has {free // mb} MB free; make room there (a container: "
            f"--shm-size), set {SCRATCH_ENV} to a directory with room, or train with engine.in_process=true "
            "(no weight files)"
        )


def process_env(threads: int | None) -> dict[str, str]:
    """What the engine's process adds to its parent's environment besides its token (the same
    for a process started ahead of its launch, ``WarmProcess``)."""
    env = {"PYTHONPATH": sdp_pythonpath()}  # the sdp_cli this process runs
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)  # the process's OpenMP pool from its start
    return env


def launch_spec(config: ProcessLaunchConfig, log_dir: Path, *, token: str, scratch: Path) -> LaunchSpec:
    """The command and environment of the local engine's process."""
    port = config.port or free_port(config.host)
    command = config.command(SERVER_MODULE, port)
    command += [
        "--temperature", repr(config.temperature),
        "--eos", *map(str, config.eos_token_ids),
        "--pad", str(config.pad_token_id),
        "--max-batch-size", str(config.max_batch_size),
        "--device", config.device,
        "--parent-pid", str(os.getpid()),
        "--scratch", str(scratch),
    ]  # fmt: skip
    # the token in the environment: argv is visible to all
    env = {TOKEN_ENV: token, **config.env, **process_env(config.threads)}
    if config.threads:
        command += ["--threads", str(config.threads)]
    if config.attn_implementation:
        command += ["--attn-implementation", config.attn_implementation]
    return config.spec(
        "local engine process",
        command,
        port=port,
        env=env,
        health_path="/health",
        log_path=Path(log_dir) / LOG_NAME,
        secrets=(token,),
        watches_parent=True,  # process_server.leave_with_parent
    )


class WarmProcess:
    """The engine's process started ahead of its launch (``python -m
    sdp_cli.engine.process_server --await-launch``): it imports torch, transformers and the code
    of ``model_type`` while sdp loads the policy, in the environment a launch with ``threads``
    gives it, and waits. ``hand_over`` (``ManagedServer``'s ``prestarted``) tells it what to
    serve; a launch it was not started for (another interpreter, environment or module) gets a
    new process, as a process that ended does. Its output until then is kept in an unlinked
    file in ``scratch``, the engine's scratch directory, and goes to the head of the engine's
    log; like a launched process it removes ``scratch`` and leaves if this process goes.
    ``discard`` ends one that was never handed over. (docs/engines.md "The local engine's
    process")"""

    def __init__(self, scratch: Path, *, threads: int | None, model_type: str | None):
        self._env = {**os.environ, **process_env(threads)}
        self._output = tempfile.TemporaryFile(dir=scratch)
        command = [
            sys.executable, "-m", SERVER_MODULE, "--await-launch", "--parent-pid", str(os.getpid()),
            "--scratch", str(scratch),
        ]  # fmt: skip
        if model_type:
            command += ["--model-type", model_type]
        try:
            self._process: subprocess.Popen[bytes] | None = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=self._output,
                stderr=subprocess.STDOUT,
                env=self._env,
                start_new_session=True,  # as a launched one: stop() ends its process group
            )
        except BaseException:
            self._output.close()
            raise

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def hand_over(self, spec: LaunchSpec, env: Mapping[str, str]) -> subprocess.Popen[bytes] | None:
        """The process, told to run ``spec`` with its token from ``env``, on this process's cores,
        writing to ``spec.log_path``; None (and the process ended) where a new process would not
        run what it runs, and the engine's log says why."""
        process, self._process = self._process, None
        if process is None:
            return None
        try:
            why_not = self._why_not(process, spec, env)
            if why_not is None:
                launch = {
                    "argv": spec.command[3:],
                    "env": {TOKEN_ENV: env[TOKEN_ENV]},
                    "log": str(spec.log_path),
                    "cores": sorted(os.sched_getaffinity(0)),
                }
                assert process.stdin is not None
                try:
                    process.stdin.write(json.dumps(launch).encode() + b"\n")
                    process.stdin.close()
                    return process
                except OSError:  # it ended meanwhile
                    why_not = f"it ended with code {process.wait()} as it was handed the launch"
            _end_now(process)
            self._note_not_used(spec.log_path, process.pid, why_not)
            return None
        finally:
            self._output.close()

    def _why_not(self, process: subprocess.Popen[bytes], spec: LaunchSpec, env: Mapping[str, str]) -> str | None:
        """Why ``process`` would not run what a new process for ``spec`` runs; None if it would."""
        code = process.poll()
        if code is not None:
            return f"it had ended with code {code}"
        if spec.command[:3] != [sys.executable, "-m", SERVER_MODULE]:
            return "the launch runs another interpreter or module"
        launch_env = {k: v for k, v in env.items() if k != TOKEN_ENV}
        differing = sorted(k for k in launch_env.keys() | self._env.keys() if launch_env.get(k) != self._env.get(k))
        if differing:  # names only: a value may be a secret
            return f"the launch's environment differs in {', '.join(differing)}"
        return None

    def _note_not_used(self, log_path: Path, pid: int, why_not: str) -> None:
        """The engine's log says why the process started ahead was not used, with what it wrote
        (an ended one's output says why it ended)."""
        self._output.seek(0)
        output = self._output.read()
        with open_in_place(log_path, "ab") as log:
            log.write(f"sdp: the engine's process {pid} started ahead was not used ({why_not}); a new process starts\n".encode())
            if output:
                log.write(b"its output:\n" + output + (b"" if output.endswith(b"\n") else b"\n"))

    def discard(self) -> None:
        """End the process if it was never handed over (idempotent)."""
        process, self._process = self._process, None
        if process is not None:
            _end_now(process)
            self._output.close()


def _end_now(process: subprocess.Popen[bytes]) -> None:
    """Kill a process that serves nothing yet, and its group, and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        if process.stdin is not None:
            process.stdin.close()
    process.wait()


class ProcessEngine(RemoteEngine):
    """``InferenceEngine`` over sdp's engine process (``launch`` starts it)."""

    engine_name = "local"
    batched_requests = True
    #: samples and scores at softmax(z / T) itself, sampled and prefill logprobs alike
    temperature_exact = True
    accepts_state_dict = True
    loopback_http = True

    def __init__(
        self,
        base_urls: Sequence[str],
        options: RemoteOptions | None = None,
        *,
        scratch: Path,
        weight_dtype: str | None = None,
        version: int = 0,
        managed: Sequence[ManagedServer] = (),
    ):
        #: where weight pushes are written (removed by ``close``)
        self.scratch = scratch
        #: the dtype the process holds its weights in ("float32", "bfloat16"; None: the pushed
        #: tensors' own): pushes are written in it
        self.weight_dtype = weight_dtype
        # The buffer of the last push the process loaded, for the next push to pack into: a
        # fresh one costs its pages again (0.2 s against 0.09 s for 540 MB on the 2-core machine).
        self._spare_lock = threading.Lock()
        self._spare: Any = None
        super().__init__(base_urls, options, version=version, managed=managed)

    @staticmethod
    def prepare(policy: Any, scratch: Path | None = None, *, push_dtype: Any = None) -> tuple[Path, str | None]:
        """The scratch directory holding ``policy`` as ``launch/``, the weights the process starts
        on, and the policy's attention implementation (the process builds the same model).
        ``launch_prepared`` starts the process on it, here or in another process. ``scratch``:
        an empty directory another process owns (the rollout process: it removes it when it
        ends); None: a new one, removed here if this fails. ``push_dtype``: the torch dtype
        pushes are written in (None: the weights' own), for ``check_scratch_room``."""
        from sdp_cli.models.loader import save_policy

        owned = scratch is None
        scratch = make_scratch() if scratch is None else scratch
        try:
            check_scratch_room(scratch, policy, push_dtype)
            save_policy(policy, scratch / LAUNCH_DIR)
            fault_point("local.start_weights_written")
        except BaseException:
            shutil.rmtree(scratch if owned else scratch / LAUNCH_DIR, ignore_errors=True)
            raise
        return scratch, getattr(getattr(policy.model, "config", None), "_attn_implementation", None)

    @classmethod
    def launch_prepared(
        cls,
        config: ProcessLaunchConfig,
        scratch: Path,
        log_dir: Path,
        options: RemoteOptions,
        *,
        warm: WarmProcess | None = None,
    ) -> ProcessEngine:
        """Start the process on the scratch directory ``prepare`` wrote (``warm``: in the process
        started ahead for it, if it can) and attach; ``close()`` stops the process and removes
        the directory, and so does a failed start."""
        try:
            config = dataclasses.replace(config, model=str(scratch / LAUNCH_DIR), python=sys.executable)
            token = secrets.token_hex(16)
            options = dataclasses.replace(options, http=dataclasses.replace(options.http, api_key=token))
            spec = launch_spec(config, log_dir, token=token, scratch=scratch)
            prestarted = warm.hand_over if warm is not None else None
            return cls._attach_launched(spec, options, prestarted=prestarted, scratch=scratch, weight_dtype=config.dtype)
        except BaseException:
            if warm is not None:
                warm.discard()
            shutil.rmtree(scratch, ignore_errors=True)
            raise

    # ------------------------------------------------------------------ weights
    def stage_weights(self, update: WeightUpdate) -> WeightUpdate:
        """A state dict packed into a private buffer (``PackedWeights``), its floating tensors in
        the process's weight dtype: the caller's tensors may change as soon as this returns, and
        ``update_weights`` writes the file."""
        if update.state_dict is None:  # a file already (the rollout process, which has no torch)
            return update
        from sdp_cli.engine.weight_file import PackedWeights  # torch, imported where it is used
        from sdp_cli.models.precision import DTYPES

        if isinstance(update.state_dict, PackedWeights):
            return update
        dtype = DTYPES[self.weight_dtype] if self.weight_dtype is not None else None
        with self._spare_lock:
            spare, self._spare = self._spare, None
        packed = PackedWeights(update.state_dict, dtype, spare=spare)
        return WeightUpdate(version=update.version, state_dict=packed, extra=update.extra)

    def update_weights(self, update: WeightUpdate) -> None:
        """A state dict is staged (``stage_weights``) and written to the scratch directory
        (tmpfs) as ``v<version>/model.safetensors``, which the process loads; older versions'
        files go once the new one is loaded (a restarted server is given the loaded one's)."""
        if not self.is_paused():
            raise EngineError("engine=local: update_weights needs a paused engine; call pause() first")
        staged = self.stage_weights(update)
        packed = staged.state_dict  # a PackedWeights, or None: ``update`` names a file
        if packed is not None:
            target = self.scratch / f"v{update.version:06d}"
            packed.write(target / WEIGHTS_FILE)
            staged = WeightUpdate(version=update.version, path=target, extra=update.extra)
        super().update_weights(staged)
        if packed is not None:  # loaded: a restarted process reads the file, not the pack
            with self._spare_lock:
                self._spare = packed.release()
        for old in self.scratch.glob("v*"):
            # older versions only: the next push's directory may be written already (the rollout
            # process's link writes it while this push loads, docs/training.md "Three processes")
            if old.name[1:].isdigit() and int(old.name[1:]) < update.version:
                shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        super().close()
        fault_point("local.process_stopped")
        with self._spare_lock:
            self._spare = None
        shutil.rmtree(self.scratch, ignore_errors=True)

    # ------------------------------------------------------------------ dialect
    def _unavailable_hint(self) -> str:
        return f"sdp's engine process stopped answering; see {LOG_NAME} in the run's logs directory"

    def _server_connect(self, server: RemoteServer) -> None:
        server.http.get("/health")

    def _server_generate_batch(
        self, server: RemoteServer, requests: list[SegmentRequest], refresh_ids: Callable[[], list[str]]
    ) -> list[Segment | BaseException]:
        def body(request_ids: list[str]) -> dict[str, Any]:
            return {
                "requests": [
                    {
                        "request_id": request_id,
                        "input_ids": r.input_ids,
                        "max_new_tokens": r.max_new_tokens,
                        "stop_token_ids": list(r.stop_token_ids),
                        "seed": r.seed,
                        "prefill_from": r.prefill_from,
                    }
                    for r, request_id in zip(requests, request_ids, strict=True)
                ]
            }

        answer = server.http.post(
            "/generate", body([r.request_id for r in requests]), refresh=lambda: body(refresh_ids())
        )
        items = answer.get("segments") if isinstance(answer, dict) else None
        if not isinstance(items, list) or len(items) != len(requests):
            raise malformed(server, "/generate", f"expected {len(requests)} segments")
        out: list[Segment | BaseException] = []
        for item in items:
            try:
                out.append(_segment(server, item))
            except EngineError as exc:
                out.append(exc)
        return out

    def _server_score_batch(
        self, server: RemoteServer, sequences: list[list[int]], starts: list[int]
    ) -> list[tuple[list[float], str | None]]:
        answer = server.http.post("/score", {"sequences": sequences, "starts": starts})
        rows = answer.get("logprobs") if isinstance(answer, dict) else None
        label = answer.get("weight_version") if isinstance(answer, dict) else None
        if not isinstance(rows, list) or len(rows) != len(sequences) or not isinstance(label, str):
            raise malformed(server, "/score", f"expected {len(sequences)} rows of logprobs and a weight_version")
        return [
            (as_logprobs(server, "/score", row, "a score") if isinstance(row, list) else [], label)
            for row in rows
        ]

    def _server_abort_all(self, server: RemoteServer) -> None:
        server.http.post("/abort", {"request_ids": None}, timeout=self.options.http.admin_timeout_s)

    def _server_abort_requests(self, server: RemoteServer, request_ids: list[str]) -> None:
        server.http.post("/abort", {"request_ids": request_ids}, retry=False)

    def _server_load_weights(self, server: RemoteServer, path: Path, label: str) -> None:
        server.http.post(
            "/load_weights", {"path": str(path), "label": label}, timeout=self.options.http.admin_timeout_s
        )

    def _server_set_version(self, server: RemoteServer, label: str) -> None:
        server.http.post("/weight_version", {"label": label}, timeout=self.options.http.admin_timeout_s)

    def _server_get_version(self, server: RemoteServer) -> str | None:
        answer = server.http.get("/weight_version")
        if not isinstance(answer, dict) or not isinstance(answer.get("weight_version"), str):
            raise malformed(server, "/weight_version", "no weight_version string")
        return answer["weight_version"]


def _segment(server: RemoteServer, item: Any) -> Segment:
    """One request's answer of ``/generate``, parsed and checked."""
    path = "/generate"
    if not isinstance(item, dict):
        raise malformed(server, path, "a segment is not an object")
    token_ids = as_token_ids(server, path, item.get("token_ids"), "token_ids")
    logprobs = item.get("logprobs")
    if not isinstance(logprobs, list):
        raise malformed(server, path, "logprobs is not a list")
    prefill = item.get("prefill_logprobs")
    if prefill is not None and not isinstance(prefill, list):
        raise malformed(server, path, "prefill_logprobs is not a list")
    prefill_version = item.get("prefill_version")
    return Segment(
        token_ids=token_ids,
        logprobs=as_logprobs(server, path, logprobs, "a logprob"),
        finish_reason=str(item.get("finish_reason")),
        token_versions=expand_spans(server, path, item.get("weight_versions"), len(token_ids)),
        prefill_logprobs=None if prefill is None else as_logprobs(server, path, prefill, "a prefill logprob"),
        prefill_version=None if prefill_version is None else str(prefill_version),
    )
