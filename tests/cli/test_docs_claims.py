"""Numbers the docs state about what sdp does (issue 24, item 14), checked against the code that
produces them: the tiny model's parameter count in docs/training.md's sample output, and how
many problems the accuracy column of docs/ablate.md is measured on."""

from __future__ import annotations

from pathlib import Path

from sdp_cli.ablate.sweep import available_sweeps
from sdp_cli.config.compose import compose_config
from sdp_cli.models import load_policy
from sdp_cli.tasks import build_task
from sdp_cli.train.session.policy_setup import describe_policy

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_the_sample_loading_line_has_the_tiny_models_parameter_count(tmp_path, monkeypatch):
    """docs/training.md said 0.1 M; the default tiny model on arith1 has 1.06 M parameters."""
    monkeypatch.setenv("SDP_CACHE_DIR", str(tmp_path))
    shown = describe_policy(load_policy("tiny", task="arith1", warm_start_steps=0)).split(", ")[-1]
    assert shown == "1.1 M parameters"
    line = next(l for l in (DOCS / "training.md").read_text().splitlines() if l.startswith("loading model: tiny"))
    assert f", {shown} (" in line, line


def test_the_accuracy_column_names_the_problems_it_is_measured_on():
    """docs/ablate.md said 200 problems: the arith1 sweeps ask for 200 (smoke for 32), but arith1's
    greedy evaluation draws from its held-out problems only, and it holds out 21. The runsum
    studies (s1-s4) ask for 200 of runsum's held-out sequences, which it has thousands of."""
    held_out = len(build_task("arith1").eval_items(10**6, seed=0))
    asked, runsum = {}, {}
    for sweep in available_sweeps():
        # s5 trains a model from a directory the user names; its path does not matter here
        extra = ["model.path=/models/smollm2-135m"] if sweep == "s5" else []
        cfg, _ = compose_config([f"+ablate={sweep}", *extra])
        if cfg.task.name == "arith1":
            asked[sweep] = cfg.train.eval_samples
        elif cfg.task.name == "runsum":
            runsum[sweep] = cfg.train.eval_samples
    assert {"default", "harsh", "smoke"} <= asked.keys() and {"s1", "s2", "s3u", "s3m", "s4"} <= runsum.keys()
    assert held_out < min(asked.values())  # so every arith1 sweep evaluates all held-out problems
    # 6 digits: about a fifth of 10^6 sequences held out, far more than any study asks for
    assert max(runsum.values()) <= len(build_task("runsum").eval_items(max(runsum.values()), seed=0))
    row = next(l for l in (DOCS / "ablate.md").read_text().splitlines() if l.startswith("| acc |"))
    assert f"holds out {held_out}, all {held_out}" in row, row
    assert f"smoke for {asked['smoke']}" in row and f"ask for {asked['default']}" in row, row
    assert f"runsum studies: {runsum['s1']} of its held-out sequences" in row, row
