"""Numbers the docs state about what sdp does (issue 24, item 14), checked against the code that
produces them: the tiny model's parameter count in docs/training.md's sample output, and how
many problems the accuracy column of docs/ablate.md is measured on."""

from __future__ import annotations

from pathlib import Path

import yaml

from sdp_cli.models import load_policy
from sdp_cli.tasks import build_task
from sdp_cli.train.session.policy_setup import describe_policy

DOCS = Path(__file__).resolve().parents[2] / "docs"
ABLATE_CONF = Path(__file__).resolve().parents[2] / "sdp_cli" / "conf" / "ablate"


def test_the_sample_loading_line_has_the_tiny_models_parameter_count(tmp_path, monkeypatch):
    """docs/training.md said 0.1 M; the default tiny model on arith1 has 1.06 M parameters."""
    monkeypatch.setenv("SDP_CACHE_DIR", str(tmp_path))
    shown = describe_policy(load_policy("tiny", task="arith1", warm_start_steps=0)).split(", ")[-1]
    assert shown == "1.1 M parameters"
    line = next(l for l in (DOCS / "training.md").read_text().splitlines() if l.startswith("loading model: tiny"))
    assert f", {shown} (" in line, line


def test_the_accuracy_column_names_the_problems_it_is_measured_on():
    """docs/ablate.md said 200 problems: the sweeps ask for 200 (smoke for 32), but arith1's
    greedy evaluation draws from its held-out problems only, and it holds out 21."""
    held_out = len(build_task("arith1").eval_items(10**6, seed=0))
    asked = {p.stem: yaml.safe_load(p.read_text())["train"]["eval_samples"] for p in ABLATE_CONF.glob("*.yaml")}
    assert held_out < min(asked.values())  # so every sweep evaluates all held-out problems
    row = next(l for l in (DOCS / "ablate.md").read_text().splitlines() if l.startswith("| acc |"))
    assert f"holds out {held_out}, all {held_out}" in row, row
    assert f"smoke for {asked['smoke']}" in row and f"ask for {asked['default']}" in row, row
