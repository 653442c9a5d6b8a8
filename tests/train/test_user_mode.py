"""A correction mode from your own file (``loss.mode=path/to/file.py:function``, docs/design.md
"Adding a mode"): it trains, it is measured in the shadow metrics, inspect-weights and recompute
take it from the command line, and a bad one is one line before anything is written.

The shipped example (examples/own_mode/tempered.py) is the decoupled weight to the power ½, so
its numbers are tied to decoupled's by hand: max w^½ = (max w)^½ and mean w^½ ≤ (mean w)^½."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from sdp_cli.modes import MODES, load_user_mode, resolve_mode, unregister

from ..cli.run_main import run_main
from .conftest import FAST

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_mode" / "tempered.py"
SPEC = f"{EXAMPLE}:tempered_decoupled"


def _write(tmp_path: Path, body: str) -> str:
    path = tmp_path / "my_mode.py"
    path.write_text("from sdp_cli.modes import mode\nimport torch\n\n" + body)
    return str(path)


def test_a_mode_from_a_file_trains_and_is_measured_like_a_built_in_one(tmp_path, capsys, forget_user_modes):
    root = tmp_path / "runs"
    code, _, err = run_main(
        ["train", *FAST, "train.steps=2", f"run.root={root}", f"loss.mode={SPEC}", "train.save_batches=true"], capsys
    )
    assert code == 0, err
    (run,) = root.iterdir()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss/pg_loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        dec, own = "shadow/decoupled/rollout_is_", "shadow/tempered_decoupled/rollout_is_"
        # w^½: the maximum is the square root of decoupled's; the mean at most (Jensen)
        assert row[f"{own}max"] == pytest.approx(math.sqrt(row[f"{dec}max"]), rel=1e-5)
        assert row[f"{own}mean"] <= math.sqrt(row[f"{dec}mean"]) + 1e-6
        # it is the weight trained (the cap of 5 does not bind a square root of these ratios)
        assert row[f"{own}max"] < 5
        assert row["weights/rollout_is_mean"] == pytest.approx(row[f"{own}mean"], rel=1e-5)
    # the saved batches name the mode; inspect-weights adds its row when told the file
    code, out, err = run_main(["inspect-weights", run / "batches", "--json", "--mode", SPEC], capsys)
    assert code == 0, err
    modes = json.loads(out)["modes"]
    assert "tempered_decoupled" in modes
    own, full = modes["tempered_decoupled"], modes["decoupled"]
    assert own["tokens"] == full["tokens"]
    assert own["weights"]["token"]["max"] == pytest.approx(math.sqrt(full["weights"]["token"]["max"]), rel=1e-5)


def test_a_batch_names_a_mode_of_yours_without_importing_it(tmp_path, capsys, forget_user_modes):
    # inspect-weights without --mode reads the batch and gives no row for the unknown mode
    root = tmp_path / "runs"
    code, _, err = run_main(
        ["train", *FAST, "train.steps=1", f"run.root={root}", f"loss.mode={SPEC}", "train.save_batches=true"], capsys
    )
    assert code == 0, err
    unregister("tempered_decoupled")
    (run,) = root.iterdir()
    code, out, err = run_main(["inspect-weights", run / "batches", "--json"], capsys)
    assert code == 0, err
    assert "tempered_decoupled" not in json.loads(out)["modes"]


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ("def weight(old, proximal, proximal_t, mask):\n    return proximal - old\n", "is not declared as a mode"),
        (
            "@mode(needs=('proximal_logprobs',))\ndef weight(old, proximal, proximal_t, mask):\n    return (proximal - old)[:, :1]\n",
            "of shape (2, 1); return a float tensor of the log-probs' shape (2, 3)",
        ),
        (
            "@mode(needs=('proximal_logprobs',))\ndef weight(old, proximal, proximal_t, mask):\n"
            "    return (proximal - old) * float('nan')\n",
            "returned nan at a valid token",
        ),
        (
            "@mode(needs=('proximal_logprobs',))\ndef weight(old, proximal, proximal_t, mask):\n"
            "    return (proximal - old).requires_grad_()\n",
            "requires a gradient",
        ),
        (
            "@mode(needs=('proximal_logprobs',))\ndef weight(old, proximal, proximal_t, mask):\n    return 1 / 0\n",
            "ZeroDivisionError: division by zero in loss.mode=",
        ),
        ("@mode(needs=('pi_theta',))\ndef weight(old, proximal, proximal_t, mask):\n    return old\n", "is not valid"),
        (
            "@mode(needs=('proximal_logprobs',), name='decoupled')\ndef weight(old, proximal, proximal_t, mask):\n"
            "    return old\n",
            "the name 'decoupled' is taken by a built-in mode",
        ),
        ("@mode(needs=('proximal_logprobs',))\ndef weight(old, proximal, proximal_t, mask)\n    return old\n", "SyntaxError"),
        (
            "@mode(needs=('proximal_logprobs',))\ndef weight(old, proximal, proximal_t, mask):\n    return None\n",
            "returned None although it declares",
        ),
    ],
    ids=["undeclared", "shape", "nan", "grad", "raises", "bad-needs", "name-taken", "syntax", "none"],
)
def test_a_bad_mode_of_yours_is_one_line_naming_the_file_and_nothing_is_written(
    tmp_path, capsys, body, problem, forget_user_modes
):
    spec = f"{_write(tmp_path, body)}:weight"
    root = tmp_path / "runs"
    code, out, err = run_main(["train", *FAST, "train.steps=1", f"run.root={root}", f"loss.mode={spec}"], capsys)
    assert code == 2
    line = err.strip()
    assert "\n" not in line and problem in line and "my_mode.py" in line, line
    assert not root.exists()


def test_a_mode_that_breaks_its_contract_during_training_stops_the_step_in_one_line(tmp_path, forget_user_modes):
    # the small-batch check passes (no NaN there); a real batch makes it NaN: refused at the step
    body = (
        "@mode(needs=('proximal_logprobs',))\ndef weight(old, proximal, proximal_t, mask):\n"
        "    return torch.where(old < -3, float('nan'), proximal - old)\n"
    )
    spec = _write(tmp_path, body) + ":weight"
    mode = load_user_mode(spec)
    import torch

    from sdp_cli.errors import UserError

    old = torch.tensor([[-4.0, -1.0]])
    with pytest.raises(UserError, match=r"returned nan at a valid token"):
        mode.log_ratio(old, old, None, torch.tensor([[True, True]]))
    # NaN at a padding position is no error: padding holds anything
    assert mode.log_ratio(old, old, None, torch.tensor([[False, True]])).shape == (1, 2)


def test_an_edited_file_is_loaded_again_and_replaces_the_old_version(tmp_path, forget_user_modes):
    import os

    import torch

    path = _write(tmp_path, "@mode(needs=('proximal_logprobs',))\ndef weight(old, proximal, proximal_t, mask):\n    return proximal - old\n")
    first = resolve_mode(f"{path}:weight")
    Path(path).write_text(Path(path).read_text().replace("return proximal - old", "return 2 * (proximal - old)"))
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    second = resolve_mode(f"{path}:weight")
    assert first.name == second.name == "weight" and MODES["weight"] is second
    old, prox = torch.zeros(1, 2), torch.ones(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    assert torch.equal(second.log_ratio(old, prox, None, mask), torch.full((1, 2), 2.0))


def test_a_mode_from_an_importable_module_trains(tmp_path, capsys, monkeypatch, forget_user_modes):
    # the other spec form docs/design.md names: package.module:function, found on sys.path (no file
    # to stamp, so it is imported once per process)
    import torch

    package = tmp_path / "lab_modes"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "halved.py").write_text(
        "from sdp_cli.modes import mode\n\n"
        "@mode(needs=('proximal_logprobs',), name='halved_decoupled')\n"
        "def halved(old, proximal, proximal_t, mask):\n    return 0.5 * (proximal - old)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    own = load_user_mode("lab_modes.halved:halved")
    assert own.name == "halved_decoupled" and MODES["halved_decoupled"] is own
    assert load_user_mode("lab_modes.halved:halved") is own
    old = torch.tensor([[-1.0, -2.0]])
    assert torch.equal(own.log_ratio(old, old + 1.0, None, torch.ones(1, 2, dtype=torch.bool)), torch.full((1, 2), 0.5))
    root = tmp_path / "runs"
    code, _, err = run_main(
        ["train", *FAST, "train.steps=1", f"run.root={root}", "loss.mode=lab_modes.halved:halved"], capsys
    )
    assert code == 0, err
    (run,) = root.iterdir()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("shadow/halved_decoupled/rollout_is_mean" in row for row in rows)


def test_recompute_takes_a_mode_of_yours_from_the_command_line(tmp_path, capsys, forget_user_modes):
    code, _, err = run_main(["recompute", tmp_path, "--checkpoints", tmp_path, "--mode", SPEC], capsys)
    # the mode is accepted; what fails is the empty batch directory, named in one line
    assert "is not a registered mode" not in err
    assert "tempered_decoupled" in MODES
    assert code != 0 and "\n" not in err.strip()


def test_the_ablate_report_has_a_row_for_a_mode_of_yours_and_its_columns_when_told_the_file(
    tmp_path, capsys, forget_user_modes
):
    import csv

    # a run under a sweep's runs/ is a sweep of one for the report
    root = tmp_path / "sweep" / "runs"
    code, _, err = run_main(["train", *FAST, "train.steps=2", f"run.root={root}", f"loss.mode={SPEC}"], capsys)
    assert code == 0, err
    unregister("tempered_decoupled")  # a fresh report process knows nothing of the file
    code, _, err = run_main(["ablate", "--report", tmp_path / "sweep", "--no-plots", "--mode", SPEC], capsys)
    assert code == 0, err
    (group,) = list(csv.DictReader((tmp_path / "sweep" / "summary.csv").open()))
    assert group["mode"] == "tempered_decoupled"
    # its shadow's largest weight is the square root of decoupled's, as in the run's metrics
    assert float(group["w_tempered_decoupled_max_mean"]) == pytest.approx(math.sqrt(float(group["w_dec_max_mean"])), rel=1e-5)


def test_a_resume_never_imports_a_mode_file_that_only_the_runs_files_name(tmp_path, capsys, forget_user_modes):
    # the mode's file leaves a mark each time it is imported
    marks = tmp_path / "imported"
    path = tmp_path / "marking.py"
    path.write_text(
        "from pathlib import Path\nfrom sdp_cli.modes import mode\n"
        f"with open({str(marks)!r}, 'a') as f:\n    f.write('x')\n\n"
        "@mode(needs=('proximal_logprobs',))\ndef marking(old, proximal, proximal_t, mask):\n    return proximal - old\n"
    )
    run = tmp_path / "run"
    code, _, err = run_main(["train", *FAST, "train.steps=1", f"run.dir={run}", f"loss.mode={path}:marking"], capsys)
    assert code == 0, err
    unregister("marking")
    imported = marks.read_text()
    code, _, err = run_main(["train", f"resume={run}", "train.steps=2"], capsys)
    assert code == 2 and "loss.mode" in err and "pass loss.mode=... again" in err, err
    assert marks.read_text() == imported  # refused before the file was imported
    # named again on the command line, the resume runs it
    code, _, err = run_main(["train", f"resume={run}", "train.steps=2", f"loss.mode={path}:marking"], capsys)
    assert code == 0, err


def test_a_mode_of_yours_that_raises_on_a_saved_batch_is_one_line_naming_its_line(tmp_path, capsys, forget_user_modes):
    # the check before use passes (first call); the call on the batch raises: inspect-weights
    # says where in your file, as a run does, instead of a traceback
    spec = _write(
        tmp_path,
        "CALLS = []\n\n@mode(needs=('proximal_logprobs',))\ndef weight(old, proximal, proximal_t, mask):\n"
        "    CALLS.append(1)\n    if len(CALLS) > 1:\n        raise KeyError('k')\n    return proximal - old\n",
    ) + ":weight"
    code, _, err = run_main(["inspect-weights", "--example", "--mode", spec], capsys)
    assert code == 2 and "Traceback" not in err, err
    assert err.strip() == f"error: {tmp_path / 'my_mode.py'}:10: KeyError: 'k' in loss.mode={spec}; fix the function", err
