"""The trainer's shared-prompt forward (train/step/shared_prefix.py): the plan by hand, the same
log-probs, entropies and gradients as the plain forward on random GRPO-shaped batches, the same
trainer step, and the plain forward wherever sharing cannot hold."""

import copy
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdp_cli.config.schema import LossConfig, OptimConfig
from sdp_cli.models.kv_cache import CACHE_NAME
from sdp_cli.models.packed import packing_saves
from sdp_cli.models.tiny import build_tiny_model
from sdp_cli.rollout.records import RolloutGroup, RolloutSample
from sdp_cli.train.step.batch import assemble_batch
from sdp_cli.train.session.policy_setup import enable_gradient_checkpointing
from sdp_cli.train.step.response_logprobs import ResponseLogprobs
from sdp_cli.train.step.shared_prefix import plan_shared_prefix
from sdp_cli.train.step.trainer import Trainer

from ..sliding_models import KINDS, sliding_model
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
    #   [1 5 6 8 9]   prefix 0, predicts positions 3..4 (8 9): runs 8      → window [8 0]
    #   [1 7 8 9 4]   prefix 1, predicts positions 2..4 (8 9 4): runs 8 9  → window [8 9] (2 wide)
    #   [1 5 6 3 0]   prefix 0, predicts position 3 (3) from the prefix    → window [0 0]
    #   [1 5 6 2 0]   prefix 0                                            → window [0 0]
    # A row's last trained token is predicted, never run: its state predicts nothing.
    groups = _groups([[1, 5, 6], [1, 7], [1, 5, 6]], [[[8, 9]], [[8, 9, 4]], [[3], [2]]])
    batch = assemble_batch(groups, pad_token_id=0, trainer_version=0)
    assert batch.input_ids.tolist() == [[1, 5, 6, 8, 9], [1, 7, 8, 9, 4], [1, 5, 6, 3, 0], [1, 5, 6, 2, 0]]
    plan = plan_shared_prefix(batch.input_ids, batch.attention_mask, batch.mask > 0, min_saving=0.0)
    assert plan is not None
    # prefixes left-padded, so both end at cache index 2 and each window follows its prefix
    assert plan.prefix_ids.tolist() == [[1, 5, 6], [0, 1, 7]]
    assert plan.prefix_mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    assert plan.prefix_positions.tolist() == [[0, 1, 2], [0, 0, 1]]
    assert plan.row_prefix.tolist() == [0, 1, 0, 0]
    assert plan.window_ids.tolist() == [[8, 0], [8, 9], [0, 0], [0, 0]]
    assert plan.window_mask.tolist() == [[1, 0], [1, 1], [0, 0], [0, 0]]
    assert plan.positions.tolist() == [[3, 4], [2, 3], [3, 4], [3, 4]]
    assert plan.targets.tolist() == [[True, True, False], [True, True, True], [True, False, False], [True, False, False]]
    # 2·3 prefix + 4·2 window positions instead of the plain forward's 4·4 (every row but its last token)
    assert plan.positions_saved == pytest.approx(1 - 14 / 16)
    assert plan_shared_prefix(batch.input_ids, batch.attention_mask, batch.mask > 0) is None  # < 20 % saved


def test_the_window_stops_before_the_last_trained_token_and_keeps_one_column():
    # row 0 trains 8 and 9 but not the trailing 4 (a loss mask may leave it out): the window runs
    # 8 only; row 1 trains its one token. With single-token answers only, one column stays.
    groups = _groups([[1, 5, 6]], [[[8, 9, 4], [3]]])
    batch = assemble_batch(groups, pad_token_id=0, trainer_version=0)
    response = batch.mask > 0
    response[0, 4] = False  # the 4 at position 5
    plan = plan_shared_prefix(batch.input_ids, batch.attention_mask, response, min_saving=0.0)
    assert plan.window_ids.tolist() == [[8], [0]]
    assert plan.targets.tolist() == [[True, True], [True, False]]
    singles = assemble_batch(_groups([[1, 5, 6]], [[[8], [3]]]), pad_token_id=0, trainer_version=0)
    plan = plan_shared_prefix(singles.input_ids, singles.attention_mask, singles.mask > 0, min_saving=0.0)
    assert plan.window_ids.tolist() == [[0], [0]] and plan.window_mask.tolist() == [[0], [0]]
    assert plan.targets.tolist() == [[True], [True]]


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
    leading and trailing response tokens the loss may leave out (a row's prefix then runs past
    its prompt; its window then ends before its sequence does)."""
    vocab = cases.VOCAB
    n_groups = draw(st.integers(1, 4))
    # any id, the padding id 0 too: a real vocabulary's id 0 is a token like any other (Qwen's "!"),
    # so padding is known from the attention mask, never from the id
    prompts = [[1, *draw(st.lists(st.integers(0, vocab - 1), min_size=0, max_size=6))] for _ in range(n_groups)]
    responses = [
        draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6), min_size=2, max_size=5))
        for _ in range(n_groups)
    ]
    batch = assemble_batch(_groups(prompts, responses), pad_token_id=0, trainer_version=0)
    mask = batch.mask.clone()
    for row in range(mask.shape[0]):
        trained = mask[row].nonzero().flatten().tolist()
        skip = draw(st.integers(0, len(trained) - 1))
        drop_last = draw(st.integers(0, len(trained) - 1 - skip))
        mask[row, trained[:skip]] = 0
        mask[row, trained[len(trained) - drop_last :]] = 0
    batch.mask = mask
    return batch


def _model(kind: str) -> torch.nn.Module:
    """A full-attention tiny model, or one whose window (4 tokens) is shorter than most rows. Both
    have 2 layers: with one, the first layer's output is also the last one's, so reading the wrong
    hidden state of a packed forward would pass unseen."""
    if kind == "full":
        return build_tiny_model(
            cases.VOCAB, seed=3, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=64
        )
    return sliding_model(kind, vocab=cases.VOCAB, seed=3)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["full", *KINDS]), batch=grpo_batches())
def test_the_shared_forward_gives_the_plain_log_probs_entropies_and_gradients(kind, batch):
    torch.manual_seed(0)
    model = _model(kind).train()
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
    if plan is not None:
        # full attention packs the windows' real tokens (models/packed.py) where that saves positions
        window_tokens = plan.window_mask.sum(1).tolist()
        packs = kind == "full" and packing_saves(window_tokens)
        ran = plan.prefix_ids.numel() + (sum(window_tokens) if packs else plan.window_ids.numel())
        assert engine.positions_saved == pytest.approx(1 - ran / plan.plain_positions)
    assert ((lp != 0) == (batch.mask > 0)).all()
    # both against the model's own logits over every row's whole sequence (neither forward runs
    # the last trained token, whose state predicts nothing)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    full = torch.log_softmax(logits / 0.7, -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    trained = batch.mask > 0
    torch.testing.assert_close(plain_lp[trained], full[trained], rtol=0, atol=2e-6)
    torch.testing.assert_close(lp, plain_lp, rtol=0, atol=2e-6)
    torch.testing.assert_close(ent, plain_ent, rtol=0, atol=2e-6)
    # summation order differs: float32 noise, relative to the largest gradient entry (a gradient
    # that is 0 in exact arithmetic, e.g. of keys a softmax over one key ignores, is noise alone)
    scale = max(float(g.abs().max()) for g in plain_grads)
    for got, expected in zip(grads, plain_grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6 * scale + 1e-7)


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


class _DropsTheCache(torch.nn.Module):
    """A causal LM whose forward starts a new KV cache on every call: a cached continuation then
    sees none of its prompt, so the shared forward cannot reproduce the plain one. (Dropping
    position ids would not do: the prefixes are left-padded, so the model's default positions
    shift all of a row's tokens alike, which rotary attention does not see.)"""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        kwargs.pop(CACHE_NAME, None)
        return self.inner(*args, **kwargs)

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    @property
    def config(self):
        return self.inner.config


def test_a_model_that_breaks_the_shared_forward_falls_back_with_one_warning():
    model, groups = _shared_prompt_batch()
    batch = cases.batch_of(groups)
    wrapped = _DropsTheCache(model)
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


def _sliding_batches() -> list:
    """A short first batch (every prompt 3 tokens: no row has padding before its response), then
    batches whose groups mix prompts of 2 and 14 tokens, so a short prompt's response sits far
    to the left of the batch's longest prompt: the layout of issue 24's reproduction."""
    gen = torch.Generator().manual_seed(11)

    def batch(prompt_lengths: list[int]):
        prompts = [[1, *torch.randint(3, cases.VOCAB, (n - 1,), generator=gen).tolist()] for n in prompt_lengths]
        responses = [
            [torch.randint(3, cases.VOCAB, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen).tolist() for _ in range(4)]
            for _ in prompts
        ]
        return assemble_batch(_groups(prompts, responses), pad_token_id=0, trainer_version=0)

    return [batch([3, 3]), batch([3, 3, 3]), batch([2, 14]), batch([14, 2, 5]), batch([2, 2, 14, 9])]


@pytest.mark.parametrize("kind", KINDS)
def test_sliding_window_models_share_prompts_exactly_when_later_batches_mix_lengths(kind):
    """Issue 24: the shared forward's log-probs are the plain forward's on every batch, not only
    on the first (which the first-batch check sees), and the prompts are still shared."""
    model = _model(kind)
    config = copy.deepcopy(model.config)  # the same weights without the window
    config.sliding_window = None
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"] * len(config.layer_types)
    full = type(model)(config).eval()
    full.load_state_dict(model.state_dict())
    shared, plain = _logprobs(True), _logprobs(False)
    window_mattered = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # sliding windows need no fallback
        for batch in _sliding_batches():
            got, _ = shared.forward(model, batch, grad=False, with_entropy=False)
            expected, _ = plain.forward(model, batch, grad=False, with_entropy=False)
            assert shared.share_prefixes is True and shared.positions_saved > 0
            torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)
            no_window, _ = plain.forward(full, batch, grad=False, with_entropy=False)
            window_mattered = max(window_mattered, float((no_window - expected).abs().max()))
    assert window_mattered > 0.05  # the window changes these log-probs: a lost key would show


def test_attention_the_config_does_not_vouch_for_runs_plainly_with_one_warning():
    """Chunked attention (here declared by the config alone) is not known to keep the shared
    forward exact: the forward is the plain one, said in one warning, before any batch is compared."""
    model, groups = _shared_prompt_batch()
    model.config.attention_chunk_size = 4
    batch = cases.batch_of(groups)
    engine = _logprobs(True)
    with pytest.warns(UserWarning, match="attention_chunk_size") as caught:
        logprobs, _ = engine.forward(model, batch, grad=False, with_entropy=False)
    assert len(caught) == 1 and len(str(caught[0].message).splitlines()) == 1
    assert engine.share_prefixes is False and engine.positions_saved == 0
    plain, _ = _logprobs(False).forward(model, batch, grad=False, with_entropy=False)
    torch.testing.assert_close(logprobs, plain, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        engine.forward(model, batch, grad=False, with_entropy=False)


@pytest.fixture(scope="module")
def sliding_hf_model(tmp_path_factory):
    """The fast tiny Qwen2 (arith tokenizer), saved as a Hugging Face directory whose config
    turns on a sliding window of 8 tokens in every layer (what issue 24 reproduced with)."""
    import json

    from sdp_cli.models import load_policy, save_policy

    path = tmp_path_factory.mktemp("hf") / "tiny-qwen2-sliding"
    small = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128)
    save_policy(load_policy("tiny", task="arith1", warm_start_steps=0, seed=1, **small), path)
    config = json.loads((path / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention"] * 2)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_sdp_train_on_a_sliding_window_model_keeps_lag_0_weights_at_1(sliding_hf_model, tmp_path):
    """Issue 24's acceptance: `sdp train model=hf` on a sliding-window Qwen2, η = 0, decoupled,
    default settings (prompts shared), the first steps' prompts short and of one length, later
    steps mixing prompts of 4 and 19 tokens. At η = 0 every token is of lag 0: π_prox and π_behav
    come from the same weights, so every weight π_prox/π_behav is 1 up to float32 noise."""
    import json

    from ..fast_run import FAST, train_run

    short = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(1, 9)]  # BOS + 4 characters
    long = [{"prompt": f"{i}{i}{i}{i}{i}{i}{i}{i}+{i}{i}{i}{i}{i}{i}{i}{i}=", "answer": "0"} for i in range(1, 9)]
    mixed = [record for pair in zip(short, long) for record in pair]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in short + mixed))
    run = train_run(
        tmp_path,
        [
            *FAST,
            "model=hf",
            f"model.path={sliding_hf_model}",
            "task=dataset",
            f"task.path={data}",
            "task.reward=final_number",
            "task.shuffle=false",
            "task.require_stop=false",
            "rollout.max_new_tokens=6",
            "rollout.max_head_offpolicyness=0",
            "loss.mode=decoupled",
            "train.steps=6",
        ],
    )
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "weights/rollout_is_min" in r]
    assert len(steps) == 6
    for row in steps:
        assert row["batch/positions_saved"] > 0  # the prompts were shared
        assert row["staleness/lag_max"] == 0
        assert abs(row["weights/rollout_is_min"] - 1) <= 1e-3 and abs(row["weights/rollout_is_max"] - 1) <= 1e-3, row
        assert abs(row["shadow/decoupled/lag0/behav_imp_weight/avg"] - 1) <= 1e-3
