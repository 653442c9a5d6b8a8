"""Test-only fault injection: make this process die or fail when it reaches a named point.

The reliability suite (``tests/reliability``, docs/reliability.md) sets ``SDP_TEST_FAULTS`` to
a comma-separated list of ``ACTION:POINT[@N]``; the N-th time (default: the first) this process
reaches ``POINT``, ``ACTION`` happens:

- ``kill``: SIGKILL this process, which no cleanup code sees (crash recovery tests);
- ``raise``: raise :class:`InjectedFault`, an unexpected error (a bug, an out-of-memory);
- ``engine_error``: raise ``EngineError``, a fault the engine reports (e.g. a lost server);
- ``enospc``: raise ``OSError(ENOSPC)``, as a write to a full disk does;
- ``stall``: sleep 3 s (``SDP_TEST_STALL_S`` seconds when set), so that a test can signal the
  process while it is at ``POINT``.

Named points let a test crash a run at an exact place (between two files of a checkpoint, mid
optimizer step) instead of guessing with timers. Without the variable, which is the case
outside the tests, :func:`fault_point` is one dictionary lookup. The points are listed in
``POINTS``; an unknown name in the variable is refused at import, so a typo cannot make a
test pass vacuously.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time

ENV = "SDP_TEST_FAULTS"
ACTIONS = ("kill", "raise", "engine_error", "enospc", "stall")
STALL_ENV = "SDP_TEST_STALL_S"


def _stall_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 3600:
        raise ValueError(f"{STALL_ENV}: {value!r} is not a number of seconds between 0 and 3600")
    return seconds


#: seconds the ``stall`` action sleeps (a test that times what a signal cuts short sets more, so
#: that a slow exit on a loaded machine still tells "cut short" from "waited")
STALL_S = _stall_seconds(os.environ.get(STALL_ENV, "3"))
POINTS = (
    "producer.generated",  # a generate call returned; its groups are not handed over yet
    "producer.handover",  # mid hand-over: one group is in the queue, the others are not
    "local.generate",  # the local engine finished one decode step
    "local.score",  # the local engine is about to score (the recompute pass)
    "local.start_weights_written",  # the local engine's start-up weights are written; its process is not started
    "local.process_stopped",  # closing: the local engine's process is stopped, its scratch directory not removed
    "loop.batch_taken",  # a batch left the cache; the trainer has not stepped on it
    "trainer.optimizer_step",  # one optimizer step of a training step is done
    "loop.recomputed",  # the recompute pass is done; the new weights are not loaded
    "loop.weights_loaded",  # the engine runs the new weights; the loop's version is not updated yet
    "run.metrics_written",  # the step's metrics line is written; its checkpoint is not
    "checkpoint.policy",  # checkpoint: the policy is in the temporary directory
    "checkpoint.optimizer",  # checkpoint: optimizer.safetensors is written too
    "checkpoint.state",  # checkpoint: state.json is written, no manifest yet
    "checkpoint.manifest",  # checkpoint: complete in the temporary directory, not renamed
    "checkpoint.renamed",  # checkpoint: renamed into place, `latest` not updated
    "checkpoint.latest",  # checkpoint: `latest` updated, older checkpoints not pruned
)


class InjectedFault(RuntimeError):
    """The error ``raise:POINT`` injects."""


def _parse(spec: str) -> dict[str, list[tuple[str, int]]]:
    plan: dict[str, list[tuple[str, int]]] = {}
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        action, _, rest = entry.partition(":")
        point, _, nth = rest.partition("@")
        if action not in ACTIONS or point not in POINTS or not (nth or "1").isdigit():
            raise ValueError(
                f"{ENV}: bad entry {entry!r}; use ACTION:POINT[@N] with ACTION in "
                f"{', '.join(ACTIONS)} and POINT in {', '.join(POINTS)}"
            )
        plan.setdefault(point, []).append((action, int(nth or 1)))
    return plan


_PLAN = _parse(os.environ.get(ENV, ""))
_counts: dict[str, int] = {}
_lock = threading.Lock()


def enabled() -> bool:
    """Whether any fault is planned in this process."""
    return bool(_PLAN)


def fault_point(name: str) -> None:
    """Mark point ``name``; act if ``SDP_TEST_FAULTS`` plans a fault for this arrival."""
    actions = _PLAN.get(name)
    if actions is None:
        return
    with _lock:
        _counts[name] = count = _counts.get(name, 0) + 1
    for action, nth in actions:
        if nth != count:
            continue
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "raise":
            raise InjectedFault(f"fault injected at {name} (arrival {count})")
        if action == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC) + f" (fault injected at {name})")
        if action == "stall":
            time.sleep(STALL_S)
            continue
        from sdp_cli.errors import EngineError

        raise EngineError(f"fault injected at {name} (arrival {count}); the engine failed")
