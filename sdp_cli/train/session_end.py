"""How a training session ends: its summary when it finishes; a signal, a stop, an abort, a crash.

A mixin of :class:`sdp_cli.train.run.TrainingRun` (docs/reliability.md, "Signals"): a signal
stops the loop at a step boundary and :meth:`SessionEnd._interrupted` checkpoints that step and
writes an ``interrupted`` event; an engine fault, a failed producer or reward, or a full disk
end in a ``stopped`` event and one line; a second Ctrl-C ends in an ``aborted`` event, with the
last complete checkpoint as the resume point. Every line says how to go on with
:func:`resume_command`, which a user can paste as it is printed.
"""

from __future__ import annotations

import json
import re
import shlex
import traceback
from pathlib import Path
from typing import Any

from sdp_cli.config.schema import SdpConfig
from sdp_cli.errors import Interrupted, UserError, describe_os_error
from sdp_cli.modes import resolve_mode
from sdp_cli.stopsignals import signal_name
from sdp_cli.tasks.plugins import RewardError
from sdp_cli.train import checkpoint as ckpt
from sdp_cli.train.start import PROGRAM_KEYS

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


class SessionEnd:
    """The end-of-session part of a training run; the attributes it uses are TrainingRun's."""

    run_dir: Any
    loop: Any
    engine: Any
    events: Any
    coordinator: Any
    trainer: Any
    stop_request: Any
    start_step: int
    cfg: Any
    eval_rewards: Any
    _last_checkpoint: tuple[int, Path] | None

    def _end_session(self, code: int) -> None:
        """Release the other ranks, which exit with ``code`` as rank 0 will (0, 1 or 2, or 128 +
        the signal); after the last collective this session needs (checkpoint, evaluation)."""
        self.coordinator.end(code)

    def close(self, *, abort: bool = False) -> None:
        """Stop what this session started that outlives it (a launched server); idempotent.
        ``abort``: the process is about to end, the evaluation's reward workers and the logs
        are closed too."""
        if getattr(self, "progress", None) is not None:
            self.progress.close()
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.close()
        if abort:
            self._end_evaluation()
            self._close_logs(ok=False)

    def _end_evaluation(self) -> None:
        """No evaluation follows: end its reward workers (a call still running is left to them)."""
        if getattr(self, "eval_rewards", None) is not None:
            self.eval_rewards.close()

    def resume_command(self, *extra: str) -> str:
        return resume_command(self.run_dir.path, self.cfg, *extra)

    def _reward_errors(self, step: int) -> dict[str, float]:
        """``reward/errors`` (task.reward_errors=zero): the reward calls that failed and scored 0
        since the last step; and a ``reward_error`` event with the first traceback of each error
        not seen before (greedy evaluation's included)."""
        failed, first = self.loop.rewards.take_errors()
        if getattr(self, "eval_rewards", None) is not None:
            first += self.eval_rewards.take_errors()[1]
        for error in first:
            self._event("reward_error", step=step, error=str(error), traceback=error.details or None)
        return {"reward/errors": float(failed)} if self.cfg.task.reward_errors == "zero" else {}

    def _close_logs(self, *, ok: bool = True) -> None:
        """Close the run's logs; ``ok``: the session finished (trackers mark a run that did not)."""
        for log in ("metrics", "ledger", "events"):
            if getattr(self, log, None) is not None:
                getattr(self, log).close()
        if getattr(self, "trackers", None) is not None:
            self.trackers.close(ok=ok)

    def _checkpoint_at_stop(self, step: int) -> tuple[Path | None, str | None]:
        """The checkpoint of ``step`` (written now unless it exists): (path, None), or
        (None, why not) when it cannot be written (a full disk)."""
        if step == self.start_step and self._last_checkpoint is None:
            return None, None  # a fresh run that never stepped: a resume starts it over
        try:
            return self.checkpoint(step), None
        except OSError as err:
            return None, describe_os_error(err)

    def _last_complete_step(self) -> int | None:
        found = ckpt.find_latest(self.run_dir.checkpoints)
        return None if found is None else ckpt.step_of(found)

    def _interrupted(self) -> Interrupted:
        """The end of a session stopped by a signal, at a step boundary."""
        step = self.loop.state.step
        name = self.stop_request.name
        self._end_evaluation()
        path, problem = self._checkpoint_at_stop(step)
        self._reward_errors(step)
        self._event("interrupted", step=step, signal=name, checkpoint=str(path) if path else None, error=problem)
        self._close_logs(ok=False)
        where = f"resume with: {self.resume_command()}"
        if problem:
            last = self._last_complete_step()
            where = f"its checkpoint could not be written ({problem}); {where} (from step {last or 0})"
        return Interrupted(f"stopped at step {step} ({name}); {where}", 128 + int(self.stop_request.signum))

    def _stopped(self, exc: BaseException) -> UserError:
        """The end of a session stopped by an engine fault, a failed producer or reward, or a full disk."""
        step = self.loop.state.step
        self._end_evaluation()
        path, problem = self._checkpoint_at_stop(step) if step > self.start_step else (None, None)
        self._reward_errors(step)
        cause = exc if isinstance(exc, RewardError) else exc.__cause__
        detail: dict[str, Any] = {}
        if isinstance(cause, RewardError):  # user code: its own traceback
            detail["traceback"] = cause.details
        elif cause is not None and not isinstance(cause, (UserError, OSError)):  # a bug: keep its trace
            detail["traceback"] = "".join(traceback.format_exception(cause))
        reason = describe_os_error(exc) if isinstance(exc, OSError) else str(exc)
        self._event("stopped", step=step, reason=reason, checkpoint=str(path) if path else None, error=problem, **detail)
        self._close_logs(ok=False)
        last = self._last_complete_step()
        where = f"; resume with: {self.resume_command()}" if last is not None or step else ""
        if problem:
            where = f"; its checkpoint could not be written ({problem}){where} (from step {last or 0})"
        error = UserError(f"training stopped at step {step}: {reason}{where}")
        error.__cause__ = exc
        return error

    def _event(self, name: str, **fields: Any) -> None:
        """An end-of-session event; a full disk must not hide the one line that follows."""
        try:
            self.events.write(name, **{k: v for k, v in fields.items() if v is not None or k == "checkpoint"})
        except (OSError, ValueError):  # ValueError: the log was closed (a second Ctrl-C after the stop's line)
            pass

    def aborted(self, signum: int) -> Interrupted:
        """The end of a session aborted by a second Ctrl-C: no checkpoint, the last complete one
        is the resume point."""
        step = self.loop.state.step if self.loop is not None else self.start_step
        last = self._last_complete_step()
        self._event("aborted", step=step, signal=signal_name(signum), resume_step=last)
        self.close(abort=True)
        return Interrupted(
            f"aborted at step {step} (second {signal_name(signum)}); resume with: {self.resume_command()} "
            f"({self._resume_point(last)})",
            128 + signum,
        )

    def crashed(self, exc: BaseException) -> None:
        """The end of a session ended by a bug (an exception no stop expects): close what it
        opened, and add to the traceback how to go on from the last complete checkpoint."""
        self.close(abort=True)
        step = self.loop.state.step if self.loop is not None else self.start_step
        exc.add_note(
            f"sdp train stopped at step {step} on this error; resume with: {self.resume_command()} "
            f"({self._resume_point(self._last_complete_step())})"
        )

    @staticmethod
    def _resume_point(last: int | None) -> str:
        return f"from step {last}, the last complete checkpoint" if last is not None else "it starts over: no checkpoint yet"

    def _summary(
        self, wall: float, acc_start: float | None, acc_end: float | None, session_start: dict[str, Any]
    ) -> dict[str, Any]:
        """Run totals plus this session's rates (``wall_seconds`` covers this session only)."""
        rows = [json.loads(line) for line in self.run_dir.metrics.read_text().splitlines() if line]
        rewards = [r["reward/mean"] for r in rows if r.get("reward/mean") is not None]
        window = min(50, max(1, len(rewards) // 2))
        counters = self.loop.state.counters
        session_tokens = counters.tokens_generated - session_start["tokens_generated"]
        session_recompute = counters.recompute_seconds - session_start["recompute_seconds"]
        session_blocking = counters.recompute_blocking_seconds - session_start["recompute_blocking_seconds"]
        return {
            "run_dir": str(self.run_dir.path),
            "steps": self.loop.state.step,
            "mode": resolve_mode(self.cfg.loss.mode).name,
            "staleness": self.cfg.staleness.strategy,
            "max_head_offpolicyness": self.cfg.rollout.max_head_offpolicyness,
            "wall_seconds": wall,
            "reward_first": sum(rewards[:window]) / window if rewards else None,
            "reward_last": sum(rewards[-window:]) / window if rewards else None,
            "reward_window": window,
            "greedy_accuracy_start": acc_start,
            "greedy_accuracy_end": acc_end,
            "tokens_generated": counters.tokens_generated,
            "session_start_step": self.start_step,
            "tokens_per_second": session_tokens / wall if wall > 0 else None,
            "steps_per_second": (self.loop.state.step - self.start_step) / wall if wall > 0 else None,
            # time the pass took (mostly in the producer thread, overlapping training) and the
            # part the trainer waited for at weight pushes
            "recompute_share": session_recompute / wall if wall > 0 else None,
            "recompute_blocking_share": session_blocking / wall if wall > 0 else None,
            "filtered_groups": sum(self.loop.strategy.filtered_by_version.values()),
            "counters": counters.to_dict(),
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
