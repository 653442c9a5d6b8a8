"""Where a run reports: ``metrics.jsonl`` (one line per step), ``events.jsonl`` (what happened:
start, resume, faults, checkpoints, end) and a live terminal display. Experiment trackers
(TensorBoard, W&B, MLflow) are ``sdp_cli.train.trackers``."""

from __future__ import annotations

import json
import math
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, TextIO


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
        self._fh.write(json.dumps({"time": time.time(), "event": event, **fields}, default=str) + "\n")

    def close(self) -> None:
        self._fh.close()


class Progress:
    """A live line in a terminal (rich), or a plain line every ``every`` steps elsewhere."""

    FIELDS = (
        ("reward", "reward/mean", "{:.3f}"),
        ("lag", "staleness/lag_mean", "{:.2f}"),
        ("w mean", "weights/rollout_is_mean", "{:.3f}"),
        ("w std", "weights/rollout_is_std", "{:.3f}"),
        ("filtered", "staleness/filtered_groups_total", "{:.0f}"),
        ("epoch", "data/epoch", "{:.2f}"),  # data-set tasks only
    )

    def __init__(self, total: int, *, start: int = 0, enabled: bool = True, stream: TextIO | None = None):
        self.total = total
        self.start_step = start
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.started = time.monotonic()
        self.rewards: deque[float] = deque(maxlen=20)
        self.tokens_at_start: float | None = None
        self._rich = None
        self._task = None
        self.every = max(1, total // 20)
        if enabled and self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress
            from rich.progress import TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._rich = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
                console=Console(file=self.stream),
                transient=False,
            )
            self._task = self._rich.add_task("train", total=total, completed=start, info="")
            self._rich.start()

    def _summary(self, step: int, metrics: dict[str, float]) -> str:
        if "reward/mean" in metrics:
            self.rewards.append(metrics["reward/mean"])
        parts = []
        for label, key, fmt in self.FIELDS:
            if key == "reward/mean" and self.rewards:
                parts.append(f"{label} {fmt.format(sum(self.rewards) / len(self.rewards))}")
            elif key in metrics:
                parts.append(f"{label} {fmt.format(metrics[key])}")
        tokens = metrics.get("throughput/tokens_generated_total")
        if tokens is not None:
            if self.tokens_at_start is None:
                self.tokens_at_start = tokens
            elapsed = max(time.monotonic() - self.started, 1e-9)
            parts.append(f"tok/s {(tokens - self.tokens_at_start) / elapsed:.0f}")
        return "  ".join(parts)

    def update(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        info = self._summary(step, metrics)
        if self._rich is not None:
            self._rich.update(self._task, completed=step, info=info)
        elif step % self.every == 0 or step == self.total:
            done = step - self.start_step
            elapsed = time.monotonic() - self.started
            remaining = elapsed / done * (self.total - step) if done else float("nan")
            print(f"step {step}/{self.total}  {info}  elapsed {elapsed:.0f}s  eta {remaining:.0f}s", file=self.stream, flush=True)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
