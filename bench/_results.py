"""What every benchmark writes: its rows plus the machine they were measured on, as JSON."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any


def write_results(path: Path, benchmark: str, **fields: Any) -> None:
    """Write ``fields`` under a header naming the benchmark, the date and the machine."""
    result = {
        "benchmark": benchmark,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        **fields,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
