"""Where a benchmark's runs live while it measures: a temporary directory, removed afterwards."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

KEEP_HELP = "keep the runs' directories (printed at the end) instead of removing them"


@contextmanager
def run_scratch(benchmark: str, keep: bool = False) -> Iterator[Path]:
    """A new directory for ``benchmark``'s runs (hundreds of MB for a bench/train.py series).
    Removed when the block ends or is interrupted (Ctrl-C), unless ``keep`` is set or the block
    failed (a run that failed ends the benchmark with SystemExit): then its path is printed, so
    the failed run's log can be read."""
    root = Path(tempfile.mkdtemp(prefix=f"sdp-bench-{benchmark}-"))
    try:
        yield root
    except KeyboardInterrupt:
        shutil.rmtree(root, ignore_errors=True)
        raise
    except BaseException:
        print(f"{benchmark}: the runs are kept in {root}", file=sys.stderr)
        raise
    if keep:
        print(f"{benchmark}: the runs are kept in {root}", file=sys.stderr)
    else:
        shutil.rmtree(root, ignore_errors=True)
