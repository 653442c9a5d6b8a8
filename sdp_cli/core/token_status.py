"""The segment-wise invariant, coded once (docs/design.md §1–2): where a token's π_prox_t stands.

At trainer version c, a response token of version v needs π_prox_t = π_{v+1}
(``proximal_t_versions == v + 1``; for v = c that is π_behav itself, ``proximal_t_versions == c``):

    OK             the token has what it needs
    FILL           v = c − 1 and π_prox_t is still π_v: weights c are loaded, so it is scored when
                   the trainer takes its batch (or the trainer fills it, proximal_t_source=trainer)
    UNCORRECTABLE  v < c and π_prox_t is neither π_{v+1} nor, for v = c − 1, still to fill: the
                   weights of version v + 1 are gone, the token can never get its weight
    INVALID        v > c, or v = c with π_prox_t from another version (a bookkeeping error)

The rule is written with comparisons, ``&``, ``|`` and ``*`` only, so it applies elementwise to
tensors of any shape and equally to plain ints (the staleness strategy asks it per token of a
record): one rule, whatever holds the versions.
"""

from __future__ import annotations

from typing import Any

OK, FILL, UNCORRECTABLE, INVALID = 0, 1, 2, 3


def token_status(versions: Any, proximal_t_versions: Any, trainer_version: int, mask: Any = None) -> Any:
    """OK / FILL / UNCORRECTABLE / INVALID per token (module docstring); tokens outside ``mask``
    (a bool or 0/1 tensor, or a bool) are OK. Tensors in, an integer tensor out; ints in, an int."""
    v, pv, c = versions, proximal_t_versions, trainer_version
    fill = (v == c - 1) & (pv == v)
    uncorrectable = ((v <= c - 2) & (pv != v + 1)) | ((v == c - 1) & (pv != c) & (pv != v))
    invalid = (v > c) | ((v == c) & (pv != c))
    status = fill * FILL + uncorrectable * UNCORRECTABLE + invalid * INVALID
    return status if mask is None else status * (mask > 0)


def lacks_next_version(status: Any) -> Any:
    """Stale tokens without π_{v+1} (FILL or UNCORRECTABLE). Once the take-time pass and the
    trainer's fill are done, a FILL token has missed its window too: the trainer leaves both out
    of a segment-wise loss and inspect-weights leaves them out of the segment-wise weight."""
    return (status == FILL) | (status == UNCORRECTABLE)


def covered_tokens(valid: Any, status: Any, *, reads_proximal_t: bool) -> Any:
    """The tokens a weight is measured and trained on (docs/math.md §1, "Which tokens a weight
    covers"): every valid token, less — for a weight that reads π_prox_t — the stale tokens without
    π_{v+1} (``lacks_next_version``). ``status`` is ``token_status`` (None: π_prox_t not tracked).
    The trainer's loss mask, its shadow metrics and inspect-weights all use this one rule."""
    if not reads_proximal_t or status is None:
        return valid
    return valid & ~lacks_next_version(status)
