"""The report's statistical comparison, as text: its title and legend (with or without
``--against``), the check of the ``--against`` names, and its rows for the console table,
summary.md and comparison.csv. The numbers come from ``sdp_cli.ablate.stats.compare_modes``."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Sequence

from sdp_cli.ablate.stats import ModeComparison
from sdp_cli.errors import UserError


#: what the comparison table compares, and how to read it
COMPARISON_TITLE = "Final reward against the best other mode at the same η (Welch, 95 %)"
COMPARISON_NOTE = (
    "Δ = this mode's mean final reward − that of the mode with the highest mean among the others "
    "at the same η; the 95 % interval is Welch's t interval over the seeds, and Δ/SE is Δ in "
    "standard errors. The best other mode is picked on the same data, so for it the interval is "
    "slightly optimistic. A mode whose interval lies below 0 is worse than the best other mode; "
    "one whose interval holds 0 ties with it."
)


def comparison_title(against: Sequence[str] = ()) -> str:
    if not against:
        return COMPARISON_TITLE
    return f"Final reward against the better of {', '.join(against)} at the same η (Welch, 95 %)"


def comparison_note(against: Sequence[str] = ()) -> str:
    if not against:
        return COMPARISON_NOTE
    return COMPARISON_NOTE.replace(
        "the mode with the highest mean among the others",
        f"the mode with the highest mean among {', '.join(against)} (not counting itself)",
    ).replace("the best other mode", "the better baseline").replace("The best other mode", "The better baseline")


def check_against(modes: Iterable[str], against: Sequence[str]) -> None:
    """``--against`` must name modes of the sweep, as the report labels them (``mode_label``)."""
    modes = sorted(set(modes))
    unknown = [m for m in against if m not in modes]
    if unknown:
        raise UserError(
            f"--against {','.join(unknown)}: no such mode in this sweep; its modes are {', '.join(modes)}"
        )


def comparison_columns(comparisons: Sequence[ModeComparison]) -> list[str]:
    extra = ["other"] if any(c.extra for c in comparisons) else []
    return ["η", *extra, "mode", "n", "reward", "best other", "Δ", "95 % interval", "Δ/SE"]


def comparison_rows(comparisons: Sequence[ModeComparison]) -> list[list[str]]:
    with_extra = any(c.extra for c in comparisons)
    rows = []
    for c in comparisons:
        w = c.comparison
        interval = "n/a" if w is None or w.low is None else f"[{w.low:+.3f}, {w.high:+.3f}]"
        ratio = "n/a" if w is None or not w.standard_error else f"{w.difference / w.standard_error:+.1f}"
        rows.append(
            [
                str(c.max_head_offpolicyness),
                *([" ".join(c.extra)] if with_extra else []),
                c.mode,
                str(c.n),
                f"{c.mean:.3f}",
                c.best_other or "–",
                "n/a" if w is None else f"{w.difference:+.3f}",
                interval,
                ratio,
            ]
        )
    return rows


def comparisons_csv(comparisons: Sequence[ModeComparison]) -> str:
    """The comparison, machine-readable: one row per mode and η."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(
        ["eta", "other", "mode", "n", "reward_mean", "best_other", "difference", "standard_error", "dof", "low", "high"]
    )
    for c in comparisons:
        w = c.comparison
        writer.writerow(
            [
                c.max_head_offpolicyness,
                " ".join(c.extra),
                c.mode,
                c.n,
                _num(c.mean),
                c.best_other or "",
                *(_num(None if w is None else getattr(w, f)) for f in ("difference", "standard_error", "dof", "low", "high")),
            ]
        )
    return buf.getvalue()


def _num(value: float | None) -> str:
    return "" if value is None else repr(float(value))
