"""What the config needs to know about a correction mode, torch-free (docs/design.md §4,
"Adding a mode").

The modes' behavioural weights are registered in ``sdp_cli/core/weights.py`` (``MODE_WEIGHTS``,
pure torch). The config layer must not import torch (``sdp --help``, ``--print-config`` stay
fast), but registering a mode imports that module, so: when it is loaded its registry is the
truth; when it is not, no mode beyond the built-in ones (``sdp_cli/choices.py`` ``MODES``) can
exist, and the built-in answers below hold (``tests/test_choices.py`` checks both paths agree).
"""

from __future__ import annotations

import sys
from typing import Any

from sdp_cli.choices import MODES

REGISTRY_MODULE = "sdp_cli.core.weights"
#: the suffix of a mode's drift-clipped weight (inspect-weights row, shadow metrics)
DRIFT_SUFFIX = "_drift"
#: the built-in mode whose weight reads π_prox_t, as registered in core/weights.py
_BUILTIN_READS_PROXIMAL_T = ("segment_wise",)
#: the built-in modes with a behavioural weight (bypass has none), as registered
_BUILTIN_WEIGHTED = ("decoupled", "segment_wise")
#: the built-in mode that takes ``drift_clip``, as registered
_BUILTIN_DRIFT_CLIPPED = ("segment_wise",)


def _registry() -> dict[str, Any] | None:
    module = sys.modules.get(REGISTRY_MODULE)
    return None if module is None else module.MODE_WEIGHTS


def mode_names() -> tuple[str, ...]:
    """Every mode a config may name: the registered ones (the built-in ones before it loads)."""
    registry = _registry()
    return MODES if registry is None else tuple(registry)


def reads_proximal_t(mode: str) -> bool:
    """Whether ``mode``'s behavioural weight reads π_prox_t (so the recompute pass must run)."""
    registry = _registry()
    if registry is None or mode not in registry:
        return mode in _BUILTIN_READS_PROXIMAL_T
    return "proximal_logprobs_t" in registry[mode].needs


def has_weight(mode: str) -> bool:
    """Whether ``mode`` has a behavioural weight: its weight reads π_prox or π_prox_t (a weight
    of π_behav alone would be no importance ratio; bypass reads neither, w ≡ 1)."""
    registry = _registry()
    if registry is None or mode not in registry:
        return mode in _BUILTIN_WEIGHTED
    return bool(registry[mode].needs)


def takes_drift_clip(mode: str) -> bool:
    """Whether ``mode``'s weight takes ``drift_clip`` (κ of the drift factor, docs/math.md §1.1)."""
    registry = _registry()
    if registry is None or mode not in registry:
        return mode in _BUILTIN_DRIFT_CLIPPED
    return "drift_clip" in registry[mode].params


def weight_names() -> tuple[str, ...]:
    """Every weight a report can name: each mode, followed by ``<mode>_drift``, its
    drift-clipped weight, when it takes ``drift_clip`` (the rows of ``sdp inspect-weights``;
    built in: bypass, decoupled, segment_wise, segment_wise_drift)."""
    names: list[str] = []
    for mode in mode_names():
        names.append(mode)
        if takes_drift_clip(mode):
            names.append(mode + DRIFT_SUFFIX)
    return tuple(names)


def drift_clipped_mode(name: str) -> str | None:
    """The mode whose drift-clipped weight ``name`` is (``segment_wise_drift`` → segment_wise);
    None for a mode's own weight."""
    mode = name.removesuffix(DRIFT_SUFFIX)
    return mode if mode != name and name not in mode_names() and takes_drift_clip(mode) else None


def shadow_weights() -> tuple[str, ...]:
    """The weights a run measures besides the one it trains with (``shadow/<name>/*`` metrics,
    the ablate report's columns): ``weight_names`` less the modes without a weight. Built in:
    decoupled, segment_wise, segment_wise_drift."""
    return tuple(n for n in weight_names() if has_weight(drift_clipped_mode(n) or n))
