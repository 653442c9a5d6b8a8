"""LocalEngine: exact logprobs, full-softmax sampling, stops, scoring and weight loading.

The reference everywhere is how a trainer computes logprobs: one full forward of the unpadded
sequence, log_softmax(logits / T) gathered at the next tokens (docs/design.md §4). It shares no code
with the engine's padded, KV-cached loop.
"""

from __future__ import annotations

import math

import pytest
import torch

from sdp_cli.engine.base import EngineError, SamplingParams, WeightUpdate
from sdp_cli.engine.local import LocalEngine, scoring_width
from sdp_cli.rollout.records import RolloutSample

from .tiny_qwen import EOS, PAD, VOCAB, model_with, prompts, reference_logprobs, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -------------------------------------------------------------- logprobs
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_full_forward_with_left_padded_prompts(temperature):
    model = tiny_model()
    engine = LocalEngine(model, temperature=temperature, eos_token_id=EOS, pad_token_id=PAD, seed=3)
    samples = prompts([1, 4, 9, 2, 7, 3])
    engine.generate(samples, SamplingParams(max_new_tokens=12))

    worst = 0.0
    for s in samples:
        assert s.output_len >= 1 and s.is_finished
        assert s.versions == [0] * s.output_len and s.proximal_t_versions == s.versions
        assert s.proximal_logprobs_t == s.old_logprobs
        ref = reference_logprobs(model, s.input_ids, s.prompt_len, temperature)
        worst = max(worst, max(abs(a - b) for a, b in zip(s.old_logprobs, ref, strict=True)))
    assert worst <= 1e-5


def test_score_equals_sampled_logprobs_and_honours_starts():
    model = tiny_model()
    engine = LocalEngine(
        model, temperature=0.7, eos_token_id=EOS, pad_token_id=PAD, seed=4, max_batch_size=4
    )
    samples = prompts([2, 8, 5, 3, 6, 1, 4])  # 7 rows with max_batch_size 4: two chunks
    engine.generate(samples, SamplingParams(max_new_tokens=10))

    scored = engine.score([s.input_ids for s in samples], [s.prompt_len for s in samples])
    for s, values in zip(samples, scored, strict=True):
        assert len(values) == s.output_len
        assert max(abs(a - b) for a, b in zip(values, s.old_logprobs, strict=True)) <= 1e-5

    # a start inside the prompt scores prompt tokens too; start == len gives nothing
    seq = samples[1].input_ids
    inner, empty = engine.score([seq, seq], [3, len(seq)])
    assert empty == []
    ref = reference_logprobs(model, seq, 3, 0.7)
    assert len(inner) == len(seq) - 3
    assert max(abs(a - b) for a, b in zip(inner, ref, strict=True)) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_scores_do_not_move_with_the_lengths_of_the_other_answers(dtype):
    """The recompute pass scores answers of every length at once, and ``sdp recompute`` later scores
    them beside other answers: a row's log-probs must be the same bits whatever the other answers to
    its prompt hold (one forward padded to the longest moved them by ~1e-6 in float32 and up to
    0.016 of a logit in bfloat16)."""
    engine = LocalEngine(tiny_model(), eos_token_id=EOS, pad_token_id=PAD, dtype=dtype)
    prompt, answer = [5, 9, 4, 11, 7, 3], [8, 12, 6]
    alone = engine.score([prompt + answer], [len(prompt)])[0]
    for n in (1, 4, 6, 10, 18):
        other = prompt + [3 + (7 * j) % (VOCAB - 3) for j in range(n)]
        shorter = prompt + answer[:1]
        scored = engine.score([other, prompt + answer, shorter], [len(prompt)] * 3)
        assert scored[1] == alone, f"beside an answer of {n} tokens"
        assert scored[2] == engine.score([shorter], [len(prompt)])[0]


def test_a_long_answers_scores_do_not_move_with_the_lengths_beside_it():
    """Past 16 tokens a suffix is padded to its own ``scoring_width``: the answers beside it of the
    same width and count may have any lengths."""
    engine = LocalEngine(tiny_model(), eos_token_id=EOS, pad_token_id=PAD)
    prompt = [5, 9, 4, 11, 7, 3]

    def answer(n: int, salt: int) -> list[int]:
        return [3 + (salt + 5 * j) % (VOCAB - 3) for j in range(n)]

    mine = prompt + answer(19, 0)  # 18 tokens scored after its first: width 20
    first = engine.score([mine, prompt + answer(18, 1), prompt + answer(21, 2), prompt + answer(41, 3)], [6] * 4)
    for lengths in ((21, 20), (20, 18), (18, 18)):
        others = [prompt + answer(n, 7 + i) for i, n in enumerate(lengths)]
        scored = engine.score([mine, *others, prompt + answer(35, 9)], [6] * 4)
        assert scored[0] == first[0], f"beside answers of {lengths} tokens"
    reference = reference_logprobs(engine.model, mine, 6, 1.0)
    assert max(abs(a - b) for a, b in zip(first[0], reference, strict=True)) <= 1e-5


def test_scoring_widths_pad_little_and_stay_few():
    assert [scoring_width(n) for n in (0, 1, 16, 17, 20, 21, 32, 33, 100)] == [0, 1, 16, 20, 20, 24, 32, 40, 112]
    widths = [scoring_width(n) for n in range(5000)]
    assert all(n <= w <= 1.25 * n for n, w in enumerate(widths))
    assert widths == sorted(widths)
    # exact up to 16, then four per doubling: 16 + 4 · log2(4096 / 16) + the last partial octave
    assert len(set(widths)) <= 17 + 4 * 9


def test_score_rejects_bad_starts_and_ids():
    engine = LocalEngine(tiny_model(), eos_token_id=EOS, pad_token_id=PAD)
    with pytest.raises(ValueError, match="start 0"):
        engine.score([[1, 2]], [0])
    with pytest.raises(ValueError, match="start 3"):
        engine.score([[1, 2]], [3])
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        engine.score([[1, VOCAB]], [1])


# -------------------------------------------------------------- sampling
def binomial_bounds_hold(counts: torch.Tensor, probs: torch.Tensor, n: int, sigmas: float) -> bool:
    expected = n * probs
    std = torch.sqrt(n * probs * (1 - probs))
    return bool(((counts - expected).abs() <= sigmas * std + 1).all())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_first_token_is_drawn_from_the_full_tempered_softmax(temperature):
    model = tiny_model()
    prompt = [5, 7, 9]
    n = 20_000
    engine = LocalEngine(
        model,
        temperature=temperature,
        eos_token_id=EOS,
        pad_token_id=PAD,
        seed=11,
        max_batch_size=n,
    )
    samples = [RolloutSample(prompt_ids=list(prompt)) for _ in range(n)]
    engine.generate(samples, SamplingParams(max_new_tokens=1))

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    probs = torch.softmax(logits / temperature, dim=-1).double()
    counts = torch.bincount(
        torch.tensor([s.output_ids[0] for s in samples]), minlength=VOCAB
    ).double()

    # the test can see truncation: top-p 0.9 would drop this much mass, i.e. hundreds of draws
    tail_mass = probs.sort().values.cumsum(0)
    assert n * tail_mass[tail_mass <= 0.1].max() > 300
    # every token within 5 binomial std of n·p (a false alarm per token has p ≈ 6e-7)
    assert binomial_bounds_hold(counts, probs, n, 5.0)
    # chi-square against its 0.9999 quantile with VOCAB − 1 = 31 degrees of freedom, by
    # Wilson-Hilferty: k·(1 − 2/(9k) + z·sqrt(2/(9k)))³ with z = 3.719 (normal 0.9999) ≈ 69.3
    k = VOCAB - 1
    critical = k * (1 - 2 / (9 * k) + 3.719 * math.sqrt(2 / (9 * k))) ** 3
    chi2 = (((counts - n * probs) ** 2) / (n * probs)).sum().item()
    assert chi2 < critical, (chi2, critical)
    # the same draws are far from the distribution at the other temperature
    other = torch.softmax(logits / (1.7 - temperature), dim=-1).double()
    assert not binomial_bounds_hold(counts, other, n, 5.0)

    for s in samples[:50]:
        assert s.old_logprobs[0] == pytest.approx(math.log(probs[s.output_ids[0]].item()), abs=1e-5)


def test_same_seed_same_samples_and_per_call_seed_overrides():
    def run(engine_seed, call_seed):
        engine = LocalEngine(tiny_model(), eos_token_id=EOS, pad_token_id=PAD, seed=engine_seed)
        samples = prompts([3, 5, 2])
        engine.generate(samples, SamplingParams(max_new_tokens=8, seed=call_seed))
        return [s.output_ids for s in samples]

    assert run(1, None) == run(1, None)
    assert run(1, None) != run(2, None)
    assert run(1, 9) == run(2, 9)


# ------------------------------------------------------------- stopping
def test_stop_tokens_eos_and_length():
    model = tiny_model()
    decode_rows = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: (
            decode_rows.append(kwargs["input_ids"].shape[0])
            if kwargs["input_ids"].shape[1] == 1
            else None
        ),
        with_kwargs=True,
    )
    engine = LocalEngine(model, eos_token_id=EOS, pad_token_id=PAD, seed=5)
    stop = tuple(range(1, 9))  # with EOS, 9 of 32 ids stop a row: most rows stop early
    samples = prompts([3] * 40 + [6] * 24)
    engine.generate(samples, SamplingParams(max_new_tokens=6, stop_token_ids=stop))

    # finished rows are dropped from the batch (with its KV cache) once half are done, and the
    # rows left still get exact logprobs
    assert decode_rows[0] == 64 and min(decode_rows) < 32
    for s in samples:
        ref = reference_logprobs(model, s.input_ids, s.prompt_len, 1.0)
        assert max(abs(a - b) for a, b in zip(s.old_logprobs, ref, strict=True)) <= 1e-5

    enders = set(stop) | {EOS}
    reasons = {s.finish_reason for s in samples}
    assert reasons == {"stop", "length"}, "the seed must exercise both ways of finishing"
    assert any(s.output_ids[-1] == EOS for s in samples), "the seed must exercise EOS"
    for s in samples:
        assert not enders & set(s.output_ids[:-1]), "no stop token before the last one"
        if s.finish_reason == "stop":
            assert s.output_ids[-1] in enders and s.output_len <= 6
        else:
            assert s.output_len == 6 and s.output_ids[-1] not in enders
    assert engine.inflight_samples() == []


def test_partial_output_is_continued_within_the_budget():
    model = tiny_model()
    engine = LocalEngine(model, eos_token_id=EOS, pad_token_id=PAD, seed=6)
    engine.set_version(2)
    partial = RolloutSample(prompt_ids=[4, 5, 6])
    # arrived from elsewhere: token 0 of version 0, tokens 1-2 of version 1 (bogus logprobs)
    partial.append_tokens([7], [-9.0], 0)
    partial.append_tokens([8, 9], [-8.0, -7.0], 1)
    done = RolloutSample(prompt_ids=[4, 5])
    done.append_tokens([7, 8, 9, 10, 11], [-1.0] * 5, 2)
    engine.generate([partial, done], SamplingParams(max_new_tokens=5))

    assert done.output_len == 5 and done.finish_reason == "length"
    assert 4 <= partial.output_len <= 5 and partial.versions[3:] == [2] * (partial.output_len - 3)
    ref = reference_logprobs(model, partial.input_ids, partial.prompt_len, 1.0)
    # the new tokens continue the partial sequence
    assert max(abs(a - b) for a, b in zip(partial.old_logprobs[3:], ref[3:], strict=True)) <= 1e-5
    # tokens of version 1 = current − 1 take π_prox_t from the prefill under version 2;
    # the version-0 token missed its window and stays untouched
    assert partial.proximal_t_versions[:3] == [0, 2, 2]
    assert partial.proximal_logprobs_t[0] == -9.0
    assert partial.proximal_logprobs_t[1:3] == pytest.approx(ref[1:3], abs=1e-5)
    assert partial.old_logprobs[:3] == [-9.0, -8.0, -7.0]


def test_generate_rejects_bad_samples():
    engine = LocalEngine(tiny_model(), eos_token_id=EOS, pad_token_id=PAD)
    finished = RolloutSample(prompt_ids=[1])
    finished.finish("stop")
    one = RolloutSample(prompt_ids=[1, 2])
    cases = [
        ([finished], "already finished"),
        ([RolloutSample(prompt_ids=[])], "empty prompt"),
        ([RolloutSample(prompt_ids=[1, 99])], "outside the model's vocabulary"),
        ([one, one], "twice"),
    ]
    for samples, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.generate(samples, SamplingParams(max_new_tokens=2))
    assert engine.inflight_samples() == []
    # the engine trusts its temperature: the config (tests/config/test_compose.py) and the batch
    # reader (tests/rollout/test_batch_file.py) refuse one outside [0.01, 100]


# -------------------------------------------------------------- abort
def test_aborting_some_samples_of_a_call_leaves_the_others_generating_exactly():
    # abort(ids) ends those samples at the next token boundary, unfinished; the call's other rows
    # decode on to their end with exact log-probs (2 of 4 rows aborted: the batch is compacted and
    # its KV cache cut to the live rows). Ids that are not in flight are ignored.
    model = tiny_model()
    samples = prompts([3, 6, 2, 5], seed=7)
    aborted = {samples[0].sample_id, samples[2].sample_id}
    steps = []

    def after_step():
        steps.append(len(steps) + 1)
        if len(steps) == 3:
            engine.abort([*aborted, 10**9])

    engine = LocalEngine(
        model, temperature=0.8, eos_token_id=EOS, pad_token_id=PAD, seed=2, step_callback=after_step
    )
    engine.generate(samples, SamplingParams(max_new_tokens=10))
    for s in samples:
        if s.sample_id in aborted:
            assert not s.is_finished and s.output_len == 3, (s.output_len, s.finish_reason)
        else:
            assert s.is_finished
        ref = reference_logprobs(model, s.input_ids, s.prompt_len, 0.8)
        assert max(abs(a - b) for a, b in zip(s.old_logprobs, ref, strict=True)) <= 1e-5
    assert max(s.output_len for s in samples if s.sample_id not in aborted) > 4, "the seed must decode past the abort"
    assert engine.inflight_samples() == []
    assert engine.abort([samples[1].sample_id]) is None and engine._aborted == set()  # noqa: SLF001


# -------------------------------------------------------------- weights
def perturbed_state(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A copy of the model's weights plus noise; tied tensors stay one tensor."""
    g = torch.Generator().manual_seed(seed)
    new = {id(p): p.detach() + 0.05 * torch.randn(p.shape, generator=g) for p in model.parameters()}
    return {name: new[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}


def test_update_in_memory_sets_version_and_keeps_tied_weights_tied():
    model = tiny_model()
    engine = LocalEngine(model, eos_token_id=EOS, pad_token_id=PAD)
    state = perturbed_state(model, seed=1)
    seq = [3, 1, 4, 1, 5, 9, 2, 6]
    before = engine.score([seq], [1])[0]

    engine.pause()
    engine.update_weights(WeightUpdate(version=1, state_dict=state))
    engine.resume()

    assert engine.get_version() == 1
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])
    after = engine.score([seq], [1])[0]
    ref = reference_logprobs(model_with(state), seq, 1, 1.0)
    assert max(abs(a - b) for a, b in zip(after, ref, strict=True)) <= 1e-5
    assert max(abs(a - b) for a, b in zip(after, before, strict=True)) > 1e-3, (
        "the new weights must matter"
    )


@pytest.mark.parametrize("shard", [None, "40KB"])
def test_update_from_a_safetensors_directory(tmp_path, shard):
    model = tiny_model()
    engine = LocalEngine(model, eos_token_id=EOS, pad_token_id=PAD)
    state = perturbed_state(model, seed=2)
    saved = model_with(state)
    if shard is None:
        saved.save_pretrained(tmp_path)
        assert (tmp_path / "model.safetensors").is_file()
    else:
        saved.save_pretrained(tmp_path, max_shard_size=shard)
        assert (tmp_path / "model.safetensors.index.json").is_file()

    engine.pause()
    engine.update_weights(WeightUpdate(version=3, path=tmp_path))
    assert engine.get_version() == 3
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    seq = [2, 7, 1, 8, 2, 8]
    ref = reference_logprobs(saved, seq, 1, 1.0)
    assert max(abs(a - b) for a, b in zip(engine.score([seq], [1])[0], ref, strict=True)) <= 1e-5


def test_weight_update_errors_leave_the_engine_unchanged(tmp_path):
    model = tiny_model()
    engine = LocalEngine(model, eos_token_id=EOS, pad_token_id=PAD)
    state = perturbed_state(model, seed=3)
    seq = [1, 2, 3, 4, 5]
    before = engine.score([seq], [1])[0]

    with pytest.raises(EngineError, match="pause"):
        engine.update_weights(WeightUpdate(version=1, state_dict=state))

    engine.pause()
    (tmp_path / "empty").mkdir()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    missing_key = {k: v for k, v in state.items() if k != "model.norm.weight"}
    wrong_shape = {**state, "model.norm.weight": torch.zeros(3)}
    drifted_tie = {**state, "lm_head.weight": state["lm_head.weight"] + 1}
    cases = [
        (WeightUpdate(version=1, path=tmp_path / "nowhere"), "nowhere: weight directory not found"),
        (WeightUpdate(version=1, path=tmp_path / "empty"), "empty: no model.safetensors"),
        (WeightUpdate(version=1, path=broken), "broken/model.safetensors: is truncated: its header claims 16 bytes but 12 follow"),
        (WeightUpdate(version=1, state_dict=missing_key), "1 missing .e.g. model.norm.weight"),
        (WeightUpdate(version=1, state_dict={**state, "extra": torch.zeros(1)}), "1 unexpected"),
        (WeightUpdate(version=1, state_dict=wrong_shape), "wrong shape"),
        (WeightUpdate(version=1, state_dict=drifted_tie), "tied tensors"),
    ]
    for update, message in cases:
        with pytest.raises(EngineError, match=message) as info:
            engine.update_weights(update)
        assert "\n" not in str(info.value)

    engine.set_version(5)
    with pytest.raises(EngineError, match="go back"):
        engine.update_weights(WeightUpdate(version=4, state_dict=state))
    assert engine.get_version() == 5
    assert engine.score([seq], [1])[0] == before
