"""The trainer's shared-prompt forward (train/shared_prefix.py): the plan by hand, the same
log-probs, entropies and gradients as the plain forward on random GRPO-shaped batches, the same
trainer step, and the plain forward wherever sharing cannot hold."""

import copy
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdp_cli.config.schema import LossConfig, OptimConfig
from sdp_cli.rollout.records import RolloutGroup, RolloutSample
from sdp_cli.train.batch import assemble_batch
from sdp_cli.train.policy_setup import enable_gradient_checkpointing
from sdp_cli.train.response_logprobs import ResponseLogprobs
from sdp_cli.train.shared_prefix import plan_shared_prefix
from sdp_cli.train.trainer import Trainer

from . import cases


def _logprobs(share: bool) -> ResponseLogprobs:
    return ResponseLogprobs(
        temperature=0.7, device=torch.device("cpu"), autocast_dtype=None, unwrap=lambda m: m, share_prefixes=share
    )


def _groups(prompts: list[list[int]], responses: list[list[list[int]]]) -> list[RolloutGroup]:
    out = []
    for gid, (prompt, outputs) in enumerate(zip(prompts, responses)):
        samples = []
        for tokens in outputs:
            sample = RolloutSample(prompt_ids=list(prompt), group_id=gid)
            sample.append_tokens(tokens, [-1.0] * len(tokens), 0)
            sample.finish("length")
            sample.reward = float(len(tokens) % 2)
            samples.append(sample)
        out.append(RolloutGroup(gid, samples))
    return out


def test_the_plan_maps_rows_onto_distinct_prefixes_by_hand():
    # rows 0, 2 and 3 share the prompt [1, 5, 6]; row 1 has [1, 7]. Rows (right-padded with 0):
    #   [1 5 6 8 9]   prefix 0, window = positions 3..5 → [8 9 0] (3 wide: row 1's is)
    #   [1 7 8 9 4]   prefix 1, window = positions 2..4 → [8 9 4]
    #   [1 5 6 3 0]   prefix 0, window = positions 3..5 → [3 0 0]
    #   [1 5 6 2 0]   prefix 0                          → [2 0 0]
    groups = _groups([[1, 5, 6], [1, 7], [1, 5, 6]], [[[8, 9]], [[8, 9, 4]], [[3], [2]]])
    batch = assemble_batch(groups, pad_token_id=0, trainer_version=0)
    assert batch.input_ids.tolist() == [[1, 5, 6, 8, 9], [1, 7, 8, 9, 4], [1, 5, 6, 3, 0], [1, 5, 6, 2, 0]]
    plan = plan_shared_prefix(batch.input_ids, batch.attention_mask, batch.mask > 0, min_saving=0.0)
    assert plan is not None
    assert plan.prefix_ids.tolist() == [[1, 5, 6], [1, 7, 0]]
    assert plan.prefix_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert plan.row_prefix.tolist() == [0, 1, 0, 0]
    assert plan.prefix_len.tolist() == [3, 2, 3, 3]
    assert plan.window_ids.tolist() == [[8, 9, 0], [8, 9, 4], [3, 0, 0], [2, 0, 0]]
    assert plan.window_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 0, 0]]
    assert plan.positions.tolist() == [[3, 4, 5], [2, 3, 4], [3, 4, 5], [3, 4, 5]]
    assert plan.targets.tolist() == [[True, True, False], [True, True, True], [True, False, False], [True, False, False]]
    # 2·3 prefix + 4·3 window positions instead of 4·5
    assert plan.positions_saved == pytest.approx(1 - 18 / 20)
    assert plan_shared_prefix(batch.input_ids, batch.attention_mask, batch.mask > 0) is None  # < 20 % saved


def test_the_plan_is_refused_where_sharing_cannot_hold_or_gains_too_little():
    shared = assemble_batch(_groups([[1, 5, 6, 7]], [[[8], [9], [4], [3]]]), pad_token_id=0, trainer_version=0)
    response = shared.mask > 0
    assert plan_shared_prefix(shared.input_ids, shared.attention_mask, response) is not None
    distinct = assemble_batch(_groups([[1, 5], [1, 6]], [[[8]], [[9]]]), pad_token_id=0, trainer_version=0)
    assert plan_shared_prefix(distinct.input_ids, distinct.attention_mask, distinct.mask > 0) is None
    # a row without a trained token, and a row with padding inside its tokens (left padding)
    untrained = response.clone()
    untrained[1] = False
    assert plan_shared_prefix(shared.input_ids, shared.attention_mask, untrained) is None
    holes = shared.attention_mask.clone()
    holes[0, 0] = 0
    assert plan_shared_prefix(shared.input_ids, holes, response) is None


@st.composite
def grpo_batches(draw):
    """Groups of samples with one prompt each, prompts and responses of several lengths, and
    leading response tokens the loss may leave out (a row's prefix then runs past its prompt)."""
    vocab = cases.VOCAB
    n_groups = draw(st.integers(1, 4))
    prompts = [[1, *draw(st.lists(st.integers(3, vocab - 1), min_size=0, max_size=6))] for _ in range(n_groups)]
    responses = [
        draw(st.lists(st.lists(st.integers(3, vocab - 1), min_size=1, max_size=6), min_size=2, max_size=5))
        for _ in range(n_groups)
    ]
    batch = assemble_batch(_groups(prompts, responses), pad_token_id=0, trainer_version=0)
    mask = batch.mask.clone()
    for row in range(mask.shape[0]):
        trained = mask[row].nonzero().flatten().tolist()
        skip = draw(st.integers(0, len(trained) - 1))
        mask[row, trained[:skip]] = 0
    batch.mask = mask
    return batch


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=grpo_batches())
def test_the_shared_forward_gives_the_plain_log_probs_entropies_and_gradients(batch):
    torch.manual_seed(0)
    model = cases.tiny_model(seed=3).train()
    plan = plan_shared_prefix(batch.input_ids, batch.attention_mask, batch.mask > 0, min_saving=0.0)
    results = []
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        engine = _logprobs(share)
        engine.share_prefixes = share  # skip the first-batch check: this test is that check
        if share and plan is not None:
            engine._prefix_plan = lambda *_: plan  # noqa: SLF001 (whatever the saving)
        logprobs, entropy = engine.forward(model, batch, grad=True, with_entropy=True)
        (logprobs.sum() + 0.1 * entropy.sum()).backward()
        results.append((logprobs.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()], engine))
    (plain_lp, plain_ent, plain_grads, _), (lp, ent, grads, engine) = results
    assert plan is None or engine.positions_saved == pytest.approx(plan.positions_saved)
    assert ((lp != 0) == (batch.mask > 0)).all()
    torch.testing.assert_close(lp, plain_lp, rtol=0, atol=2e-6)
    torch.testing.assert_close(ent, plain_ent, rtol=0, atol=2e-6)
    for got, expected in zip(grads, plain_grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def _shared_prompt_batch(version: int = 0):
    groups = cases.random_groups(24, seed=5, version=version, group_size=8, shared_prompts=True)
    model = cases.tiny_model(seed=2)
    cases.set_old_logprobs(groups, model, noise=0.3, seed=6)
    return model, groups


@pytest.mark.parametrize("minibatches", [1, 2])
def test_a_trainer_step_with_shared_prompts_equals_the_plain_step(minibatches):
    """Compared by gradients, not weights: Adam turns the float noise of a gradient that is 0 in
    exact arithmetic (the key bias's: softmax ignores a shift shared by every key) into steps of
    the learning rate's size."""
    model, groups = _shared_prompt_batch()
    grads, saved = [], []
    for share in (False, True):
        trainer = Trainer(
            copy.deepcopy(model),
            loss=LossConfig(mode="decoupled", agg="token-mean", weight_cap=1.5),
            optim=OptimConfig(lr=1e-2, minibatches=minibatches),
            temperature=1.0,
            seed=1,
            share_prefixes=share,
        )
        grads.append(cases.capture_gradients(trainer))
        saved.append(trainer.step(cases.batch_of(groups)).metrics["batch/positions_saved"])
    assert saved[0] == 0 and saved[1] > 0.2
    assert len(grads[0]) == len(grads[1]) == minibatches
    for plain, shared in zip(*grads):
        for name, value in plain.items():
            torch.testing.assert_close(shared[name], value, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")


class _IgnoresPositions(torch.nn.Module):
    """A causal LM whose forward drops ``position_ids``: its cached continuation then starts
    again at position 0, so the shared forward cannot reproduce the plain one."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, position_ids=None, **kwargs):
        return self.inner(*args, **kwargs)

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()


def test_a_model_that_breaks_the_shared_forward_falls_back_with_one_warning():
    model, groups = _shared_prompt_batch()
    batch = cases.batch_of(groups)
    wrapped = _IgnoresPositions(model)
    engine = _logprobs(True)
    with pytest.warns(UserWarning, match="share_prefixes=false"):
        logprobs, _ = engine.forward(wrapped, batch, grad=False, with_entropy=False)
    assert engine.share_prefixes is False and engine.positions_saved == 0
    plain, _ = _logprobs(False).forward(model, batch, grad=False, with_entropy=False)
    torch.testing.assert_close(logprobs, plain, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        engine.forward(wrapped, batch, grad=False, with_entropy=False)


def test_a_model_that_passes_the_check_shares_from_the_first_batch_on():
    model, groups = _shared_prompt_batch()
    engine = _logprobs(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.forward(model, cases.batch_of(groups), grad=False, with_entropy=False)
    assert engine.share_prefixes is True and engine.positions_saved > 0.2


def test_gradient_checkpointing_and_the_switch_keep_the_plain_forward():
    model, groups = _shared_prompt_batch()
    engine = _logprobs(False)
    engine.forward(model, cases.batch_of(groups), grad=True, with_entropy=False)
    assert engine.positions_saved == 0
    enable_gradient_checkpointing(model)
    engine = _logprobs(True)
    engine.forward(model.train(), cases.batch_of(groups), grad=True, with_entropy=False)
    assert engine.positions_saved == 0 and engine.share_prefixes is None


def test_a_lora_model_and_its_reference_share_prompts_with_the_same_gradients():
    """peft's wrapper passes position ids and the cache through; the KL term's reference (the
    same model with its adapters disabled) runs on the same shared forward."""
    from sdp_cli.models.lora import apply_lora

    base, groups = _shared_prompt_batch()
    grads, saved = [], []
    for share in (False, True):
        torch.manual_seed(0)  # the same adapter initialisation
        model = apply_lora(copy.deepcopy(base), r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
        trainer = Trainer(
            model,
            loss=LossConfig(mode="decoupled", kl_coef=0.1, entropy_coef=0.01),
            optim=OptimConfig(lr=1e-2),
            temperature=1.0,
            seed=1,
            share_prefixes=share,
        )
        grads.append(cases.capture_gradients(trainer))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            saved.append(trainer.step(cases.batch_of(groups)).metrics["batch/positions_saved"])
    assert saved[0] == 0 and saved[1] > 0.2
    (plain,), (shared,) = grads
    assert plain and sorted(plain) == sorted(shared)
    for name, value in plain.items():
        torch.testing.assert_close(shared[name], value, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_every_process_must_be_able_to_share():
    """With several processes the path is agreed on (one all-reduce per forward): when another
    process's shard cannot share, this one runs plainly too, though its own batch could."""
    model, groups = _shared_prompt_batch()
    batch = cases.batch_of(groups)
    asked: list[bool] = []

    def others_cannot(flag: bool) -> bool:
        asked.append(flag)
        return False

    engine = ResponseLogprobs(
        temperature=0.7, device=torch.device("cpu"), autocast_dtype=None, unwrap=lambda m: m, every_process=others_cannot
    )
    logprobs, _ = engine.forward(model, batch, grad=False, with_entropy=False)
    assert asked == [True] and engine.positions_saved == 0 and engine.share_prefixes is None
    plain, _ = _logprobs(False).forward(model, batch, grad=False, with_entropy=False)
    torch.testing.assert_close(logprobs, plain, rtol=0, atol=0)
    asked.clear()
    _logprobs(False).forward(model, batch, grad=False, with_entropy=False)
    assert asked == []  # sharing off everywhere: nothing to agree on
