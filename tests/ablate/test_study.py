"""A study's file, its check against a sweep's plan, and its registration in the sweep directory."""

import json

import pytest
import yaml

from sdp_cli.ablate.study import (
    Primary,
    Study,
    builtin_study_path,
    check_registration,
    check_study,
    read_registration,
    read_study_file,
    register,
)
from sdp_cli.ablate.sweep import available_sweeps, plan_sweep
from sdp_cli.errors import UserError

ETA = "rollout.max_head_offpolicyness"
MODES = ["decoupled", "segment_wise", "segment_wise_drift(κ=4)"]
AXES = {"+preset": ["decoupled", "segment_wise", "segment_wise_drift_k4"], ETA: ["1", "8"], "seed": ["0", "1"]}


def _study(**keys):
    return Study.from_mapping(keys, "s.yaml")


def test_a_study_file_with_every_key(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(
        "metric: acc_end\nbaseline: decoupled\n"
        "primary: {treatment: segment_wise, at: {rollout.max_head_offpolicyness: 8}}\n"
        "margin: 0.05\nalpha: 0.01\npower: 0.9\n"
    )
    study = read_study_file(path)
    assert study == Study("acc_end", "decoupled", Primary("segment_wise", ((ETA, "8"),)), 0.05, 0.01, 0.9)
    # an empty file is the default study: final reward against decoupled, no primary, no margin
    (tmp_path / "empty.yaml").write_text("")
    assert read_study_file(tmp_path / "empty.yaml") == Study("reward_last", "decoupled", None, None, 0.05, 0.8)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"margn": 0.1}, "s.yaml: unknown key 'margn'; the keys are metric, baseline, primary, margin, alpha, power"),
        ({"metric": "accuracy"}, "s.yaml: metric 'accuracy' is not one of reward_last, acc_end"),
        ({"alpha": 0.5}, "s.yaml: alpha must be a number between 0 and 0.5 (exclusive), got 0.5"),
        ({"power": True}, "s.yaml: power must be a number between 0 and 1 (exclusive), got True"),
        ({"margin": 0}, "s.yaml: margin must be a number > 0, got 0"),
        ({"margin": "0.05"}, "s.yaml: margin must be a number > 0, got '0.05'"),
        ({"baseline": ["decoupled"]}, "s.yaml: baseline must be a mode label"),
        ({"primary": "segment_wise"}, "s.yaml: primary is a mapping of treatment and at"),
        ({"primary": {"treatment": "segment_wise", "cell": {}}}, "s.yaml: unknown key 'primary.cell'"),
        ({"primary": {"at": {ETA: 8}}}, "s.yaml: primary.treatment must be a mode label"),
        ({"primary": {"treatment": ""}}, "s.yaml: primary.treatment must be a mode label"),
        ({"primary": {"treatment": 3}}, "s.yaml: primary.treatment must be a mode label"),
        ({"primary": {"treatment": "decoupled"}}, "s.yaml: primary.treatment is the baseline decoupled"),
        ({"primary": {"treatment": "segment_wise", "at": {ETA: [1, 8]}}}, "s.yaml: primary.at maps swept keys"),
    ],
)
def test_a_bad_study_is_one_line(keys, message):
    with pytest.raises(UserError) as info:
        _study(**keys)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_a_study_file_that_is_no_yaml_mapping(tmp_path):
    (tmp_path / "list.yaml").write_text("- metric\n")
    with pytest.raises(UserError, match=r"list.yaml: a study is a mapping of metric, baseline"):
        read_study_file(tmp_path / "list.yaml")
    (tmp_path / "bad.yaml").write_text("metric: [\n")
    with pytest.raises(UserError, match=r"bad.yaml:2: not valid YAML"):
        read_study_file(tmp_path / "bad.yaml")
    with pytest.raises(UserError, match=r"^--study .*none.yaml: cannot read"):
        read_study_file(tmp_path / "none.yaml")
    with pytest.raises(UserError) as info:
        read_study_file(tmp_path)  # the OS's reason, not its whole exception
    assert str(info.value) == f"--study {tmp_path}: cannot read (Is a directory); pass a study YAML file"


def test_the_primary_cell_matches_values_as_hydra_and_yaml_spell_them():
    primary = Primary("segment_wise", ((ETA, "8"), ("optim.lr", "0.0003")))
    assert primary.matches(8, ["optim.lr=3e-4"])
    assert not primary.matches(8, ["optim.lr=1e-4"])
    assert not primary.matches(4, ["optim.lr=3e-4"])
    assert not primary.matches(8, [])  # a key the cell does not have
    assert primary.describe("decoupled") == "segment_wise − decoupled at η = 8, optim.lr = 0.0003"


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"baseline": "decoupld"}, "baseline 'decoupld' is not a mode of this sweep (decoupled, segment_wise, "),
        ({"primary": {"treatment": "segment_wise_drift_k4"}}, "primary.treatment 'segment_wise_drift_k4' is not a mode"),
        ({"primary": {"treatment": "segment_wise", "at": {ETA: 4}}}, f"primary.at {ETA}=4 is not in this sweep ({ETA} ∈ 1, 8)"),
        ({"primary": {"treatment": "segment_wise", "at": {ETA: 8, "optim.lr": 1}}}, "primary.at names optim.lr, which this sweep does not sweep"),
        ({"primary": {"treatment": "segment_wise", "at": {}}}, f"primary.at must give a value of every swept key; add {ETA}"),
        ({"primary": {"treatment": "segment_wise", "at": {"seed": 0, ETA: 8}}}, "primary.at names seed, which this sweep does not sweep"),
    ],
)
def test_a_study_that_does_not_fit_the_sweep_is_one_line(keys, message):
    with pytest.raises(UserError) as info:
        check_study(_study(**keys), MODES, AXES, "study s.yaml")
    text = str(info.value)
    assert text.startswith(f"study s.yaml: {message}") and "\n" not in text
    assert "--no-study" in text


def test_a_cell_in_a_sweep_of_modes_and_seeds_alone_names_no_axes():
    with pytest.raises(UserError) as info:
        check_study(_study(primary={"treatment": "segment_wise", "at": {ETA: 8}}), MODES, {"+preset": ["x"], "seed": ["0"]}, "s")
    assert f"primary.at names {ETA}, which this sweep does not sweep (its axes: none but the mode and the seed)" in str(info.value)


def test_a_study_that_fits():
    check_study(_study(primary={"treatment": "segment_wise_drift(κ=4)", "at": {ETA: 8.0}}), MODES, AXES, "s")
    # a sweep with one η has no cell key to name
    check_study(_study(primary={"treatment": "segment_wise"}), MODES, {"+preset": ["x"], "seed": ["0"]}, "s")


def test_the_smoke_sweeps_study_fits_its_plan(tmp_path):
    # default's and harsh's: tests/ablate/test_ablate.py, which plans them anyway
    study = read_study_file(builtin_study_path("smoke"))
    plan = plan_sweep("smoke", [], tmp_path)
    check_study(study, plan.modes, plan.axes, "smoke")
    assert study.primary == Primary("segment_wise", ((ETA, "2"),))


def test_a_study_file_is_no_hydra_config_of_the_sweep_group():
    # the study lives beside the sweep: `+ablate=default` never sees it, and it is no sweep
    assert "study" not in available_sweeps()
    assert builtin_study_path("nope") is None


def test_registration_is_written_once_and_never_replaced(tmp_path):
    study = _study(metric="acc_end", margin=0.05, primary={"treatment": "segment_wise", "at": {ETA: 8}})
    check_registration(tmp_path, study)  # nothing registered yet
    path = register(tmp_path, study, "conf/s.yaml")
    data = json.loads(path.read_text())
    assert data["study"]["primary"] == {"treatment": "segment_wise", "at": {ETA: "8"}}
    assert data["source"] == "conf/s.yaml" and data["registered"].endswith("+00:00")
    assert read_registration(tmp_path).study == study
    # the same study again (re-running the sweep command): the first registration stays
    register(tmp_path, study, "elsewhere.yaml")
    assert json.loads(path.read_text()) == data
    # another study: refused, naming the first key that differs
    with pytest.raises(UserError) as info:
        check_registration(tmp_path, _study(metric="acc_end", margin=0.02))
    assert str(info.value).startswith(f"{path} registered another study (primary: ")
    assert "pass a new --dir" in str(info.value) and "\n" not in str(info.value)


def test_a_damaged_registration_is_one_line(tmp_path):
    (tmp_path / "study.json").write_text("{")
    with pytest.raises(UserError, match=r"study.json: not a study record of sdp ablate; restore it or delete it"):
        read_registration(tmp_path)
    (tmp_path / "study.json").write_text(json.dumps({"study": {"metric": "x"}, "source": "s", "registered": "t"}))
    with pytest.raises(UserError, match=r"study.json: metric 'x' is not one of"):
        read_registration(tmp_path)


def test_every_shipped_sweep_has_a_study_file():
    # plain YAML with only the study's keys (no Hydra package header)
    for sweep in available_sweeps():
        data = yaml.safe_load(builtin_study_path(sweep).read_text())
        assert set(data) <= {"metric", "baseline", "primary", "margin", "alpha", "power"}, sweep
