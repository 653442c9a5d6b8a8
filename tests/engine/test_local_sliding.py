"""LocalEngine on sliding-window models (issue 24): generation, re-prefills of partial outputs
of unequal length, weight updates mid-generation and scoring give the log-probs of one unpadded
full forward; a model whose config declares attention the engine does not know runs each row's
whole sequence, with one warning.

transformers masks a sliding window by cache index. The engine's batches are left-padded, which
keeps a row's tokens at consecutive cache indices; a re-prefill of partial outputs of unequal
length would leave padding between a short output and the tokens decoded after it, so it runs
each row's whole sequence instead (``LocalEngine._forward_shared``).
"""

from __future__ import annotations

import warnings
from functools import partial

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdp_cli.engine.base import SamplingParams, WeightUpdate
from sdp_cli.engine.local import LocalEngine
from sdp_cli.models.kv_cache import with_cache
from sdp_cli.rollout.records import RolloutSample

from ..sliding_models import KINDS, sliding_model
from .test_local_segments import WAIT_S, Pauser, check_versions_and_proximal, perturb_, snapshot, start_generate
from .tiny_qwen import EOS, PAD, prompts, reference_logprobs, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _forward_widths(model: torch.nn.Module) -> list[int]:
    """The input width of every forward of ``model`` from now on (1: a decode step)."""
    widths: list[int] = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    return widths


def _with_state(kind: str, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = sliding_model(kind)
    model.load_state_dict(state)
    return model


def _partials(model: torch.nn.Module) -> list[RolloutSample]:
    """Four samples, three of them with one prompt, arriving with outputs of 1, 9, 4 and 0
    tokens of version 0 (the window is 4 tokens) and their logprobs under ``model``."""
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(1, EOS, (3,), generator=gen).tolist()
    other = torch.randint(1, EOS, (6,), generator=gen).tolist()
    samples = []
    for prompt, output_len in [(shared, 1), (shared, 9), (other, 4), (shared, 0)]:
        sample = RolloutSample(prompt_ids=list(prompt))
        if output_len:
            tokens = torch.randint(1, EOS, (output_len,), generator=gen).tolist()
            sample.append_tokens(tokens, reference_logprobs(model, prompt + tokens, len(prompt), 1.0), 0)
        samples.append(sample)
    return samples


def _worst(model: torch.nn.Module, sample: RolloutSample, start: int, values: list[float]) -> float:
    """The largest gap between ``values`` (log-probs of output tokens ``start``…) and the reference."""
    ref = reference_logprobs(model, sample.input_ids, sample.prompt_len, 1.0)[start:]
    assert len(ref) == len(values)
    return max((abs(a - b) for a, b in zip(values, ref, strict=True)), default=0.0)


@pytest.mark.parametrize("kind", KINDS)
def test_generation_and_scoring_of_prompts_of_mixed_lengths_are_exact(kind):
    model = sliding_model(kind)
    engine = LocalEngine(model, eos_token_id=EOS, pad_token_id=PAD, seed=3)
    samples = prompts([1, 4, 12, 2, 7, 3])
    engine.generate(samples, SamplingParams(max_new_tokens=16))
    assert max(s.output_len for s in samples) > 8  # twice the window
    assert max(_worst(model, s, 0, s.old_logprobs) for s in samples) <= 1e-5
    scored = engine.score([s.input_ids for s in samples], [s.prompt_len for s in samples])
    assert max(_worst(model, s, 0, v) for s, v in zip(samples, scored, strict=True)) <= 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_partial_outputs_of_unequal_length_continue_exactly(kind):
    """The engine is at version 1 and the samples bring tokens of version 0: the prefill takes
    their π_prox_t, and decoding continues on its cache past the window."""
    model = sliding_model(kind)
    engine = LocalEngine(model, eos_token_id=EOS, pad_token_id=PAD, seed=6)
    engine.set_version(1)
    samples = _partials(model)
    widths = _forward_widths(model)
    engine.generate(samples, SamplingParams(max_new_tokens=20))
    assert max(s.output_len for s in samples) > 12
    state = snapshot(model)
    check_versions_and_proximal(samples, {0: state, 1: state}, 1.0, model_of=partial(_with_state, kind))
    # one prefill of each row's whole sequence (the longest: 3 + 9 tokens), then decode steps
    assert widths[0] == 12 and set(widths[1:]) == {1}


@pytest.mark.parametrize("kind", KINDS)
def test_weight_updates_mid_generation_reprefill_exactly(kind):
    """Outputs of unequal length at both updates: every token's π_behav and π_prox_t are the
    reference's under the weights of its version and of the next."""
    model = sliding_model(kind)
    trainer = sliding_model(kind)
    pauser = Pauser({3, 7})
    engine = LocalEngine(model, eos_token_id=EOS, pad_token_id=PAD, seed=7, step_callback=pauser)
    pauser.engine = engine
    states = {0: snapshot(trainer)}
    samples = _partials(model)
    thread, errors = start_generate(engine, samples, SamplingParams(max_new_tokens=20))
    for version in (1, 2):
        pauser.wait()
        perturb_(trainer, seed=version)
        states[version] = snapshot(trainer)
        engine.update_weights(WeightUpdate(version=version, state_dict=states[version]))
        engine.resume()
    thread.join(WAIT_S)
    assert not thread.is_alive() and not errors
    assert sum(max(s.versions) == 2 for s in samples) >= 2  # rows of unequal length outlived both updates
    check_versions_and_proximal(samples, states, 1.0, model_of=partial(_with_state, kind))


def test_partial_outputs_of_equal_length_still_share_their_prompt():
    """Equal outputs leave no gap: the prefill runs the distinct prompt once, then the outputs."""
    model = sliding_model("qwen2")
    engine = LocalEngine(model, eos_token_id=EOS, pad_token_id=PAD, seed=8)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, EOS, (5,), generator=gen).tolist()
    samples = []
    for _ in range(3):
        tokens = torch.randint(1, EOS, (6,), generator=gen).tolist()
        sample = RolloutSample(prompt_ids=list(prompt))
        sample.append_tokens(tokens, reference_logprobs(model, prompt + tokens, 5, 1.0), 0)
        samples.append(sample)
    widths = _forward_widths(model)
    engine.generate(samples, SamplingParams(max_new_tokens=14))
    assert widths[:2] == [5, 6] and set(widths[2:]) == {1}
    assert max(_worst(model, s, 0, s.old_logprobs) for s in samples) <= 1e-5


def test_attention_the_engine_does_not_know_runs_each_row_plainly_with_one_warning():
    """Chunked attention (declared by the config alone here, on a full-attention model, so that
    the reference is known) is not trusted with shared prompts: prefills and scoring run each
    row's whole sequence, and the log-probs are still exact."""
    model = tiny_model()
    model.config.attention_chunk_size = 4
    with pytest.warns(UserWarning, match="attention_chunk_size") as caught:
        engine = LocalEngine(model, eos_token_id=EOS, pad_token_id=PAD, seed=9)
    assert len(caught) == 1 and len(str(caught[0].message).splitlines()) == 1
    samples = [*prompts([4, 4, 4], seed=2), *_partials(model)]
    widths = _forward_widths(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once, at construction
        engine.generate(samples[:3], SamplingParams(max_new_tokens=8))
        engine.generate(samples[3:], SamplingParams(max_new_tokens=12))
        scored = engine.score([s.input_ids for s in samples], [s.prompt_len for s in samples])
    # three whole-row forwards, none of a prompt alone: the two prefills (4; 3 + 9) and the scoring
    assert [w for w in widths if w > 1] == [4, 12, max(len(s.input_ids) for s in samples) - 1]
    state = snapshot(model)
    check_versions_and_proximal(samples, {0: state}, 1.0, model_of=lambda _: model)
    assert max(_worst(model, s, 0, v) for s, v in zip(samples, scored, strict=True)) <= 1e-5


@st.composite
def rows(draw):
    """Prefixes (some shared) and suffixes of mixed lengths, the window (4) shorter than most rows."""
    prefixes = draw(st.lists(st.lists(st.integers(1, EOS - 1), min_size=1, max_size=9), min_size=1, max_size=3))
    owners = draw(st.lists(st.integers(0, len(prefixes) - 1), min_size=1, max_size=5))
    suffixes = [draw(st.lists(st.integers(1, EOS - 1), min_size=0, max_size=7)) for _ in owners]
    return [list(prefixes[o]) for o in owners], suffixes


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(KINDS), batch=rows(), use_cache=st.booleans(), token=st.integers(1, EOS - 1))
def test_the_forward_and_a_decode_step_on_its_cache_are_exact(kind, batch, use_cache, token):
    """``_forward_shared``: every logits column is the unpadded forward's, and with the cache kept,
    one decode step after each row's last token (the next prefill turn) is exact too."""
    model = sliding_model(kind)
    engine = LocalEngine(model, eos_token_id=EOS, pad_token_id=PAD)
    prefixes, suffixes = batch
    with torch.inference_mode():
        logits, mask, cache = engine._forward_shared(prefixes, suffixes, use_cache=use_cache)  # noqa: SLF001
        worst = 0.0
        for i, (prefix, suffix) in enumerate(zip(prefixes, suffixes, strict=True)):
            full = model(input_ids=torch.tensor([prefix + suffix + [token]])).logits[0]
            expected = full[len(prefix) - 1 : len(prefix) + len(suffix)]
            worst = max(worst, float((logits[i, : len(suffix) + 1] - expected).abs().max()))
        if use_cache:
            step = model(
                input_ids=torch.full((len(prefixes), 1), token),
                attention_mask=torch.cat([mask, mask.new_ones(len(prefixes), 1)], 1),
                position_ids=mask.sum(1, keepdim=True),
                use_cache=True,
                **with_cache(cache),
            ).logits[:, -1]
            for i, (prefix, suffix) in enumerate(zip(prefixes, suffixes, strict=True)):
                full = model(input_ids=torch.tensor([prefix + suffix + [token]])).logits[0, -1]
                worst = max(worst, float((step[i] - full).abs().max()))
    assert worst <= 1e-5
