"""The terminal display of `sdp train`: the run directory first, a status line per setup phase
(model load and warm start, evaluations), and a live bar that keeps step/total, the ETA and the
reward at 80 columns and narrower."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdp_cli.train.session import display
from sdp_cli.train.session.display import Progress, StartDisplay, format_duration, progress_line

from ..fast_run import FAST

FIELDS = [("reward", "0.412"), ("lag", "1.20"), ("w mean", "1.003"), ("w std", "0.052"), ("filtered", "3"), ("tok/s", "1234")]
_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _text(segments) -> str:
    return "".join(text for text, _ in segments)


def _frames(raw: str) -> list[str]:
    """What a terminal showed, frame by frame: escape codes removed, split at \\r and \\n."""
    plain = _ESCAPES.sub("", raw)
    return [frame for line in plain.split("\n") for frame in line.split("\r") if frame.strip()]


def test_format_duration():
    assert format_duration(75.4) == "1:15"  # 75 s = 1 min 15 s
    assert format_duration(3725) == "1:02:05"  # 3600 + 2·60 + 5
    assert format_duration(None) == "?" and format_duration(float("nan")) == "?"


def test_80_columns_keep_counts_eta_and_reward():
    # 120 of 300 steps after 31.2 s, 45 s to go: the numbers a user needs must all be there
    line = _text(progress_line(80, 120, 300, 31.2, 45.0, FIELDS))
    assert len(line) <= 79
    assert "120/300" in line and "eta 0:45" in line and "reward 0.412" in line and "━" in line
    # by hand: "train  120/300  " (16) + bar + "  0:31  eta 0:45  reward 0.412  lag 1.20" (40)
    # leaves 79 − 56 = 23 columns for the bar; "  w mean 1.003" (14) more would need a bar of
    # 79 − 70 = 9 < BAR_MIN = 10, so the third field is the first left out
    assert line == "train  120/300  " + "━" * 23 + "  0:31  eta 0:45  reward 0.412  lag 1.20"


def test_wide_terminal_shows_every_field_and_narrow_drops_the_bar_last():
    wide = _text(progress_line(200, 120, 300, 31.2, 45.0, FIELDS))
    assert wide.startswith("train  120/300  ━") and all(f"{k} {v}" in wide for k, v in FIELDS)
    assert "0:31" in wide  # elapsed
    # at 40 columns: "120/300  eta 0:45  reward 0.412" is 31 characters; bar and fields go
    narrow = _text(progress_line(40, 120, 300, 31.2, 45.0, FIELDS))
    assert narrow == "120/300  eta 0:45  reward 0.412"


def test_bar_fill_is_the_done_share():
    segments = progress_line(200, 15, 30, 1.0, 1.0, [])  # half done, a 30-column bar
    bar = [text for text, style in segments if style in ("green", "grey37")]
    assert [len(b) for b in bar] == [15, 15]


@settings(max_examples=300, deadline=None)
@given(
    # the longest essentials: "100000/100000  eta 277:46:40  reward 0.412" (42 characters)
    width=st.integers(min_value=43, max_value=250),
    total=st.integers(min_value=1, max_value=100_000),
    data=st.data(),
    n_fields=st.integers(min_value=1, max_value=len(FIELDS)),
    remaining=st.one_of(st.none(), st.floats(min_value=0, max_value=1e6)),
)
def test_line_fits_and_keeps_the_essentials(width, total, data, n_fields, remaining):
    step = data.draw(st.integers(min_value=0, max_value=total))
    line = _text(progress_line(width, step, total, 12.0, remaining, FIELDS[:n_fields]))
    assert len(line) <= width - 1
    assert f"{step}/{total}" in line and f"eta {format_duration(remaining)}" in line and "reward 0.412" in line


def test_live_bar_in_an_80_column_terminal(monkeypatch):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich treats the stream as a terminal
    monkeypatch.setenv("COLUMNS", "80")
    stream = io.StringIO()
    progress = Progress(3, stream=stream)
    for step in (1, 2, 3):
        progress.update(step, {"reward/mean": 0.5, "staleness/lag_mean": 2.0, "weights/rollout_is_mean": 1.0,
                               "weights/rollout_is_std": 0.1, "staleness/filtered_groups_total": 0.0})  # fmt: skip
    progress.close()
    frames = _frames(stream.getvalue())
    assert frames and all(len(frame) <= 79 for frame in frames), frames
    assert "3/3" in frames[-1] and "eta 0:00" in frames[-1] and "reward 0.500" in frames[-1]


def test_plain_progress_lines():
    stream = io.StringIO()  # not a terminal: one line per step here (20 steps or fewer)
    progress = Progress(2, stream=stream)
    progress.update(1, {"reward/mean": 0.25})
    progress.update(2, {"reward/mean": 0.75})
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("step 1/2  reward 0.250  elapsed ") and " eta " in lines[0]
    assert lines[1].startswith("step 2/2  reward 0.500")  # mean of the last 20 rewards


def test_phases_on_a_plain_stream(monkeypatch):
    monkeypatch.setattr(display, "PLAIN_DETAIL_EVERY_S", 0.0)
    stream = io.StringIO()
    shown = StartDisplay(stream=stream)
    shown.line("run dir runs/x")
    with shown.phase("loading model") as phase:
        phase.update("warm start step 1/2")
        phase.result = "tiny, 0.1 M parameters"
    with shown.phase("initial evaluation"):
        pass
    lines = stream.getvalue().splitlines()
    assert lines[0] == "run dir runs/x"
    assert lines[1] == "loading model …"
    assert lines[2] == "  loading model: warm start step 1/2"
    assert re.fullmatch(r"loading model: tiny, 0\.1 M parameters \(\d+\.\d s\)", lines[3])
    assert re.fullmatch(r"initial evaluation: done \(\d+\.\d s\)", lines[5])


def test_a_failing_phase_adds_no_line_and_disabled_is_silent():
    stream = io.StringIO()
    with pytest.raises(RuntimeError):
        with StartDisplay(stream=stream).phase("loading model"):
            raise RuntimeError("boom")
    assert stream.getvalue() == "loading model …\n"  # the error itself is the one line that follows
    quiet = io.StringIO()
    with StartDisplay(enabled=False, stream=quiet).phase("loading model") as phase:
        phase.update("x")
    StartDisplay(enabled=False, stream=quiet).line("run dir")
    assert quiet.getvalue() == ""


def _train(tmp_path: Path, *extra: str, tty: bool) -> tuple[str, Path]:
    run = tmp_path / "run"
    env = {**os.environ, "SDP_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "80", "PYTHONPATH": os.getcwd()}
    env.pop("TTY_COMPATIBLE", None)
    if tty:
        env["TTY_COMPATIBLE"] = "1"
    overrides = [*FAST, "run.progress=true"]  # +debug=fast turns the display off
    proc = subprocess.run(
        [sys.executable, "-m", "sdp_cli", "train", *overrides, "train.steps=3", "train.eval_samples=8",
         "train.checkpoint_every=0", f"run.dir={run}", *extra],  # fmt: skip
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stderr, run


def test_sdp_train_prints_the_run_dir_first_then_each_phase(tmp_path):
    err, run = _train(tmp_path, tty=False)
    lines = err.splitlines()
    assert lines[0] == f"run dir {run}"
    assert lines[1].startswith("task arith1: ")
    order = ["loading model …", "loading model: tiny-qwen2:arith1:ws10:", "initial evaluation (greedy, held-out prompts) …",
             "initial evaluation (greedy, held-out prompts): greedy accuracy ", "step 1/3  reward ",
             "step 3/3  reward ", "final evaluation (greedy, held-out prompts): greedy accuracy "]  # fmt: skip
    positions = [next(i for i, line in enumerate(lines) if line.startswith(prefix)) for prefix in order]
    assert positions == sorted(positions), lines


def test_sdp_train_on_a_terminal_shows_the_warm_start_and_an_80_column_bar(tmp_path):
    err, run = _train(tmp_path, "model.warm_start_steps=20", tty=True)
    frames = _frames(err)
    assert frames[0] == f"run dir {run}"
    # the spinner's detail while the (uncached) warm start trains
    assert any("warm start on arith1 (first use, cached afterwards): step " in f for f in frames), frames
    bars = [f for f in frames if re.match(r"train  \d+/3  ", f)]
    assert bars and all(len(f) <= 79 for f in bars)
    assert "3/3" in bars[-1] and "eta " in bars[-1] and "reward " in bars[-1]
