"""sdp ablate without training: run names, sweep planning, aggregation maths, tables and plots.

Aggregation is checked on hand-made run directories whose expected numbers are computed by hand
in the comments; the end-to-end sweep (real runs) is in tests/cli/test_ablate.py.
"""

import csv
import io
import json
import math
import shutil
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hypothesis import given
from hypothesis import strategies as st

from sdp_cli.ablate.sweep import (
    FINISHED,
    NEW,
    PARTIAL,
    _first_difference,
    available_sweeps,
    default_sweep_dir,
    plan_sweep,
    prune_checkpoints,
    run_job,
    run_name,
    run_state,
)
from sdp_cli.ablate.records import RunValues, load_sweep, read_metrics
from sdp_cli.ablate.study import Primary, Study, builtin_study_path, check_study, read_study_file, register
from sdp_cli.ablate.report import (
    aggregate,
    pooled_std,
    reward_curves,
    run_values,
    table_columns,
    to_csv,
    to_markdown,
    write_report,
)
from sdp_cli.config.compose import compose_config
from sdp_cli.errors import UserError

from ..cli.run_main import run_main


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


def test_a_run_name_of_exactly_the_limit_stays_whole():
    whole = run_name(["+preset=bypass", "model.k=" + "x" * 99, "seed=0"])
    assert whole == "bypass-model.k@" + "x" * 99 + "-seed0" and len(whole) == 120
    cut = run_name(["+preset=bypass", "model.k=" + "x" * 100, "seed=0"])
    assert len(cut) == 120 and cut.startswith("bypass-model.k@xxx") and not cut.endswith("-seed0")


def test_a_sweep_writes_under_runs_ablate_by_default():
    assert default_sweep_dir("smoke") == Path("runs/ablate/smoke")


def test_a_config_difference_is_the_first_key_that_differs():
    old = {"loss": {"mode": "decoupled", "clip": 0.2}, "seed": 0, "gone": 1}
    assert _first_difference(old, {**old, "added": 2}) is None  # keys one side lacks are skipped
    assert _first_difference(old, {**old, "loss": {"mode": "segment_wise", "clip": 0.3}}) == "loss.clip: 0.2 → 0.3"
    assert _first_difference(old, {**old, "loss": "decoupled"}) == "loss: {'mode': 'decoupled', 'clip': 0.2} → 'decoupled'"
    assert _first_difference({"a": "xy"}, {"a": {"x": 1, "y": 2}}) == "a: 'xy' → {'x': 1, 'y': 2}"


# ------------------------------------------------------------------- sweeps
def test_every_sweep_composes_into_a_valid_run_config():
    sweeps = available_sweeps()
    assert {"default", "harsh", "s5", "smoke"} <= set(sweeps)
    for sweep in sweeps:
        # s5 trains a real model, from a directory the user names (docs/real-models.md)
        cfg, _ = compose_config([f"+ablate={sweep}", *(["model.path=/models/smollm2-135m"] if sweep == "s5" else [])])
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
    # issue 22: the sweep's study registers segment_wise − decoupled at η = 8 in greedy accuracy
    study = read_study_file(builtin_study_path(sweep))
    check_study(study, plan.modes, plan.axes, sweep)
    assert (study.metric, study.baseline, study.margin) == ("acc_end", "decoupled", 0.05)
    assert study.primary == Primary("segment_wise", (("rollout.max_head_offpolicyness", "8"),))


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


def test_a_run_far_from_the_first_made_with_another_config_stops_the_plan_too(tmp_path):
    """The plan composes only the jobs one axis from the first (they hold every value), but every
    run that exists is checked against its planned config."""
    from sdp_cli.config.compose import to_yaml

    plan = plan_sweep("smoke", [], tmp_path)
    job = plan.jobs[-1]
    assert sum(a != b for a, b in zip(job.overrides, plan.jobs[0].overrides)) == 2  # mode and η
    _, raw = compose_config([*job.train_overrides(), "train.steps=99"])
    job.run_dir.mkdir(parents=True)
    (job.run_dir / "config.yaml").write_text(to_yaml(raw))
    with pytest.raises(UserError, match=rf"{job.name} was trained with a different config \(train.steps: 99 → 6\)"):
        plan_sweep("smoke", [], tmp_path)


def test_pruning_deletes_the_checkpoints_of_finished_runs_only(tmp_path):
    plan = plan_sweep("smoke", [], tmp_path)
    finished, partial = plan.jobs[0].run_dir, plan.jobs[1].run_dir
    for run_dir in (finished, partial):
        (run_dir / "checkpoints" / "step-000002").mkdir(parents=True)
    (finished / "summary.json").write_text("{}")
    assert prune_checkpoints(plan) == 1
    assert not (finished / "checkpoints").exists() and (finished / "summary.json").exists()
    assert (partial / "checkpoints" / "step-000002").is_dir()  # it resumes from there
    assert prune_checkpoints(plan) == 0


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
        ("nope", [], "unknown sweep 'nope'; choose one of default, harsh, s1, s1b, s2, s3m, s3u, s4, s4b, s5, smoke"),
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


def test_a_key_no_run_of_the_sweep_reads_is_one_line_and_one_some_runs_read_is_taken(tmp_path, monkeypatch):
    with pytest.raises(UserError) as info:
        plan_sweep("smoke", ["model.path=/models/mine"], tmp_path / "a")
    assert str(info.value) == (
        "model.path applies to model.kind=hf, not model.kind=tiny; add model=hf to train the model it names, "
        "or remove it (no run of the sweep reads it)"
    )
    # LoRA against full fine-tuning: the r=4 runs read the adapters' settings, the r=0 runs do not
    quick = ["train.steps=1", "engine.in_process=true"]
    plan = plan_sweep("smoke", ["model.lora.r=0,4", "model.lora.alpha=8", *quick], tmp_path / "b")
    assert plan.axes["model.lora.r"] == ["0", "4"]
    # and a run that does not read it trains with it (the plan judged the sweep as a whole)
    monkeypatch.setenv("SDP_CACHE_DIR", str(tmp_path / "cache"))
    full = next(job for job in plan.jobs if "model.lora.r=0" in job.overrides)
    threads = torch.get_num_threads()
    assert run_job(plan.sweep_dir, list(full.overrides)) == "trained"
    torch.set_num_threads(threads)
    with pytest.raises(UserError, match=r"^model.lora.alpha applies to LoRA .* \(no run of the sweep reads it\)$"):
        plan_sweep("smoke", ["model.lora.r=0", "model.lora.alpha=8"], tmp_path / "c")


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
    bypass, dec = aggregate(run_values(sweep.records))
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


def _one_run_values(tmp_path, rows, summary):
    _fake_run(tmp_path, "decoupled-eta2-seed0", mode="decoupled", eta=2, seed=0, rows=rows, summary=summary)
    (run,) = run_values(load_sweep(tmp_path).records)
    return run.values


def test_throughput_counts_the_recompute_ahead_and_is_none_without_timings(tmp_path):
    timed = [{**_row(0.5, 1.0, 2, 1.0, 0.0, 0.9, 1.0), "time/recompute_ahead_s": 0.5} for _ in range(2)]
    values = _one_run_values(tmp_path / "timed", timed, _summary(0.5, 0, 10))
    # 2 × (0.25 s at the take + 0.5 s ahead) of 2 × 2 s in the loop
    assert values["recompute_share"] == pytest.approx(0.375) and values["filtered"] == 0.0
    untimed = [
        {k: v for k, v in _row(0.5, 1.0, 2, 1.0, 0.0, 0.9, 1.0).items() if not k.startswith(("time/", "throughput/"))}
        for _ in range(2)
    ]
    values = _one_run_values(tmp_path / "untimed", untimed, _summary(0.5, None, 10))
    assert [values[k] for k in ("wall_s", "tokens_per_s", "steps_per_s", "recompute_share", "filtered")] == [None] * 5
    # time logged but no token counter: the rates that need it are None, the others are not
    no_tokens = [{k: v for k, v in row.items() if not k.startswith("throughput/")} for row in timed]
    values = _one_run_values(tmp_path / "no-tokens", no_tokens, _summary(0.5, 3, 0))
    assert (values["wall_s"], values["tokens_per_s"], values["steps_per_s"]) == (pytest.approx(4.0), None, pytest.approx(0.5))
    assert values["filtered"] is None  # no groups generated: no share


def test_a_sweep_with_no_finished_run_has_tables_and_no_plots(tmp_path):
    _fake_run(tmp_path, "decoupled-eta2-seed0", mode="decoupled", eta=2, seed=0,
              rows=[_row(0.5, 1.0, 2, 1.0, 0.0, 0.9, 1.0)], summary=None)  # fmt: skip
    report = write_report(tmp_path, plots=True)
    assert report.groups == [] and report.plots == [] and report.unfinished == ["decoupled-eta2-seed0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs", "runs.csv", "study.csv", "summary.csv", "summary.md"]


@given(st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=6))
def test_a_groups_mean_and_std_are_over_its_seeds(rewards):
    """Mean and sample std (n − 1) of any number of seeds, as the statistics module gives them;
    one seed has no std."""
    runs = [RunValues("decoupled", 2, (), seed, f"r{seed}", {"reward_last": r}) for seed, r in enumerate(rewards)]
    (group,) = aggregate(runs)
    assert group.count["reward_last"] == len(rewards) and group.seeds == list(range(len(rewards)))
    assert group.mean["reward_last"] == pytest.approx(statistics.fmean(rewards), abs=1e-9)
    if len(rewards) == 1:
        assert group.std["reward_last"] is None
    else:
        assert group.std["reward_last"] == pytest.approx(statistics.stdev(rewards), rel=1e-9, abs=1e-9)


def test_each_human_table_has_its_own_columns_and_only_those_some_run_logged(fake_sweep):
    groups = aggregate(run_values(load_sweep(fake_sweep).records))
    assert table_columns(groups, "weights") == [
        "mode", "η", "n", "lag", "std dec", "std seg", "ESS dec", "ESS seg", "max dec", "max seg", "kl",
    ]  # fmt: skip
    assert table_columns(groups, "outcome") == [
        "mode", "η", "n", "reward", "acc", "filtered", "tok/s", "steps/s", "wall s", "recompute",
    ]  # fmt: skip


def test_csv_and_markdown_carry_the_aggregates(fake_sweep):
    groups = aggregate(run_values(load_sweep(fake_sweep).records))
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
    assert [g.extra for g in aggregate(run_values(sweep.records))] == [("optim.lr=1e-4",), ("optim.lr=3e-4",)]


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


def test_the_report_command_names_the_unfinished_runs_it_left_out(fake_sweep, capsys):
    code, out, err = run_main(["ablate", "--report", str(fake_sweep), "--no-plots"], capsys)
    assert code == 0, err
    assert "1 unfinished runs left out: decoupled-eta2-seed2" in out
    assert f"wrote {fake_sweep / 'summary.md'}" in " ".join(out.split())  # (rich may wrap a long path)


def test_report_writes_tables_and_pngs(fake_sweep):
    report = write_report(fake_sweep)
    assert [p.name for p in report.written] == ["summary.csv", "study.csv", "runs.csv", "summary.md"]
    assert (fake_sweep / "summary.csv").read_text() == to_csv(report.groups)
    assert "# sdp ablate" in (fake_sweep / "summary.md").read_text()
    # decoupled (the default study's baseline) has no cell in common with bypass: no contrast
    assert report.primary is None and report.secondary == []
    assert sorted(p.name for p in report.plots) == [
        "reward_curves.png",
        "reward_vs_eta.png",
        "throughput_vs_eta.png",
        "weights_vs_eta.png",
    ]
    for path in report.plots:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert report.unfinished == ["decoupled-eta2-seed2"]


def _paired_sweep(root, rewards, eta=4, accuracy=None):
    """Finished runs of several modes at one η: ``rewards[mode]`` holds one final reward per seed."""
    for mode, values in rewards.items():
        for seed, reward in enumerate(values):
            kappa = float(mode.rpartition("_k")[2]) if "_drift_k" in mode else None
            summary = _summary(reward, 0, 10)
            if accuracy is not None:
                summary["greedy_accuracy_end"] = accuracy[mode][seed]
            _fake_run(root, f"{mode}-eta{eta}-seed{seed}", mode=mode, eta=eta, seed=seed,
                      rows=[_row(0.2, 4.0, 2, 1.0, 0.0, 0.9, 1.0)], summary=summary, drift_clip=kappa)


def test_drift_runs_form_their_own_mode_and_are_compared_with_decoupled_seed_by_seed(tmp_path):
    # decoupled at η = 4: final rewards 0.30, 0.26, 0.20; drift κ = 2: 0.28, 0.25, 0.17: the seeds
    # differ a lot, the per-seed differences −0.02, −0.01, −0.03 hardly
    _paired_sweep(tmp_path, {"decoupled": (0.30, 0.26, 0.20), "segment_wise_drift_k2": (0.28, 0.25, 0.17)})
    report = write_report(tmp_path)
    assert [g.mode for g in report.groups] == ["decoupled", "segment_wise_drift(κ=2)"]
    (drift,) = report.secondary
    # d = (−0.02, −0.01, −0.03): mean −0.02, s_d = 0.01, SE = 0.01/√3, t = −2√3 = −3.4641, ν = 2
    assert (drift.treatment, drift.baseline, drift.seeds) == ("segment_wise_drift(κ=2)", "decoupled", (0, 1, 2))
    assert drift.test.mean == pytest.approx(-0.02) and drift.test.t == pytest.approx(-2 * math.sqrt(3))
    # t_{0.975, 2} = 4.302653: the interval is −0.02 ± 4.302653 · 0.01/√3 = [−0.044841, +0.004841];
    # Welch's unpaired interval of the same runs would be [−0.137, +0.097]
    assert (drift.test.low, drift.test.high) == (pytest.approx(-0.044841, abs=1e-6), pytest.approx(0.004841, abs=1e-6))
    # a family of one: Holm changes nothing; p = 0.0742 (scipy.stats.ttest_rel) ≥ 0.05, no margin
    assert drift.p_holm == pytest.approx(drift.test.p) and drift.test.p == pytest.approx(0.074180, abs=1e-6)
    assert drift.verdict == "inconclusive" and drift.mde_alpha == 0.05
    markdown = (tmp_path / "summary.md").read_text()
    assert "## Study" in markdown and "none registered; the default: baseline decoupled" in markdown
    assert "| 4 | segment_wise_drift(κ=2) | 3 | -0.020 | [-0.045, +0.005] |" in markdown
    (row,) = csv.DictReader(io.StringIO((tmp_path / "study.csv").read_text()))
    assert (row["role"], row["treatment"], row["eta"], row["n"], row["seeds"]) == (
        "secondary", "segment_wise_drift(κ=2)", "4", "3", "0 1 2"
    )
    assert float(row["difference"]) == pytest.approx(-0.02) and float(row["p"]) == pytest.approx(0.074180, abs=1e-6)
    assert row["verdict"].startswith("inconclusive (MDE = ")
    runs = list(csv.DictReader(io.StringIO((tmp_path / "runs.csv").read_text())))
    assert sorted((r["mode"], r["seed"], float(r["reward_last"])) for r in runs)[:2] == [
        ("decoupled", "0", 0.30), ("decoupled", "1", 0.26),
    ]
    assert "difference_vs_eta.png" in [p.name for p in report.plots]


def test_the_registered_study_decides_the_report_and_a_study_file_replaces_it_post_hoc(tmp_path):
    rewards = {"decoupled": (0.30, 0.26, 0.20), "segment_wise": (0.20, 0.17, 0.12), "segment_wise_drift_k2": (0.31, 0.27, 0.21)}
    _paired_sweep(tmp_path, rewards, eta=8)
    registered = Study("reward_last", "decoupled", Primary("segment_wise", (("rollout.max_head_offpolicyness", "8"),)), 0.02)
    register(tmp_path, registered, "conf/study.yaml")
    report = write_report(tmp_path, plots=False)
    assert report.study == registered and report.provenance.startswith(f"registered in {tmp_path / 'study.json'} at ")
    # primary: d = (−0.10, −0.09, −0.08), mean −0.09, s_d = 0.01 → t = −15.588, ν = 2,
    # p = 0.00409 (scipy.stats.ttest_rel), tested alone at α: worse
    primary = report.primary
    assert (primary.treatment, primary.primary, primary.p_holm) == ("segment_wise", True, None)
    assert primary.test.p == pytest.approx(0.004090, abs=1e-6) and primary.verdict == "worse"
    # the other contrast is the secondary family: κ = 2 − decoupled = +0.01 on every seed (up to
    # float rounding), within the margin 0.02: equivalent, p_TOST ≈ 0
    (drift,) = report.secondary
    assert (drift.treatment, drift.verdict) == ("segment_wise_drift(κ=2)", "equivalent")
    assert drift.tost_p_holm == pytest.approx(0.0, abs=1e-12)
    text = (tmp_path / "summary.md").read_text()
    assert "Primary: segment_wise − decoupled at η = 8" in text and "verdict: worse" in text
    assert "equivalent within ±0.02" in text

    # a study file chosen now replaces the registration, and says so
    other = tmp_path / "other.yaml"
    other.write_text("baseline: segment_wise\nmetric: acc_end\n")
    report = write_report(tmp_path, plots=False, study_file=other)
    assert report.study.baseline == "segment_wise" and report.primary is None
    assert report.provenance == f"from {other}, instead of the registered {tmp_path / 'study.json'}; chosen after the runs (post hoc)"
    assert [c.treatment for c in report.secondary] == ["decoupled", "segment_wise_drift(κ=2)"]
    other.write_text("baseline: decoupld\n")
    with pytest.raises(UserError, match=r"^--study .*other.yaml: baseline 'decoupld' is not a mode of this sweep "
                       r"\(decoupled, segment_wise, segment_wise_drift\(κ=2\)\); fix the study file$"):
        write_report(tmp_path, plots=False, study_file=other)


def test_the_report_runs_from_its_runs_csv_alone(tmp_path):
    sweep = tmp_path / "sweep"
    rewards = {"decoupled": (0.30, 0.26, 0.20), "segment_wise": (0.20, 0.17, 0.12)}
    _paired_sweep(sweep, rewards, eta=8)
    study = tmp_path / "study.yaml"
    study.write_text("margin: 0.05\nprimary: {treatment: segment_wise, at: {rollout.max_head_offpolicyness: 8}}\n")
    write_report(sweep, plots=False, study_file=study)
    # the run directories are gone; runs.csv (and the study file) give every number again
    table = tmp_path / "table"
    table.mkdir()
    shutil.copy(sweep / "runs.csv", table / "runs.csv")
    again = write_report(table / "runs.csv", plots=False, study_file=study, out=tmp_path / "again")
    assert (tmp_path / "again" / "study.csv").read_text() == (sweep / "study.csv").read_text()
    assert (tmp_path / "again" / "summary.csv").read_text() == (sweep / "summary.csv").read_text()
    assert not (tmp_path / "again" / "runs.csv").exists()  # the input is the run table
    assert again.table.curves is None and again.primary.verdict == "worse"
    with pytest.raises(UserError, match=r"^--report .*summary.md: no such sweep directory or runs.csv"):
        write_report(sweep / "summary.md")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("mode,eta,seed\nx,1,0\n", "runs.csv: no column 'other'"),
        ("mode,eta,other,seed,run,reward_last\n", "runs.csv: no runs"),
        ("mode,eta,other,seed,run,reward_last\nx,1,,0,r,high\n", "runs.csv:2: a value is not a number"),
    ],
)
def test_a_runs_csv_that_is_not_the_reports_is_one_line(tmp_path, text, message):
    (tmp_path / "runs.csv").write_text(text)
    with pytest.raises(UserError, match=message):
        write_report(tmp_path / "runs.csv", plots=False)
    assert not (tmp_path / "summary.md").exists()


def test_trained_weight_ess_columns(tmp_path):
    # two steps logging the trained weight's ESS after / before bounds and the loss's token ESS
    rows = [_row(0.2, 2.0, 2, 1.0, 0.0, 0.9, 1.0), _row(0.3, 2.0, 2, 1.0, 0.0, 0.9, 1.0)]
    for row, (after, before, token) in zip(rows, [(0.9, 0.7, 0.95), (0.8, 0.5, 0.85)], strict=True):
        row.update({"weights/trained_ess": after, "weights/trained_ess_raw": before,
                    "weights/rollout_is_eff_sample_size": token})
    _fake_run(tmp_path, "a", mode="decoupled", eta=2, seed=0, rows=rows, summary=_summary(0.3, 0, 1))
    (group,) = aggregate(run_values(load_sweep(tmp_path).records))
    # means over the steps: (0.9 + 0.8)/2, (0.7 + 0.5)/2, (0.95 + 0.85)/2
    assert group.mean["trained_ess"] == pytest.approx(0.85)
    assert group.mean["trained_ess_raw"] == pytest.approx(0.6)
    assert group.mean["trained_token_ess"] == pytest.approx(0.9)
    assert "| ESS trained | ESS trained raw | ESS trained tok |" in to_markdown([group])


def test_columns_no_run_logged_are_left_out_of_the_tables_not_the_csv(fake_sweep):
    groups = aggregate(run_values(load_sweep(fake_sweep).records))
    assert "ESS trained" not in to_markdown(groups) and "ppo kl" not in to_markdown(groups)
    header = to_csv(groups).splitlines()[0].split(",")
    assert {"trained_ess_mean", "trained_ess_raw_mean", "trained_token_ess_mean", "ppo_kl_mean"} <= set(header)


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
    for text in ('{"+preset": "decoupled"}', '["seed=0", 3]'):
        (tmp_path / "runs" / "x" / "overrides.json").write_text(text)
        with pytest.raises(UserError) as err:
            load_sweep(tmp_path)
        assert str(err.value) == f"{tmp_path / 'runs' / 'x'}/overrides.json: expected a list of strings; not a run of sdp ablate"


def test_a_sweep_skips_what_under_runs_is_no_run(fake_sweep):
    runs = fake_sweep / "runs"
    names = [r.name for r in load_sweep(fake_sweep).records]
    (runs / "notes.txt").write_text("a file beside the runs\n")
    (runs / "started-not-written").mkdir()  # a run directory sdp train had not filled yet
    (runs / "started-not-written" / "config.yaml").write_text("seed: 0\n")
    assert [r.name for r in load_sweep(fake_sweep).records] == names


def test_a_run_is_labelled_by_the_correction_it_trains_with():
    from sdp_cli.ablate.sweep import mode_label

    def label(loss, overrides=()):
        return mode_label({"loss": loss}, overrides)

    # the field's presets train mode=decoupled with their own options: the preset names them
    assert label({"mode": "decoupled"}, ["+preset=gspo", "seed=0"]) == "gspo"
    assert label({"mode": "decoupled"}, ["+preset=decoupled"]) == "decoupled"
    assert label({"mode": "segment_wise"}, []) == "segment_wise"
    # each drift clip κ is a mode of its own, whatever preset set it
    assert label({"mode": "segment_wise", "drift_clip": 4.0}, ["+preset=segment_wise_drift"]) == "segment_wise_drift(κ=4)"
    # a mode of yours is named by its function, never by its path
    assert label({"mode": "/x/own.py:tempered"}, []) == "tempered"
