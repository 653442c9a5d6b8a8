"""Batch assembly puts every token in its target-frame column; the lag-1 fill and the invariant."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sdp_cli.core.token_status import FILL, OK, UNCORRECTABLE, lacks_next_version, token_status
from sdp_cli.rollout.records import RolloutGroup, RolloutSample
from sdp_cli.train.step.batch import assemble_batch, fill_one_step_proximal


def _sample(prompt, outputs, logprobs, versions, reward, group_id=0):
    s = RolloutSample(prompt_ids=list(prompt), group_id=group_id)
    for tok, lp, v in zip(outputs, logprobs, versions):
        s.append_tokens([tok], [lp], v)
    s.finish("stop")
    s.reward = reward
    return s


def _batch(trainer_version=3):
    a = _sample([1, 5, 6], [7, 2], [-0.5, -0.25], [2, 3], reward=1.0)
    b = _sample([1, 9], [4, 4, 2], [-1.0, -2.0, -0.125], [1, 2, 3], reward=0.0)
    return assemble_batch([RolloutGroup(0, [a, b])], pad_token_id=0, trainer_version=trainer_version), a, b


def test_tokens_land_in_their_target_columns():
    batch, a, b = _batch()
    # row a: prompt length 3 → output token t sits at position 3+t, i.e. target column 2+t
    assert batch.input_ids[0].tolist() == [1, 5, 6, 7, 2]
    assert batch.mask[0].tolist() == [0, 0, 1, 1]
    assert batch.old_logprobs[0].tolist() == [0, 0, -0.5, -0.25]
    assert batch.versions[0].tolist() == [-1, -1, 2, 3]
    # row b: prompt length 2, three outputs → columns 1..3, nothing padded
    assert batch.input_ids[1].tolist() == [1, 9, 4, 4, 2]
    assert batch.mask[1].tolist() == [0, 1, 1, 1]
    assert batch.old_logprobs[1].tolist() == [0, -1.0, -2.0, -0.125]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]


def test_right_padding_and_grpo_advantages():
    s1 = _sample([1, 2], [3], [-0.1], [0], reward=1.0)
    s2 = _sample([1, 2, 2, 2], [3, 3], [-0.1, -0.2], [0, 0], reward=0.0)
    batch = assemble_batch([RolloutGroup(0, [s1, s2])], pad_token_id=0, trainer_version=0)
    assert batch.input_ids[0].tolist() == [1, 2, 3, 0, 0, 0]
    assert batch.attention_mask[0].tolist() == [1, 1, 1, 0, 0, 0]
    # rewards (1, 0): mean 0.5, unbiased std √0.5 → advantages ±0.5/√0.5 = ±0.7071 (eps aside)
    adv = batch.advantages
    assert adv[0, 1].item() == pytest.approx(0.70711, abs=1e-4)
    # row 1 has a 4-token prompt: its two outputs sit in target columns 3 and 4
    assert adv[1, 3].item() == pytest.approx(-0.70711, abs=1e-4)
    assert adv[1, 4].item() == pytest.approx(-0.70711, abs=1e-4)
    assert adv[1, :3].abs().sum().item() == 0
    # advantages are zero off the response
    assert adv[0, 0].item() == 0 and adv[0, 2:].abs().sum().item() == 0


def test_one_step_fill_only_touches_lag_one_tokens_and_updates_records():
    batch, a, b = _batch(trainer_version=3)
    prox = torch.full_like(batch.old_logprobs, -9.0)
    filled = fill_one_step_proximal(batch, prox)
    # versions at c=3: a = [2, 3], b = [1, 2, 3] → the two version-2 tokens are one step behind
    assert filled == 2
    assert a.proximal_logprobs_t == [-9.0, -0.25] and a.proximal_t_versions == [3, 3]
    assert b.proximal_logprobs_t == [-1.0, -9.0, -0.125] and b.proximal_t_versions == [1, 3, 3]
    assert batch.proximal_logprobs_t[1].tolist() == [0, -1.0, -9.0, -0.125]


def test_token_status_of_a_batch_finds_a_closed_window_and_nothing_once_complete():
    batch, a, b = _batch(trainer_version=3)
    status = token_status(batch.versions, batch.proximal_t_versions, 3, batch.mask)
    # c = 3, target columns (see test_tokens_land_in_their_target_columns): a = [v2, v3] at 2–3,
    # b = [v1, v2, v3] at 1–3, padding OK; each token's π_prox_t starts at its own version, so
    # the version-2 tokens are FILL and b's version-1 token (≤ c − 2, not at π_2) UNCORRECTABLE
    assert status.tolist() == [[OK, OK, FILL, OK], [OK, UNCORRECTABLE, FILL, OK]]
    fill_one_step_proximal(batch, torch.zeros_like(batch.old_logprobs))
    status = token_status(batch.versions, batch.proximal_t_versions, 3, batch.mask)
    assert status.tolist() == [[OK, OK, OK, OK], [OK, UNCORRECTABLE, OK, OK]]
    b.set_proximal_t(0, -0.75, 2)
    batch2 = assemble_batch([RolloutGroup(0, [a, b])], pad_token_id=0, trainer_version=3)
    fill_one_step_proximal(batch2, torch.zeros_like(batch2.old_logprobs))
    assert not lacks_next_version(token_status(batch2.versions, batch2.proximal_t_versions, 3, batch2.mask)).any()


def test_rows_selects_a_consistent_sub_batch():
    batch, a, b = _batch()
    sub = batch.rows(torch.tensor([1]))
    assert sub.num_sequences == 1 and sub.samples == [b]
    assert sub.old_logprobs[0].tolist() == batch.old_logprobs[1].tolist()


def test_assemble_refuses_unscored_or_empty_samples():
    s = RolloutSample(prompt_ids=[1, 2])
    s.append_tokens([3], [-0.1], 0)
    with pytest.raises(ValueError, match="no reward"):
        assemble_batch([RolloutGroup(0, [s])], pad_token_id=0, trainer_version=0)
    empty = RolloutSample(prompt_ids=[1], reward=1.0)
    with pytest.raises(ValueError, match="empty response"):
        assemble_batch([RolloutGroup(0, [empty])], pad_token_id=0, trainer_version=0)
    # no prompt: output token 0 has no column to go to (never wrapped into the last one)
    no_prompt = RolloutSample(prompt_ids=[], reward=1.0)
    no_prompt.append_tokens([3, 4], [-0.1, -0.2], 0)
    with pytest.raises(ValueError, match="empty prompt"):
        assemble_batch([RolloutGroup(0, [no_prompt, s])], pad_token_id=0, trainer_version=0)


def _reference_layout(samples, pad):
    """Each sample written into its row one by one: what assemble_batch's scatter must equal."""
    n, length = len(samples), max(s.prompt_len + s.output_len for s in samples)
    ids = [[pad] * length for _ in range(n)]
    attention = [[0] * length for _ in range(n)]
    per_token = {key: [[fill] * (length - 1) for _ in range(n)] for key, fill in
                 (("mask", 0.0), ("old", 0.0), ("prox", 0.0), ("versions", -1), ("prox_versions", -1))}  # fmt: skip
    for i, s in enumerate(samples):
        for j, token in enumerate(s.input_ids):
            ids[i][j], attention[i][j] = token, 1
        for t in range(s.output_len):
            col = s.prompt_len + t - 1
            per_token["mask"][i][col] = 1.0
            per_token["old"][i][col] = s.old_logprobs[t]
            per_token["prox"][i][col] = s.proximal_logprobs_t[t]
            per_token["versions"][i][col] = s.versions[t]
            per_token["prox_versions"][i][col] = s.proximal_t_versions[t]
    return ids, attention, per_token


@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(1, 50), min_size=1, max_size=6),  # prompt
            st.lists(st.tuples(st.integers(1, 50), st.floats(-20, 0), st.integers(0, 9)), min_size=1, max_size=7),
        ),
        min_size=1,
        max_size=9,
    )
)
@settings(max_examples=150, deadline=None)
def test_every_token_of_every_sample_lands_where_a_row_by_row_layout_puts_it(specs):
    samples = []
    for g, (prompt, outputs) in enumerate(specs):
        s = _sample(prompt, [o[0] for o in outputs], [o[1] for o in outputs], [o[2] for o in outputs], 1.0, group_id=g)
        for t, (_, lp, v) in enumerate(outputs):
            if t % 2:  # some tokens carry an engine π_prox_t of the next version
                s.set_proximal_t(t, lp / 2, v + 1)
        samples.append(s)
    batch = assemble_batch([RolloutGroup(i, [s]) for i, s in enumerate(samples)], pad_token_id=0, trainer_version=10)
    ids, attention, per_token = _reference_layout(samples, 0)
    assert batch.input_ids.tolist() == ids
    assert batch.attention_mask.tolist() == attention
    assert batch.mask.tolist() == per_token["mask"]
    assert batch.old_logprobs.tolist() == torch.tensor(per_token["old"], dtype=torch.float32).tolist()
    assert batch.proximal_logprobs_t.tolist() == torch.tensor(per_token["prox"], dtype=torch.float32).tolist()
    assert batch.versions.tolist() == per_token["versions"]
    assert batch.proximal_t_versions.tolist() == per_token["prox_versions"]
