"""Where a run reports: ``metrics.jsonl`` (one line per step), ``events.jsonl`` (what happened:
start, resume, faults, checkpoints, end). Experiment trackers (TensorBoard, W&B, MLflow) are
``sdp_cli.train.trackers``; the terminal display is ``sdp_cli.train.display``."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, TextIO

from sdp_cli.redact import redact_urls


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLog:
    """Appends one JSON object per step; on resume, drops lines past the checkpoint step."""

    def __init__(self, path: Path, *, resume_step: int | None = None):
        self.path = path
        if resume_step is not None and path.exists():
            kept = [
                line
                for line in path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= resume_step
            ]
            path.write_text("".join(line + "\n" for line in kept))
        self._fh: TextIO = open(path, "a", buffering=1)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "time": time.time(), **{k: _jsonable(v) for k, v in sorted(metrics.items())}}
        self._fh.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self._fh.close()


class EventLog:
    """Human-meaningful events with timestamps, appended and flushed immediately."""

    def __init__(self, path: Path):
        self._fh: TextIO = open(path, "a", buffering=1)

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"time": time.time(), "event": event, **fields}, default=str)
        self._fh.write(redact_urls(line) + "\n")  # an error or override may quote a URL with credentials

    def close(self) -> None:
        self._fh.close()
