"""A study's paired contrasts (sdp_cli/ablate/contrasts.py): pairing by seed, the fixed baseline,
the primary tested alone, Holm over the secondary family, and the verdicts.

Expected p-values are scipy.stats.ttest_rel's, quoted in the comments."""

import math

import pytest
from scipy import stats as sps

from sdp_cli.ablate.contrasts import BETTER, EQUIVALENT, INCONCLUSIVE, WORSE, study_contrasts, verdict
from sdp_cli.ablate.records import RunValues
from sdp_cli.ablate.stats import minimum_detectable_effect
from sdp_cli.ablate.study import Primary, Study
from sdp_cli.errors import UserError

ETA = "rollout.max_head_offpolicyness"


def _runs(table, metric="reward_last", extra=()):
    """RunValues from {(mode, η): {seed: value}}."""
    return [
        RunValues(mode, eta, extra, seed, f"{mode}-eta{eta}-seed{seed}", {metric: value})
        for (mode, eta), values in table.items()
        for seed, value in values.items()
    ]


def _study(**keys):
    return Study(**keys)


def test_runs_pair_by_seed_only_where_both_ran():
    # treatment seeds 0, 1, 2 and baseline seeds 1, 2, 3: pairs are seeds 1 and 2
    runs = _runs({("segment_wise", 4): {0: 0.9, 1: 0.30, 2: 0.25}, ("decoupled", 4): {1: 0.28, 2: 0.20, 3: 0.1}})
    _, (c,) = study_contrasts(runs, _study())
    assert c.seeds == (1, 2) and c.n == 2
    # d = (0.02, 0.05): mean 0.035; means over the paired seeds only
    assert c.difference == pytest.approx(0.035)
    assert (c.treatment_mean, c.baseline_mean) == (pytest.approx(0.275), pytest.approx(0.24))


def test_the_baseline_is_fixed_never_the_better_mode_of_the_cell():
    # segment_wise is better than decoupled here; κ = 2 is still compared with decoupled
    runs = _runs(
        {
            ("decoupled", 8): {0: 0.20, 1: 0.22, 2: 0.24},
            ("segment_wise", 8): {0: 0.30, 1: 0.33, 2: 0.35},
            ("segment_wise_drift(κ=2)", 8): {0: 0.25, 1: 0.26, 2: 0.28},
        }
    )
    _, secondary = study_contrasts(runs, _study())
    assert [(c.treatment, c.baseline) for c in secondary] == [
        ("segment_wise", "decoupled"),
        ("segment_wise_drift(κ=2)", "decoupled"),
    ]
    assert secondary[1].difference == pytest.approx(0.043333, abs=1e-6)  # (0.05 + 0.04 + 0.04)/3


def _family():
    """Three secondary contrasts at η = 2, 4, 8 and the primary at η = 8."""
    return _runs(
        {
            ("decoupled", 2): {0: 0.30, 1: 0.25, 2: 0.28, 3: 0.26},
            ("segment_wise", 2): {0: 0.31, 1: 0.27, 2: 0.28, 3: 0.28},  # d = .01 .02 0 .02
            ("decoupled", 4): {0: 0.30, 1: 0.25, 2: 0.28, 3: 0.26},
            ("segment_wise", 4): {0: 0.26, 1: 0.22, 2: 0.23, 3: 0.22},  # d = −.04 −.03 −.05 −.04
            ("decoupled", 8): {0: 0.30, 1: 0.25, 2: 0.28, 3: 0.26},
            ("segment_wise", 8): {0: 0.20, 1: 0.17, 2: 0.16, 3: 0.17},  # d = −.10 −.08 −.12 −.09
            ("segment_wise_drift(κ=4)", 8): {0: 0.31, 1: 0.24, 2: 0.29, 3: 0.26},  # d = .01 −.01 .01 0
        }
    )


def test_the_primary_is_tested_alone_and_the_secondary_family_is_holm_adjusted():
    study = _study(primary=Primary("segment_wise", ((ETA, "8"),)), margin=0.02)
    primary, secondary = study_contrasts(_family(), study)
    d8 = [-0.10, -0.08, -0.12, -0.09]
    # the primary: its own p (scipy.stats.ttest_rel: 0.0014416), no Holm, MDE at α
    assert primary.primary and primary.p_holm is None
    assert primary.test.p == pytest.approx(0.0014416, abs=1e-7)
    assert primary.verdict == WORSE and primary.mde_alpha == 0.05
    sd = float(sps.tstd(d8))
    assert primary.mde == pytest.approx(minimum_detectable_effect(sd, 4, 0.05, 0.8))
    # the secondary family: segment_wise at η = 2 and 4, κ = 4 at η = 8 (m = 3; the primary is out)
    by = {(c.treatment, c.max_head_offpolicyness): c for c in secondary}
    assert sorted(by) == [("segment_wise", 2), ("segment_wise", 4), ("segment_wise_drift(κ=4)", 8)]
    # scipy.stats.ttest_rel p-values: η = 2: 0.0796050, η = 4: 0.0022595, κ = 4: 0.6376181
    assert by["segment_wise", 2].test.p == pytest.approx(0.0796050, abs=1e-7)
    assert by["segment_wise", 4].test.p == pytest.approx(0.0022595, abs=1e-7)
    assert by["segment_wise_drift(κ=4)", 8].test.p == pytest.approx(0.6376181, abs=1e-7)
    # Holm: 3 · 0.0022595 = 0.0067785; 2 · 0.0796050 = 0.1592100; 1 · 0.6376181
    assert by["segment_wise", 4].p_holm == pytest.approx(0.0067785, abs=1e-6)
    assert by["segment_wise", 2].p_holm == pytest.approx(0.1592100, abs=1e-6)
    assert by["segment_wise_drift(κ=4)", 8].p_holm == pytest.approx(0.6376181, abs=1e-7)
    assert by["segment_wise", 4].verdict == WORSE
    # TOST at ±0.02, every SE from s_d over √4 (scipy.stats.t):
    # κ = 4: d̄ = 0.0025, SE = 0.0047871: max(P(T₃ ≥ 0.0225/SE), P(T₃ ≤ −0.0175/SE))
    #        = max(0.0091099, 0.0176764) = 0.0176764
    # η = 2: d̄ = 0.0125, SE = 0.0047871: max(0.0032666, P(T₃ ≤ −0.0075/SE) = 0.1075850) = 0.1075850
    # η = 4: d̄ = −0.04, SE = 0.0040825: P(T₃ ≥ −0.02/SE) = 0.9918617
    kappa, eta2 = by["segment_wise_drift(κ=4)", 8], by["segment_wise", 2]
    assert kappa.tost_p == pytest.approx(0.0176764, abs=1e-7)
    assert eta2.tost_p == pytest.approx(0.1075850, abs=1e-7)
    assert by["segment_wise", 4].tost_p == pytest.approx(0.9918617, abs=1e-7)
    # Holm over the three: 3 · 0.0176764 = 0.0530292 > 0.05, so κ = 4 is not shown equivalent
    # (alone, at 0.0177, it would be); η = 2: 2 · 0.1075850 = 0.2151700
    assert kappa.tost_p_holm == pytest.approx(0.0530292, abs=1e-6) and kappa.verdict == INCONCLUSIVE
    assert eta2.tost_p_holm == pytest.approx(0.2151700, abs=1e-6) and eta2.verdict == INCONCLUSIVE
    # every secondary MDE is at α/m = 0.05/3
    assert [c.mde_alpha for c in secondary] == pytest.approx([0.05 / 3] * 3)


def test_verdicts():
    # significant and outside the margin: by the sign
    assert verdict(5, 0.05, 0.001, 0.9, 0.05) == BETTER
    assert verdict(5, -0.05, 0.001, None, 0.05) == WORSE
    # equivalence wins over a significant difference smaller than the margin
    assert verdict(5, 0.01, 0.001, 0.01, 0.05) == EQUIVALENT
    assert verdict(5, 0.0, 1.0, 0.001, 0.05) == EQUIVALENT
    # neither: inconclusive; one pair: nothing to test
    assert verdict(5, 0.03, 0.2, 0.3, 0.05) == INCONCLUSIVE
    assert verdict(1, 0.5, None, None, 0.05) == INCONCLUSIVE
    # the threshold is strict: p = α is not significant
    assert verdict(5, 0.05, 0.05, None, 0.05) == INCONCLUSIVE
    assert verdict(5, 0.01, 0.2, 0.05, 0.05) == INCONCLUSIVE  # and so for the equivalence test
    # two pairs already make a test (one degree of freedom)
    assert verdict(2, -0.5, 0.01, None, 0.05) == WORSE
    assert verdict(2, 0.0, 0.9, 0.01, 0.05) == EQUIVALENT


def test_bit_identical_runs_are_equivalent_not_a_038_wide_interval():
    # issue 22: at η = 1 the drift-clipped runs are decoupled's bit for bit; the unpaired Welch
    # interval of the first sweep was ±0.038 there, the paired one is the point 0
    values = {0: 0.2727, 1: 0.3342, 2: 0.3043, 3: 0.3039, 4: 0.2721}
    runs = _runs({("decoupled", 1): values, ("segment_wise_drift(κ=4)", 1): dict(values)})
    _, (c,) = study_contrasts(runs, _study(margin=0.02))
    assert (c.test.low, c.test.high, c.bootstrap, c.mde) == (0.0, 0.0, (0.0, 0.0), 0.0)
    assert c.verdict == EQUIVALENT
    # without a stated margin there is no equivalence verdict
    _, (c,) = study_contrasts(runs, _study())
    assert c.verdict == INCONCLUSIVE and c.tost_p is None


def test_one_pair_has_no_test_and_is_left_out_of_the_family():
    runs = _runs(
        {
            ("decoupled", 2): {0: 0.3},
            ("segment_wise", 2): {0: 0.2},
            ("decoupled", 4): {0: 0.3, 1: 0.2},
            ("segment_wise", 4): {0: 0.2, 1: 0.15},
        }
    )
    _, (one, two) = study_contrasts(runs, _study())
    assert (one.n, one.test, one.p_holm, one.verdict) == (1, None, None, INCONCLUSIVE)
    assert one.difference == pytest.approx(-0.1)
    # the family has one testable member: its Holm p is its p, its MDE at α/1
    assert two.p_holm == pytest.approx(two.test.p) and two.mde_alpha == 0.05


def test_a_primary_without_runs_is_inconclusive_and_named_as_registered():
    runs = _runs({("decoupled", 4): {0: 0.3, 1: 0.2}, ("segment_wise", 4): {0: 0.2, 1: 0.1}})
    primary, secondary = study_contrasts(runs, _study(primary=Primary("segment_wise", ((ETA, "8"),))))
    assert (primary.max_head_offpolicyness, primary.seeds, primary.verdict) == (8, (), INCONCLUSIVE)
    assert primary.difference is None and len(secondary) == 1


def test_a_primary_cell_that_names_too_little_is_an_error():
    runs = _runs({("decoupled", 8): {0: 0.3, 1: 0.2}, ("segment_wise", 8): {0: 0.2, 1: 0.1}}, extra=("optim.lr=1e-4",))
    runs += _runs({("decoupled", 8): {0: 0.3, 1: 0.2}, ("segment_wise", 8): {0: 0.2, 1: 0.1}}, extra=("optim.lr=3e-4",))
    study = _study(primary=Primary("segment_wise", ((ETA, "8"),)))
    with pytest.raises(UserError, match=r"matches several cells of these runs \(η=8 optim.lr=1e-4; η=8 optim.lr=3e-4\)"):
        study_contrasts(runs, study)
    # naming the key, or a key every run shares (``common``), picks one cell
    study = _study(primary=Primary("segment_wise", ((ETA, "8"), ("optim.lr", "0.0003"))))
    primary, secondary = study_contrasts(runs, study)
    assert primary.extra == ("optim.lr=3e-4",) and [c.extra for c in secondary] == [("optim.lr=1e-4",)]
    shared = _runs({("decoupled", 8): {0: 0.3, 1: 0.2}, ("segment_wise", 8): {0: 0.2, 1: 0.1}})
    primary, _ = study_contrasts(shared, study, common=("optim.lr=3e-4",))
    assert primary.n == 2


def test_the_study_metric_is_the_one_compared():
    runs = _runs({("decoupled", 4): {0: 0.5, 1: 0.6}, ("segment_wise", 4): {0: 0.7, 1: 0.7}}, metric="acc_end")
    _, (c,) = study_contrasts(runs, _study(metric="acc_end"))
    assert c.difference == pytest.approx(0.15)
    assert study_contrasts(runs, _study()) == (None, [])  # nothing logged reward_last
    assert math.isfinite(c.test.p)
