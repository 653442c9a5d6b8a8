"""How a training session ends: its summary when it finishes; a signal, a stop, an abort, a crash.

:class:`SessionEnd` is what the end records and says; the session (``TrainingRun`` in
``sdp_cli/train/session/run.py``) holds one as ``run.end`` and, at its end, closes what it opened and
hands it the step it reached (docs/reliability.md, "Signals"). A signal stops the loop at a step
boundary, that step is checkpointed and an ``interrupted`` event written; an engine fault, a
failed producer or reward, or a full disk end in a ``stopped`` event and one line; a second
Ctrl-C ends in an ``aborted`` event, with the last complete checkpoint as the resume point.
Every line says how to go on with :func:`resume_command`, which a user can paste as it is printed.
"""

from __future__ import annotations

import json
import re
import shlex
import traceback
from pathlib import Path
from typing import Any

from sdp_cli.config.schema import SdpConfig
from sdp_cli.errors import Interrupted, UserCodeError, UserError, describe_os_error
from sdp_cli.modes import resolve_mode
from sdp_cli.rundir import RunDir
from sdp_cli.stopsignals import StopRequest, signal_name
from sdp_cli.train.session import checkpoint as ckpt
from sdp_cli.train.session.reporting import EventLog
from sdp_cli.train.session.start import PROGRAM_KEYS

# a path or module:function that a Hydra override value holds unquoted and reads back as this
# string (the "/" or ":" keeps it from reading as a number, a bool or null)
_PLAIN_VALUE = re.compile(r"(?=.*[/:])[A-Za-z0-9_./:@+%-]+( +[A-Za-z0-9_./:@+%-]+)*")


def _hydra_value(text: str) -> str:
    """``text`` as a Hydra override value that reads back as this string: as it is when it can
    be, else single-quoted, with a quote and the backslashes before a quote or the end escaped."""
    if _PLAIN_VALUE.fullmatch(text):
        return text
    escaped = re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), text)
    return f"'{escaped}'"


def resume_command(run_dir: Path, cfg: SdpConfig, *extra: str) -> str:
    """``sdp train resume=RUN``, complete: with every program key the resume takes only from its
    command line (``PROGRAM_KEYS``, e.g. ``task.reward=reward.py:fn``) and the ``extra``
    overrides, each quoted for Hydra and for the shell, so that it works pasted as printed."""
    overrides = [f"resume={_hydra_value(str(run_dir))}"]
    for key, named in PROGRAM_KEYS.items():
        if (program := named(cfg)) is not None:
            overrides.append(f"{key}={_hydra_value(program)}")
    return " ".join(["sdp", "train", *(shlex.quote(o) for o in [*overrides, *extra])])


#: the checkpoint of a stop: its path, the error that kept it from being written, or None when
#: there is none to write
SavedAtStop = Path | OSError | None


def _checkpoint_fields(saved: SavedAtStop) -> tuple[Path | None, str | None]:
    """(the checkpoint, why it could not be written) of a stop."""
    if isinstance(saved, OSError):
        return None, describe_os_error(saved)
    return saved, None


class SessionEnd:
    """The events and the one line that end a session, and its summary."""

    def __init__(self, cfg: SdpConfig, run_dir: RunDir, events: EventLog | None):
        self.cfg = cfg
        self.run_dir = run_dir
        #: the run's event log (rank 0; other ranks write no events)
        self.events = events

    def resume_command(self, *extra: str) -> str:
        return resume_command(self.run_dir.path, self.cfg, *extra)

    def event(self, name: str, **fields: Any) -> None:
        """Write an event; a full disk must not hide the one line that follows."""
        if self.events is None:
            return
        try:
            self.events.write(name, **{k: v for k, v in fields.items() if v is not None or k == "checkpoint"})
        except (OSError, ValueError):  # ValueError: the log was closed (a second Ctrl-C after the stop's line)
            pass

    def interrupted(self, step: int, stop: StopRequest, saved: SavedAtStop) -> Interrupted:
        """The end of a session stopped by a signal at step boundary ``step``, with the checkpoint
        ``saved`` of that step: its ``interrupted`` event, and the line to end on."""
        path, problem = _checkpoint_fields(saved)
        self.event("interrupted", step=step, signal=stop.name, checkpoint=str(path) if path else None, error=problem)
        where = f"resume with: {self.resume_command()}"
        if problem:
            where = f"its checkpoint could not be written ({problem}); {where}"
        if path is None:  # the resume goes on from an older checkpoint, or starts over
            where += f" ({self._resume_point(self._last_complete_step())})"
        return Interrupted(f"stopped at step {step} ({stop.name}); {where}", 128 + int(stop.signum))

    def stopped(self, step: int, exc: BaseException, saved: SavedAtStop, *, inside_step: bool = False) -> UserError:
        """The end of a session stopped at ``step`` by ``exc`` (an error you can fix, an engine
        fault, a failed producer or reward, a full disk): its ``stopped`` event, and the line to
        end on. ``inside_step``: it came inside the next step, which left no checkpoint to write
        (``saved`` is None): the last complete one is the resume point."""
        path, problem = _checkpoint_fields(saved)
        cause = exc if isinstance(exc, UserCodeError) else exc.__cause__
        detail: dict[str, Any] = {}
        if isinstance(cause, UserCodeError):  # your code: its own traceback
            if cause.details:
                detail["traceback"] = cause.details
        elif cause is not None and not isinstance(cause, (UserError, OSError)):  # a bug: keep its trace
            detail["traceback"] = "".join(traceback.format_exception(cause))
        reason = describe_os_error(exc) if isinstance(exc, OSError) else str(exc)
        last = self._last_complete_step()
        if inside_step:
            detail["resume_step"] = last
        self.event("stopped", step=step, reason=reason, checkpoint=str(path) if path else None, error=problem, **detail)
        where = f"; resume with: {self.resume_command()}"
        if problem:
            same = isinstance(exc, OSError) and isinstance(saved, OSError) and exc.errno == saved.errno
            why = "for the same reason" if same else f"({problem})"
            where = f"; its checkpoint could not be written {why}{where}"
        if path is None and (inside_step or problem or last != step):
            # the resume goes on from an older checkpoint, or starts over
            where += f" ({self._resume_point(last)})"
        error = UserError(f"training stopped at step {step}: {reason}{where}")
        error.__cause__ = exc
        return error

    def aborted(self, step: int, signum: int) -> Interrupted:
        """The end of a session aborted at ``step`` by a second Ctrl-C: its ``aborted`` event (no
        checkpoint: the last complete one is the resume point), and the line to end on."""
        last = self._last_complete_step()
        self.event("aborted", step=step, signal=signal_name(signum), resume_step=last)
        return Interrupted(
            f"aborted at step {step} (second {signal_name(signum)}); resume with: {self.resume_command()} "
            f"({self._resume_point(last)})",
            128 + signum,
        )

    def crash_note(self, step: int) -> str:
        """What a traceback of a bug (an exception no stop expects) at ``step`` adds: how to go on
        from the last complete checkpoint."""
        return (
            f"sdp train stopped at step {step} on this error; resume with: {self.resume_command()} "
            f"({self._resume_point(self._last_complete_step())})"
        )

    def _last_complete_step(self) -> int | None:
        found = ckpt.find_latest(self.run_dir.checkpoints)
        return None if found is None else ckpt.step_of(found)

    @staticmethod
    def _resume_point(last: int | None) -> str:
        return f"from step {last}, the last complete checkpoint" if last is not None else "it starts over: no checkpoint yet"

    def summary(
        self,
        steps: int,
        counters: dict[str, Any],
        filtered_groups: int,
        *,
        start_step: int,
        wall: float,
        acc_start: float | None,
        acc_end: float | None,
        session_start: dict[str, Any],
    ) -> dict[str, Any]:
        """Run totals plus this session's rates (``wall_seconds`` covers this session only, which
        started at ``start_step`` with the counters ``session_start``; ``steps`` and ``counters``
        are the loop's at its end)."""
        rows = [json.loads(line) for line in self.run_dir.metrics.read_text().splitlines() if line]
        rewards = [r["reward/mean"] for r in rows if r.get("reward/mean") is not None]
        window = min(50, max(1, len(rewards) // 2))
        session_tokens = counters["tokens_generated"] - session_start["tokens_generated"]
        session_recompute = counters["recompute_seconds"] - session_start["recompute_seconds"]
        session_blocking = counters["recompute_blocking_seconds"] - session_start["recompute_blocking_seconds"]
        return {
            "run_dir": str(self.run_dir.path),
            "steps": steps,
            "mode": resolve_mode(self.cfg.loss.mode).name,
            "staleness": self.cfg.staleness.strategy,
            "max_head_offpolicyness": self.cfg.rollout.max_head_offpolicyness,
            "wall_seconds": wall,
            "reward_first": sum(rewards[:window]) / window if rewards else None,
            "reward_last": sum(rewards[-window:]) / window if rewards else None,
            "reward_window": window,
            "greedy_accuracy_start": acc_start,
            "greedy_accuracy_end": acc_end,
            "tokens_generated": counters["tokens_generated"],
            "session_start_step": start_step,
            "tokens_per_second": session_tokens / wall if wall > 0 else None,
            "steps_per_second": (steps - start_step) / wall if wall > 0 else None,
            # time the pass took (mostly in the producer thread, overlapping training) and the
            # part the trainer waited for at weight pushes
            "recompute_share": session_recompute / wall if wall > 0 else None,
            "recompute_blocking_share": session_blocking / wall if wall > 0 else None,
            "filtered_groups": filtered_groups,
            "counters": dict(counters),
        }


def summary_line(summary: dict[str, Any], further: str) -> str:
    """The done line; ``further``: the command that trains the run on (as many steps again)."""

    def fmt(value: Any, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    return (
        f"done: {summary['steps']} steps in {summary['wall_seconds']:.0f}s; "
        f"reward {fmt(summary['reward_first'], '.3f')} → {fmt(summary['reward_last'], '.3f')} "
        f"(first/last {summary['reward_window']} steps); greedy accuracy "
        f"{fmt(summary['greedy_accuracy_start'], '.2f')} → {fmt(summary['greedy_accuracy_end'], '.2f')}; "
        f"run dir {summary['run_dir']}; train further with: {further}"
    )
