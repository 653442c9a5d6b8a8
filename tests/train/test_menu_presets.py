"""The field's corrections as presets (`+preset=gspo|m2po|icepop|decoupled_k3_rs|opsm|cispo|dppo|a3po`,
docs/math.md §9): each trains a few real asynchronous steps, and what it logs (or saves) holds the
relation its definition fixes."""

from __future__ import annotations

import json

import pytest
import torch

from sdp_cli.analysis.inspect import MaskOptions, analyse_batches

from ..fast_run import FAST, train_run

#: a warm start that leaves reward variance (the smoke sweep's), η = 2 and several optimizer steps
#: per batch: the policy moves, the weights leave 1 and the PPO ratio moves
ASYNC = ["model.warm_start_steps=60", "model.warm_start_lr=3e-3", "rollout.max_head_offpolicyness=2", "optim.ppo_epochs=2", "optim.minibatches=2", "optim.lr=3e-3", "train.steps=4"]


def _rows(run):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss/pg_loss" in r]


def test_m2po_keeps_the_batch_second_moment_below_its_threshold(tmp_path):
    run = train_run(tmp_path, [*FAST, "+preset=m2po", *ASYNC, "loss.m2_threshold=0.001", "train.save_batches=true"])
    rows = _rows(run)
    assert len(rows) == 4
    for row in rows:
        # what is kept has a mean lr² below τ, or a single token is left
        assert row["m2po/m2_after"] < 0.001 or row["m2po/masked_fraction"] > 0.9
        assert row["m2po/m2_after"] <= row["m2po/m2_before"]
    assert any(row["m2po/masked_fraction"] > 0 for row in rows)
    # the saved loss mask is M2PO's kept set: inspect-weights --m2-threshold drops nothing more from it
    for batch in _batches(run):
        report = analyse_batches([batch], ["b"], masks=MaskOptions(m2_threshold=0.001))
        assert report.modes["decoupled"].masks["m2po"] == 0.0


def test_icepop_masks_token_weights_outside_its_band(tmp_path):
    rows = _rows(train_run(tmp_path, [*FAST, "+preset=icepop", *ASYNC, "loss.weight_floor=0.99", "loss.weight_cap=1.01"]))
    for row in rows:
        # every weight left is inside [0.99, 1.01] or 0 (masked)
        assert row["weights/rollout_is_max"] <= 1.01
        assert row["weights/rollout_is_min"] == 0.0 or row["weights/rollout_is_min"] >= 0.99
    assert any(row["weights/rollout_is_masked_fraction"] > 0 for row in rows)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_gspo_clips_whole_sequences(tmp_path, level):
    rows = _rows(train_run(tmp_path, [*FAST, "+preset=gspo", *ASYNC, f"loss.is_level={level}"]))
    # the paper's ε = 3e-4/4e-4 clips most sequences after a batch's first optimizer step
    assert any(row["loss/pg_clipfrac"] > 0 for row in rows)
    for row in rows:
        # the trained weight's ESS is reported at the level it trains with: at the sequence
        # level that is the per-sequence ESS, at the token level the token ESS
        key = "weights/rollout_is_eff_sample_size" if level == "token" else "weights/rollout_is_seq_eff_sample_size"
        assert row["weights/trained_ess"] == row[key]
        assert 0 < row["weights/trained_ess"] <= 1 and 0 < row["weights/trained_ess_raw"] <= 1


def _batches(run):
    from sdp_cli.rollout.batch_file import read_batch

    return [read_batch(p) for p in sorted((run / "batches").glob("*.safetensors"))]


#: one optimizer step per batch: θ = π_prox at that step, so a per-step mask (OPSM) is what
#: inspect-weights measures on the saved batch
ONE_STEP = ["model.warm_start_steps=60", "model.warm_start_lr=3e-3", "rollout.max_head_offpolicyness=2", "optim.lr=3e-3", "train.steps=4", "train.save_batches=true"]


def test_decoupled_k3_rs_rejects_exactly_the_sequences_whose_mean_k3_is_above_the_threshold(tmp_path):
    upper = 2e-3
    run = train_run(tmp_path, [*FAST, "+preset=decoupled_k3_rs", *ONE_STEP, f"loss.rejection.upper={upper}"])
    rows = _rows(run)
    assert any(r["rejection/rollout_rs_seq_masked_fraction"] > 0 for r in rows)
    for row in rows:  # verl's preset has no behavioural weight: held at 1
        assert row["weights/rollout_is_mean"] == 1.0 and row["weights/rollout_is_std"] == 0.0
    outcomes = set()
    for batch in _batches(run):
        padded = batch.to_padded()
        response = torch.arange(padded.mask.shape[1]) < padded.response_lens.unsqueeze(-1)
        # verl's k3 written out in float64: e^lr − 1 − lr, lr = log π_prox − log π_behav, row mean
        lr = (padded.proximal_logprobs - padded.old_logprobs).double() * response
        k3 = (torch.exp(lr) - 1 - lr) * response
        mean = k3.sum(-1) / response.sum(-1)
        kept = padded.mask.any(-1)
        clear = (mean - upper).abs() > 1e-6  # float32 inputs: leave the rows on the threshold out
        assert torch.equal(kept[clear], (mean <= upper)[clear])
        outcomes |= set(kept[clear].tolist())
    assert outcomes == {True, False}  # rows on both sides of the threshold were checked
    # inspect-weights with the same bounds rejects nothing more from the saved (kept) rows; a batch
    # that kept none has no share to report
    options = MaskOptions(rejection_level="geometric", rejection_metric="k3", rejection_upper=upper)
    for batch in _batches(run):
        expected = 0.0 if batch.to_padded().mask.any() else None
        assert analyse_batches([batch], ["b"], masks=options).modes["decoupled"].masks["rejection"] == expected


def test_opsm_drops_what_inspect_weights_measures_on_the_saved_batch(tmp_path):
    run = train_run(tmp_path, [*FAST, "+preset=opsm", *ONE_STEP, "loss.opsm_delta=0.0"])
    rows = _rows(run)
    assert any(r["opsm/masked_fraction"] > 0 for r in rows)
    for row, batch in zip(rows, _batches(run), strict=True):
        # a group's advantages sum to 0, so it holds a row with A ≥ 0, which OPSM never drops
        assert row["opsm/seq_masked_fraction"] < 1
        report = analyse_batches([batch], ["b"], masks=MaskOptions(opsm_delta=0.0))
        assert row["opsm/masked_fraction"] == pytest.approx(report.modes["decoupled"].masks["opsm"], abs=1e-9)
        # and the loss drops those rows: at θ = π_prox (r = 1) it is −Σ A·w·keep over all N tokens,
        # w = clamp(π_prox/π_behav, 0.2, 5), keep = 0 where A < 0 and mean(log π_behav − log π_prox) > 0
        p = batch.to_padded()
        m = p.mask.double()
        lr = (p.proximal_logprobs - p.old_logprobs).double() * m
        w = lr.exp().clamp(0.2, 5.0)
        drift = -lr.sum(-1, keepdim=True) / m.sum(-1, keepdim=True)
        keep = ~((drift > 0) & (p.advantages < 0))
        expected = (-p.advantages.double() * w * keep * m).sum() / m.sum()
        assert row["loss/pg_loss"] == pytest.approx(float(expected), rel=1e-5, abs=1e-7)


def test_cispo_caps_the_ratio_weight_and_never_floors_it(tmp_path):
    rows = _rows(train_run(tmp_path, [*FAST, "+preset=cispo", *ASYNC, "loss.clip_high=0.01"]))
    assert any(row["loss/pg_clipfrac_high"] > 0 for row in rows)
    for row in rows:
        assert row["loss/pg_clipfrac_low"] == 0.0  # clip = 1: the band's floor 1 − 1 = 0 is below every ratio


def test_dppo_trains_against_the_behaviour_policy_with_its_trust_region(tmp_path):
    rows = _rows(train_run(tmp_path, [*FAST, "+preset=dppo", *ASYNC, "loss.clip=0.01", "loss.clip_high=0.01"]))
    assert any(row["loss/pg_clipfrac"] > 0 for row in rows)
    for row in rows:
        assert "offpolicy/kl" not in row  # anchored at π_behav: no π_prox forward
        assert row["loss/pg_clipfrac"] == pytest.approx(row["loss/pg_clipfrac_high"] + row["loss/pg_clipfrac_low"])


def test_a3po_interpolates_by_the_staleness_of_the_saved_batch(tmp_path):
    run = train_run(tmp_path, [*FAST, "+preset=a3po", *ONE_STEP, "optim.ppo_epochs=2"])
    rows = _rows(run)
    assert any(row["a3po/alpha_mean"] > 0 for row in rows)
    for row, batch in zip(rows, _batches(run), strict=True):
        assert "offpolicy/kl" not in row  # no π_prox forward
        assert batch.proximal_logprobs is None
        # α = (k − 1)/k for a token k ≥ 1 versions stale, 0 below, averaged over the batch's tokens
        # (one minibatch: every optimizer step sees them all)
        padded = batch.to_padded()
        k = (batch.trainer_version - padded.versions[padded.mask]).double()
        assert row["a3po/alpha_mean"] == pytest.approx(float(((k - 1) / k.clamp_min(1)).clamp_min(0).mean()))
        assert 0 < row["weights/trained_ess"] <= 1
