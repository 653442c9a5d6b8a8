"""A study's paired contrasts and their verdicts (docs/ablate.md "Statistics").

Every mode is compared with the study's fixed baseline in every cell (η and any other swept
values) where both ran: the runs pair by seed (only seeds both have a value for), and Δ is the
mean of the per-seed differences treatment − baseline in the study's metric
(``sdp_cli.ablate.stats``). The registered primary contrast is tested alone at α. Every other
contrast belongs to the secondary family: its p-values are Holm-adjusted over the family, and so,
as a family of their own, are its equivalence (TOST) p-values. The minimum detectable effect is
given at the level each verdict is held to: α for the primary, α/m for the m testable secondary
contrasts (Holm's strictest step, so the MDE is conservative for the others).

The verdict of a contrast with n ≥ 2 pairs, with p and p_TOST the primary's own or the
secondary's Holm-adjusted ones:
- ``equivalent`` when the study states a margin δ and p_TOST < α: the 1 − 2α interval lies
  within ±δ. A difference that is also significant is then smaller than the margin the study
  declared irrelevant, and is reported as equivalent (its p-value still shows);
- else ``better`` or ``worse`` when p < α, by the sign of Δ;
- else ``inconclusive`` (the MDE says what the design could have found).
Below 2 pairs there is no variance to test with: ``inconclusive``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sdp_cli.ablate.records import RunValues
from sdp_cli.ablate.stats import PairedT, bootstrap_interval, holm, minimum_detectable_effect, paired_t, tost_p
from sdp_cli.ablate.study import Study
from sdp_cli.ablate.sweep import MAX_HEAD_OFFPOLICYNESS_KEY
from sdp_cli.errors import UserError

BETTER, WORSE, EQUIVALENT, INCONCLUSIVE = "better", "worse", "equivalent", "inconclusive"
#: a cell of a sweep: η and the other swept values (``key=value``)
Cell = tuple[int, tuple[str, ...]]


@dataclass(frozen=True)
class Contrast:
    """``treatment`` − ``baseline`` in one cell over the paired ``seeds`` (module docstring).

    ``test``, ``bootstrap`` and ``mde`` need two pairs; ``tost_p`` a margin too. ``p_holm`` and
    ``tost_p_holm`` are the secondary family's adjusted values (None for the primary);
    ``mde_alpha`` is the level of ``mde``. η is None only for a primary contrast whose cell has
    no runs and whose study names no η."""

    treatment: str
    baseline: str
    max_head_offpolicyness: int | None
    extra: tuple[str, ...]
    primary: bool
    seeds: tuple[int, ...]
    treatment_mean: float | None
    baseline_mean: float | None
    test: PairedT | None
    bootstrap: tuple[float, float] | None
    tost_p: float | None
    p_holm: float | None
    tost_p_holm: float | None
    mde: float | None
    mde_alpha: float
    verdict: str

    @property
    def n(self) -> int:
        return len(self.seeds)

    @property
    def difference(self) -> float | None:
        """Δ: the mean per-seed difference (for one pair, that pair's difference)."""
        if self.treatment_mean is None or self.baseline_mean is None:
            return None
        return self.test.mean if self.test is not None else self.treatment_mean - self.baseline_mean


def verdict(n: int, difference: float | None, p: float | None, equivalence_p: float | None, alpha: float) -> str:
    """The verdict (module docstring) from the p-values the contrast is judged by."""
    if n < 2 or p is None or difference is None:
        return INCONCLUSIVE
    if equivalence_p is not None and equivalence_p < alpha:
        return EQUIVALENT
    if p < alpha:
        return BETTER if difference > 0 else WORSE
    return INCONCLUSIVE


@dataclass(frozen=True)
class _Pairs:
    treatment: str
    cell: tuple[int | None, tuple[str, ...]]
    seeds: tuple[int, ...]
    treatment_values: tuple[float, ...]
    baseline_values: tuple[float, ...]

    @property
    def differences(self) -> list[float]:
        return [t - b for t, b in zip(self.treatment_values, self.baseline_values, strict=True)]


def _by_cell(runs: Sequence[RunValues], metric: str) -> dict[tuple[str, Cell], dict[int, float]]:
    """Per (mode, cell): the metric's value of each seed that has one."""
    out: dict[tuple[str, Cell], dict[int, float]] = {}
    for run in runs:
        value = run.values.get(metric)
        if value is not None:
            out.setdefault((run.mode, (run.max_head_offpolicyness, run.extra)), {})[run.seed] = value
    return out


def _pairs(
    values: dict[tuple[str, Cell], dict[int, float]], treatment: str, baseline: str, cell: tuple[int | None, tuple[str, ...]]
) -> _Pairs:
    ours, theirs = values.get((treatment, cell), {}), values.get((baseline, cell), {})
    seeds = tuple(sorted(set(ours) & set(theirs)))
    return _Pairs(treatment, cell, seeds, tuple(ours[s] for s in seeds), tuple(theirs[s] for s in seeds))


def _contrast(
    pairs: _Pairs,
    study: Study,
    test: PairedT | None,
    *,
    mde_alpha: float,
    holm_p: tuple[float | None, float | None] | None = None,
) -> Contrast:
    """The contrast of ``pairs`` with its ``test`` (None below 2 pairs); ``holm_p``: a
    secondary's Holm-adjusted p and TOST p (None for the primary, judged by its own)."""
    n = len(pairs.seeds)
    equivalence = tost_p(test, study.margin) if test is not None and study.margin is not None else None
    p_holm, tost_p_holm = holm_p if holm_p is not None else (None, None)
    judged = (test.p if test else None, equivalence) if holm_p is None else (p_holm, tost_p_holm)
    return Contrast(
        treatment=pairs.treatment,
        baseline=study.baseline,
        max_head_offpolicyness=pairs.cell[0],
        extra=pairs.cell[1],
        primary=holm_p is None,
        seeds=pairs.seeds,
        treatment_mean=_mean(pairs.treatment_values),
        baseline_mean=_mean(pairs.baseline_values),
        test=test,
        bootstrap=bootstrap_interval(pairs.differences, 1.0 - study.alpha) if test is not None else None,
        tost_p=equivalence,
        p_holm=p_holm,
        tost_p_holm=tost_p_holm,
        mde=minimum_detectable_effect(test.sd, n, mde_alpha, study.power) if test is not None else None,
        mde_alpha=mde_alpha,
        verdict=verdict(n, test.mean if test else None, *judged, study.alpha),
    )


def _test(pairs: _Pairs, study: Study) -> PairedT | None:
    return paired_t(pairs.differences, study.alpha) if len(pairs.seeds) >= 2 else None


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def study_contrasts(
    runs: Sequence[RunValues], study: Study, common: Sequence[str] = ()
) -> tuple[Contrast | None, list[Contrast]]:
    """The primary contrast (None when the study registers none; without pairs when its runs
    are missing) and the secondary ones, by cell and mode. ``common``: the overrides every run
    shares, which the primary's cell may name."""
    values = _by_cell(runs, study.metric)
    cells = sorted({cell for _, cell in values})
    modes = sorted({mode for mode, _ in values if mode != study.baseline})
    primary, primary_key = None, None
    if study.primary is not None:
        matching = [c for c in cells if study.primary.matches(c[0], [*c[1], *common])]
        if len(matching) > 1:
            found = "; ".join(" ".join([f"η={c[0]}", *c[1]]) for c in matching)
            raise UserError(
                f"the primary contrast ({study.primary.describe(study.baseline)}) matches several cells of these runs "
                f"({found}); name the key that tells them apart in primary.at of a study file (--study FILE)"
            )
        cell = matching[0] if matching else _named_cell(study)
        pairs = _pairs(values, study.primary.treatment, study.baseline, cell)
        primary = _contrast(pairs, study, _test(pairs, study), mde_alpha=study.alpha)
        primary_key = (study.primary.treatment, cell)
    family = [
        pairs
        for cell in cells
        for mode in modes
        if (mode, cell) != primary_key and (pairs := _pairs(values, mode, study.baseline, cell)).seeds
    ]
    tests = [_test(pairs, study) for pairs in family]
    testable = [i for i, test in enumerate(tests) if test is not None]
    p_holm = holm([tests[i].p for i in testable])
    tost_holm = holm([tost_p(tests[i], study.margin) for i in testable]) if study.margin is not None else None
    adjusted = {i: (p_holm[k], None if tost_holm is None else tost_holm[k]) for k, i in enumerate(testable)}
    mde_alpha = study.alpha / max(len(testable), 1)
    secondary = [
        _contrast(pairs, study, test, mde_alpha=mde_alpha, holm_p=adjusted.get(i, (None, None)))
        for i, (pairs, test) in enumerate(zip(family, tests, strict=True))
    ]
    return primary, secondary


def _named_cell(study: Study) -> tuple[int | None, tuple[str, ...]]:
    """The primary's cell as the study names it (no run is in it)."""
    assert study.primary is not None
    at = dict(study.primary.at)
    eta = at.pop(MAX_HEAD_OFFPOLICYNESS_KEY, None)
    return (None if eta is None else int(float(eta)), tuple(f"{k}={v}" for k, v in sorted(at.items())))
