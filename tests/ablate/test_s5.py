"""`sdp ablate s5` (issue 22, S5): its data file, the plan it makes, and one job of each mode
trained for two steps on a tiny Hugging Face model standing in for SmolLM2-135M-Instruct.

The real sweep is a benchmark (docs/results.md "S5"),
not CI: here only the machinery is checked, with the sweep's own config.
"""

import json
import re
from pathlib import Path

import pytest
import yaml

from sdp_cli.ablate.sweep import NEW, plan_sweep, run_job
from sdp_cli.ablate.study import Primary, builtin_study_path, check_study, read_study_file
from sdp_cli.config.compose import compose_config
from sdp_cli.errors import UserError
from sdp_cli.models import load_policy, save_policy
from sdp_cli.tasks import build_task

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "sdp_cli" / "data" / "digits_chat.jsonl"
SWEEP = ROOT / "sdp_cli" / "conf" / "ablate" / "s5.yaml"
QUESTION = re.compile(r"What is (\d) (plus|times) (\d)\? Answer with just the number\.")


def test_every_record_is_a_single_digit_sum_or_product_with_its_answer():
    records = [json.loads(line) for line in DATA.read_text().splitlines()]
    seen = set()
    for record in records:
        match = QUESTION.fullmatch(record["prompt"])
        assert match, record
        a, op, b = int(match[1]), match[2], int(match[3])
        # the answer computed here, from the question's own words
        assert record["answer"] == str(a + b if op == "plus" else a * b), record
        seen.add((a, op, b))
    # every pair of digits once per operation: 10 · 10 · 2 = 200 distinct questions
    assert len(records) == len(seen) == 200


def test_a_fifth_is_held_out_and_never_trained_on():
    task = build_task("dataset", path=str(DATA), reward="final_number", eval_fraction=0.2)
    train = {item.prompt for item in task.items}
    held_out = {item.prompt for item in task.eval_items(1000, seed=0)}
    assert (len(train), len(held_out)) == (160, 40)  # round(200 · 0.2) = 40
    assert not train & held_out


def test_without_model_path_the_sweep_stops_in_one_line(tmp_path):
    with pytest.raises(UserError, match="model=hf needs model.path=") as err:
        plan_sweep("s5", [], tmp_path)
    assert "\n" not in str(err.value)


def test_the_plan_is_two_modes_at_eta_8_by_three_seeds_with_sequence_weights(tmp_path):
    plan = plan_sweep("s5", ["model.path=/models/smollm2-135m"], tmp_path)
    assert plan.axes == {
        "+preset": ["decoupled", "segment_wise"],
        "rollout.max_head_offpolicyness": ["8"],
        "seed": ["0", "1", "2"],
    }
    assert len(plan.jobs) == 6 and {job.state for job in plan.jobs} == {NEW}
    assert plan.modes == {"decoupled", "segment_wise"}
    # the seeds differ in nothing else: one job of each mode stands for its three
    for job in (j for j in plan.jobs if j.overrides[2] == "seed=0"):
        cfg, _ = compose_config(job.train_overrides())
        assert (cfg.model.kind, cfg.model.path) == ("hf", "/models/smollm2-135m")
        assert (cfg.task.name, cfg.task.reward, cfg.task.chat_template) == ("dataset", "final_number", True)
        assert (ROOT / cfg.task.path).resolve() == DATA
        assert cfg.rollout.max_head_offpolicyness == 8
        assert cfg.loss.is_level == "sequence"
        # the shadow weights need the recompute pass in every mode
        assert cfg.rollout.recompute == "always"
        assert cfg.train.eval_every > 0 and cfg.train.eval_samples > 0
    # one run at a time: η = 8 gives generation and training a core each
    assert yaml.safe_load(SWEEP.read_text())["hydra"]["launcher"]["n_jobs"] == 1
    study = read_study_file(builtin_study_path("s5"))
    check_study(study, plan.modes, plan.axes, "s5")
    assert (study.metric, study.baseline, study.margin) == ("reward_last", "decoupled", 0.05)
    assert study.primary == Primary("segment_wise", (("rollout.max_head_offpolicyness", "8"),))


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A tiny Qwen2 with a printable-ASCII tokenizer and a chat template, saved as an HF directory."""
    path = tmp_path_factory.mktemp("hf") / "tiny"
    policy = load_policy(
        "tiny", task="arith1", charset="ascii", warm_start_steps=0, seed=1,
        hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64,
    )
    save_policy(policy, path)
    return path


@pytest.mark.parametrize("mode", ["decoupled", "segment_wise"])
def test_one_job_of_each_mode_trains_with_the_sweeps_config(tmp_path, monkeypatch, tiny_hf, mode):
    monkeypatch.chdir(ROOT)  # task.path is relative to the repository root, as documented
    monkeypatch.setenv("SDP_CACHE_DIR", str(tmp_path / "cache"))
    short = [f"model.path={tiny_hf}", "train.steps=2", "train.eval_every=1", "train.eval_samples=3", "seed=0"]
    plan = plan_sweep("s5", [*short, f"+preset={mode}"], tmp_path / "sweep")
    (job,) = plan.jobs
    assert run_job(plan.sweep_dir, list(job.overrides)) == "trained"
    rows = [json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in trained] == [1, 2]
    # both behavioural weights measured on the same tokens whatever the mode trains with
    assert all("shadow/decoupled/rollout_is_mean" in r and "shadow/segment_wise/rollout_is_mean" in r for r in trained)
    # sequence-level weights: the trained ESS is over one weight per completion
    assert all("weights/rollout_is_seq_eff_sample_size" in r for r in trained)
    evals = [r["step"] for r in rows if "eval/greedy_accuracy" in r]
    assert evals[0] == 0 and evals[-1] == 2
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert summary["steps"] == 2
    config = yaml.safe_load((job.run_dir / "config.yaml").read_text())
    assert config["loss"]["mode"] == mode and config["loss"]["is_level"] == "sequence"
