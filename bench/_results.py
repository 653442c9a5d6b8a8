"""What every benchmark writes: its rows plus the machine they were measured on, as JSON."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from sdp_cli.cpuinfo import CPUINFO, first_entry, flags_of, read_cpuinfo

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


#: the flags of /proc/cpuinfo that say which vector kernels torch's CPU build can use here
VECTOR_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def cpu_of(cpuinfo: Path = CPUINFO) -> dict[str, Any] | None:
    """The processor a benchmark ran on, from ``cpuinfo`` (None: no such file). Machines of one
    model name differ (this project's 2-core machines were an AVX2-only and an AVX-512 EPYC days
    apart), so the family, model and vector flags go with the numbers."""
    text = read_cpuinfo(cpuinfo)
    if text is None:
        return None
    fields = first_entry(text)

    def number(name: str) -> int | None:
        return int(fields[name]) if fields.get(name, "").isdigit() else None

    return {
        "model_name": fields.get("model name"),
        "family": number("cpu family"),
        "model": number("model"),
        "vector_flags": sorted(flags_of(text) & set(VECTOR_FLAGS)),
    }


def write_results(path: Path, benchmark: str, **fields: Any) -> None:
    """Write ``fields`` under a header naming the benchmark, the date, the machine and the code."""
    result = {
        "benchmark": benchmark,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {
            "cpus": os.cpu_count(),
            "cpu": cpu_of(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "code": code_of(REPO),
        **fields,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
