"""The rollout side in a process of its own, and the trainer's link to it.

With sdp's local engine in its own process (``engine.in_process=false``, the default) a run has
three processes: the trainer's (sdp's), the *rollout process*, which runs the rollout side
(``RolloutSide``: the producer, rewards, the buffers, the recompute passes and the weight push's
protocol), and the engine's, which the rollout side reaches as before (docs/training.md "Three
processes"). The trainer's process is then left with the trainer's step: the rollout side's
Python work no longer holds the interpreter lock that the step needs (docs/benchmarks.md: each
percent of it another thread held cost the one-thread step 1–2 ms).

The trainer's process holds a ``RolloutLink``: ``RolloutSide``'s methods that the loop and the
session call, each one forwarded as one request over a Unix socket pair and answered by
``serve`` in the rollout process, one at a time, in order. A message is a frame: four bytes of
length (big-endian) and a JSON object. Groups travel in columns (``encode_groups``); the trainer's
weights as a safetensors file the link packs straight into a push slot in the engine's scratch
directory on tmpfs (``WeightSlots``), which the engine process reads; errors as
their kind, message and details, raised again in the trainer's process as the same class
(``error_from_json``); warnings the rollout process logs come back with the next answer and are
logged again under the same logger. Nothing is pickled.

The rollout process leaves when the link's other end closes (sdp ended, or was killed: the socket
closes with it), stopping its engine first; sdp stops it in order at the end of a session
(``shutdown``), and a lost rollout process ends the run at a step boundary like a producer
failure (``RolloutProcessLost``).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import select
import shutil
import signal
import socket
import struct
import subprocess
import threading
import traceback
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from sdp_cli.engine.base import EngineError, EngineUnavailable, WeightUpdate
from sdp_cli.engine.process import WEIGHTS_FILE
from sdp_cli.errors import UserError
from sdp_cli.faults import InjectedFault
from sdp_cli.rollout.records import RolloutGroup, RolloutSample
from sdp_cli.tasks.plugins import RewardError
from sdp_cli.train.asyncloop.loop_state import LoopCounters, LoopInterrupted, LoopStopped
from sdp_cli.train.asyncloop.rollout import RolloutSide, StepReport


#: a frame's length prefix
_LENGTH = struct.Struct(">I")
#: ``take_batch``'s answer when its batch is the one the trainer holds from ``take_ahead``
AHEAD = "ahead"
#: how often a call waiting for its answer looks whether the rollout process is still there
_POLL_S = 1.0


class RolloutProcessLost(ConnectionError):
    """The rollout process stopped answering: it exited, was killed, or a call to it was cut off
    (a second Ctrl-C). An ``OSError``: the run stops at its step boundary, as on a full disk."""


class RolloutProcessError(RuntimeError):
    """An unexpected error (a bug) in the rollout process; its traceback there is a note."""


# ------------------------------------------------------------------ frames
def send_frame(sock: socket.socket, message: Any) -> None:
    """Send ``message`` as one frame (JSON)."""
    data = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _read_exactly(sock: socket.socket, n: int, wait: Callable[[], None] | None) -> bytes | None:
    """``n`` bytes from ``sock``; None at a clean end of the stream before the first byte.
    ``wait``, called between reads that found nothing, may raise to give up."""
    buffer = bytearray()
    while len(buffer) < n:
        if wait is not None:
            ready, _, _ = select.select([sock], [], [], _POLL_S)
            if not ready:
                wait()
                continue
        chunk = sock.recv(n - len(buffer))
        if not chunk:
            if buffer:
                raise ConnectionError(f"the link closed within a frame ({len(buffer)} of {n} bytes)")
            return None
        buffer += chunk
    return bytes(buffer)


def receive_frame(sock: socket.socket, wait: Callable[[], None] | None = None) -> Any | None:
    """The next frame's message; None when the other end closed the link between frames."""
    head = _read_exactly(sock, _LENGTH.size, wait)
    if head is None:
        return None
    (length,) = _LENGTH.unpack(head)
    body = _read_exactly(sock, length, wait)
    if body is None:
        raise ConnectionError("the link closed within a frame")
    return json.loads(body)


# ------------------------------------------------------------------ groups
def encode_groups(groups: list[RolloutGroup]) -> dict[str, Any]:
    """``groups`` as plain data for ``decode_groups``, in columns: the per-token lists of every
    sample one after another, the integers (token ids, versions) in one base64 string of 32-bit
    values and the logprobs in one of float64 values (Python's floats, exactly), and each sample's lengths and the rest of
    it (ids, reward, finish reason, meta) as JSON, a meta equal to the one of the sample before
    it in its group as null (a group's samples share their prompt's). ``RolloutGroup.to_dict``'s
    JSON cost the rollout process twice the time to encode and the trainer's three times the time
    to decode (each float printed and parsed, each meta again)."""
    ints, floats = array("i"), array("d")
    samples = []
    for group in groups:
        before = None
        for s in group.samples:
            for values in (s.prompt_ids, s.output_ids, s.versions, s.proximal_t_versions):
                ints.extend(values)
            floats.extend(s.old_logprobs)
            floats.extend(s.proximal_logprobs_t)
            meta = None if s.meta == before else s.meta
            samples.append([s.sample_id, s.group_id, s.prompt_len, s.output_len, s.reward, s.finish_reason, meta])
            before = s.meta
    return {
        "groups": [[g.group_id, len(g.samples)] for g in groups],
        "samples": samples,
        "ints": base64.b64encode(ints.tobytes()).decode("ascii"),
        "floats": base64.b64encode(floats.tobytes()).decode("ascii"),
    }


def decode_groups(data: dict[str, Any]) -> list[RolloutGroup]:
    """The groups ``encode_groups`` wrote (trusted: sdp's own rollout process wrote them)."""
    ints, floats = array("i"), array("d")
    ints.frombytes(base64.b64decode(data["ints"]))
    floats.frombytes(base64.b64decode(data["floats"]))
    int_values, float_values = ints.tolist(), floats.tolist()
    i = f = 0
    samples = iter(data["samples"])
    groups = []
    for group_id, size in data["groups"]:
        members: list[RolloutSample] = []
        for _ in range(size):
            sample_id, sample_group, prompt_len, n, reward, finish_reason, meta = next(samples)
            meta = dict(members[-1].meta) if meta is None else meta
            members.append(
                RolloutSample(
                    prompt_ids=int_values[i : i + prompt_len],
                    output_ids=int_values[i + prompt_len : i + prompt_len + n],
                    versions=int_values[i + prompt_len + n : i + prompt_len + 2 * n],
                    proximal_t_versions=int_values[i + prompt_len + 2 * n : i + prompt_len + 3 * n],
                    old_logprobs=float_values[f : f + n],
                    proximal_logprobs_t=float_values[f + n : f + 2 * n],
                    reward=reward,
                    group_id=sample_group,
                    finish_reason=finish_reason,
                    sample_id=sample_id,
                    meta=meta,
                )
            )
            i += prompt_len + 3 * n
            f += 2 * n
        groups.append(RolloutGroup(group_id=group_id, samples=members))
    return groups


# ------------------------------------------------------------------ errors
#: the exception classes that cross the link as themselves (by name); anything else is a
#: ``RolloutProcessError``
_ERRORS: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for cls in (
        LoopInterrupted,
        LoopStopped,
        RewardError,
        EngineUnavailable,
        EngineError,
        UserError,
        InjectedFault,
        RolloutProcessLost,
    )
}


def error_to_json(exc: BaseException) -> dict[str, Any]:
    """``exc`` (and its cause) as plain data for ``error_from_json``."""
    data: dict[str, Any] = {"kind": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, RewardError):
        data.update(details=exc.details, key=exc.key)
    elif isinstance(exc, OSError) and not isinstance(exc, RolloutProcessLost):
        data.update(kind="OSError", errno=exc.errno, strerror=exc.strerror, filename=exc.filename)
    elif type(exc).__name__ not in _ERRORS:
        data["traceback"] = "".join(traceback.format_exception(exc))
    if exc.__cause__ is not None:
        data["cause"] = error_to_json(exc.__cause__)
    return data


def error_from_json(data: dict[str, Any]) -> BaseException:
    """The exception ``error_to_json`` described, rebuilt (with its cause) in this process."""
    kind, message = data["kind"], data["message"]
    exc: BaseException
    if kind == "RewardError":
        exc = RewardError(message, data.get("details", ""), key=data.get("key"))
    elif kind == "OSError":
        if data.get("errno") is not None:
            exc = OSError(data["errno"], data.get("strerror"), data.get("filename"))
        else:
            exc = OSError(message)
    elif kind in _ERRORS:
        exc = _ERRORS[kind](message)
    else:
        exc = RolloutProcessError(f"{kind}: {message}" if message else kind)
        exc.add_note(f"in the rollout process:\n{data.get('traceback', '')}")
    if "cause" in data:
        exc.__cause__ = error_from_json(data["cause"])
    return exc


# ------------------------------------------------------------------ the rollout process's end
class _ForwardedLog(logging.Handler):
    """Keeps the warnings the rollout process logs until the next answer carries them."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self._records: list[list[Any]] = []
        self._records_lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._records_lock:
            self._records.append([record.name, record.levelno, record.getMessage()])

    def take(self) -> list[list[Any]]:
        with self._records_lock:
            records, self._records = self._records, []
        return records


def _stop(side: RolloutSide, wait: bool) -> dict[str, Any] | None:
    failure = side.stop(wait=wait)
    return None if failure is None else error_to_json(failure)


def _take_batch(
    side: RolloutSide, trainer_version: int, step: int, stop_requested: bool, wait_s: float, ahead: bool = False
) -> Any:
    """The batch, encoded; or, when it is the batch the trainer already holds (``ahead``: the
    answer of its ``reserve_batch``), ``AHEAD``."""
    reserved = side.reserved_batch() if ahead else None
    groups = side.take_batch(trainer_version, step, stop_requested=stop_requested, wait_s=wait_s)
    if groups is None:
        return None
    if groups is reserved:  # the side's take handed out the very list it had set aside
        return AHEAD
    return encode_groups(groups)


def _reserve_batch(side: RolloutSide, sock: socket.socket, trainer_version: int, step: int) -> Any:
    """``RolloutSide.reserve_batch``, encoded; it waits for its batch until the trainer's next
    request arrives."""
    groups = side.reserve_batch(
        trainer_version, step, give_up=lambda: bool(select.select([sock], [], [], 0)[0]), watch=sock.fileno()
    )
    return None if groups is None else encode_groups(groups)


def _finish_step(side: RolloutSide, version: int, path: str, last_step: bool) -> dict[str, Any]:
    """The step's report, encoded; the push it starts waits until the answer is sent (``serve``)."""
    report = side.finish_step(WeightUpdate(version=version, path=Path(path)), last_step=last_step, hold_push=True)
    return {
        "version": report.version,
        "metrics": report.metrics,
        "push_error": None if report.push_error is None else error_to_json(report.push_error),
        "reward_errors_failed": report.reward_errors_failed,
        "reward_errors_first": [error_to_json(e) for e in report.reward_errors_first],
    }


def _sync_engine(side: RolloutSide, version: int, path: str | None) -> None:
    side.sync_engine(None if path is None else WeightUpdate(version=version, path=Path(path)), version)


def _method(name: str) -> Callable[..., Any]:
    """A call answered by the side's method ``name`` as it is."""
    return lambda side, **args: getattr(side, name)(**args)


#: the calls the rollout process answers: name → fn(the side, **the request's arguments) → answer
_CALLS: dict[str, Callable[..., Any]] = {
    "stop": _stop,
    "take_batch": _take_batch,
    "finish_step": _finish_step,
    "counters": lambda side: side.counters().to_dict(),
    "sync_engine": _sync_engine,
    **{
        name: _method(name)
        for name in ("start", "join_push", "settle_push", "snapshot", "restore", "filtered_groups", "close", "shutdown")
    },
}


def serve(side: RolloutSide, sock: socket.socket) -> None:
    """Answer the trainer's calls on ``sock``, one at a time, until ``shutdown`` (answered, then
    this returns) or until the trainer's end of the link closes (the side is shut down first)."""
    forwarded = _ForwardedLog()
    logging.getLogger().addHandler(forwarded)
    calls = {**_CALLS, "reserve_batch": lambda side, **args: _reserve_batch(side, sock, **args)}
    try:
        while True:
            request = receive_frame(sock)
            if request is None:  # sdp has gone
                side.shutdown()
                return
            name = request.get("call")
            try:
                answer: dict[str, Any] = {"ok": calls[name](side, **request.get("args", {}))}
            except Exception as exc:  # noqa: BLE001 - every failure goes back to the caller
                answer = {"error": error_to_json(exc)}
            answer["log"] = forwarded.take()
            try:
                send_frame(sock, answer)
            finally:
                if name == "finish_step":
                    side.release_push()  # held until the trainer has its answer (_finish_step)
            if name == "shutdown":
                return
    finally:
        logging.getLogger().removeHandler(forwarded)


# ------------------------------------------------------------------ the trainer's end
class RolloutLink:
    """``RolloutSide``'s methods, answered by the rollout process ``process`` over ``sock``.

    One call at a time (a lock); a call cut off in the middle (a second Ctrl-C) leaves the stream
    unusable, so every later call raises ``RolloutProcessLost`` and ``shutdown`` ends the process
    by signal. The trainer's weights are written as files for the engine (``finish_step``)."""

    #: the trainer hands over its weights in memory; the link writes them where the engine reads
    accepts_state_dict = True

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        sock: socket.socket,
        *,
        log_path: Path,
        weight_dtype: str | None,
    ):
        self._process = process
        self._sock = sock
        self.log_path = log_path
        #: the log files of the rollout process and of its engine (``begin``)
        self.log_paths: tuple[Path, ...] = (log_path,)
        # the engine's scratch directory (tmpfs; ``receive_scratch``), where pushes are written,
        # in the engine's dtype
        self._scratch: Path | None = None
        self._slots: Any = None
        self._weight_dtype = weight_dtype
        self._lock = threading.Lock()
        self._lost: str | None = None
        self._closed = False
        # calls sent without waiting (``take_ahead``), answered in order before the next call's
        # answer: (name, arguments) each
        self._posted: list[tuple[str, dict[str, Any]]] = []
        #: the batch ``take_ahead`` got: (trainer version, step, the groups); or the error
        #: its call raised, for the next ``take_batch`` to raise (where a take's error belongs)
        self._ahead: tuple[int, int, Any] | None = None
        self._ahead_error: BaseException | None = None

    def receive_scratch(self) -> Path:
        """The engine's scratch directory: the rollout process makes it as it starts and says
        where (its first frame), so that it is that process's from the start and goes with it
        however sdp ends (docs/training.md "Three processes"). What the engine starts from is
        written there, then every push."""
        from sdp_cli.engine.weight_file import WeightSlots  # torch: the trainer's end only

        with self._talking():
            hello = self._answer()
        self._scratch = Path(self._result(hello)["scratch"])
        self._slots = WeightSlots(self._scratch, WEIGHTS_FILE)
        return self._scratch

    def begin(self, recipe: dict[str, Any]) -> None:
        """Send the rollout process its recipe and wait until it has built the rollout side and
        started its engine; what kept it from that is raised here."""
        ready = self._exchange(recipe)
        self.log_paths = (*(Path(p) for p in ready["engine_log_paths"]), self.log_path)

    # -------------------------------------------------------------- calls
    def _call(self, name: str, **args: Any) -> Any:
        return self._exchange({"call": name, "args": args})

    def _exchange(self, request: dict[str, Any]) -> Any:
        """Send ``request``, wait for its answer (after those of the calls posted before it); its
        error is raised, its warnings logged."""
        with self._talking():
            send_frame(self._sock, request)
            self._read_posted_locked()
            answer = self._answer()
        return self._result(answer)

    def _read_posted(self) -> None:
        """Read the answers of the posted calls (each waits until its call is done)."""
        if self._posted:
            with self._talking():
                self._read_posted_locked()

    def _read_posted_locked(self) -> None:
        while self._posted:
            self._posted_answer(*self._posted.pop(0), self._answer())

    @contextlib.contextmanager
    def _talking(self) -> Iterator[None]:
        """Hold the link for one exchange; a lost process or a cut-off exchange marks it lost."""
        with self._lock:
            if self._lost is not None:
                raise RolloutProcessLost(self._lost)
            try:
                yield
            except RolloutProcessLost:
                self._lost = "the rollout process has stopped"
                raise
            except OSError as exc:
                self._lost = "the rollout process has stopped"
                raise RolloutProcessLost(self._gone(f"the link to it failed ({exc.strerror or exc})")) from None
            except BaseException:
                self._lost = "a call to the rollout process was cut off"
                raise

    def _answer(self) -> dict[str, Any]:
        """The next answer (the lock held; a lost process raises as ``_exchange`` says)."""
        answer = receive_frame(self._sock, self._check_alive)
        if answer is None:
            self._lost = "the rollout process has stopped"
            raise RolloutProcessLost(self._gone("it closed the link"))
        return answer

    @staticmethod
    def _result(answer: dict[str, Any]) -> Any:
        """An answer's result, its warnings logged; its error raised."""
        for logger_name, level, message in answer.get("log", []):
            logging.getLogger(logger_name).log(level, "%s", message)
        if "error" in answer:
            raise error_from_json(answer["error"])
        return answer["ok"]

    def _post(self, name: str, **args: Any) -> None:
        """Send a call without waiting for its answer (read by the next ``_exchange``)."""
        with self._lock:
            if self._lost is not None:
                return  # the next call says why
            try:
                send_frame(self._sock, {"call": name, "args": args})
            except OSError:
                return  # likewise
            self._posted.append((name, args))

    def _posted_answer(self, name: str, args: dict[str, Any], answer: dict[str, Any]) -> None:
        assert name == "reserve_batch", f"no answer handling for a posted {name!r}"
        try:
            encoded = self._result(answer)
            # decoded now: this answer is read while the trainer waits for the push's answer
            # (idle time otherwise), and the take then has nothing left to do but claim it
            groups = None if encoded is None else decode_groups(encoded)
        except Exception as exc:  # noqa: BLE001 - the next take raises it
            self._ahead, self._ahead_error = None, exc
            return
        self._ahead = None if groups is None else (args["trainer_version"], args["step"], groups)

    def _check_alive(self) -> None:
        code = self._process.poll()
        if code is not None:
            raise RolloutProcessLost(self._gone(None))

    def _gone(self, failure: str | None) -> str:
        """Why the rollout process stopped answering: its exit (waited for a moment: a killed
        process closes the link before it is reaped), else ``failure``; and its log's last line."""
        try:
            code = self._process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = None
        if code is not None and code < 0:
            how = f"it was killed by {signal.Signals(-code).name}"
        elif code is not None:
            how = f"it exited with code {code}"
        else:
            how = failure or "it does not answer"
        return f"the rollout process stopped answering: {how}; see {self.log_path} (last line: {self._last_log_line()})"

    def _last_log_line(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "no log"
        return lines[-1].strip() if lines else "empty"

    # -------------------------------------------------------------- RolloutSide's methods
    def start(self) -> None:
        self._call("start")

    def stop(self, *, wait: bool = True) -> BaseException | None:
        if self._lost is not None:
            return None  # nothing left to stop; the run already knows why
        try:
            failure = self._call("stop", wait=wait)
        except RolloutProcessLost:
            return None
        return None if failure is None else error_from_json(failure)

    def take_batch(
        self, trainer_version: int, step: int, *, stop_requested: bool, wait_s: float
    ) -> list[RolloutGroup] | None:
        """The batch, as ``RolloutSide.take_batch`` takes it; the one ``take_ahead`` brought when
        it is for this step (the rollout process says so, and sends nothing else)."""
        self._read_posted()
        error, self._ahead_error = self._ahead_error, None
        if error is not None:
            self._ahead = None
            raise error
        ahead, self._ahead = self._ahead, None  # this take claims it, or it goes back to the cache
        if ahead is not None and ahead[:2] != (trainer_version, step):
            ahead = None
        groups = self._call(
            "take_batch",
            trainer_version=trainer_version,
            step=step,
            stop_requested=stop_requested,
            wait_s=wait_s,
            ahead=ahead is not None,
        )
        if groups == AHEAD:
            assert ahead is not None, "the rollout process answered with a batch this end does not hold"
            return ahead[2]
        return None if groups is None else decode_groups(groups)

    def take_ahead(self, trainer_version: int, step: int) -> None:
        """Ask the rollout process to set aside the batch of step ``step`` at trainer version
        ``trainer_version`` (``RolloutSide.reserve_batch``) while the trainer trains the step
        before, without waiting: its answer comes before the next call's, and that step's take
        then costs the trainer one short exchange."""
        self._post("reserve_batch", trainer_version=trainer_version, step=step)

    def finish_step(self, update: WeightUpdate, *, last_step: bool) -> StepReport:
        path = self._write_weights(update) if update.state_dict is not None else update.path
        data = self._call("finish_step", version=update.version, path=str(path), last_step=last_step)
        push_error = None if data["push_error"] is None else error_from_json(data["push_error"])
        assert push_error is None or isinstance(push_error, EngineError), f"a push failed with {push_error!r}"
        return StepReport(
            version=int(data["version"]),
            metrics={k: float(v) for k, v in data["metrics"].items()},
            push_error=push_error,
            reward_errors_failed=int(data["reward_errors_failed"]),
            reward_errors_first=[error_from_json(e) for e in data["reward_errors_first"]],  # type: ignore[misc]
        )

    def _write_weights(self, update: WeightUpdate) -> Path:
        """The trainer's weights written, in the engine's weight dtype, into the push slot of
        their version in the engine's scratch directory (``WeightSlots``), which the engine
        process loads."""
        from sdp_cli.models.precision import DTYPES

        assert update.state_dict is not None
        dtype = DTYPES[self._weight_dtype] if self._weight_dtype is not None else None
        return self._slots.write(update.version, update.state_dict, dtype)

    def join_push(self) -> None:
        self._call("join_push")

    def settle_push(self) -> None:
        if self._lost is None:
            try:
                self._call("settle_push")
            except RolloutProcessLost:
                pass

    def snapshot(self) -> dict[str, Any]:
        self._read_posted()
        self._ahead = None  # the snapshot puts it back in the cache
        return self._call("snapshot")

    def restore(self, snap: dict[str, Any], step: int) -> None:
        self._call("restore", snap=snap, step=step)

    def counters(self) -> LoopCounters:
        return LoopCounters.from_dict(self._call("counters"))

    def filtered_groups(self) -> int:
        return int(self._call("filtered_groups"))

    def sync_engine(self, update: WeightUpdate | None, version: int) -> None:
        path = None if update is None else str(update.path)
        self._call("sync_engine", version=version, path=path)

    def close(self) -> None:
        """Close the engine; what the rollout side holds stays readable (a stop's checkpoint)."""
        if self._lost is None and not self._closed:
            self._closed = True
            try:
                self._call("close")
            except RolloutProcessLost:
                pass

    def shutdown(self, grace_s: float = 30.0) -> None:
        """End the rollout process (it stops its engine and closes the ledger), by signal when it
        does not answer; idempotent."""
        if self._lost is None:
            try:
                self._call("shutdown")
            except RolloutProcessLost:
                pass
            self._lost = "the rollout process was shut down"
        try:
            self._sock.close()  # the rollout process, if still there, leaves at this end of the link
        except OSError:
            pass
        try:
            self._process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self._process.terminate()  # it stops its engine on SIGTERM
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()  # its engine's process leaves on its own (it watches its parent)
                self._process.wait()
        if self._slots is not None:
            self._slots.close()
        if self._scratch is not None:  # the rollout process's, normally removed by it
            shutil.rmtree(self._scratch, ignore_errors=True)
