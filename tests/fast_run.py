"""The small, fast training config that end-to-end tests compose, ``+debug=fast`` (a step takes
tens of milliseconds on the embedded engine), and a real `sdp train` run made from it.

Test modules import it relatively (``from ..fast_run import FAST``): pytest runs with
``--import-mode=importlib``, which imports ``tests/<area>/test_x.py`` as ``tests.<area>.test_x``.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from sdp_cli.config.compose import compose_config
from sdp_cli.train.session.run import run_training

#: the fast debug run users get with ``sdp train +debug=fast`` (sdp_cli/conf/debug/fast.yaml),
#: with the local engine in this process: a run then starts no engine process (seconds of
#: imports each), and faults injected into the engine (sdp_cli/faults.py) hit sdp itself. The
#: engine's own process is tested where it matters (tests/engine/test_process_engine.py,
#: tests/reliability/test_engine_process.py, tests/train/test_threads.py).
FAST = ["+debug=fast", "engine.in_process=true"]
#: the same fast debug run on a server engine (engine=vllm, engine=sglang), which refuses the local
#: engine's engine.in_process (sdp_cli/config/scopes.py)
FAST_SERVER = ["+debug=fast"]


#: what a stop's line may say after its command: where the resume goes on from, when not from the
#: step it stopped at (sdp_cli/train/session/session_end.py)
_RESUME_NOTE = re.compile(r" \((from step \d+, the last complete checkpoint|it starts over: no checkpoint yet)\)$")


def printed_command(line: str, marker: str = "resume with: ") -> list[str]:
    """The `sdp train` command ``line`` prints after ``marker``, split as a shell would: what a
    user pastes (a resume line's note on where it goes on from is not part of it)."""
    command = shlex.split(_RESUME_NOTE.sub("", line.split(marker, 1)[1]))
    assert command[:2] == ["sdp", "train"], line
    return command


def fast_with(overrides: Sequence[str]) -> list[str]:
    """The fast debug run with ``overrides``: FAST's, or FAST_SERVER's when they choose an engine."""
    chooses_engine = any(o.startswith(("engine=", "engine.kind=")) for o in overrides)
    return [*(FAST_SERVER if chooses_engine else FAST), *overrides]


def train_run(root: Path, overrides: list[str]) -> Path:
    """Trains `[*overrides, run.dir=root/run]` in this process with its own warm-start cache
    under `root`, and returns the run directory. Training sets torch's thread count; the
    caller's is restored afterwards."""
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SDP_CACHE_DIR", str(root / "cache"))
        overrides = [*overrides, f"run.dir={root / 'run'}"]
        cfg, raw = compose_config(overrides)
        run_training(cfg, raw, overrides=overrides)
    torch.set_num_threads(threads)
    return root / "run"


def resume_run(run_dir: Path, *extra: str) -> dict:
    """Resumes ``run_dir`` (`sdp train resume=RUN_DIR *extra`) in this process and returns its
    summary; torch's thread count is restored afterwards, also when the resume is refused."""
    overrides = [f"resume={run_dir}", *extra]
    threads = torch.get_num_threads()
    try:
        cfg, raw = compose_config(overrides)
        return run_training(cfg, raw, overrides=overrides)
    finally:
        torch.set_num_threads(threads)
