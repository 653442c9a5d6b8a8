"""bench/_scratch.py: a benchmark's run directories go when it is done, and stay (named) when a
run failed or the user asked to keep them."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from .bench_scripts import load_bench


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return load_bench("_scratch.py")


def _made(root: Path) -> Path:
    (root / "run-1").mkdir()
    (root / "run-1" / "metrics.jsonl").write_text("{}\n")
    return root


def test_the_runs_are_removed_when_the_benchmark_is_done(scratch, tmp_path, capsys):
    with scratch.run_scratch("train") as root:
        _made(root)
        assert root.parent == tmp_path and root.name.startswith("sdp-bench-train-")
    assert not root.exists() and capsys.readouterr().err == ""


def test_kept_on_request_and_named(scratch, capsys):
    with scratch.run_scratch("train", keep=True) as root:
        _made(root)
    assert (root / "run-1" / "metrics.jsonl").exists()
    assert capsys.readouterr().err == f"train: the runs are kept in {root}\n"


@pytest.mark.parametrize("failure", [SystemExit("sdp train exited with 2"), ValueError("bad row")])
def test_kept_and_named_when_a_run_failed(scratch, capsys, failure):
    with pytest.raises(type(failure)), scratch.run_scratch("ab") as root:
        _made(root)
        raise failure
    assert (root / "run-1").is_dir()
    assert capsys.readouterr().err == f"ab: the runs are kept in {root}\n"


def test_removed_when_interrupted(scratch, capsys):
    with pytest.raises(KeyboardInterrupt), scratch.run_scratch("cpu") as root:
        _made(root)
        raise KeyboardInterrupt
    assert not root.exists() and capsys.readouterr().err == ""
