"""What ``sdp train`` shows on the terminal (stderr; docs/training.md, "What a run prints"): the
run directory first, one status line per setup phase (model load and warm start, engine start,
evaluations) and the live training bar.

On a terminal a phase is a spinner with its latest detail and ends as one line with its result
and duration; elsewhere (a log file, CI) it is one line when it starts, a detail line at most
every ``PLAIN_DETAIL_EVERY_S`` seconds, and one line when it ends. The live bar keeps step/total,
the ETA and the reward wherever they fit (about 35 columns): the other fields go first, then
the label, the elapsed time and the bar (``progress_line``).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import deque
from typing import Any, Callable, Iterator, TextIO

#: seconds between two detail lines of a phase when the output is not a terminal
PLAIN_DETAIL_EVERY_S = 10.0
#: the bar's width range in columns
BAR_MIN, BAR_MAX = 10, 30


def _console(stream: TextIO) -> Any:
    from rich.console import Console

    return Console(file=stream, highlight=False)


def format_duration(seconds: float | None) -> str:
    """``75.4`` → ``1:15``, ``3725`` → ``1:02:05``; ``?`` when unknown."""
    if seconds is None or seconds != seconds or seconds < 0 or seconds == float("inf"):
        return "?"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_took(seconds: float) -> str:
    """A phase's duration: ``4.2 s`` under a minute, else as ``format_duration``."""
    return f"{seconds:.1f} s" if seconds < 59.95 else format_duration(seconds)


class Phase:
    """A running setup phase: ``update(detail)`` shows progress; ``result`` is printed at its end."""

    def __init__(self, show: Callable[[str], None]):
        self._show = show
        self.result: str | None = None

    def update(self, detail: str) -> None:
        self._show(detail)


class StartDisplay:
    """The lines before training starts; silent when ``enabled`` is false (``run.progress``)."""

    def __init__(self, *, enabled: bool = True, stream: TextIO | None = None):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self._console = _console(self.stream) if enabled else None

    def line(self, text: str) -> None:
        """One line (the run directory, a phase's start or end)."""
        if self.enabled:
            print(text, file=self.stream, flush=True)

    @contextlib.contextmanager
    def phase(self, title: str) -> Iterator[Phase]:
        """A setup phase titled ``title`` (e.g. "loading model"); its body may update the
        detail and set ``result``."""
        if not self.enabled:
            yield Phase(lambda detail: None)
            return
        started = time.monotonic()
        live = self._console.is_terminal
        status = None
        last_plain = [started]

        def show(detail: str) -> None:
            if status is not None:
                status.update(f"{title}: {detail}")
            elif time.monotonic() - last_plain[0] >= PLAIN_DETAIL_EVERY_S:
                last_plain[0] = time.monotonic()
                self.line(f"  {title}: {detail}")

        if live:
            status = self._console.status(f"{title} …")
            status.start()
        else:
            self.line(f"{title} …")
        phase = Phase(show)
        try:
            yield phase
        finally:  # a failure is reported by the error itself, in one line
            if status is not None:
                status.stop()
        took = format_took(time.monotonic() - started)
        self.line(f"{title}: {phase.result or 'done'} ({took})")


def start_evaluation_title(step: int) -> str:
    """The title of the evaluation before training: "initial" only for a run at step 0; a
    resumed one evaluates the checkpoint's weights."""
    return "initial evaluation" if step == 0 else f"evaluation at step {step} (resumed)"


# ------------------------------------------------------------------ live bar
def progress_line(
    width: int, step: int, total: int, elapsed: float, remaining: float | None, fields: list[tuple[str, str]]
) -> list[tuple[str, str]]:
    """The bar's segments ``(text, rich style)`` for a terminal ``width`` columns wide, at most
    ``width - 1`` characters together (a full-width line wraps on some terminals).

    ``step/total``, the ETA and the first field (the reward) always stay; when they do not all
    fit, the other fields go first (last one first), then the ``train`` label, the elapsed time
    and at last the bar. A bar that stays grows from ``BAR_MIN`` up to ``BAR_MAX`` columns.
    """
    room = width - 1
    counts, eta = f"{step}/{total}", f"eta {format_duration(remaining)}"
    texts = [f"{label} {value}" for label, value in fields]
    first, rest = texts[:1], texts[1:]

    def build(label: bool, clock: bool, extra: list[str], bar: int) -> list[tuple[str, str]]:
        words: list[tuple[str, str]] = [("train", "bold")] if label else []
        words.append((counts, "bold"))
        if bar:
            done = min(bar, round(bar * step / total)) if total else bar
            words.append(("━" * done + "━" * (bar - done), f"bar:{done}"))
        if clock:
            words.append((format_duration(elapsed), ""))
        words += [(eta, ""), *((t, "") for t in first + extra)]
        segments: list[tuple[str, str]] = []
        for text, style in words:
            if segments:
                segments.append(("  ", ""))
            if style.startswith("bar:"):
                done = int(style[4:])
                segments += [(text[:done], "green"), (text[done:], "grey37")]
            else:
                segments.append((text, style))
        return segments

    def length(segments: list[tuple[str, str]]) -> int:
        return sum(len(text) for text, _ in segments)

    candidates = [(True, True, rest[:k], BAR_MIN) for k in range(len(rest), -1, -1)]
    candidates += [(False, True, [], BAR_MIN), (False, False, [], BAR_MIN), (False, False, [], 0)]
    for label, clock, extra, bar in candidates:
        segments = build(label, clock, extra, bar)
        if length(segments) <= room:
            if bar:
                segments = build(label, clock, extra, min(BAR_MAX, bar + room - length(segments)))
            return segments
    return segments  # narrower than the numbers themselves: the terminal crops the line


class Progress:
    """The training bar: a live line on a terminal (``progress_line``), or a plain line every
    ``every`` steps elsewhere."""

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
        self.step = start
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.started = time.monotonic()
        self.rewards: deque[float] = deque(maxlen=20)
        self.tokens_at_start: float | None = None
        self.fields: list[tuple[str, str]] = []
        self.every = max(1, total // 20)
        self._live = None
        if enabled:
            console = _console(self.stream)
            if console.is_terminal:
                from rich.live import Live

                self._console = console
                self._live = Live(get_renderable=self._render, console=console, refresh_per_second=2, transient=False)
                self._live.start()

    def _remaining(self) -> float | None:
        done = self.step - self.start_step
        return (time.monotonic() - self.started) / done * (self.total - self.step) if done else None

    def _render(self) -> Any:
        from rich.text import Text

        segments = progress_line(
            self._console.width, self.step, self.total, time.monotonic() - self.started, self._remaining(), self.fields
        )
        return Text.assemble(*segments, no_wrap=True, overflow="crop")

    def _update_fields(self, metrics: dict[str, float]) -> None:
        if "reward/mean" in metrics:
            self.rewards.append(metrics["reward/mean"])
        fields = []
        for label, key, fmt in self.FIELDS:
            if key == "reward/mean" and self.rewards:
                fields.append((label, fmt.format(sum(self.rewards) / len(self.rewards))))
            elif key in metrics:
                fields.append((label, fmt.format(metrics[key])))
        tokens = metrics.get("throughput/tokens_generated_total")
        if tokens is not None:
            if self.tokens_at_start is None:
                self.tokens_at_start = tokens
            elapsed = max(time.monotonic() - self.started, 1e-9)
            fields.append(("tok/s", f"{(tokens - self.tokens_at_start) / elapsed:.0f}"))
        self.fields = fields

    def update(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        self.step = step
        self._update_fields(metrics)
        if self._live is not None:
            self._live.refresh()
        elif step % self.every == 0 or step == self.total:
            info = "  ".join(f"{label} {value}" for label, value in self.fields)
            elapsed = time.monotonic() - self.started
            print(
                f"step {step}/{self.total}  {info}  elapsed {format_duration(elapsed)}  "
                f"eta {format_duration(self._remaining())}",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
