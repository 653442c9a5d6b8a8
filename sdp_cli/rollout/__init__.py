"""Version-tagged rollouts: records, queue/cache, staleness control, hooks, recompute, batch files.

Names are exported lazily (PEP 562) so that ``import sdp_cli.rollout.records`` — which the
engine contract and the CLI use — does not pull in torch through ``batch_file``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "records": ("RolloutGroup", "RolloutSample", "samples_of"),
    "buffers": ("RolloutCache", "RolloutQueue"),
    "staleness": (
        "CapacityModifier",
        "FilteredSamplesCapacityModifier",
        "RolloutStat",
        "StalenessManager",
    ),
    "strategies": (
        "SegmentWiseStrategy",
        "StalenessControlStrategy",
        "StandardStrategy",
        "create_staleness_strategy",
        "segment_wise_stale_reason",
    ),
    "hooks": ("HookError", "PauseController", "PauseHooks"),
    "recompute": ("ProximalRecomputer", "RecomputeStats"),
    "batch_file": ("BatchFormatError", "PaddedBatch", "SavedBatch", "read_batch", "write_batch"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
