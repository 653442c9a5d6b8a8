"""Experiment trackers (run.trackers): the same scalars and the config land in TensorBoard, W&B
(offline) and MLflow (a file store under tmp), a resume continues the same runs, secrets never
leave, a missing extra is one line, and a tracker failing mid-run does not stop training."""

from __future__ import annotations

import io
import json
import math
import sys
import time
from pathlib import Path

import pytest
import yaml

from sdp_cli.config.compose import compose_config
from sdp_cli.errors import UserError
from sdp_cli.rundir import RunDir
from sdp_cli.train.session import trackers as trackers_mod
from sdp_cli.train.session.run import run_training
from sdp_cli.train.session.trackers import (
    REDACTED,
    Trackers,
    active_trackers,
    check_installed,
    finite_scalars,
    flatten,
    redacted_config,
)

from .conftest import FAST
from .tracker_readers import mlflow_run, tensorboard_scalars, wandb_offline

ALL = "run.trackers=[tensorboard,wandb,mlflow]"
TB_ON = "run.tensorboard=true"  # FAST turns it off
SECRET = "s3cret-token-value"


# ------------------------------------------------------------------ units
def test_redacted_config_masks_server_env_and_url_passwords():
    config = {
        "engine": {
            "env": {"HF_TOKEN": SECRET, "OMP_NUM_THREADS": "2"},
            "urls": ["http://alice:" + SECRET + "@127.0.0.1:8000/v1", "http://127.0.0.1:9000"],
            "api_key_env": "MY_KEY",  # a variable's name, not its value: kept
        },
        "task": {"path": "data.jsonl"},
    }
    out = redacted_config(config)
    assert out["engine"]["env"] == {"HF_TOKEN": REDACTED, "OMP_NUM_THREADS": REDACTED}
    assert out["engine"]["urls"] == ["http://alice:<redacted>@127.0.0.1:8000/v1", "http://127.0.0.1:9000"]
    assert out["engine"]["api_key_env"] == "MY_KEY" and out["task"] == {"path": "data.jsonl"}
    assert config["engine"]["env"]["HF_TOKEN"] == SECRET  # the input is not changed


def test_flatten_and_finite_scalars():
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}}) == {"a.b": 1, "a.c.d": [1, 2], "e": {}}
    row = {"x": 1.5, "n": 3, "nan": math.nan, "inf": math.inf, "none": None, "flag": True, "s": "t"}
    assert finite_scalars(row) == {"x": 1.5, "n": 3.0}


def test_active_trackers_follow_the_older_switch():
    assert active_trackers(["tensorboard", "wandb", "tensorboard"], True) == ["tensorboard", "wandb"]
    assert active_trackers(["tensorboard", "mlflow"], False) == ["mlflow"]  # run.tensorboard=false


def test_missing_extra_is_one_line_naming_it(monkeypatch):
    monkeypatch.setitem(trackers_mod.OPTIONAL_PACKAGES, "wandb", ("sdp_no_such_module_xyz", "wandb"))
    with pytest.raises(UserError) as err:
        check_installed(["tensorboard", "wandb"])
    message = str(err.value)
    assert "\n" not in message and "pip install 'sdp-cli[wandb]'" in message and "run.trackers" in message


def test_unknown_tracker_is_refused_by_config():
    with pytest.raises(UserError, match=r"run.trackers='neptune' is not valid; choose one of tensorboard, wandb, mlflow"):
        compose_config(["run.trackers=[tensorboard,neptune]"])


class _Recorder:
    def __init__(self, name, fail_at=None):
        self.name, self.fail_at, self.rows, self.closed = name, fail_at, [], None

    def log(self, step, metrics):
        if step == self.fail_at:
            raise ConnectionError("server went away\nsecond line")
        self.rows.append((step, metrics))

    def close(self, ok):
        self.closed = ok


def test_a_failing_tracker_warns_once_and_the_others_go_on():
    good, bad, err = _Recorder("good"), _Recorder("bad", fail_at=2), io.StringIO()
    trackers = Trackers([good, bad], stream=err)
    for step in (1, 2, 3):
        trackers.log(step, {"loss": float(step), "skip": math.nan})
    trackers.close()
    assert good.rows == [(1, {"loss": 1.0}), (2, {"loss": 2.0}), (3, {"loss": 3.0})]
    assert bad.rows == [(1, {"loss": 1.0})] and bad.closed is None  # dropped at step 2
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and "bad failed while logging (ConnectionError: server went away)" in lines[0]


@pytest.mark.parametrize("text", ['["abc"]', '{"wandb": 3}', '"abc"'])
def test_saved_run_ids_that_are_not_an_object_of_strings_are_one_line(tmp_path, text):
    path = tmp_path / "trackers.json"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        trackers_mod.saved_ids(path)
    assert str(err.value) == f"{path} is not a JSON object of run ids; delete it to start new tracker runs"


@pytest.mark.parametrize(("error", "why"), [(RuntimeError(), "RuntimeError"), (OSError("no network\nat host"), "OSError: no network")])
def test_a_tracker_failing_to_start_is_one_line_with_its_first_line(tmp_path, monkeypatch, error, why):
    """The exception's type and the first line of its message; a message-less one by its type
    alone (it read "RuntimeError: RuntimeError")."""

    class Failing:
        def __init__(self, *args, **kwargs):
            raise error

    monkeypatch.setattr(trackers_mod, "WandbTracker", Failing)
    with pytest.raises(UserError) as err:
        trackers_mod.open_trackers(["wandb"], RunDir(tmp_path / "run"), project="p", config={})
    assert str(err.value) == f"run.trackers: wandb could not start ({why}); log in with `wandb login`, or set WANDB_MODE=offline"


def test_a_resumed_wandb_run_gets_no_step_below_its_last(tmp_path, monkeypatch):
    """W&B refuses a step below a resumed run's last one, with a warning per call: sdp drops
    those rows itself (a resume that restarts from an earlier checkpoint repeats steps)."""
    logged = []

    class Run:
        id, step = "r1", 5

        def log(self, metrics, step):
            logged.append(step)

    class Settings:
        def __init__(self, **kwargs):
            pass

    fake = type(sys)("wandb")
    fake.init, fake.Settings = (lambda **kwargs: Run()), Settings
    monkeypatch.setitem(sys.modules, "wandb", fake)
    tracker = trackers_mod.WandbTracker(RunDir(tmp_path), project="p", config={}, run_id="r1")
    for step in (3, 4, 5, 6):
        tracker.log(step, {"loss": 1.0})
    assert logged == [5, 6]


def test_mlflow_stamps_each_metric_in_milliseconds(tmp_path, offline_trackers):
    from mlflow import MlflowClient

    tracker = trackers_mod.MlflowTracker(RunDir(tmp_path / "run"), project="p", config={"a": 1}, run_id=None)
    before = time.time() * 1000
    tracker.log(7, {"loss": 0.5})
    after = time.time() * 1000
    tracker.close(ok=True)
    (entry,) = MlflowClient().get_metric_history(tracker.run_id, "loss")
    assert entry.step == 7 and entry.value == 0.5 and before - 1 <= entry.timestamp <= after + 1


# ------------------------------------------------------------ end to end
@pytest.fixture
def offline_trackers(tmp_path, monkeypatch):
    """W&B offline, MLflow in a file store under tmp; returns the MLflow tracking URI."""
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return uri


def _train(run: Path, *overrides: str, accepted: tuple[str, ...] = ()) -> dict:
    args = [*FAST, ALL, TB_ON, f"run.dir={run}", *overrides]
    cfg, raw = compose_config(args, accepted=accepted)
    return run_training(cfg, raw, overrides=args)


def _rows(run: RunDir) -> dict[int, dict[str, float]]:
    """step → finite scalars of metrics.jsonl (the reference every tracker must match)."""
    rows: dict[int, dict[str, float]] = {}
    for line in run.metrics.read_text().splitlines():
        row = json.loads(line)
        step = row.pop("step")
        row.pop("time")
        rows.setdefault(step, {}).update(finite_scalars(row))
    return rows


def _assert_same(expected, got, *, rel, name):
    assert sorted(got) == sorted(expected), f"{name}: steps differ"
    for step, scalars in expected.items():
        assert sorted(got[step]) == sorted(scalars), f"{name}: keys differ at step {step}"
        for key, value in scalars.items():
            assert got[step][key] == pytest.approx(value, rel=rel, abs=1e-6), f"{name}: {key} at step {step}"


def test_same_scalars_and_config_in_every_tracker(tmp_path, offline_trackers):
    run = RunDir(tmp_path / "run")
    # a launched server's key, which the local engine does not read: accepted as a config file
    # or a run begun before that check may hold it, so that the config every tracker logs has it
    secret = f"+engine.env.HF_TOKEN={SECRET}"
    _train(run.path, "train.steps=3", "train.eval_samples=4", secret, accepted=(secret,))
    expected = _rows(run)
    assert sorted(expected) == [0, 1, 2, 3] and "eval/greedy_accuracy" in expected[0]
    assert "reward/mean" in expected[3]

    tb, tb_config = tensorboard_scalars(run.tensorboard)
    _assert_same(expected, tb, rel=1e-6, name="tensorboard")  # TensorBoard stores float32
    wb, wb_config, wb_ids = wandb_offline(run.path)
    _assert_same(expected, wb, rel=1e-12, name="wandb")
    ml, ml_params, ml_config, ml_id = mlflow_run(offline_trackers, run.path.name)
    _assert_same(expected, ml, rel=1e-12, name="mlflow")

    # the config: the same keys and values everywhere as in config.yaml, the secret masked
    saved = yaml.safe_load(run.config.read_text())
    assert saved["engine"]["env"] == {"HF_TOKEN": SECRET}  # the run directory's own copy
    masked = redacted_config(saved)
    assert yaml.safe_load(tb_config.replace("\n    ", "\n").strip()) == masked
    assert {k: wb_config[k] for k in saved} == masked
    assert yaml.safe_load(ml_config) == masked
    assert ml_params["loss.mode"] == "decoupled" and ml_params["run.trackers"] == "[tensorboard, wandb, mlflow]"
    assert ml_params["engine.max_model_len"] == "null"
    assert json.loads(run.trackers.read_text()) == {"wandb": wb_ids[0], "mlflow": ml_id}

    # nothing secret in what the trackers stored
    for root in (run.path / "wandb", run.tensorboard, tmp_path / "mlruns"):
        for path in root.rglob("*"):
            if path.is_file():
                assert SECRET.encode() not in path.read_bytes(), path


def test_resume_continues_the_same_tracker_runs(tmp_path, offline_trackers):
    run = RunDir(tmp_path / "run")
    _train(run.path, "train.steps=2", "train.checkpoint_every=1")
    first = json.loads(run.trackers.read_text())
    resume = [f"resume={run.path}", "train.steps=4"]
    cfg, raw = compose_config(resume)
    run_training(cfg, raw, overrides=resume)
    assert json.loads(run.trackers.read_text()) == first
    ml, _, _, ml_id = mlflow_run(offline_trackers, run.path.name)
    assert ml_id == first["mlflow"] and sorted(ml) == [1, 2, 3, 4]
    _, _, wb_ids = wandb_offline(run.path)
    assert wb_ids == [first["wandb"], first["wandb"]]  # two sessions, one W&B run
    tb, _ = tensorboard_scalars(run.tensorboard)
    assert sorted(tb) == [1, 2, 3, 4]
