"""The group ledger: what became of every rollout group of a run, kept consistent across crashes.

``<run>/ledger.jsonl`` holds one JSON object per fate, written when it happens (each also
carries the wall-clock ``time``):

    {"event": "consumed", "step": s, "groups": [ids], "samples": [n per group]}
    {"event": "dropped", "version": c, "where": "enqueue" | "queue" | "cache", "groups": [ids]}
    {"event": "rejected", "groups": [ids], "reason": "..."}
    {"event": "abandoned", "groups": [ids], "checkpoint_step": s}

``consumed``: trained on at step s. ``dropped``: removed by the staleness strategy at trainer
version c. ``rejected``: generation failed (an engine fault); the capacity came back.
``abandoned``: in flight when the checkpoint a resume started from was taken; that generation
belonged to the crashed session, the resumed run never had it and the capacity came back.

Crash consistency: a checkpoint records the ledger's length and the sha256 of those bytes,
taken in the same critical section as the loop snapshot (:meth:`LedgerLog.mark`), and a resume
checks both, audits the ledger against the snapshot and truncates the file to that length. The ledger then
describes one lineage: the checkpointed past plus the resumed session. Events of a crashed
session after its last checkpoint are removed, because the state they changed was lost with
it (its group ids are handed out again by the resumed run).

:func:`audit` checks the ledger against a checkpoint (docs/reliability.md): every group id below
the checkpoint's ``next_group_id`` has exactly one fate, counting "held" (queued or cached) and
"in flight" as fates; none is *lost* (no fate) and none is *duplicated* (two fates, e.g.
consumed twice). It also checks the staleness manager's counters against the fates.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdp_cli.fileio import fsync_directory, open_in_place, write_all

EVENTS = ("consumed", "dropped", "rejected", "abandoned")


class LedgerLog:
    """Appends ledger events; thread-safe; every event reaches the OS before ``write`` returns.
    Keeps the sha256 of the whole file as it grows, for :meth:`mark`."""

    def __init__(self, path: Path, *, truncate_to: int | None = None):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._fh = open_in_place(self.path, "a+b")
        if truncate_to is not None and self._fh.seek(0, os.SEEK_END) > truncate_to:
            self._fh.truncate(truncate_to)
        self._fh.seek(0)
        kept = self._fh.read()  # the file as it is kept (one read at start)
        self._digest = hashlib.sha256(kept)
        self._size = len(kept)

    def write(self, event: str, groups: list[int], **fields: Any) -> None:
        assert event in EVENTS, f"unknown ledger event {event!r}"
        line = json.dumps(
            {"event": event, "time": time.time(), "groups": [int(g) for g in groups], **fields}
        ).encode() + b"\n"
        with self._lock:
            # Written past the file object's buffer, whole or not at all: a failed write (a full
            # disk) left its line in the buffer, counted in the length a checkpoint records but
            # not in the file or its sha256, and flushed again later
            fd = self._fh.fileno()
            try:
                write_all(fd, line)  # (the file is opened to append)
            except OSError as err:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, self._size)  # no torn line
                raise OSError(err.errno, err.strerror, str(self.path)) from err
            self._size += len(line)
            self._digest.update(line)

    def offset(self) -> int:
        """Bytes written so far."""
        with self._lock:
            return self._size

    def mark(self) -> dict[str, Any]:
        """What a checkpoint records (``ledger_offset``, ``ledger_sha256``): the length and the
        sha256 of the ledger, read together."""
        with self._lock:
            return {"ledger_offset": self._size, "ledger_sha256": self._digest.hexdigest()}

    def sync(self) -> None:
        """Make the ledger durable (before a checkpoint that records its length)."""
        with self._lock:
            os.fsync(self._fh.fileno())
        fsync_directory(self.path.parent)

    def close(self) -> None:
        with self._lock:
            self._fh.close()


def record_fate(ledger: LedgerLog | None, event: str, group_ids: list[int], **fields: Any) -> None:
    """Write the fate of ``group_ids`` to the loop's ledger (none in benchmarks and unit tests).
    Callers hold the loop's hand-off lock or are the trainer thread, which also takes the
    snapshots, so every fate falls on one side of a snapshot."""
    if ledger is not None and group_ids:
        ledger.write(event, group_ids, **fields)


def parse_events(data: bytes) -> list[dict[str, Any]]:
    """The events of a ledger's bytes, each checked to be what :class:`LedgerLog` writes;
    ``ValueError("line N: ...")`` names the first that is not."""
    events = []
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except (ValueError, RecursionError):  # also UnicodeDecodeError
            raise ValueError(f"line {number}: not JSON") from None
        problem = _event_problem(event)
        if problem is not None:
            raise ValueError(f"line {number}: {problem}")
        events.append(event)
    return events


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _event_problem(event: Any) -> str | None:
    if not isinstance(event, dict):
        return f"a {type(event).__name__}, not an event object"
    name = event.get("event")
    if name not in EVENTS:
        return f"event {json.dumps(name)[:40]} is not one of {', '.join(EVENTS)}"
    groups = event.get("groups")
    if not isinstance(groups, list) or not all(_is_count(g) for g in groups):
        return "groups is not a list of group ids"
    if name == "consumed":
        samples = event.get("samples")
        if not isinstance(samples, list) or not all(_is_count(n) for n in samples):
            return "samples is not a list of sample counts"
        if len(samples) != len(groups):
            return f"{len(samples)} sample counts for {len(groups)} groups"
        if not _is_count(event.get("step")):
            return "a consumed event without a step number"
    return None


def read_events(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The events in the first ``limit`` bytes of a ledger (all when None)."""
    data = Path(path).read_bytes()
    return parse_events(data if limit is None else data[:limit])


@dataclass
class Audit:
    """The fates of a run's groups, and what is wrong with them (empty lists: nothing)."""

    groups: int = 0
    group_size: int = 0
    fates: Counter[str] = field(default_factory=Counter)
    lost: list[int] = field(default_factory=list)
    duplicated: list[int] = field(default_factory=list)
    #: consumed groups whose sample count differs from the group size
    bad_sample_counts: list[int] = field(default_factory=list)
    #: staleness-manager counters that disagree with the ledger, as "name: counter vs ledger"
    counter_mismatches: list[str] = field(default_factory=list)

    @property
    def samples_lost(self) -> int:
        return self.group_size * len(self.lost)

    @property
    def samples_duplicated(self) -> int:
        return self.group_size * len(self.duplicated)

    @property
    def ok(self) -> bool:
        return not (
            self.lost or self.duplicated or self.bad_sample_counts or self.counter_mismatches
        )

    def problems(self) -> str:
        """What is wrong, in one line (``group 7 lost, group 6 duplicated``); empty when ok."""

        def groups(ids: list[int], what: str) -> str:
            shown = ", ".join(map(str, sorted(ids)[:5])) + (", ..." if len(ids) > 5 else "")
            return f"group{'s' if len(ids) > 1 else ''} {shown} {what}"

        parts = [groups(ids, what) for ids, what in (
            (self.lost, "lost"), (self.duplicated, "duplicated"),
            (self.bad_sample_counts, f"consumed with other than {self.group_size} samples"),
        ) if ids]  # fmt: skip
        return ", ".join(parts + [f"counter {m}" for m in self.counter_mismatches])


def audit(ledger_path: Path, loop_snapshot: dict[str, Any], group_size: int) -> Audit:
    """Check the ledger prefix a checkpoint's loop snapshot points at (see the module docstring)."""
    return audit_events(read_events(ledger_path, int(loop_snapshot["ledger_offset"])), loop_snapshot, group_size)


def audit_events(events: list[dict[str, Any]], loop_snapshot: dict[str, Any], group_size: int) -> Audit:
    """:func:`audit` of events already read (``parse_events``)."""
    snap = loop_snapshot
    fates: dict[int, list[str]] = {}
    result = Audit(groups=int(snap["next_group_id"]), group_size=group_size)
    consumed_steps: Counter[int] = Counter()
    for event in events:
        name = event["event"]
        for i, gid in enumerate(event["groups"]):
            fates.setdefault(gid, []).append(name)
            if name == "consumed" and event["samples"][i] != group_size:
                result.bad_sample_counts.append(gid)
        if name == "consumed":
            consumed_steps[event["step"]] += 1
    held = [g["group_id"] for g in [*snap["queue"], *snap["cache"]]]
    for gid in held:
        fates.setdefault(gid, []).append("held")
    for gid in snap["in_flight_group_ids"]:
        fates.setdefault(gid, []).append("in_flight")
    for gid in range(result.groups):
        found = fates.get(gid, [])
        if not found:
            result.lost.append(gid)
        elif len(found) > 1:
            result.duplicated.append(gid)
        for fate in found:
            result.fates[fate] += 1
    result.duplicated.extend(g for g in fates if not 0 <= g < result.groups)

    stats = snap["manager"]["stats"]
    f = result.fates
    expected = {
        "submitted": result.groups,
        "accepted": f["consumed"] + f["dropped"] + f["held"],
        "rejected": f["rejected"] + f["abandoned"],
        "running": f["in_flight"],
        "filtered": f["dropped"],
        "enqueued": 0,
    }
    for name, value in expected.items():
        if stats[name] != value:
            result.counter_mismatches.append(f"{name}: {stats[name]} vs {value}")
    steps = sorted(consumed_steps)
    if steps != list(range(1, int(snap["step"]) + 1)) or set(consumed_steps.values()) - {1}:
        result.counter_mismatches.append(f"consumed steps {steps} vs 1..{snap['step']} once each")
    return result
