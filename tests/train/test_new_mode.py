"""A new correction mode is one registered function plus one YAML (docs/design.md §4, "Adding a
mode"): toy modes registered here, with a config in a temporary --config-dir, train two steps on
the embedded engine, and inspect-weights, the trainer's shadow metrics, the ablate report and
`sdp recompute` all take them from the registry, without any other file changing.

The toy weights are the built-in ones to the power ½ (half the log ratio), so every number is
tied to a built-in one by hand: max w^½ = (max w)^½ (a monotone map keeps the maximum), the mean
of w^½ is at most (mean w)^½ (Jensen), and kl = mean(−log w) halves."""

import csv
import json
import math
from pathlib import Path

import pytest

from sdp_cli.ablate.report import metrics, write_report
from sdp_cli.analysis import recompute as rc
from sdp_cli.analysis.inspect import analyse_batches
from sdp_cli.analysis.recompute_plan import RecomputeOptions
from sdp_cli.config.compose import compose_config, config_source
from sdp_cli.core.weights import drift_log_factor
from sdp_cli.modes import register_mode, unregister
from sdp_cli.errors import UserError
from sdp_cli.rollout.batch_file import write_batch
from sdp_cli.train.session.run import run_training

from ..analysis.test_inspect import batch_with_an_unrecomputed_token
from ..analysis.test_recompute_logic import SEQS, FakeScorer, fake_logprob, make_batch, version_dirs
from ..cli.run_main import run_main
from .conftest import FAST

TOY_MODES = ("half_decoupled", "half_segment_wise")


@pytest.fixture
def toy_modes():
    """half_decoupled: w = (π_prox/π_behav)^½, reads π_prox. half_segment_wise: w =
    (π_prox_t/π_behav)^½, reads π_prox_t and takes a drift clip (times the clipped drift factor,
    as segment_wise does). Both anchored at π_prox."""

    @register_mode("half_decoupled", needs=("proximal_logprobs",), anchor="proximal")
    def half(old, proximal, proximal_t, mask):
        return 0.5 * (proximal - old)

    @register_mode(
        "half_segment_wise", needs=("proximal_logprobs_t",), anchor="proximal", params=("drift_clip",)
    )
    def half_segment_wise(old, proximal, proximal_t, mask, drift_clip=None):
        log_ratio = 0.5 * (proximal_t - old)
        return log_ratio if drift_clip is None else log_ratio + drift_log_factor(proximal, proximal_t, drift_clip)[0]

    try:
        yield
    finally:
        for name in TOY_MODES:
            unregister(name)  # the registry is process-wide: leave it as it was


def test_a_registered_mode_with_one_yaml_trains_and_the_ablate_report_has_its_columns(tmp_path, toy_modes):
    conf = tmp_path / "conf"
    (conf / "mode").mkdir(parents=True)
    (conf / "mode" / "half_decoupled.yaml").write_text("# @package _global_\nloss:\n  mode: half_decoupled\n")
    source = config_source(conf, None)
    # run.root is a sweep's runs/ so that the ablate report reads this run as a sweep of one
    overrides = [*FAST, "mode=half_decoupled", "train.steps=2", f"run.root={tmp_path}/sweep/runs"]
    cfg, raw = compose_config(overrides, source=source)
    assert cfg.loss.mode == "half_decoupled"
    summary = run_training(cfg, raw, overrides=overrides, source=source)
    rows = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss/pg_loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        dec, half = "shadow/decoupled/rollout_is_", "shadow/half_decoupled/rollout_is_"
        # the toy weight is measured as a shadow like the built-in ones (raw, same tokens):
        # max w^½ = (max w)^½; mean w^½ <= (mean w)^½ (Jensen)
        assert row[f"{half}max"] == pytest.approx(math.sqrt(row[f"{dec}max"]), rel=1e-5)
        assert row[f"{half}mean"] <= math.sqrt(row[f"{dec}mean"]) + 1e-6
        # the trained weight is the toy weight, bounded by loss.weight_cap, which does not bind
        # here: the same mean
        assert row[f"{half}max"] < cfg.loss.weight_cap  # so the cap does not bind
        assert row["weights/rollout_is_mean"] == pytest.approx(row[f"{half}mean"], rel=1e-5)
        assert "recompute/tokens" not in row  # it reads π_prox only: no recompute pass runs
        # π_prox_t is not tracked in this run: no weight that reads it is measured
        assert not any(k.startswith(("shadow/segment_wise", "shadow/half_segment_wise")) for k in row)

    report = write_report(tmp_path / "sweep", plots=False)
    written = {path.name: path for path in report.written}
    (group,) = list(csv.DictReader(written["summary.csv"].open()))
    assert group["mode"] == "half_decoupled"
    # the run's largest weight over both steps: max over steps of each step's max, so again
    # the square root of the decoupled column
    assert float(group["w_half_decoupled_max_mean"]) == pytest.approx(
        math.sqrt(float(group["w_dec_max_mean"])), rel=1e-5
    )
    assert group["w_half_decoupled_std_mean"] and group["w_half_decoupled_ess_mean"]
    # the columns of weights this run could not measure exist and are empty, as for built-ins
    assert group["w_half_segment_wise_std_mean"] == group["w_segment_wise_std_mean"] == ""
    # a registered mode that takes a drift clip has a drift-clipped weight, with its own
    # κ-clipped share beside the built-in one's (named "drift_clipped")
    assert group["half_segment_wise_drift_clipped_mean"] == group["drift_clipped_mean"] == ""
    assert "w_half_segment_wise_drift_std_mean" in group
    markdown = written["summary.md"].read_text()
    assert " std half_decoupled |" in markdown
    # the κ-clipped columns' labels: the built-in one's short, a registered mode's named
    labels = {m.key: m.label for m in metrics()}
    assert labels["drift_clipped"] == "κ-clipped"
    assert labels["half_segment_wise_drift_clipped"] == "κ-clipped half_segment_wise_drift"
    assert "pooled std of the half_decoupled weight" in markdown


def test_an_unregistered_mode_is_refused_in_one_line(tmp_path):
    conf = tmp_path / "conf"
    (conf / "mode").mkdir(parents=True)
    (conf / "mode" / "nowhere.yaml").write_text("# @package _global_\nloss:\n  mode: nowhere\n")
    with pytest.raises(UserError, match="loss.mode='nowhere' is not valid; choose one of bypass, decoupled, segment_wise"):
        compose_config(["mode=nowhere"], source=config_source(conf, None))


def test_inspect_weights_has_a_row_for_every_registered_mode(capsys, toy_modes):
    code, out, err = run_main(["inspect-weights", "--example", "--json"], capsys)
    assert code == 0, err
    modes = json.loads(out)["modes"]
    # the registry's order, each mode that takes a drift clip followed by its drift-clipped row
    assert list(modes) == [
        "bypass", "decoupled", "segment_wise", "segment_wise_drift",
        "half_decoupled", "half_segment_wise", "half_segment_wise_drift",
    ]
    dec, seg = modes["decoupled"], modes["segment_wise"]
    half_dec, half_seg = modes["half_decoupled"], modes["half_segment_wise"]
    # coverage from the registry's needs: π_prox covers every token, π_prox_t leaves out the
    # stale tokens without π_{v+1}, as for the built-in modes
    assert half_dec["tokens"] == dec["tokens"] and half_seg["tokens"] == seg["tokens"]
    assert modes["half_segment_wise_drift"]["tokens"] == seg["tokens"]
    assert half_dec["target"] == half_seg["target"] == "π_behav·w"
    for half, full in ((half_dec, dec), (half_seg, seg)):
        for level in ("token", "sequence", "geometric"):
            # w^½ at every level: a sequence's Π w_t^½ = (Π w_t)^½, geometric likewise
            assert half["weights"][level]["max"] == pytest.approx(math.sqrt(full["weights"][level]["max"]), rel=1e-5)
            assert half["weights"][level]["min"] == pytest.approx(math.sqrt(full["weights"][level]["min"]), rel=1e-5)
        # kl = mean(−log w) over the same tokens: half the log ratio, half the kl
        assert half["divergence"]["kl"] == pytest.approx(full["divergence"]["kl"] / 2, rel=1e-4)
    code, out, err = run_main(["inspect-weights", "--example"], capsys)
    assert code == 0, err
    assert "half_segment_wise_drift" in out and "π_behav·w" in out


def test_inspect_weights_covers_what_a_registered_mode_reads(toy_modes):
    # w_dec = 4 on both tokens; the first lacks π_{v+1}, so a weight that reads π_prox_t leaves
    # it out (docs/design.md §2)
    r = analyse_batches([batch_with_an_unrecomputed_token()], ["x"])
    half_dec, half_seg = r.modes["half_decoupled"], r.modes["half_segment_wise"]
    assert (half_dec.tokens, half_seg.tokens, r.modes["half_segment_wise_drift"].tokens) == (2, 1, 1)
    # w = 4^½ = 2 on both tokens; 2^½ on the one token with π_{v+1}
    assert half_dec.weights["token"]["mean"] == pytest.approx(2.0, rel=1e-6)
    assert half_seg.weights["token"]["mean"] == pytest.approx(math.sqrt(2.0), rel=1e-6)


def test_recompute_fills_what_a_registered_mode_reads(tmp_path, toy_modes):
    path = tmp_path / "batches" / "b.safetensors"
    path.parent.mkdir()
    write_batch(path, make_batch(3, SEQS))  # trainer version c = 3, no π_prox stored
    run = version_dirs(tmp_path / "run" / "versions", range(0, 4)).parent

    def recompute(*modes):
        return rc.recompute([path], run, lambda b: FakeScorer(), RecomputeOptions(modes=modes)).outcomes[0]

    # half_decoupled reads π_prox: scored under each batch's trainer version, c = 3 (the fake
    # scorer's value names version and position: output token 8 is position 1 of sequence B)
    filled = recompute("half_decoupled")
    assert filled.proximal_version == 3
    assert filled.batch.proximal_logprobs[8].item() == pytest.approx(fake_logprob(3, 1), abs=1e-6)
    # half_segment_wise reads π_prox_t only (always recomputed): π_prox is left alone
    only_t = recompute("half_segment_wise")
    assert only_t.proximal_version is None and only_t.batch.proximal_logprobs is None
    assert only_t.proximal_t.tokens > 0
    # its drift-clipped weight reads π_prox as well
    assert recompute("half_segment_wise_drift").proximal_version == 3


def test_recompute_names_the_registered_modes_when_refusing_one(tmp_path, capsys, toy_modes):
    code, _, err = run_main(["recompute", str(tmp_path), "--checkpoints", str(tmp_path), "--mode", "nowhere"], capsys)
    assert code != 0
    assert "--mode 'nowhere' is not a registered mode; choose one of bypass, decoupled, segment_wise, " \
        "segment_wise_drift, half_decoupled, half_segment_wise, half_segment_wise_drift" in err


def test_a_batch_saved_under_a_registered_mode_reads_back(tmp_path, toy_modes):
    # The batch header's mode is checked against the registry, not the built-in names: a run of a
    # registered mode with train.save_batches=true writes batches that inspect-weights can read.
    import dataclasses

    from sdp_cli.rollout.batch_file import read_batch

    path = tmp_path / "b.safetensors"
    write_batch(path, dataclasses.replace(make_batch(3, SEQS), mode="half_decoupled"))
    assert read_batch(path).mode == "half_decoupled"
