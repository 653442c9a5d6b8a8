"""Where a run reports: ``metrics.jsonl`` (one line per step), ``events.jsonl`` (what happened:
start, resume, faults, checkpoints, end). Experiment trackers (TensorBoard, W&B, MLflow) are
``sdp_cli.train.session.trackers``; the terminal display is ``sdp_cli.train.session.display``."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, TextIO

from sdp_cli.fileio import atomic_write_text, open_in_place
from sdp_cli.redact import redact_urls


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class _AppendedLog:
    """A JSON-lines file appended line by line (line-buffered: each line reaches the file as it
    is written)."""

    def __init__(self, path: Path):
        self.path = path
        self._fh: TextIO = open_in_place(path, "a")  # type: ignore[assignment]

    def _append(self, line: str) -> None:
        try:
            self._fh.write(line + "\n")
        except OSError as err:  # a buffered write's error names no file: this one does
            raise OSError(err.errno, err.strerror, str(self.path)) from err

    def close(self) -> None:
        try:
            self._fh.close()
        except OSError:
            # closing flushes again what a failed write left in the buffer; that failure was
            # raised when it happened (the run stopped on it), and the file is closed either way
            pass


class MetricsLog(_AppendedLog):
    """Appends one JSON object per step; on resume, drops lines past the checkpoint step (the
    lines were checked by ``sdp_cli.train.session.recovery.check_run_files``; the rewrite is a rename,
    so it never writes through a link)."""

    def __init__(self, path: Path, *, resume_step: int | None = None):
        if resume_step is not None and path.exists():
            with open_in_place(path, "r+b") as fh:
                lines = [line for line in fh.read().decode().split("\n") if line.strip()]
            kept = [line for line in lines if json.loads(line)["step"] <= resume_step]
            if kept != lines:
                atomic_write_text(path, "".join(line + "\n" for line in kept))
        super().__init__(path)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "time": time.time(), **{k: _jsonable(v) for k, v in sorted(metrics.items())}}
        self._append(json.dumps(row))


class EventLog(_AppendedLog):
    """Human-meaningful events with timestamps, appended and flushed immediately."""

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"time": time.time(), "event": event, **fields}, default=str)
        self._append(redact_urls(line))  # an error or override may quote a URL with credentials
