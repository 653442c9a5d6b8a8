"""What every benchmark writes: its rows plus the machine they were measured on, as JSON."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

#: the checkout these benchmarks run from
REPO = Path(__file__).resolve().parents[1]


def commit_of(checkout: Path) -> str | None:
    """The git commit a checkout is at (None: not a git checkout), stored with the numbers."""
    done = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def code_of(checkout: Path) -> dict[str, Any]:
    """The code a benchmark measured: the checkout's commit, and whether tracked files differed
    from it (then the commit alone does not say what ran)."""
    done = subprocess.run(
        ["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    changed = bool(done.stdout.strip()) if done.returncode == 0 else None
    return {"commit": commit_of(checkout), "uncommitted_changes": changed}


def write_results(path: Path, benchmark: str, **fields: Any) -> None:
    """Write ``fields`` under a header naming the benchmark, the date, the machine and the code."""
    result = {
        "benchmark": benchmark,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "code": code_of(REPO),
        **fields,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
