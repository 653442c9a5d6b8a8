"""The study's tables in words, on hand-built contrasts at α = 0.1 (every other test runs at
0.05, where a level written as 1 + α or as α would not show)."""

from __future__ import annotations

import csv
import io

from sdp_cli.ablate.contrasts import BETTER, INCONCLUSIVE, Contrast
from sdp_cli.ablate.stats import PairedT
from sdp_cli.ablate.study import Study
from sdp_cli.ablate.study_tables import (
    primary_lines,
    secondary_columns,
    secondary_note,
    secondary_rows,
    study_csv,
    study_markdown,
)

STUDY = Study(metric="reward_last", baseline="decoupled", margin=0.05, alpha=0.1, power=0.9)
TEST = PairedT(n=3, mean=0.04, sd=0.01, se=0.006, dof=2, t=6.9, p=0.02, low=0.025, high=0.055)


def _contrast(treatment: str, *, test: PairedT | None = TEST, seeds=(0, 1, 2), primary=False, extra=()) -> Contrast:
    paired = test is not None
    return Contrast(
        treatment=treatment, baseline="decoupled", max_head_offpolicyness=4, extra=extra, primary=primary,
        seeds=seeds, treatment_mean=0.34 if seeds else None, baseline_mean=0.30 if seeds else None, test=test,
        bootstrap=(0.03, 0.05) if paired else None, tost_p=0.4 if paired else None,
        p_holm=None if primary else (0.04 if paired else None), tost_p_holm=None if primary else (0.6 if paired else None),
        mde=0.021 if paired else None, mde_alpha=0.05, verdict=BETTER if paired else INCONCLUSIVE,
    )  # fmt: skip


def test_the_primary_contrast_in_lines_at_its_level():
    lines = primary_lines(_contrast("segment_wise", primary=True), STUDY)
    assert lines == [
        "Primary: segment_wise − decoupled at η = 4",
        "  3 pairs (seeds 0 1 2): 0.340 vs 0.300",
        "  Δ = +0.040   90% CI [+0.025, +0.055] (paired t)",
        "  bootstrap 90% CI [+0.030, +0.050]   MDE = 0.021 at power 0.9",
        "  p = 0.02 (paired t, ν = 2)   TOST ±0.05: p = 0.4",
        "  verdict: better",
    ]
    alone = primary_lines(_contrast("segment_wise", test=None, seeds=(), primary=True), STUDY)
    assert alone == ["Primary: segment_wise − decoupled at η = 4", "  0 pairs (seeds none)",
                     "  verdict: inconclusive (no paired runs)"]  # fmt: skip


def test_the_secondary_console_table_shows_each_interval_as_its_mean_and_half_width():
    secondary = [_contrast("segment_wise", extra=("task=arith2",)), _contrast("bypass", test=None, seeds=(0,))]
    assert secondary_columns(secondary, STUDY) == ["η", "other", "mode", "n", "Δ ± 90% CI", "Holm p", "MDE", "verdict"]
    assert secondary_rows(secondary, STUDY) == [
        ["4", "task=arith2", "segment_wise", "3", "+0.040 ± 0.015", "0.04", "0.021", "better"],
        ["4", "", "bypass", "1", "+0.040", "n/a", "n/a", "inconclusive"],  # one pair: the difference alone
    ]
    note = secondary_note(secondary, STUDY)
    assert "CI: paired t at 90%;" in note and "better / worse: Holm p < 0.1;" in note
    assert "MDE at α/m = 0.05 and power 0.9." in note


def test_the_markdown_and_csv_carry_the_level_and_the_bootstrap_interval():
    primary, secondary = _contrast("segment_wise", primary=True), [_contrast("bypass")]
    markdown = study_markdown(primary, secondary, STUDY, "conf/study.yaml")
    header = "| η | mode | n | Δ | 90% CI (paired t) | 90% CI (bootstrap) | p | Holm p | TOST Holm p | MDE | verdict |"
    assert header in markdown
    assert "| 4 | bypass | 3 | +0.040 | [+0.025, +0.055] | [+0.030, +0.050] | 0.02 | 0.04 | 0.6 | 0.021 | better |" in markdown
    rows = list(csv.DictReader(io.StringIO(study_csv(primary, secondary, STUDY))))
    assert [r["role"] for r in rows] == ["primary", "secondary"]
    assert (rows[1]["boot_low"], rows[1]["boot_high"]) == ("0.03", "0.05")
    assert (rows[1]["alpha"], rows[1]["power"], rows[1]["mde_alpha"]) == ("0.1", "0.9", "0.05")
