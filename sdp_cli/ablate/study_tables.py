"""The report's Study section as text: console lines and table, Markdown, and ``study.csv`` with
every number (the contrasts come from ``sdp_cli.ablate.contrasts``)."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence

from sdp_cli.ablate.contrasts import EQUIVALENT, INCONCLUSIVE, Contrast
from sdp_cli.ablate.study import METRICS, Study


def _f(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.3f}"


def _p(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2g}"


def _interval(bounds: tuple[float, float] | None) -> str:
    return "n/a" if bounds is None else f"[{bounds[0]:+.3f}, {bounds[1]:+.3f}]"


def _cell(c: Contrast) -> str:
    eta = "η = –" if c.max_head_offpolicyness is None else f"η = {c.max_head_offpolicyness}"
    return " ".join([eta, *c.extra])


def verdict_text(c: Contrast, study: Study) -> str:
    """The verdict in words: better, worse, equivalent within ±δ, or inconclusive with the
    minimum detectable effect (or why there is none)."""
    if c.verdict == EQUIVALENT:
        return f"equivalent within ±{study.margin:g}"
    if c.verdict != INCONCLUSIVE:
        return c.verdict
    if c.n == 0:
        return "inconclusive (no paired runs)"
    if c.mde is None:
        return f"inconclusive ({c.n} pair: no variance)"
    return f"inconclusive (MDE = {c.mde:.3f} at power {study.power:g})"


def study_lines(study: Study, provenance: str) -> list[str]:
    """What the study tests and where it comes from."""
    margin = f"equivalence margin ±{study.margin:g}" if study.margin is not None else "no equivalence margin"
    return [
        f"metric {study.metric} ({METRICS[study.metric]}), baseline {study.baseline}, paired by seed",
        f"α = {study.alpha:g}, power {study.power:g}, {margin}",
        f"study {provenance}",
    ]


def primary_lines(c: Contrast | None, study: Study) -> list[str]:
    """The primary contrast, tested alone at α, in a few lines of at most 80 characters."""
    if c is None:
        return ["Primary contrast: none registered."]
    level = f"{1 - study.alpha:.0%}"
    head = f"Primary: {c.treatment} − {c.baseline} at {_cell(c)}"
    if c.test is None:
        return [head, f"  {c.n} pairs (seeds {' '.join(map(str, c.seeds)) or 'none'})", f"  verdict: {verdict_text(c, study)}"]
    tost = "" if c.tost_p is None else f"   TOST ±{study.margin:g}: p = {_p(c.tost_p)}"
    return [
        head,
        f"  {c.n} pairs (seeds {' '.join(map(str, c.seeds))}): {c.treatment_mean:.3f} vs {c.baseline_mean:.3f}",
        f"  Δ = {_f(c.test.mean)}   {level} CI {_interval((c.test.low, c.test.high))} (paired t)",
        f"  bootstrap {level} CI {_interval(c.bootstrap)}   MDE = {c.mde:.3f} at power {study.power:g}",
        f"  p = {_p(c.test.p)} (paired t, ν = {c.test.dof}){tost}",
        f"  verdict: {verdict_text(c, study)}",
    ]


def secondary_title(secondary: Sequence[Contrast], study: Study) -> str:
    m = sum(1 for c in secondary if c.test is not None)
    return f"Secondary contrasts: each mode − {study.baseline} per cell, Holm over {m}"


def secondary_note(secondary: Sequence[Contrast], study: Study) -> str:
    alpha = secondary[0].mde_alpha if secondary else study.alpha
    margin = (
        f"equivalent: the Holm-adjusted TOST p-value at ±{study.margin:g} is below α"
        if study.margin is not None
        else "no margin, so no equivalence verdict"
    )
    return (
        f"Δ = mean over the paired seeds of (mode − {study.baseline}) in {study.metric}; CI: paired t at "
        f"{1 - study.alpha:.0%}; Holm p: adjusted over the family; better / worse: Holm p < {study.alpha:g}; "
        f"{margin}; MDE at α/m = {alpha:.2g} and power {study.power:g}."
    )


def secondary_columns(secondary: Sequence[Contrast], study: Study) -> list[str]:
    """Header of the console table: short, to fit 80 columns (the paired t interval is
    symmetric, so Δ ± its half-width is the whole interval)."""
    other = ["other"] if any(c.extra for c in secondary) else []
    return ["η", *other, "mode", "n", f"Δ ± {1 - study.alpha:.0%} CI", "Holm p", "MDE", "verdict"]


def _plus_minus(c: Contrast) -> str:
    if c.test is None:
        return _f(c.difference)
    return f"{c.test.mean:+.3f} ± {c.test.high - c.test.mean:.3f}"


def secondary_rows(secondary: Sequence[Contrast], study: Study) -> list[list[str]]:
    with_extra = any(c.extra for c in secondary)
    return [
        [
            str(c.max_head_offpolicyness),
            *([" ".join(c.extra)] if with_extra else []),
            c.treatment,
            str(c.n),
            _plus_minus(c),
            _p(c.p_holm),
            "n/a" if c.mde is None else f"{c.mde:.3f}",
            c.verdict,
        ]
        for c in secondary
    ]


def study_markdown(primary: Contrast | None, secondary: Sequence[Contrast], study: Study, provenance: str) -> str:
    """The Study section of summary.md: the study, the primary contrast, the secondary table."""
    lines = ["## Study", "", *(f"- {line}" for line in study_lines(study, provenance)), ""]
    lines += ["```", *primary_lines(primary, study), "```", ""]
    if not secondary:
        return "\n".join([*lines, f"No secondary contrasts: no mode shares a cell and a seed with {study.baseline}.", ""])
    level = f"{1 - study.alpha:.0%}"
    other = ["other"] if any(c.extra for c in secondary) else []
    header = ["η", *other, "mode", "n", "Δ", f"{level} CI (paired t)", f"{level} CI (bootstrap)", "p", "Holm p"]
    header += ["TOST Holm p"] if study.margin is not None else []
    header += ["MDE", "verdict"]
    lines += [f"### {secondary_title(secondary, study)}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in secondary:
        cells = [str(c.max_head_offpolicyness), *([" ".join(c.extra)] if other else []), c.treatment, str(c.n)]
        cells += [
            _f(c.difference),
            _interval(None if c.test is None else (c.test.low, c.test.high)),
            _interval(c.bootstrap),
            _p(None if c.test is None else c.test.p),
            _p(c.p_holm),
        ]
        cells += [_p(c.tost_p_holm)] if study.margin is not None else []
        cells += ["n/a" if c.mde is None else f"{c.mde:.3f}", verdict_text(c, study)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", secondary_note(secondary, study), ""]
    return "\n".join(lines)


#: the columns of study.csv
STUDY_CSV_COLUMNS = (
    "role", "metric", "baseline", "treatment", "eta", "other", "n", "seeds", "treatment_mean",
    "baseline_mean", "difference", "sd", "se", "dof", "t", "p", "p_holm", "ci_low", "ci_high",
    "boot_low", "boot_high", "margin", "tost_p", "tost_p_holm", "mde", "mde_alpha", "alpha", "power",
    "verdict",
)  # fmt: skip


def study_csv(primary: Contrast | None, secondary: Sequence[Contrast], study: Study) -> str:
    """Every contrast with every number: the primary's row first (role ``primary``)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(STUDY_CSV_COLUMNS)
    for c in [*([primary] if primary is not None else []), *secondary]:
        test = c.test
        writer.writerow(
            [
                "primary" if c.primary else "secondary",
                study.metric,
                c.baseline,
                c.treatment,
                "" if c.max_head_offpolicyness is None else c.max_head_offpolicyness,
                " ".join(c.extra),
                c.n,
                " ".join(map(str, c.seeds)),
                _num(c.treatment_mean),
                _num(c.baseline_mean),
                _num(c.difference),
                *(_num(None if test is None else getattr(test, k)) for k in ("sd", "se", "dof", "t", "p")),
                _num(c.p_holm),
                _num(None if test is None else test.low),
                _num(None if test is None else test.high),
                *(_num(b) for b in (c.bootstrap or (None, None))),
                _num(study.margin),
                _num(c.tost_p),
                _num(c.tost_p_holm),
                _num(c.mde),
                _num(c.mde_alpha),
                _num(study.alpha),
                _num(study.power),
                verdict_text(c, study),
            ]
        )
    return buf.getvalue()


def _num(value: float | None) -> str:
    return "" if value is None else repr(float(value))
