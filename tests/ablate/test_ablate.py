"""sdp ablate without training: run names, sweep planning, aggregation maths, tables and plots.

Aggregation is checked on hand-made run directories whose expected numbers are computed by hand
in the comments; the end-to-end sweep (real runs) is in tests/cli/test_ablate.py.
"""

import csv
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from sdp_cli.ablate.sweep import (
    FINISHED,
    NEW,
    PARTIAL,
    available_sweeps,
    plan_sweep,
    run_name,
    run_state,
)
from sdp_cli.ablate.records import load_sweep, read_metrics
from sdp_cli.ablate.report import (
    aggregate,
    pooled_std,
    reward_curves,
    to_csv,
    to_markdown,
    write_report,
)
from sdp_cli.config.compose import compose_config
from sdp_cli.errors import UserError


# ------------------------------------------------------------------- naming
@pytest.mark.parametrize(
    "overrides,name",
    [
        (
            ["+preset=decoupled", "rollout.max_head_offpolicyness=4", "seed=2", "+ablate=default"],
            "decoupled-eta4-seed2",
        ),
        # other keys are sorted between η and the seed; run.dir never counts
        (
            [
                "seed=0",
                "optim.lr=3e-4",
                "+preset=bypass",
                "rollout.max_head_offpolicyness=0",
                "run.dir=/x",
                "+ablate=smoke",
            ],
            "bypass-eta0-optim.lr@3e-4-seed0",
        ),
        # characters a directory name (or an unquoted Hydra value) should not hold become '_'
        (["+preset=bypass", "task.path=/data/a b,c.jsonl"], "bypass-task.path@_data_a_b_c.jsonl"),
    ],
)
def test_run_name(overrides, name):
    assert run_name(overrides) == name


def test_long_run_names_are_cut_and_hashed_so_they_stay_distinct():
    a = run_name(["+preset=bypass", *(f"model.k{i}={'x' * 20}" for i in range(8)), "seed=0"])
    b = run_name(["+preset=bypass", *(f"model.k{i}={'x' * 20}" for i in range(8)), "seed=1"])
    assert len(a) == len(b) == 120
    assert a != b


# ------------------------------------------------------------------- sweeps
def test_every_sweep_composes_into_a_valid_run_config():
    sweeps = available_sweeps()
    assert {"default", "harsh", "smoke"} <= set(sweeps)
    for sweep in sweeps:
        cfg, _ = compose_config([f"+ablate={sweep}"])
        # the shadow weights need the recompute pass in every mode
        assert cfg.rollout.recompute == "always", sweep
        assert cfg.train.threads == 1, sweep


def _axes(sweep):
    text = (
        Path(__file__).resolve().parents[2] / "sdp_cli" / "conf" / "ablate" / f"{sweep}.yaml"
    ).read_text()
    return yaml.safe_load(text)["hydra"]["sweeper"]["params"]


DRIFT_STUDY_MODES = [
    "decoupled",
    "segment_wise",
    "segment_wise_drift_k1.5",
    "segment_wise_drift_k2",
    "segment_wise_drift_k4",
]


@pytest.mark.parametrize(
    ("sweep", "etas"), [("default", ["1", "2", "4", "8", "16"]), ("harsh", ["2", "4", "8", "16"])]
)
def test_drift_clip_study_sweeps_five_modes_by_eta_by_at_least_five_seeds(tmp_path, sweep, etas):
    # issue 16: decoupled, segment_wise and segment_wise + κ ∈ {1.5, 2, 4} in both regimes
    plan = plan_sweep(sweep, [], tmp_path)
    assert plan.axes["+preset"] == DRIFT_STUDY_MODES
    assert plan.axes["rollout.max_head_offpolicyness"] == etas
    assert len(plan.axes["seed"]) >= 5
    assert len(plan.jobs) == len(DRIFT_STUDY_MODES) * len(etas) * len(plan.axes["seed"])
    assert {job.state for job in plan.jobs} == {NEW}


def test_harsh_regime_moves_the_policy_more_than_the_default():
    default, _ = compose_config(["+ablate=default"])
    harsh, _ = compose_config(["+ablate=harsh"])
    assert harsh.optim.lr > default.optim.lr
    assert (
        harsh.optim.ppo_epochs * harsh.optim.minibatches
        > default.optim.ppo_epochs * default.optim.minibatches
    )
    assert (
        max(int(x) for x in str(_axes("harsh")["rollout.max_head_offpolicyness"]).split(",")) >= 8
    )


def test_plan_expands_like_hydra_and_the_command_line_replaces_an_axis(tmp_path):
    plan = plan_sweep("smoke", [], tmp_path / "a")
    assert sorted(job.name for job in plan.jobs) == sorted(
        f"{mode}-eta{eta}-seed0"
        for mode in ("bypass", "decoupled", "segment_wise")
        for eta in (0, 2)
    )
    # Hydra's order: the sweep's axes first, then the command line (+ablate=smoke included)
    assert plan.jobs[0].overrides == (
        "+preset=bypass",
        "rollout.max_head_offpolicyness=0",
        "seed=0",
        "+ablate=smoke",
    )
    assert all(job.run_dir == tmp_path.resolve() / "a" / "runs" / job.name for job in plan.jobs)

    more = plan_sweep("smoke", ["seed=0,1", "rollout.max_head_offpolicyness=8"], tmp_path / "b")
    assert len(more.jobs) == 3 * 1 * 2
    assert {job.name.split("-")[1] for job in more.jobs} == {"eta8"}
    assert more.axes == {"+preset": ["bypass", "decoupled", "segment_wise"], "seed": ["0", "1"]}


def test_plan_classifies_run_directories(tmp_path):
    plan = plan_sweep("smoke", [], tmp_path)
    finished, partial = plan.jobs[0].run_dir, plan.jobs[1].run_dir
    for run_dir in (finished, partial):
        run_dir.mkdir(parents=True)
        (run_dir / "overrides.json").write_text("[]")
    (finished / "summary.json").write_text("{}")
    assert (run_state(finished), run_state(partial), run_state(plan.jobs[2].run_dir)) == (
        FINISHED,
        PARTIAL,
        NEW,
    )
    again = plan_sweep("smoke", [], tmp_path)
    assert (again.count(FINISHED), again.count(PARTIAL), again.count(NEW)) == (1, 1, 4)


def test_a_run_made_with_another_config_stops_the_plan(tmp_path):
    plan = plan_sweep("smoke", [], tmp_path)
    job = plan.jobs[0]
    _, raw = compose_config([*job.train_overrides(), "train.steps=99"])
    from sdp_cli.config.compose import to_yaml

    job.run_dir.mkdir(parents=True)
    (job.run_dir / "config.yaml").write_text(to_yaml(raw))
    with pytest.raises(UserError, match=r"different config \(train.steps: 99 → 6\)") as info:
        plan_sweep("smoke", [], tmp_path)
    assert "\n" not in str(info.value)

    # a key only one side has (a newer or older sdp) is not a difference
    text = yaml.safe_load(to_yaml(compose_config(job.train_overrides())[1]))
    del text["train"]["steps"]
    text["train"]["a_key_from_another_version"] = 1
    (job.run_dir / "config.yaml").write_text(yaml.safe_dump(text))
    assert plan_sweep("smoke", [], tmp_path).jobs[0].state == PARTIAL


@pytest.mark.parametrize(
    "sweep,overrides,fragment",
    [
        ("nope", [], "unknown sweep 'nope'; choose one of default, harsh, smoke"),
        (
            "smoke",
            ["rollout.max_head_offpolicyness=0,-1"],
            "rollout.max_head_offpolicyness=-1 must be >= 0",
        ),
        ("smoke", ["+preset=bypass,nope"], "preset=nope: no such option"),
        ("smoke", ["nope.key=1"], "unknown config key 'nope'"),
        ("smoke", ["run.dir=/tmp/x"], "run.dir is set by the sweep"),
        ("smoke", ["resume=/tmp/x"], "resume is set by the sweep"),
        ("smoke", ["+ablate=default"], "choose the sweep as the first argument"),
        ("smoke", ["seed=[1"], "cannot parse override"),
        ("smoke", ["hydra/launcher=nope"], "cannot apply hydra/launcher=nope"),
        ("smoke", ["--dir", "a=b"], "must not contain any of ' = ,"),
    ],
)
def test_bad_sweep_input_is_one_line(tmp_path, sweep, overrides, fragment):
    if overrides[:1] == ["--dir"]:
        tmp_path, overrides = tmp_path / overrides[1], []
    with pytest.raises(UserError) as info:
        plan_sweep(sweep, overrides, tmp_path)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


# -------------------------------------------------------------- aggregation
def _fake_run(root, name, *, mode, eta, seed, rows, summary, extra=(), drift_clip=None):
    """A run directory as sdp train writes it (only what the report reads)."""
    run_dir = root / "runs" / name
    run_dir.mkdir(parents=True)
    overrides = [
        f"+preset={mode}",
        f"rollout.max_head_offpolicyness={eta}",
        f"seed={seed}",
        "+ablate=smoke",
        *extra,
    ]
    (run_dir / "overrides.json").write_text(json.dumps([*overrides, f"run.dir={run_dir}"]))
    loss = {"mode": "segment_wise" if drift_clip else mode, "drift_clip": drift_clip}
    config = {"seed": seed, "loss": loss, "rollout": {"max_head_offpolicyness": eta}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    lines = [json.dumps({"step": i + 1, **row}) for i, row in enumerate(rows)]
    lines.insert(
        1, json.dumps({"step": 0, "eval/greedy_accuracy": 0.5})
    )  # eval rows carry no reward
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def _row(reward, lag, n, mean, std, ess, wmax, tokens=100.0):
    shadow = {
        "rollout_is_mean": mean,
        "rollout_is_std": std,
        "rollout_is_eff_sample_size": ess,
        "rollout_is_max": wmax,
    }
    out = {
        "reward/mean": reward,
        "staleness/lag_mean": lag,
        "batch/response_tokens": n,
        "offpolicy/kl": 0.01 * lag,
    }
    # every step: 0.5 s waiting, 1 s training, 0.5 s pushing (0.25 s of it recomputing)
    out.update(
        {"time/wait_s": 0.5, "time/train_s": 1.0, "time/push_s": 0.5, "time/recompute_s": 0.25}
    )
    out["throughput/tokens_generated_total"] = tokens
    for name in ("decoupled", "segment_wise"):
        out.update({f"shadow/{name}/{k}": v for k, v in shadow.items()})
    return out


def _summary(reward_last, filtered, generated):
    # throughput fields of summary.json are left out on purpose: the report reads metrics.jsonl
    return {
        "reward_last": reward_last,
        "greedy_accuracy_end": reward_last,
        "filtered_groups": filtered,
        "counters": {"groups_generated": generated},
    }


@pytest.fixture
def fake_sweep(tmp_path):
    # seed 0: step weights {1,1} and {3,3} → all tokens {1,1,3,3}: mean 2, population std 1
    _fake_run(
        tmp_path,
        "decoupled-eta2-seed0",
        mode="decoupled",
        eta=2,
        seed=0,
        rows=[
            _row(0.5, 1.0, 2, 1.0, 0.0, 0.9, 1.0),
            _row(0.7, 2.0, 2, 3.0, 0.0, 0.7, 3.0, tokens=200.0),
        ],
        summary=_summary(0.25, 3, 30),
    )
    # seed 1: {4} and {0,2} (mean 1, std 1) → {4,0,2}: mean 2, variance (4+4+0)/3 → std √(8/3)
    _fake_run(
        tmp_path,
        "decoupled-eta2-seed1",
        mode="decoupled",
        eta=2,
        seed=1,
        rows=[
            _row(0.1, 1.0, 1, 4.0, 0.0, 0.6, 4.0),
            _row(0.3, 2.0, 2, 1.0, 1.0, 0.8, 2.0, tokens=600.0),
        ],
        summary=_summary(0.75, 0, 20),
    )
    # unfinished (no summary.json): listed, never aggregated
    _fake_run(
        tmp_path,
        "decoupled-eta2-seed2",
        mode="decoupled",
        eta=2,
        seed=2,
        rows=[_row(9.0, 9.0, 9, 9.0, 9.0, 9.0, 9.0)],
        summary=None,
    )
    _fake_run(
        tmp_path,
        "bypass-eta0-seed0",
        mode="bypass",
        eta=0,
        seed=0,
        rows=[_row(0.2, 0.0, 4, 1.0, 0.0, 1.0, 1.0)],
        summary=_summary(0.2, 0, 10),
    )
    return tmp_path


def test_pooled_std_by_hand():
    # {1,1,3,3}: mean 2, every deviation 1 → std 1
    assert pooled_std([2, 2], [1.0, 3.0], [0.0, 0.0]) == pytest.approx(1.0)
    # {4} ∪ {0,2}: mean 2, squared deviations 4, 4, 0 → std √(8/3)
    assert pooled_std([1, 2], [4.0, 1.0], [0.0, 1.0]) == pytest.approx(math.sqrt(8 / 3))
    assert pooled_std([], [], []) is None


@given(st.lists(st.lists(st.floats(0.0, 50.0), min_size=1, max_size=20), min_size=1, max_size=8))
def test_pooled_std_equals_the_std_of_the_union(chunks):
    counts = [len(c) for c in chunks]
    means = [float(np.mean(c)) for c in chunks]
    stds = [float(np.std(c)) for c in chunks]
    union = np.concatenate([np.asarray(c) for c in chunks])
    assert pooled_std(counts, means, stds) == pytest.approx(
        float(np.std(union)), rel=1e-6, abs=1e-6
    )


def test_aggregate_by_hand(fake_sweep):
    sweep = load_sweep(fake_sweep)
    assert [r.name for r in sweep.records if not r.finished] == ["decoupled-eta2-seed2"]
    assert sweep.common == ()  # +ablate=smoke is not an override the report keeps
    bypass, dec = aggregate(sweep.records)
    assert (bypass.mode, bypass.max_head_offpolicyness, bypass.n) == ("bypass", 0, 1)
    assert (dec.mode, dec.max_head_offpolicyness, dec.seeds) == ("decoupled", 2, [0, 1])
    # weight std per run 1 and √(8/3) (see the fixture); mean and sample std over the two seeds
    s1, s2 = 1.0, math.sqrt(8 / 3)
    assert dec.mean["w_dec_std"] == pytest.approx((s1 + s2) / 2)
    assert dec.std["w_dec_std"] == pytest.approx(abs(s1 - s2) / math.sqrt(2))
    assert dec.mean["w_segment_wise_std"] == pytest.approx((s1 + s2) / 2)
    # ESS: per run the mean over steps, (0.9+0.7)/2 = 0.8 and (0.6+0.8)/2 = 0.7 → 0.75 ± 0.1/√2
    assert dec.mean["w_dec_ess"] == pytest.approx(0.75)
    assert dec.std["w_dec_ess"] == pytest.approx(0.1 / math.sqrt(2))
    # max weight per run 3 and 4 → 3.5
    assert dec.mean["w_dec_max"] == pytest.approx(3.5)
    # lag: both runs (1+2)/2 = 1.5, no spread; kl = 0.01·lag
    assert (dec.mean["lag"], dec.std["lag"]) == (pytest.approx(1.5), pytest.approx(0.0))
    assert dec.mean["kl"] == pytest.approx(0.015)
    # from summary.json: reward_last 0.25 and 0.75; filtered 3/30 and 0/20
    assert (dec.mean["reward_last"], dec.std["reward_last"]) == (
        pytest.approx(0.5),
        pytest.approx(0.5 / math.sqrt(2)),
    )
    assert dec.mean["filtered"] == pytest.approx(0.05)
    # two steps of 0.5 + 1 + 0.5 s → 4 s in the loop; 200 and 600 tokens → 50 and 150 tokens/s;
    # 2 steps / 4 s; recompute 2 × 0.25 s of 4 s
    assert dec.mean["wall_s"] == pytest.approx(4.0)
    assert dec.mean["tokens_per_s"] == pytest.approx(100.0)
    assert dec.mean["steps_per_s"] == pytest.approx(0.5)
    assert dec.mean["recompute_share"] == pytest.approx(0.125)
    # one seed: a mean, no std; a metric nobody logged: no value at all
    assert bypass.std["reward_last"] is None and bypass.count["reward_last"] == 1
    assert bypass.mean["ppo_kl"] is None and bypass.count["ppo_kl"] == 0


def test_csv_and_markdown_carry_the_aggregates(fake_sweep):
    groups = aggregate(load_sweep(fake_sweep).records)
    rows = list(csv.DictReader(io.StringIO(to_csv(groups))))
    assert [(r["mode"], r["eta"], r["n"], r["seeds"]) for r in rows] == [
        ("bypass", "0", "1", "0"),
        ("decoupled", "2", "2", "0 1"),
    ]
    assert float(rows[1]["reward_last_mean"]) == pytest.approx(0.5)
    assert float(rows[1]["w_dec_std_std"]) == pytest.approx(
        abs(1 - math.sqrt(8 / 3)) / math.sqrt(2)
    )
    assert rows[0]["reward_last_std"] == "" and rows[0]["ppo_kl_mean"] == ""
    # the segment-wise weight's columns say so ("sdp" is the program's name, not a weight)
    assert float(rows[1]["w_segment_wise_max_mean"]) == pytest.approx(3.5)
    assert not any("sdp" in column for column in rows[0])
    md = to_markdown(groups)
    assert "| decoupled | 2 | 2 | 1.50 ± 0.00 |" in md
    assert "| 0.500 ± 0.354 |" in md  # reward 0.5 ± 0.5/√2
    assert "| bypass | 0 | 1 | 0.200 | 0.200 |" in md  # one seed: the value alone


def test_groups_differ_only_in_what_varies(tmp_path):
    for seed, lr in ((0, "1e-4"), (1, "3e-4")):
        _fake_run(
            tmp_path,
            f"r{seed}",
            mode="decoupled",
            eta=1,
            seed=seed,
            extra=("optim.lr=" + lr, "train.steps=5"),
            rows=[_row(0.5, 1.0, 2, 1.0, 0.0, 1.0, 1.0)],
            summary=_summary(0.5, 0, 10),
        )
    sweep = load_sweep(tmp_path)
    assert sweep.common == ("train.steps=5",)
    assert [g.extra for g in aggregate(sweep.records)] == [("optim.lr=1e-4",), ("optim.lr=3e-4",)]


def test_reward_curves_keep_the_steps_every_seed_reached(tmp_path):
    _fake_run(
        tmp_path,
        "a",
        mode="bypass",
        eta=1,
        seed=0,
        rows=[_row(r, 1, 1, 1, 0, 1, 1) for r in (0.1, 0.2, 0.3)],
        summary=_summary(0.3, 0, 1),
    )
    _fake_run(
        tmp_path,
        "b",
        mode="bypass",
        eta=1,
        seed=1,
        rows=[_row(r, 1, 1, 1, 0, 1, 1) for r in (0.3, 0.6)],
        summary=_summary(0.6, 0, 1),
    )
    ((key, (steps, means, stds)),) = reward_curves(load_sweep(tmp_path).records).items()
    assert key == ("bypass", 1, ())
    assert steps == [1, 2]
    assert means == pytest.approx([0.2, 0.4])  # (0.1+0.3)/2, (0.2+0.6)/2
    assert stds == pytest.approx([0.2 / math.sqrt(2), 0.4 / math.sqrt(2)])


def test_report_writes_tables_and_pngs(fake_sweep):
    report = write_report(fake_sweep)
    assert report.csv_path.read_text() == to_csv(report.groups)
    assert "# sdp ablate" in report.markdown_path.read_text()
    assert sorted(p.name for p in report.plots) == [
        "reward_curves.png",
        "reward_vs_eta.png",
        "throughput_vs_eta.png",
        "weights_vs_eta.png",
    ]
    for path in report.plots:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert [r.name for r in report.unfinished] == ["decoupled-eta2-seed2"]


def test_drift_runs_form_their_own_mode_and_are_compared(tmp_path):
    # decoupled at η = 4: final rewards 0.30, 0.26; drift κ = 2: 0.28, 0.24 (same spread)
    for seed, (dec, drift) in enumerate([(0.30, 0.28), (0.26, 0.24)]):
        rows = [_row(0.2, 4.0, 2, 1.0, 0.0, 0.9, 1.0)]
        rows[0]["shadow/segment_wise_drift/drift_clipped_fraction"] = 0.1 * (seed + 1)
        _fake_run(tmp_path, f"decoupled-eta4-seed{seed}", mode="decoupled", eta=4, seed=seed,
                  rows=rows, summary=_summary(dec, 0, 10))
        _fake_run(tmp_path, f"segment_wise_drift_k2-eta4-seed{seed}", mode="segment_wise_drift_k2",
                  eta=4, seed=seed, rows=rows, summary=_summary(drift, 0, 10), drift_clip=2.0)
    report = write_report(tmp_path)
    assert [g.mode for g in report.groups] == ["decoupled", "segment_wise_drift(κ=2)"]
    # mean share of κ-clipped tokens over the seeds: (0.1 + 0.2) / 2
    assert report.groups[1].mean["drift_clipped"] == pytest.approx(0.15)
    by_mode = {c.mode: c for c in report.comparisons}
    drift = by_mode["segment_wise_drift(κ=2)"]
    # Δ = 0.26 − 0.28 = −0.02; each sample variance 2·0.02² = 0.0008, over n = 2 → 0.0004,
    # so SE = √0.0008 and ν = 0.0008² / (2 · 0.0004² / 1) = 2 (t_{0.975, 2} = 4.3027)
    assert drift.best_other == "decoupled"
    assert drift.comparison.difference == pytest.approx(-0.02)
    assert drift.comparison.standard_error == pytest.approx(math.sqrt(0.0008))
    assert drift.comparison.dof == pytest.approx(2.0)
    assert drift.comparison.high == pytest.approx(-0.02 + 4.3027 * math.sqrt(0.0008), abs=1e-4)
    markdown = report.markdown_path.read_text()
    assert "Final reward against the best other mode" in markdown and "| 4 | segment_wise_drift(κ=2) |" in markdown
    table = list(csv.DictReader(io.StringIO((tmp_path / "comparison.csv").read_text())))
    assert {r["mode"]: float(r["difference"]) for r in table} == pytest.approx(
        {"decoupled": 0.02, "segment_wise_drift(κ=2)": -0.02}
    )
    runs = list(csv.DictReader(io.StringIO((tmp_path / "runs.csv").read_text())))
    assert sorted((r["mode"], r["seed"], float(r["reward_last"])) for r in runs) == [
        ("decoupled", "0", 0.30), ("decoupled", "1", 0.26),
        ("segment_wise_drift(κ=2)", "0", 0.28), ("segment_wise_drift(κ=2)", "1", 0.24),
    ]
    assert "reward_difference_vs_eta.png" in [p.name for p in report.plots]


def test_a_torn_last_metrics_line_is_skipped_a_bad_middle_line_is_an_error(tmp_path):
    run_dir = _fake_run(
        tmp_path,
        "a",
        mode="bypass",
        eta=1,
        seed=0,
        rows=[_row(0.1, 1, 1, 1, 0, 1, 1), _row(0.3, 1, 1, 1, 0, 1, 1)],
        summary=None,
    )
    path = run_dir / "metrics.jsonl"
    path.write_text(path.read_text() + '{"step": 3, "reward/me')  # killed mid-write
    assert [r["reward/mean"] for r in read_metrics(path)] == [0.1, 0.3]
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "garbage", *lines[1:]]) + "\n")
    with pytest.raises(UserError, match=r"metrics.jsonl:2: not JSON"):
        read_metrics(path)


def test_report_of_a_directory_that_is_no_sweep(tmp_path):
    with pytest.raises(UserError, match="no runs/ directory"):
        load_sweep(tmp_path)
    (tmp_path / "runs" / "x").mkdir(parents=True)
    (tmp_path / "runs" / "x" / "overrides.json").write_text("{not json")
    with pytest.raises(UserError, match="overrides.json: cannot read"):
        load_sweep(tmp_path)


def test_report_against_named_baselines_and_a_mode_that_is_not_there(tmp_path):
    rewards = {"decoupled": (0.30, 0.26), "segment_wise": (0.20, 0.22), "segment_wise_drift_k2": (0.31, 0.29)}
    for mode, values in rewards.items():
        for seed, reward in enumerate(values):
            _fake_run(tmp_path, f"{mode}-eta4-seed{seed}", mode=mode, eta=4, seed=seed,
                      rows=[_row(0.2, 4.0, 2, 1.0, 0.0, 0.9, 1.0)], summary=_summary(reward, 0, 10),
                      drift_clip=2.0 if mode.endswith("k2") else None)
    with pytest.raises(UserError, match=r"^--against decoupld: no such mode in this sweep; its modes are "
                       r"decoupled, segment_wise, segment_wise_drift\(κ=2\)$"):
        write_report(tmp_path, plots=False, against=("decoupld",))
    assert not (tmp_path / "summary.md").exists()  # a bad option writes nothing
    report = write_report(tmp_path, plots=False, against=("decoupled", "segment_wise"))
    drift = {c.mode: c for c in report.comparisons}["segment_wise_drift(κ=2)"]
    # 0.30 − 0.28 (decoupled, the better baseline; κ=2 itself is not a baseline)
    assert drift.best_other == "decoupled" and drift.comparison.difference == pytest.approx(0.02)
    text = report.markdown_path.read_text()
    assert "against the better of decoupled, segment_wise at the same η" in text
