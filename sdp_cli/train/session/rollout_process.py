"""The rollout process: a run's rollout side in a process of its own (docs/training.md "Three processes").

``RolloutProcessStart`` (in sdp's process) starts ``python -m
sdp_cli.train.session.rollout_process`` with one end of a Unix socket pair as ``sdp train``
begins (``early_start``, before sdp's own imports) or as the session's setup begins, so that
the process imports what it runs while sdp imports and loads the policy. The process first
makes the engine's scratch directory and says where (its first frame): the directory is the
process's, removed when it ends however that comes (by sdp or the engine's process if it was
killed). Then it starts the engine's process ahead, where the engine has a ``warm`` half (the
local engine's: it imports torch and transformers meanwhile). ``begin`` writes what the engine
starts from into the directory (the registry entry's ``prepare`` half, where the policy is) and
sends the run's recipe as the first frame of its own (``rollout_link.py``): the typed config, the
run directory and the log to go on in, the engine's recipe, the ids and budgets of generation,
the ledger offset of a resume. ``main`` (in the rollout process) builds from it what the rollout
side needs (the task with its reward code, the tokenizer the engine's files hold, the engine
from the ``start`` half, in the process started ahead if it can, the group ledger), answers with
the engine's log files, or with the error that kept it from starting, and then serves the link
until the session ends or sdp is gone.

The process has its own session, so a Ctrl-C at the terminal reaches sdp only, which stops it in
order; it ignores SIGINT, ends on SIGTERM (stopping its engine first), and leaves on its own
when sdp has gone. Its output goes to ``<run>/logs/rollout.log`` (started before the run
directory existed: to an unlinked file until the recipe names the log, then to the log, after
what it wrote until then).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

# What this module imports at its top is what sdp's process needs to start the rollout process
# (it may do so before its own imports of torch, ``early_start``); the rollout process imports
# the rest in ``_serve_session`` while it waits for its recipe: no torch, no transformers model
# code (its engine computes in a process of its own), so that it starts in a fraction of a second
# (tests/train/test_rollout_process.py checks).
from sdp_cli.engines import engine_kind
from sdp_cli.fileio import open_in_place, redirect_output
from sdp_cli.models.model_dir import model_type_hint
from sdp_cli.rundir import RunDir
from sdp_cli.processes import pin_process, scratch_root, sdp_pythonpath
from sdp_cli.train.session.placement import thread_counts

if TYPE_CHECKING:
    from sdp_cli.config.schema import SdpConfig
    from sdp_cli.train.asyncloop.rollout import RolloutSide
    from sdp_cli.train.asyncloop.rollout_link import RolloutLink

#: the rollout process's log in the run's logs directory
LOG_NAME = "rollout.log"


class RolloutProcessStart:
    """A rollout process started ahead of its recipe, for a run whose engine builds in two
    halves (``EngineKind.own_process``): its interpreter imports what it runs, and it starts
    the engine's process ahead too where the engine has a ``warm`` half, while sdp loads the
    policy; it waits for ``begin``. ``cancel`` ends it if the run never gets that far (so does
    sdp's end: the process leaves when its end of the link closes).

    ``run_dir`` None: started before the run directory exists (``early_start``); its output is
    kept in an unlinked file, copied into the run's log once the directory exists
    (``run_dir_made``) and before the start weights are written, and the process goes on in
    that log from its recipe on."""

    def __init__(self, cfg: SdpConfig, run_dir: RunDir | None):
        #: the unlinked file of an early start's output, until ``begin``, and how much of it
        #: has been copied into the run's log
        self._early: IO[bytes] | None = None
        self._copied = 0
        scratch_root()  # a $SDP_SCRATCH_DIR that is no writable directory: one line here, not a dead process
        ours, theirs = socket.socketpair()
        try:
            env = {
                **os.environ,
                "PYTHONPATH": sdp_pythonpath(),  # the sdp_cli this process runs
                # the rollout side computes nothing with torch: no OpenMP pool beside the trainer's
                "OMP_NUM_THREADS": "1",
            }
            command = [sys.executable, "-m", __name__, "--fd", str(theirs.fileno()), "--parent-pid", str(os.getpid())]
            kind = engine_kind(cfg.engine.kind)
            if kind.warm is not None:
                warm = {"kind": kind.name, "threads": thread_counts(cfg)[1], "model_type": model_type_hint(cfg)}
                command += ["--warm-engine", json.dumps(warm)]
            if cfg.model.kind == "hf":  # its tokenizer is transformers' (the tiny model's is sdp's)
                command += ["--auto-tokenizer"]
            if run_dir is not None:
                run_dir.logs.mkdir(parents=True, exist_ok=True)
                # the log is in the run directory: never written through a link (sdp_cli/fileio.py)
                log = open_in_place(run_dir.logs / LOG_NAME, "ab")
            else:
                log = self._early = tempfile.TemporaryFile()
            with contextlib.ExitStack() as closing:
                if log is not self._early:
                    closing.enter_context(log)
                # Its own session: a Ctrl-C at the terminal reaches sdp only, which stops it in order.
                self._process: subprocess.Popen[bytes] | None = subprocess.Popen(
                    command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    pass_fds=(theirs.fileno(),),
                    start_new_session=True,
                )
        except BaseException:
            ours.close()
            self._close_early()
            raise
        finally:
            theirs.close()
        self._sock = ours

    @classmethod
    def early_start(cls, cfg: SdpConfig, environ: Mapping[str, str]) -> RolloutProcessStart | None:
        """The rollout process of ``sdp train``, started as the command begins, before sdp's own
        seconds of imports, for a run in one process whose engine runs in a process of its own
        (a resume's engine as its saved overrides compose, ``_resumed``). None otherwise, and
        where a resume's config cannot be told before the run reads its directory: setup starts
        it then. A start the run turns out not to need is ended by the run."""
        if environ.get("WORLD_SIZE", "1") not in ("", "1"):
            return None  # (a WORLD_SIZE that is no number is the run's to refuse)
        run_cfg = _resumed(cfg) if cfg.resume else cfg
        if run_cfg is None or not engine_kind(run_cfg.engine.kind).own_process(run_cfg):
            return None
        return cls(run_cfg, None)

    def _close_early(self) -> None:
        early, self._early = self._early, None
        if early is not None:
            early.close()

    def run_dir_made(self, run_dir: RunDir) -> None:
        """The run directory exists: what the process wrote until now goes into its log."""
        self._copy_early_output(run_dir.logs / LOG_NAME)

    def _copy_early_output(self, log_path: Path) -> None:
        """What the process wrote since the last copy, appended to its log in the run directory
        (its first lines name the scratch directory and the engine's process it started: once
        there, a kill of sdp at any later moment leaves them where the run's logs are)."""
        if self._early is None:
            return
        try:
            self._early.seek(self._copied)
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open_in_place(log_path, "ab") as log:
                shutil.copyfileobj(self._early, log)
            self._copied = self._early.tell()
        except OSError:
            pass  # the run's log is the report's only loss

    def begin(
        self,
        cfg: SdpConfig,
        *,
        policy: Any,
        run_dir: RunDir,
        stop_token_ids: tuple[int, ...],
        max_new_tokens: int,
        ledger_offset: int | None,
        device: Any,
        engine_threads: int | None,
        cores: list[int] | None,
    ) -> RolloutLink:
        """Write what the engine starts from (the ``prepare`` half, here where the policy is),
        send the process the run's recipe and return the link to it, once its engine is up. The
        engine's failure to start is raised here as in sdp's process (``EngineUnavailable`` …),
        and the process is ended. ``cores``: where it and its engine's process run
        (``placement.core_split``; None: anywhere)."""
        from sdp_cli.train.asyncloop.rollout_link import RolloutLink

        assert self._process is not None, "begin() is called once"
        kind = engine_kind(cfg.engine.kind)
        log_path = run_dir.logs / LOG_NAME
        log_path.parent.mkdir(parents=True, exist_ok=True)
        link = RolloutLink(self._process, self._sock, log_path=log_path, weight_dtype=kind.weight_dtype(cfg))
        scratch: Path | None = None
        try:
            scratch = link.receive_scratch()
            self._copy_early_output(log_path)
            recipe = kind.preparer()(cfg, policy, run_dir, device=device, threads=engine_threads, scratch=scratch)
        except BaseException:
            self.cancel(keep_output=log_path)  # the process, which has no recipe, leaves and removes the directory
            if scratch is not None:  # unless it was killed
                shutil.rmtree(scratch, ignore_errors=True)
            raise
        self._process = None
        try:
            link.begin(
                {
                    "config": dataclasses.asdict(cfg),
                    "run_dir": str(run_dir.path),
                    # an early start's output goes on in the run's log from here (the process
                    # moves what it wrote after the part copied above)
                    "log": str(log_path) if self._early is not None else None,
                    "log_copied": self._copied,
                    "engine": recipe,
                    "stop_token_ids": list(stop_token_ids),
                    "max_new_tokens": max_new_tokens,
                    "ledger_offset": ledger_offset,
                    "cores": cores,
                }
            )
        except BaseException:
            link.shutdown(grace_s=10.0)
            raise
        finally:
            self._close_early()
        return link

    def cancel(self, *, keep_output: Path | None = None) -> None:
        """End the process if it is still waiting for its recipe (idempotent): it leaves when
        its end of the link closes, removing the scratch directory it made, by signal if it
        does not. ``keep_output``: the log an early start's output is appended to then."""
        process, self._process = self._process, None
        if process is not None:
            self._sock.close()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if keep_output is not None:
            self._copy_early_output(keep_output)
        self._close_early()


def _resumed(cfg: SdpConfig) -> SdpConfig | None:
    """The config the saved overrides of the run ``cfg.resume`` names compose to, for the early
    start's engine, threads and model only; None where that is not plain: no ``overrides.json``
    that is a file holding a list of strings, the run's own ``--config-dir``, or a compose that
    fails (the run reads and checks its directory itself, under its lock, and says what is
    wrong). Composing runs no code of the run's (its programs are imported only once the resume
    has been accepted, docs/reliability.md "Security defaults")."""
    from sdp_cli.config.compose import compose_config
    from sdp_cli.errors import UserError

    run_dir = RunDir(Path(cfg.resume))
    try:
        if not run_dir.overrides.is_file() or run_dir.config_source.exists():
            return None
        saved = json.loads(run_dir.overrides.read_text())
        if not isinstance(saved, list) or not all(isinstance(o, str) for o in saved):
            return None
        return compose_config([*saved, f"resume={run_dir.path}"], accepted=saved)[0]
    except (OSError, ValueError, RecursionError, UserError):
        return None


# ------------------------------------------------------------------ the rollout process
def _build(recipe: dict[str, Any], warm: Any) -> RolloutSide:
    """The rollout side of ``recipe`` (``RolloutProcessStart.begin``) with its engine started
    (in ``warm``, the engine's process started ahead, if it can)."""
    from sdp_cli.config.compose import config_from_dict
    from sdp_cli.engine.process import LAUNCH_DIR
    from sdp_cli.models.policy import PromptCodec
    from sdp_cli.models.tokenizer import load_tokenizer
    from sdp_cli.train.asyncloop.ledger import LedgerLog
    from sdp_cli.train.asyncloop.rollout import RolloutSide
    from sdp_cli.train.session.task_setup import prepare_task

    cfg = config_from_dict(recipe["config"])
    run_dir = RunDir(recipe["run_dir"])
    engine_recipe = recipe["engine"]
    # the tokenizer the engine's start-up weights were saved with: the trainer's
    tokenizer = load_tokenizer(Path(engine_recipe["scratch"]) / LAUNCH_DIR)
    task = prepare_task(cfg, tokenizer=tokenizer)
    codec = PromptCodec.of_tokenizer(tokenizer, int(engine_recipe["eos_token_ids"][0]))
    engine = engine_kind(cfg.engine.kind).starter()(cfg, engine_recipe, run_dir, warm=warm)
    try:
        ledger = LedgerLog(run_dir.ledger, truncate_to=recipe["ledger_offset"])
    except BaseException:
        engine.close()
        raise
    return RolloutSide(
        cfg,
        engine=engine,
        task=task,
        codec=codec,
        stop_token_ids=tuple(recipe["stop_token_ids"]),
        max_new_tokens=int(recipe["max_new_tokens"]),
        max_consecutive_engine_faults=cfg.engine.max_consecutive_faults,
        ledger=ledger,
    )


def _import_the_rest(*, auto_tokenizer: bool) -> None:
    """What the rollout side runs on, imported while the process waits for its recipe (the
    module's top imports only what sdp's process needs to start it); ``auto_tokenizer``:
    transformers' ``AutoTokenizer`` too, seconds that would otherwise follow the recipe."""
    if auto_tokenizer:
        from transformers import AutoTokenizer  # noqa: F401
    import sdp_cli.config.compose  # noqa: F401
    import sdp_cli.models.policy  # noqa: F401
    import sdp_cli.models.tokenizer  # noqa: F401
    import sdp_cli.train.asyncloop.ledger  # noqa: F401
    import sdp_cli.train.asyncloop.rollout  # noqa: F401
    import sdp_cli.train.session.task_setup  # noqa: F401


def _start_warm(options: str, scratch: Path) -> Any:
    """The engine's process started ahead (``EngineKind.warm``) as ``--warm-engine`` asks, or
    None: a warm start that fails costs the run nothing but its head start."""
    try:
        asked = json.loads(options)
        warm = engine_kind(asked.pop("kind")).warmer()(scratch, **asked)
    except Exception as exc:  # noqa: BLE001 - the engine then starts as it would without
        print(f"sdp rollout process: the engine's process was not started ahead ({exc})", flush=True)
        return None
    print(f"sdp rollout process: the engine's process {warm.pid} started ahead", flush=True)
    return warm


def _end_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    from sdp_cli.processes import make_scratch
    from sdp_cli.engine.process_server import leave_with_parent

    parser = argparse.ArgumentParser(description="sdp's rollout process (started by sdp train)")
    parser.add_argument("--fd", type=int, required=True, help="this process's end of the link")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--warm-engine", default=None, help="JSON: the engine's process to start ahead")
    parser.add_argument("--auto-tokenizer", action="store_true", help="import transformers' AutoTokenizer ahead")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # sdp stops this process in order
    signal.signal(signal.SIGTERM, _end_on_sigterm)
    # The engine's scratch directory is this process's from its making to this process's end,
    # however that comes (sdp writes what the engine starts from into it, after this line):
    # a kill of sdp at any moment leaves nothing on tmpfs.
    scratch = make_scratch()
    # sdp gone, whatever this process is doing then (waiting for the recipe, in a call, closing
    # the engine: a close cut off may have stopped the engine's process, which would otherwise
    # remove the directory): the directory goes, then the process
    threading.Thread(target=leave_with_parent, args=(args.parent_pid, scratch), daemon=True).start()
    print(f"sdp rollout process {os.getpid()}: the engine's scratch directory is {scratch}", flush=True)
    sock = socket.socket(fileno=args.fd)
    warm = _start_warm(args.warm_engine, scratch) if args.warm_engine else None
    try:
        _serve_session(sock, scratch, warm, auto_tokenizer=args.auto_tokenizer)
    finally:
        if warm is not None:
            warm.discard()  # never handed over (a handed-over one is the engine's, stopped with it)
        shutil.rmtree(scratch, ignore_errors=True)
    # The engine is stopped and the ledger closed: leave now, without waiting for a reward call
    # that may still run (user code, cut off with the process rather than left to sdp's end).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _serve_session(sock: socket.socket, scratch: Path, warm: Any, *, auto_tokenizer: bool) -> None:
    """Say where the scratch directory is, take the recipe, build the rollout side and serve
    the link until the session ends or sdp has gone."""
    from sdp_cli.train.asyncloop.rollout_link import error_to_json, receive_frame, send_frame, serve

    try:
        send_frame(sock, {"ok": {"scratch": str(scratch)}})
    except OSError:  # sdp has gone already
        return
    _import_the_rest(auto_tokenizer=auto_tokenizer)
    recipe = receive_frame(sock)
    if recipe is None:  # sdp cancelled the start, or has gone
        return
    assert Path(recipe["engine"]["scratch"]) == scratch, "the engine starts from this process's directory"
    started = time.perf_counter()
    if recipe["cores"] is not None:
        pin_process(recipe["cores"])  # before the engine's process starts: it inherits them
    try:
        if recipe["log"] is not None:  # started early: its output goes on in the run's log
            redirect_output(Path(recipe["log"]), copied=recipe["log_copied"])
        side = _build(recipe, warm)
    except Exception as exc:  # noqa: BLE001 - sdp reports it as its own
        send_frame(sock, {"error": error_to_json(exc)})
        return
    # the imports and what setup built live as long as the process: out of the collector's full
    # passes, which walked them with the interpreter lock held while a call waited
    gc.collect()
    gc.freeze()
    print(
        f"sdp rollout process: pid {os.getpid()}, cores {','.join(map(str, sorted(os.sched_getaffinity(0))))}, "
        f"started in {time.perf_counter() - started:.2f} s",
        flush=True,
    )
    try:
        send_frame(sock, {"ok": {"engine_log_paths": [str(p) for p in side.log_paths]}})
        serve(side, sock)
    finally:
        side.shutdown()


if __name__ == "__main__":
    main()
