"""`sdp_cli.analysis.inspect` on hand-made batches: every number below is worked out by hand from
the weights the batch was built with (docs/math.md §2, §4), plus invariants between the modes.

The batch ``hand_batch`` (trainer version c = 3) is built from chosen weights, not logprobs:
every token has log π_behav = ln 0.1, log π_prox_t = ln 0.1 + ln w_seg, log π_prox = ln 0.1 +
ln w_dec, so that w_seg = π_prox_t/π_behav (the segment-wise weight), w_dec = π_prox/π_behav and
the factor segment-wise drops is w_dec / w_seg.

    sequence A (prompt 2 tokens):  token  lag  w_dec  w_seg  dropped
                                   a0     2    4      2      2
                                   a1     1    0.5    0.5    1       (π_prox_t := π_prox, lag-1 fill)
                                   a2     0    1      1      1       (π_prox_t := π_behav = π_prox)
    sequence B (prompt 1 token):   b0     2    0.25   1      0.25
                                   b1     1    2      2      1
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load, save

from sdp_cli.analysis.inspect import MISSING_PROXIMAL_FIX, MaskOptions, WeightOptions, analyse_batches, dump_tensors
from sdp_cli.rollout.batch_file import SavedBatch
from sdp_cli.rollout.records import RolloutSample

LN_B = math.log(0.1)
C = 3
# (lag, w_dec, w_seg) per output token
SEQ_A = [(2, 4.0, 2.0), (1, 0.5, 0.5), (0, 1.0, 1.0)]
SEQ_B = [(2, 0.25, 1.0), (1, 2.0, 2.0)]


Tokens = list[tuple[int, float, float]]


def sample(prompt_len: int, tokens: Tokens, c: int) -> tuple[RolloutSample, list[float]]:
    """A sample whose output tokens have the given (lag, w_dec, w_seg), and its π_prox list.

    Tokens with lag ≥ 1 carry π_prox_t of version v + 1; lag-0 tokens keep π_prox_t = π_behav.
    """
    s = RolloutSample(prompt_ids=list(range(1, prompt_len + 1)))
    prox = []
    for i, (lag, w_dec, w_seg) in enumerate(tokens):
        v = c - lag
        s.append_tokens([10 + i], [LN_B], v)
        if lag >= 1:
            s.set_proximal_t(i, LN_B + math.log(w_seg), v + 1)
        else:
            assert w_seg == 1.0
        prox.append(LN_B + math.log(w_dec))
    return s, prox


def batch_of(seqs: list[tuple[int, Tokens]], c: int = C, with_prox: bool = True) -> SavedBatch:
    built = [sample(p, toks, c) for p, toks in seqs]
    return SavedBatch.from_samples(
        [s for s, _ in built],
        trainer_version=c,
        temperature=1.0,
        model="tiny",
        mode="segment_wise",
        proximal_logprobs=[p for _, p in built] if with_prox else None,
    )


def hand_batch(with_prox: bool = True) -> SavedBatch:
    return batch_of([(2, SEQ_A), (1, SEQ_B)], with_prox=with_prox)


def approx(x: float) -> object:
    # float32 logprobs: exp(p − b) is exact to a few float32 ulps
    return pytest.approx(x, rel=2e-6, abs=1e-6)


def ess(mean: float, std: float) -> float:
    return mean * mean / (mean * mean + std * std)


# ------------------------------------------------------------------------ modes
def test_decoupled_weights_by_hand():
    r = analyse_batches([hand_batch()], ["hand"])
    dec = r.modes["decoupled"]
    assert dec.available and dec.tokens == 5
    # token: w = {4, 0.5, 1, 0.25, 2}; mean 7.75/5 = 1.55; mean w² = 21.3125/5 = 4.2625,
    # var = 4.2625 − 1.55² = 1.86.
    t = dec.weights["token"]
    assert t["mean"] == approx(1.55)
    assert t["std"] == approx(math.sqrt(1.86))
    assert (t["min"], t["max"]) == (approx(0.25), approx(4.0))
    assert t["ess"] == approx(1.55**2 / 4.2625)
    assert t["frac_high"] == t["frac_low"] == 0.0
    # sequence: A = 4·0.5·1 = 2 on 3 tokens, B = 0.25·2 = 0.5 on 2 tokens (token-weighted):
    # mean (6 + 1)/5 = 1.4, mean w² (12 + 0.5)/5 = 2.5, var 2.5 − 1.96 = 0.54.
    s = dec.weights["sequence"]
    assert s["mean"] == approx(1.4)
    assert s["std"] == approx(math.sqrt(0.54))
    assert (s["min"], s["max"]) == (approx(0.5), approx(2.0))
    assert s["ess"] == approx(1.96 / 2.5)
    # geometric: A = 2^(1/3) (mean of ln 4, ln 0.5, 0), B = 0.5^(1/2) (mean of ln 0.25, ln 2).
    g = dec.weights["geometric"]
    a, b = 2 ** (1 / 3), 2**-0.5
    assert g["mean"] == approx((3 * a + 2 * b) / 5)
    assert (g["min"], g["max"]) == (approx(b), approx(a))


def test_segment_wise_weights_by_hand():
    r = analyse_batches([hand_batch()], ["hand"])
    seg = r.modes["segment_wise"]
    # token: w = {2, 0.5, 1, 1, 2}: mean 1.3, mean w² 10.25/5 = 2.05, var 2.05 − 1.69 = 0.36.
    t = seg.weights["token"]
    assert (t["mean"], t["std"], t["ess"]) == (approx(1.3), approx(0.6), approx(1.69 / 2.05))
    # sequence: A = 2·0.5·1 = 1 on 3 tokens, B = 1·2 = 2 on 2 tokens: mean 7/5 = 1.4,
    # mean w² (3 + 8)/5 = 2.2, var 0.24.
    s = seg.weights["sequence"]
    assert (s["mean"], s["std"]) == (approx(1.4), approx(math.sqrt(0.24)))
    assert (s["min"], s["max"]) == (approx(1.0), approx(2.0))


def test_bypass_is_the_reference():
    r = analyse_batches([hand_batch()], ["hand"], WeightOptions(cap=0.5, floor=0.1))
    for level, stats in r.modes["bypass"].weights.items():
        # w ≡ 1 and never bounded, whatever --cap says (bypass has no behavioural weight)
        assert [stats[k] for k in ("mean", "std", "min", "max", "ess")] == [1, 0, 1, 1, 1], level
        assert stats["frac_high"] == 0.0
    assert r.modes["bypass"].divergence == {"kl": 0.0, "k3_kl": 0.0, "chi2_token": 0.0, "chi2_seq": 0.0}
    # shown as 0, never as −0 (the mean of an all-zero log ratio negated)
    assert all(math.copysign(1.0, v) == 1.0 for v in r.modes["bypass"].divergence.values())


def test_divergences_by_hand():
    r = analyse_batches([hand_batch()], ["hand"])
    ln2 = math.log(2)
    # decoupled: lr = (2, −1, 0, −2, 1)·ln 2 sums to 0, so kl = −mean lr = 0 and
    # k3 = mean(w − 1 − lr) = 1.55 − 1; chi2_token = mean w² − 1 = 4.2625 − 1;
    # chi2_seq = mean over rows of (Π w)² − 1 = (2² + 0.5²)/2 − 1.
    d = r.modes["decoupled"].divergence
    assert d["kl"] == approx(0.0)
    assert d["k3_kl"] == approx(0.55)
    assert d["chi2_token"] == approx(3.2625)
    assert d["chi2_seq"] == approx(1.125)
    # segment-wise: lr = (1, −1, 0, 0, 1)·ln 2, sum ln 2: kl = −ln2/5, k3 = 1.3 − 1 − ln2/5,
    # chi2_token = 2.05 − 1, chi2_seq = (1² + 2²)/2 − 1.
    s = r.modes["segment_wise"].divergence
    assert s["kl"] == approx(-ln2 / 5)
    assert s["k3_kl"] == approx(0.3 - ln2 / 5)
    assert s["chi2_token"] == approx(1.05)
    assert s["chi2_seq"] == approx(1.5)


def test_bounds_truncate_and_mask():
    # decoupled token weights {4, 0.5, 1, 0.25, 2} into [0.4, 3]: 4 → 3 (high), 0.25 → 0.4 (low).
    r = analyse_batches([hand_batch()], ["hand"], WeightOptions(cap=3.0, floor=0.4))
    t = r.modes["decoupled"].weights["token"]
    assert t["mean"] == approx((3 + 0.5 + 1 + 0.4 + 2) / 5)
    assert (t["min"], t["max"]) == (approx(0.4), approx(3.0))
    assert (t["frac_high"], t["frac_low"]) == (approx(0.2), approx(0.2))
    # sequence weights A = 2, B = 0.5 lie inside [0.4, 3]: nothing bounded.
    assert r.modes["decoupled"].weights["sequence"]["frac_high"] == 0.0
    # mask: the two out-of-bounds tokens get 0 → mean (0.5 + 1 + 2)/5 = 0.7, 2 of 5 tokens masked.
    m = analyse_batches([hand_batch()], ["hand"], WeightOptions(cap=3.0, floor=0.4, action="mask"))
    t = m.modes["decoupled"].weights["token"]
    assert (t["mean"], t["min"], t["masked"]) == (approx(0.7), 0.0, approx(0.4))
    # sequence level with cap 1.5: A's weight 2 is above it — one of two sequences, 3 of 5 tokens.
    s = analyse_batches([hand_batch()], ["hand"], WeightOptions(cap=1.5, action="mask")).modes["decoupled"]
    assert s.weights["sequence"]["frac_high"] == approx(0.5)
    assert s.weights["sequence"]["masked"] == approx(0.6)


def test_batch_normalize():
    # token weights divided by their mean 1.55: mean 1, the factor reported.
    r = analyse_batches([hand_batch()], ["hand"], WeightOptions(batch_normalize=True))
    t = r.modes["decoupled"].weights["token"]
    assert t["mean"] == approx(1.0)
    assert t["batch_norm_factor"] == approx(1.55)
    assert t["max"] == approx(4 / 1.55)


# ------------------------------------------------------------------------- lags
def test_lag_breakdown_by_hand():
    rows = {row.lag: row for row in analyse_batches([hand_batch()], ["hand"]).lags}
    assert sorted(rows) == [0, 1, 2]
    assert [rows[k].tokens for k in (0, 1, 2)] == [1, 2, 2]
    # lag 2: w_dec {4, 0.25}: mean 2.125, std 1.875; w_segment_wise {2, 1}: mean 1.5, std 0.5;
    # dropped {2, 0.25}: mean 1.125, std 0.875.
    r2 = rows[2]
    assert (r2.w_dec["mean"], r2.w_dec["std"]) == (approx(2.125), approx(1.875))
    assert r2.w_dec["ess"] == approx(ess(2.125, 1.875))
    assert (r2.w_segment_wise["mean"], r2.w_segment_wise["std"], r2.w_segment_wise["ess"]) == (approx(1.5), approx(0.5), approx(0.9))
    assert (r2.dropped["mean"], r2.dropped["std"]) == (approx(1.125), approx(0.875))
    # lag 1: w_dec = w_segment_wise = {0.5, 2}: mean 1.25, std 0.75.
    r1 = rows[1]
    assert r1.w_dec == r1.w_segment_wise
    assert (r1.w_segment_wise["mean"], r1.w_segment_wise["std"]) == (approx(1.25), approx(0.75))
    assert r1.w_segment_wise["ess"] == approx(ess(1.25, 0.75))


def test_drift_clipped_row_by_hand():
    # w = w_segment_wise · clip(w_dec / w_segment_wise, 1/κ, κ) with κ = 1.5, token by token:
    #   a0: 2 · clip(2, ⅔, 1.5) = 3;  a1: 0.5 · 1 = 0.5;  a2: 1;  b0: 1 · clip(0.25) = ⅔;  b1: 2
    # mean (3 + 0.5 + 1 + ⅔ + 2)/5 = 43/30; drift factor clipped on a0 and b0 (both lag 2).
    r = analyse_batches([hand_batch()], ["hand"], WeightOptions(drift_clip=1.5))
    m = r.modes["segment_wise_drift"]
    assert m.available and m.tokens == 5
    tok = m.weights["token"]
    assert tok["mean"] == approx(43 / 30)
    assert (tok["min"], tok["max"]) == (approx(0.5), approx(3.0))
    # sequence level: the product over the row, A = 3·0.5·1 = 1.5, B = ⅔·2 = 4/3
    assert m.weights["sequence"]["max"] == approx(1.5) and m.weights["sequence"]["min"] == approx(4 / 3)
    rows = {row.lag: row for row in r.lags}
    assert rows[2].drift_clipped == 1.0 and rows[1].drift_clipped == 0.0 and rows[0].drift_clipped == 0.0
    # κ = 4 keeps every dropped factor here (2 and 0.25 are inside [0.25, 4]): the decoupled weights
    wide = analyse_batches([hand_batch()], ["hand"], WeightOptions(drift_clip=4.0))
    assert wide.modes["segment_wise_drift"].weights == wide.modes["decoupled"].weights
    # its target is no stored input but π_behav·w, here π_prox: the divergences are decoupled's
    # (whose log ratios are symmetric about 0, so the κ = 1 check below is the one a sign flip fails)
    for name, value in wide.modes["decoupled"].divergence.items():
        assert wide.modes["segment_wise_drift"].divergence[name] == approx(value), name
    assert all(row.drift_clipped == 0.0 for row in wide.lags)
    # κ = 1 is the segment-wise row
    narrow = analyse_batches([hand_batch()], ["hand"], WeightOptions(drift_clip=1.0))
    assert narrow.modes["segment_wise_drift"].weights == narrow.modes["segment_wise"].weights
    for name, value in narrow.modes["segment_wise"].divergence.items():  # kl = −ln 2 / 5, as by hand above
        assert narrow.modes["segment_wise_drift"].divergence[name] == approx(value), name
    # without π_prox there is no drift factor
    assert not analyse_batches([hand_batch(with_prox=False)], ["h"]).modes["segment_wise_drift"].available


def test_dropped_factor_is_exactly_one_at_lag_at_most_one():
    # π_c/π_{v+1} = π_c/π_c at lag 1 and π_prox/π_behav with π_prox = π_behav at lag 0: exactly 1.
    rows = {row.lag: row for row in analyse_batches([hand_batch()], ["hand"]).lags}
    for lag in (0, 1):
        assert rows[lag].dropped == {"mean": 1.0, "std": 0.0}
    assert rows[2].dropped["mean"] != 1.0


def test_dropped_factor_at_lag_zero_is_the_engine_trainer_mismatch():
    # A lag-0 token has π_prox_t := π_behav (the engine's π_c); when the trainer's π_c differs by
    # 1% the measured factor is that mismatch, 1.01, not 1 (docs/inspect-weights.md).
    (row,) = analyse_batches([batch_of([(1, [(0, 1.01, 1.0)])])], ["x"]).lags
    assert row.lag == 0 and row.dropped["mean"] == approx(1.01)


def test_missing_proximal_logprobs_makes_decoupled_unavailable():
    r = analyse_batches([hand_batch(with_prox=False)], ["b.safetensors"])
    dec = r.modes["decoupled"]
    assert not dec.available
    assert dec.reason.startswith("b.safetensors has no proximal_logprobs")
    assert "sdp recompute" in dec.reason and "train.save_batches=true" in MISSING_PROXIMAL_FIX
    assert all(row.w_dec is None and row.dropped is None for row in r.lags)
    # segment-wise does not need π_prox: same numbers as with it
    with_prox = analyse_batches([hand_batch()], ["h"])
    assert r.modes["segment_wise"].weights == with_prox.modes["segment_wise"].weights
    d = r.to_dict()["modes"]["decoupled"]
    assert d["available"] is False and d["weights"] is None


def test_the_missing_proximal_reason_names_the_first_file_and_counts_the_rest():
    batches = [hand_batch(with_prox=False)] * 3
    r = analyse_batches(batches, ["a.safetensors", "b.safetensors", "c.safetensors"])
    assert r.modes["decoupled"].reason.startswith("a.safetensors (and 2 more) has no proximal_logprobs (π_prox); ")
    one = analyse_batches([hand_batch(), hand_batch(with_prox=False)], ["a.safetensors", "b.safetensors"])
    assert one.modes["decoupled"].reason.startswith("b.safetensors has no proximal_logprobs")


def test_opsm_needs_advantages_and_reads_none_without_them():
    """OPSM masks on the advantage's sign: a batch saved without advantages has no OPSM column
    (None), never an error; one mask alone turns the masks' table on."""
    r = analyse_batches([hand_batch()], ["hand"], masks=MaskOptions(opsm_delta=0.0))
    assert r.mask_options.any and r.modes["decoupled"].masks == {"opsm": None}
    assert MaskOptions(m2_threshold=0.1).any and MaskOptions(rejection_level="token").any
    assert not MaskOptions().any


def test_several_batches_keep_their_own_trainer_version():
    # second batch at c = 5: one token of version 3 (lag 2, w_dec 8, w_segment_wise 2), one of version 5 (lag 0).
    other = batch_of([(3, [(2, 8.0, 2.0), (0, 1.0, 1.0)])], c=5)
    r = analyse_batches([hand_batch(), other], ["a", "b"])
    rows = {row.lag: row for row in r.lags}
    assert [rows[k].tokens for k in (0, 1, 2)] == [2, 2, 3]
    # lag 2 now holds w_dec {4, 0.25, 8}: mean 12.25/3.
    assert rows[2].w_dec["mean"] == approx(12.25 / 3)
    assert r.trainer_versions == [3, 5] and r.sequences == 3 and r.tokens == 7
    # one file missing π_prox makes decoupled unavailable for the whole set, naming that file
    r = analyse_batches([hand_batch(), batch_of([(1, SEQ_B)], with_prox=False)], ["a", "b"])
    assert r.modes["decoupled"].reason.startswith("b has no proximal_logprobs")


def batch_with_an_unrecomputed_token() -> SavedBatch:
    """c = 2; two output tokens of version 0 with π_behav = 0.1 and π_prox = 0.4 (w_dec = 4);
    only the second has π_prox_t of version 1 (0.2: w_seg = 2), the first was never recomputed
    (π_prox_t version 0, not 1)."""
    s = RolloutSample(prompt_ids=[1])
    s.append_tokens([5, 6], [LN_B, LN_B], 0)
    s.set_proximal_t(1, LN_B + math.log(2.0), 1)
    return SavedBatch.from_samples(
        [s], trainer_version=2, temperature=1.0, model="t", mode="decoupled",
        proximal_logprobs=[[LN_B + math.log(4.0), LN_B + math.log(4.0)]],
    )  # fmt: skip


def test_tokens_without_next_version_logprobs_are_left_out_of_segment_wise():
    r = analyse_batches([batch_with_an_unrecomputed_token()], ["x"])
    assert r.uncorrectable == 1
    assert r.modes["decoupled"].tokens == 2 and r.modes["segment_wise"].tokens == 1
    # segment-wise sees only token 1 (w 2); decoupled both (w 4, 4)
    assert r.modes["segment_wise"].weights["token"]["mean"] == approx(2.0)
    assert r.modes["decoupled"].weights["token"]["mean"] == approx(4.0)
    (row,) = r.lags
    assert (row.lag, row.tokens, row.uncorrectable) == (2, 2, 1)
    assert row.dropped["mean"] == approx(2.0)  # 4 / 2 on the one token that has π_{v+1}


# ------------------------------------------------------------------------- dump
def test_dump_is_packed_like_the_input():
    b = hand_batch()
    r = analyse_batches([b], ["hand"])
    tensors, meta = dump_tensors(r)
    # packed: A = [p, p | a0, a1, a2], B = [p | b0, b1]; 0 on prompt tokens
    assert tensors["decoupled.token"].tolist() == pytest.approx([0, 0, 4, 0.5, 1, 0, 0.25, 2], rel=2e-6)
    assert tensors["segment_wise.token"].tolist() == pytest.approx([0, 0, 2, 0.5, 1, 0, 1, 2], rel=2e-6)
    assert tensors["decoupled.sequence"].tolist() == pytest.approx([0, 0, 2, 2, 2, 0, 0.5, 0.5], rel=2e-6)
    assert tensors["lag"].tolist() == [-1, -1, 2, 1, 0, -1, 2, 1]
    assert tensors["mask"].tolist() == [0, 0, 1, 1, 1, 0, 1, 1]
    assert tensors["cu_seqlens"].tolist() == b.cu_seqlens.tolist()
    assert tensors["prompt_lens"].tolist() == [2, 1]
    assert not any(name.startswith("bypass") for name in tensors)
    assert meta["format"] == "sdp-weights"
    assert load(save(tensors, metadata=meta)).keys() == tensors.keys()


def test_dump_of_two_batches_concatenates_them():
    other = batch_of([(3, [(2, 8.0, 2.0)])], c=5)
    tensors, _ = dump_tensors(analyse_batches([hand_batch(), other], ["a", "b"]))
    assert tensors["cu_seqlens"].tolist() == [0, 5, 8, 12]
    assert tensors["file_index"].tolist() == [0, 0, 1]
    assert tensors["decoupled.token"][-4:].tolist() == pytest.approx([0, 0, 0, 8], rel=2e-6)
    assert tensors["lag"][-4:].tolist() == [-1, -1, -1, 2]


# ------------------------------------------------------------------- invariants
lags_st = st.integers(0, 4)
logp = st.floats(-6.0, -0.0625, allow_nan=False, width=32)


@st.composite
def random_batch(draw, one_step: bool = False):
    """A valid batch at c = 5 with the lag-1 fill (π_prox_t = π_prox) and no engine–trainer
    mismatch; ``one_step``: every token one version behind."""
    c = 5
    samples, prox = [], []
    for _ in range(draw(st.integers(1, 4))):
        s = RolloutSample(prompt_ids=[1] * draw(st.integers(1, 3)))
        p = []
        for i in range(draw(st.integers(1, 5))):
            lag = 1 if one_step else draw(lags_st)
            behav = draw(logp)
            s.append_tokens([2], [behav], c - lag)
            # exact arithmetic: at lag 0 the trainer's π_prox = π_c is the engine's π_behav
            p.append(behav if lag == 0 else draw(logp))
            if lag >= 1:
                s.set_proximal_t(i, p[-1] if lag == 1 else draw(logp), c - lag + 1)
        samples.append(s)
        prox.append(p)
    return SavedBatch.from_samples(
        samples, trainer_version=c, temperature=1.0, model="t", mode="segment_wise", proximal_logprobs=prox
    )


@given(random_batch())
def test_decoupled_weight_is_segment_wise_weight_times_dropped_factor(b):
    r = analyse_batches([b], ["x"])
    covered = r.modes["segment_wise"].covered
    dec = r.modes["decoupled"].per_token["token"][covered]
    seg = r.modes["segment_wise"].per_token["token"][covered]
    torch.testing.assert_close(dec, seg * r.dropped[covered], rtol=1e-5, atol=0)
    assert sum(row.tokens for row in r.lags) == r.tokens
    for row in r.lags:
        if row.lag <= 1:
            assert row.dropped == {"mean": 1.0, "std": 0.0}


@given(random_batch(one_step=True))
def test_segment_wise_equals_decoupled_when_every_token_is_one_version_behind(b):
    r = analyse_batches([b], ["x"])
    assert r.modes["segment_wise"].weights == r.modes["decoupled"].weights
    assert r.modes["segment_wise"].divergence == r.modes["decoupled"].divergence


@given(random_batch())
def test_every_mode_is_bypass_when_all_logprobs_agree(b):
    b.proximal_logprobs = b.old_logprobs.clone()
    b.proximal_logprobs_t = b.old_logprobs.clone()
    r = analyse_batches([b], ["x"])
    for mode in ("decoupled", "segment_wise"):
        assert r.modes[mode].weights == r.modes["bypass"].weights
        assert r.modes[mode].divergence == r.modes["bypass"].divergence
