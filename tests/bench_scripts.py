"""The scripts of bench/ as the bench tests use them: run as a user runs them, or loaded as a
module to test their functions."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def run_bench(
    script: str, *args: str, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python bench/<script> <args>``, its output captured (``env``: added to ours)."""
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        check=False, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )  # fmt: skip


def load_bench(script: str) -> ModuleType:
    """bench/<script> imported as a module of its own (bench/ on the path while it imports its
    sibling ``_results``)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{Path(script).stem}_under_test", BENCH / script)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # a dataclass looks its module up there while it is made
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))
