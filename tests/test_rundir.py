"""sdp_cli/rundir.py owns the run-directory layout: its names are the documented ones, and a
real run writes exactly the paths RunDir names."""

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from sdp_cli.rundir import (
    RunDir,
    parse_step_name,
    parse_version_name,
    step_name,
    version_dirs,
    version_name,
)

from .fast_run import FAST, train_run


def test_the_layout_is_the_documented_one():
    # the names of docs/training.md "Run directory", written out by hand
    run = RunDir(Path("r"))
    assert run.config == Path("r/config.yaml")
    assert run.overrides == Path("r/overrides.json")
    assert run.config_source == Path("r/config_source.json")
    assert (run.metrics, run.events, run.ledger) == (
        Path("r/metrics.jsonl"),
        Path("r/events.jsonl"),
        Path("r/ledger.jsonl"),
    )
    assert run.summary == Path("r/summary.json")
    assert run.checkpoint(50) == Path("r/checkpoints/step-000050")
    assert run.batch(7) == Path("r/batches/step-000007.safetensors")
    assert run.version(12) == Path("r/versions/v000012")
    assert run.weights_of(3) == Path("r/weights/v000003")
    assert run.launch_weights == Path("r/weights/launch")
    assert (run.tensorboard, run.logs) == (Path("r/tensorboard"), Path("r/logs"))


@given(st.integers(0, 10**8))
def test_names_parse_back(n):
    assert parse_step_name(step_name(n)) == n
    assert parse_version_name(version_name(n)) == n


def test_other_names_are_not_steps_or_versions():
    for name in ("latest", "step-", "step-12a", ".tmp-step-000001-x", "v", "vx1", "v000012.tmp", "V1"):
        assert parse_step_name(name) is None and parse_version_name(name) is None
    # a short spelling is still that version (so that a caller can refuse a duplicate)
    assert parse_version_name("v12") == 12


def test_version_dirs_groups_the_spellings_of_one_version(tmp_path):
    for name in ("v000001", "v1", "v000002", "notes"):
        (tmp_path / name).mkdir()
    (tmp_path / "v000003").write_text("a file, not a directory")
    found = version_dirs(tmp_path)
    assert sorted(found) == [1, 2]
    assert sorted(p.name for p in found[1]) == ["v000001", "v1"]


def test_a_real_run_writes_exactly_the_paths_rundir_names(tmp_path):
    path = train_run(
        tmp_path,
        [
            *FAST,
            "+preset=segment_wise",
            "train.steps=2",
            "train.checkpoint_every=1",
            "train.save_batches=true",
            "train.keep_version_checkpoints=true",
        ],
    )
    run = RunDir(path)
    named = {run.config, run.identity, run.overrides, run.metrics, run.events, run.ledger, run.summary, run.lock}
    named |= {run.checkpoints, run.batches, run.versions}
    assert set(path.iterdir()) == named
    assert run.finished
    # two checkpoints kept, the newest named by `latest`; one batch per step; versions 0..2
    assert set(run.checkpoints.iterdir()) == {
        run.checkpoint(1),
        run.checkpoint(2),
        run.checkpoints / "latest",
    }
    assert (run.checkpoints / "latest").read_text().strip() == run.checkpoint(2).name
    assert sorted(run.batches.iterdir()) == [run.batch(1), run.batch(2)]
    assert sorted(version_dirs(run.versions)) == [0, 1, 2]
    assert all(run.version(v).is_dir() for v in (0, 1, 2))
