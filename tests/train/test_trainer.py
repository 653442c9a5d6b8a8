"""Trainer invariants on real (tiny) models: equivalent configurations give identical updates."""

import copy
import math

import pytest
import torch

from sdp_cli.config.schema import LossConfig, OptimConfig, RejectionConfig
from sdp_cli.models.tiny import build_tiny_model
from sdp_cli.rollout.records import RolloutGroup, RolloutSample
from sdp_cli.train.step.batch import assemble_batch
from sdp_cli.train.step.trainer import Trainer

VOCAB = 32


def _model(seed=0):
    return build_tiny_model(VOCAB, seed=seed, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128)


def _groups(version, n_groups=2, group_size=4, seed=0):
    """Random responses with every token of ``version``; logprobs are filled in later."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for gid in range(n_groups):
        samples = []
        for _ in range(group_size):
            s = RolloutSample(prompt_ids=[1, *torch.randint(3, VOCAB, (3,), generator=g).tolist()], group_id=gid)
            out = torch.randint(3, VOCAB, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
            s.append_tokens(out, [0.0] * len(out), version)
            s.finish("length")
            s.reward = float(torch.randint(0, 2, (1,), generator=g))
            samples.append(s)
        groups.append(RolloutGroup(gid, samples))
    return groups


def _set_old_logprobs(groups, model, temperature, shift=0.0):
    """old := the model's own logprobs (+ shift), and π_prox_t := old, as an engine would record."""
    trainer = Trainer(copy.deepcopy(model), loss=LossConfig(), optim=OptimConfig(), temperature=temperature)
    batch = assemble_batch(groups, pad_token_id=0, trainer_version=0)
    lp = trainer.logprobs(batch, grad=False)
    for i, s in enumerate(batch.samples):
        start = s.prompt_len - 1
        vals = (lp[i, start : start + s.output_len] + shift).tolist()
        s.old_logprobs[:] = vals
        s.proximal_logprobs_t[:] = vals


def _train(model, loss, groups, version, **kwargs):
    kwargs.setdefault("track_proximal_t", loss.mode == "segment_wise")
    trainer = Trainer(copy.deepcopy(model), loss=loss, optim=OptimConfig(lr=1e-2), temperature=1.0, seed=0, **kwargs)
    trainer.version = version
    out = trainer.step(assemble_batch(copy.deepcopy(groups), pad_token_id=0, trainer_version=version))
    return trainer, out


def _same_weights(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.weights().values(), b.weights().values()))


@pytest.mark.parametrize("is_level", ["token", "sequence", "geometric"])
def test_segment_wise_equals_decoupled_when_every_token_is_one_version_behind(is_level):
    model = _model()
    groups = _groups(version=4)
    _set_old_logprobs(groups, model, 1.0, shift=-0.3)  # behaviour differs from the trainer
    dec, out_dec = _train(model, LossConfig(mode="decoupled", is_level=is_level), groups, version=5)
    seg, out_seg = _train(
        model, LossConfig(mode="segment_wise", is_level=is_level), groups, version=5, proximal_t_source="trainer"
    )
    # lag 1 everywhere: π_prox_t := π_5 = π_prox, so the weight and therefore the update agree
    assert out_seg.metrics["recompute/tokens_trainer_fill"] == out_dec.metrics["batch/response_tokens"]
    assert out_dec.metrics["weights/rollout_is_mean"] == pytest.approx(out_seg.metrics["weights/rollout_is_mean"])
    assert out_dec.metrics["weights/rollout_is_mean"] != pytest.approx(1.0, abs=1e-3)  # the weights do something
    assert _same_weights(dec, seg)


@pytest.mark.parametrize("mode", ["decoupled", "segment_wise"])
def test_every_mode_equals_bypass_when_all_logprobs_agree(mode):
    model = _model()
    groups = _groups(version=0)
    _set_old_logprobs(groups, model, 1.0)  # on-policy: π_behav = π_prox exactly
    ref, out_ref = _train(model, LossConfig(mode="bypass"), groups, version=0)
    other, out = _train(model, LossConfig(mode=mode), groups, version=0)
    assert out.metrics["weights/rollout_is_mean"] == 1.0 and out.metrics["weights/rollout_is_std"] == 0.0
    assert out.metrics["loss/pg_loss"] == pytest.approx(out_ref.metrics["loss/pg_loss"], abs=1e-7)
    for a, b in zip(ref.weights().values(), other.weights().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_a_different_mode_changes_the_update_when_policies_differ():
    # guards the two tests above against passing vacuously
    model = _model()
    groups = _groups(version=0)
    _set_old_logprobs(groups, model, 1.0, shift=-0.5)
    a, _ = _train(model, LossConfig(mode="bypass"), groups, version=0)
    b, _ = _train(model, LossConfig(mode="decoupled"), groups, version=0)
    assert not _same_weights(a, b)


def test_segment_wise_without_filtering_drops_uncorrectable_tokens_from_the_loss():
    model = _model()
    groups = _groups(version=1)  # at trainer version 4 these are 3 behind and were never rescored
    _set_old_logprobs(groups, model, 1.0)
    _, out = _train(model, LossConfig(mode="segment_wise"), groups, version=4)
    assert out.metrics["segment_wise/uncorrectable_token_fraction"] == 1.0
    assert out.loss_mask.sum().item() == 0


def test_step_advances_the_version_and_state_round_trips():
    model = _model()
    groups = _groups(version=0)
    _set_old_logprobs(groups, model, 1.0)
    trainer, _ = _train(model, LossConfig(), groups, version=0)
    assert trainer.version == 1
    state = trainer.state_dict()
    other = Trainer(_model(seed=3), loss=LossConfig(), optim=OptimConfig(lr=1e-2), temperature=1.0)
    other.load_state_dict(state)
    assert other.version == 1 and _same_weights(trainer, other)


def test_batch_for_another_version_is_refused():
    model = _model()
    trainer = Trainer(model, loss=LossConfig(), optim=OptimConfig(), temperature=1.0)
    groups = _groups(version=0)
    _set_old_logprobs(groups, model, 1.0)
    with pytest.raises(AssertionError, match="version"):
        trainer.step(assemble_batch(groups, pad_token_id=0, trainer_version=3))


def test_behav_kl_has_areal_sign_prox_minus_behav():
    # every token one version behind, π_behav = π_prox − 0.3: AReaL's behave_approx_kl is
    # mean(log π_prox − log π_behav) = +0.3, and the weight e^0.3 (segment-wise: π_prox_t := π_prox)
    model = _model()
    groups = _groups(version=4)
    _set_old_logprobs(groups, model, 1.0, shift=-0.3)
    _, out = _train(model, LossConfig(mode="segment_wise"), groups, version=5, proximal_t_source="trainer")
    for name in ("decoupled", "segment_wise"):
        assert out.metrics[f"shadow/{name}/lag1/behav_kl/avg"] == pytest.approx(0.3, abs=1e-5)
        assert out.metrics[f"shadow/{name}/lag1/behav_imp_weight/avg"] == pytest.approx(math.exp(0.3), abs=1e-5)


def test_a_veto_alone_drops_sequences_with_a_catastrophic_token():
    # loss.rejection.veto without bounds (verl's token veto): rows holding a token whose
    # π_prox/π_behav < 1e-4 leave the loss; the others stay
    model = _model()
    groups = _groups(version=0)
    _set_old_logprobs(groups, model, 1.0)
    bad = groups[0].samples[1]
    bad.old_logprobs[0] += 12.0  # π_behav e^12 × π_prox: lr = −12 < log 1e-4 = −9.21
    loss = LossConfig(mode="decoupled", rejection=RejectionConfig(veto=1e-4))
    _, out = _train(model, loss, groups, version=0)
    dropped = (out.loss_mask.sum(-1) == 0).nonzero().flatten().tolist()
    assert dropped == [1]  # the second sample of the first group, and only it
    assert out.metrics["rejection/rollout_rs_veto_fraction"] == pytest.approx(1 / 8)


@pytest.mark.parametrize("mode", ["decoupled", "segment_wise"])
def test_one_optimizer_step_runs_one_forward_and_updates_exactly_as_two(mode, monkeypatch):
    # ppo_epochs = minibatches = 1: π_prox is the training forward's own output, so the step
    # runs one forward instead of two and must leave the same weights and π_prox, bit for bit.
    model = _model()
    groups = _groups(version=4)
    _set_old_logprobs(groups, model, 1.0, shift=-0.3)  # a non-trivial weight
    calls = []
    forward = Trainer._forward

    def counting(self, *args, **kwargs):
        calls.append(kwargs["grad"])
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "_forward", counting)
    one, out_one = _train(model, LossConfig(mode=mode), groups, version=5, proximal_t_source="trainer")
    assert calls == [True]
    calls.clear()
    monkeypatch.setattr(Trainer, "_single_update", lambda self: False)
    two, out_two = _train(model, LossConfig(mode=mode), groups, version=5, proximal_t_source="trainer")
    assert calls == [False, True]
    assert torch.equal(out_one.proximal_logprobs, out_two.proximal_logprobs)
    assert out_one.metrics["weights/rollout_is_mean"] != pytest.approx(1.0, abs=1e-3)  # the weights do something
    assert out_one.metrics["loss/pg_loss"] == out_two.metrics["loss/pg_loss"]
    assert _same_weights(one, two)


def test_step_metrics_keep_the_order_they_were_first_reported_in():
    """metrics.jsonl rows of two runs list their keys in the same order: the per-minibatch mean
    keeps first-seen order (a set would follow the process's string hash seed). 40 keys in a
    fixed scrambled order: a hash order matching it by chance has probability 1/40!."""
    from sdp_cli.train.step.trainer import _mean_of

    keys = [f"loss/k{(7 * i) % 40}" for i in range(40)]
    first, second = dict.fromkeys(keys[:30], 1.0), dict.fromkeys(keys[10:], 3.0)
    means = _mean_of([first, second])
    assert list(means) == keys
    assert means[keys[0]] == 1.0 and means[keys[15]] == 2.0 and means[keys[39]] == 3.0
