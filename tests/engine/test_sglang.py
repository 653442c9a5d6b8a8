"""engine=sglang against a stub server that answers like SGLang 0.5.x (tests/engine/stubs).

The stub runs a tiny real torch model, so every logprob checked here is recomputed directly
from the weights of the version that must have produced it (``tiny_lm.score``).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import httpx
import pytest

from sdp_cli.engine.base import EngineError, EngineUnavailable, SamplingParams, WeightUpdate
from sdp_cli.engine.http import HttpOptions
from sdp_cli.engine.remote import RemoteOptions
from sdp_cli.engine.servers import free_port
from sdp_cli.engine.sglang import SGLangEngine, SGLangLaunchConfig
from sdp_cli.rollout.records import RolloutSample

from .stubs import sampling, sglang_stub, tiny_lm

FAST = HttpOptions(max_retries=0, request_timeout_s=30.0)
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]


@pytest.fixture
def weight_dirs(tmp_path):
    """Weights of versions 0..4, each from its own seed."""
    return [
        tiny_lm.save_weights(tmp_path / f"v{v}", tiny_lm.make_weights(seed=100 + v))
        for v in range(5)
    ]


@pytest.fixture
def stub(weight_dirs):
    with sglang_stub.SGLangStub(weight_dirs[0]) as server:
        yield server


def _engine(stub, **options) -> SGLangEngine:
    http = options.pop("http", FAST)
    return SGLangEngine([stub.url], RemoteOptions(ignore_eos=True, http=http, **options))


def _samples(prompts=PROMPTS):
    return [RolloutSample(prompt_ids=list(p)) for p in prompts]


def _in_thread(target, *args):
    """Run ``target`` in a thread; ``join()`` re-raises its exception."""
    errors: list[BaseException] = []

    def run():
        try:
            target(*args)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join(timeout: float = 60.0):
        thread.join(timeout)
        assert not thread.is_alive(), "generation did not finish"
        if errors:
            raise errors[0]

    return thread, join


# --------------------------------------------------------------------------- generation
def test_generate_records_tokens_logprobs_and_versions(stub, weight_dirs):
    weights = tiny_lm.load_weights(weight_dirs[0])
    with _engine(stub) as engine:
        samples = _samples()
        engine.generate(samples, SamplingParams(max_new_tokens=6, seed=3))
    for s in samples:
        assert s.output_len == 6 and s.finish_reason == "length"
        assert s.versions == [0] * 6 and s.proximal_t_versions == [0] * 6
        # every behaviour logprob is log p_v0(token | prefix), recomputed from the weights
        assert s.old_logprobs == pytest.approx(
            tiny_lm.score(weights, s.input_ids, s.prompt_len), abs=1e-9
        )
        assert s.proximal_logprobs_t == s.old_logprobs
    bodies = stub.requests_to("/generate")
    assert all(
        b["return_logprob"] is True and b["stream"] is False and b["logprob_start_len"] == -1
        for b in bodies
    )
    # 0.5.23 rejects unknown sampling keys with 400, so the stub would have failed them: all known
    assert all(set(b["sampling_params"]) <= sglang_stub.KNOWN_SAMPLING_KEYS for b in bodies)


def test_model_sampling_defaults_are_overridden_by_neutral_values(tmp_path):
    # A model whose generation_config.json sets every sampling default the server applies to
    # a request that leaves it out (SGLang --sampling-defaults model). top_k = 1 alone would make
    # every sample of a prompt the same greedy string, drawn from a distribution other than the
    # one whose logprobs are recorded.
    model_dir = tiny_lm.save_weights(tmp_path / "model", tiny_lm.make_weights(seed=100))
    (model_dir / "generation_config.json").write_text(
        '{"top_k": 1, "top_p": 0.3, "min_p": 0.5, "repetition_penalty": 1.8, '
        '"frequency_penalty": 1.5, "presence_penalty": 1.5, "temperature": 0.2}'
    )
    weights = tiny_lm.load_weights(model_dir)
    with sglang_stub.SGLangStub(model_dir) as stub, _engine(stub) as engine:
        samples = _samples([[5, 6, 7]] * 16)
        engine.generate(samples, SamplingParams(max_new_tokens=8, seed=1))
        engine.score([samples[0].input_ids], [samples[0].prompt_len])
        bodies = stub.requests_to("/generate")
    assert len({tuple(s.output_ids) for s in samples}) > 1, "sampled greedily: top_k=1 applied"
    for s in samples:
        assert s.old_logprobs == pytest.approx(tiny_lm.score(weights, s.input_ids, s.prompt_len), abs=1e-9)
    for body in bodies:  # generation and scoring alike
        assert sampling.is_neutral(body["sampling_params"], stub.state.generation_defaults), body


def test_stop_token_is_kept_and_finishes_with_stop(stub):
    every_token = tuple(range(tiny_lm.VOCAB))
    with _engine(stub) as engine:
        samples = _samples()
        engine.generate(samples, SamplingParams(max_new_tokens=10, stop_token_ids=every_token))
    # whatever is sampled first is a stop token: one token, kept in the output, reason "stop"
    assert [(s.output_len, s.finish_reason) for s in samples] == [(1, "stop")] * len(samples)


def test_connect_labels_the_server_with_the_client_version(stub):
    with SGLangEngine([stub.url], RemoteOptions(http=FAST), version=7) as engine:
        assert stub.weight_version == "7"
        engine.set_version(9)
        assert stub.weight_version == "9" and engine.get_version() == 9
    assert stub.requests_to("/update_weight_version")[-1] == {
        "new_version": "9",
        "abort_all_requests": False,
    }


# ------------------------------------------------------------------------------ scoring
@pytest.mark.parametrize("start", [1, 2, 5, 7])
def test_score_aligns_with_the_null_first_row(stub, weight_dirs, start):
    weights = tiny_lm.load_weights(weight_dirs[0])
    sequence = [3, 4, 5, 6, 7, 8, 9]
    with _engine(stub) as engine:
        (scored,) = engine.score([sequence], [start])
    # log p(s[t] | s[:t]) for t = start..6; start = 7 = len(sequence) scores nothing
    assert scored == pytest.approx(tiny_lm.score(weights, sequence, start), abs=1e-9)
    assert len(scored) == len(sequence) - start
    if start < len(sequence):
        (body,) = stub.requests_to("/generate")
        assert (
            body["logprob_start_len"] == start - 1
            and body["sampling_params"]["max_new_tokens"] == 0
        )


def test_prefill_scores_equal_sampled_logprobs_at_temperature_one(stub):
    with _engine(stub) as engine:
        samples = _samples()
        engine.generate(samples, SamplingParams(max_new_tokens=8, seed=1))
        scores = engine.score([s.input_ids for s in samples], [s.prompt_len for s in samples])
    for s, scored in zip(samples, scores):
        assert scored == pytest.approx(s.old_logprobs, abs=1e-9)


# ------------------------------------------------------------- abort / resume / versions
def _recompute_pass(engine, weights_loaded_version: int) -> None:
    """docs/design.md §2 step 2, as the rollout loop does it: score tokens of version v-1 under v."""
    v = weights_loaded_version
    todo = []
    for s in engine.inflight_samples():
        idx = [
            t
            for t in range(s.output_len)
            if s.versions[t] == v - 1 and s.proximal_t_versions[t] != v
        ]
        if idx:
            todo.append((s, idx))
    if not todo:
        return
    scores = engine.score(
        [s.input_ids for s, _ in todo], [s.prompt_len + idx[0] for s, idx in todo]
    )
    for (s, idx), values in zip(todo, scores):
        for t in idx:
            s.set_proximal_t(t, values[t - idx[0]], v)


def test_abort_and_resume_across_three_weight_updates(stub, weight_dirs):
    weights = [tiny_lm.load_weights(d) for d in weight_dirs]
    hold, budget, n = 3, 20, len(PROMPTS)
    stub.set_hold(hold)  # every request stops after 3 of its tokens until it is aborted
    with _engine(stub) as engine:
        samples = _samples()
        _, join = _in_thread(
            engine.generate, samples, SamplingParams(max_new_tokens=budget, seed=5)
        )
        for version in (1, 2, 3):
            stub.wait_holding(n)
            engine.pause()
            assert sorted(s.sample_id for s in engine.inflight_samples()) == sorted(
                s.sample_id for s in samples
            )
            # pause() returns with every aborted partial output recorded, and nothing changes
            # until resume()
            assert [s.output_len for s in samples] == [hold * version] * n
            _recompute_pass(engine, version - 1)
            engine.update_weights(WeightUpdate(version=version, path=weight_dirs[version]))
            assert stub.weight_version == str(version)
            assert [s.output_len for s in samples] == [hold * version] * n
            engine.resume()
        stub.wait_holding(n)
        stub.release()
        join()
        stats = engine.stats()
    for s in samples:
        assert s.finish_reason == "length" and s.output_len == budget
        # three aborted segments of 3 tokens, then the rest under version 3
        assert s.versions == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 11
        s.check_consistent()
        for t, v in enumerate(s.versions):
            assert s.old_logprobs[t] == pytest.approx(
                tiny_lm.score(weights[v], s.input_ids, s.prompt_len)[t], abs=1e-9
            )
            if v < 3:
                # π_prox_t is log p under version v+1, computed directly from those weights
                direct = tiny_lm.score(weights[v + 1], s.input_ids, s.prompt_len)[t]
                assert s.proximal_t_versions[t] == v + 1
                assert s.proximal_logprobs_t[t] == pytest.approx(direct, abs=1e-9)
                assert s.proximal_logprobs_t[t] != pytest.approx(s.old_logprobs[t], abs=1e-6)
            else:
                assert (s.proximal_t_versions[t], s.proximal_logprobs_t[t]) == (
                    3,
                    s.old_logprobs[t],
                )
    # each sample: 4 segments (3 aborted), 3 resubmissions, 9 tokens patched from a prefill
    assert stats["resubmissions"] == 3 * n and stats["aborted_segments"] == 3 * n
    assert stats["prefill_proximal_tokens"] == 9 * n
    bodies = stub.requests_to("/generate")
    # the resubmissions' prefills covered every token: the recompute pass had nothing to score
    assert all(b["sampling_params"]["max_new_tokens"] > 0 for b in bodies)
    by_prompt = {}
    for b in bodies:
        by_prompt.setdefault(tuple(b["input_ids"][:1]), []).append(b)
    for s in samples:
        segments = by_prompt[tuple(s.prompt_ids[:1])]
        # resubmission k asks for prefill logprobs from the first token of version k-1
        # (absolute input position P + 3(k-1), so logprob_start_len is one less), budget 20 - 3k
        assert [b["logprob_start_len"] for b in segments] == [-1] + [
            s.prompt_len + 3 * (k - 1) - 1 for k in (1, 2, 3)
        ]
        assert [b["sampling_params"]["max_new_tokens"] for b in segments] == [20, 17, 14, 11]
    rids = [b["rid"] for b in bodies]
    assert len(set(rids)) == len(rids) and {len(r) for r in rids} == {32}


def test_recompute_pass_covers_a_sample_whose_resubmission_never_ran(stub, weight_dirs):
    """A sample aborted at v0, then paused again before its resubmission produced anything,
    gets π_prox_t of its v0 tokens from the recompute pass (step 2), not the prefill."""
    weights = [tiny_lm.load_weights(d) for d in weight_dirs]
    stub.set_hold(2)
    with _engine(stub) as engine:
        (sample,) = samples = _samples(PROMPTS[:1])
        _, join = _in_thread(engine.generate, samples, SamplingParams(max_new_tokens=6, seed=2))
        stub.wait_holding(1)
        engine.pause()
        engine.update_weights(WeightUpdate(version=1, path=weight_dirs[1]))
        stub.set_hold(0)  # the resubmission will be held before its first token
        engine.resume()
        stub.wait_holding(1)
        engine.pause()
        _recompute_pass(engine, 1)  # scores the v0 tokens under v1 (the prefill answer is lost)
        engine.update_weights(WeightUpdate(version=2, path=weight_dirs[2]))
        engine.resume()
        stub.release()
        join()
    assert sample.versions == [0, 0, 2, 2, 2, 2]
    direct_v1 = tiny_lm.score(weights[1], sample.input_ids, sample.prompt_len)
    assert sample.proximal_t_versions[:2] == [1, 1]
    assert sample.proximal_logprobs_t[:2] == pytest.approx(direct_v1[:2], abs=1e-9)


def test_generate_blocks_while_paused(stub):
    with _engine(stub) as engine:
        engine.pause()
        samples = _samples(PROMPTS[:1])
        thread, join = _in_thread(engine.generate, samples, SamplingParams(max_new_tokens=4))
        thread.join(0.3)  # long enough for an unblocked call to finish several times over
        assert thread.is_alive() and stub.requests_to("/generate") == []
        engine.resume()
        join()
    assert samples[0].output_len == 4


def test_update_weights_preconditions(stub, weight_dirs, tmp_path):
    import torch

    with _engine(stub) as engine:
        with pytest.raises(EngineError, match="paused"):
            engine.update_weights(WeightUpdate(version=1, path=weight_dirs[1]))
        engine.pause()
        with pytest.raises(EngineError, match="safetensors directory"):
            engine.update_weights(WeightUpdate(version=1, state_dict={"w": torch.zeros(1)}))
        with pytest.raises(EngineError, match="does not exist"):
            engine.update_weights(WeightUpdate(version=1, path=tmp_path / "missing"))
        empty = tmp_path / "empty"
        empty.mkdir()
        with pytest.raises(EngineError, match="could not load weights"):
            engine.update_weights(WeightUpdate(version=1, path=empty))
        assert engine.get_version() == 0 and stub.weight_version == "0"
        # a failed load still lets the server generate again
        engine.resume()
        samples = _samples(PROMPTS[:1])
        engine.generate(samples, SamplingParams(max_new_tokens=2))
        assert samples[0].versions == [0, 0]


def test_update_sequence_on_the_server(stub, weight_dirs):
    with _engine(stub) as engine:
        engine.pause()
        engine.update_weights(WeightUpdate(version=1, path=weight_dirs[1]))
    paths = [p for _, p, _ in stub.state.requests]
    start = paths.index("/update_weights_from_disk")
    assert paths[start - 1 : start + 3] == [
        "/pause_generation",
        "/update_weights_from_disk",
        "/flush_cache",
        "/continue_generation",
    ]
    (update,) = stub.requests_to("/update_weights_from_disk")
    assert update == {
        "model_path": str(weight_dirs[1].resolve()),
        "weight_version": "1",
        "flush_cache": False,
    }
    assert stub.requests_to("/pause_generation") == [{"mode": "abort"}] * 2


def test_version_disagreement_is_an_error_and_the_sample_is_not_touched(stub):
    with _engine(stub) as engine:
        # someone else relabels the server's weights behind sdp's back
        httpx.post(
            stub.url + "/update_weight_version",
            json={"new_version": "7", "abort_all_requests": False},
        )
        samples = _samples(PROMPTS[:1])
        with pytest.raises(EngineError, match=r"weight version\(s\) \['7'\].*tagged it version 0"):
            engine.generate(samples, SamplingParams(max_new_tokens=3))
    assert samples[0].output_len == 0 and samples[0].finish_reason is None


def test_servers_without_spans_are_checked_with_their_single_label(weight_dirs):
    with (
        sglang_stub.SGLangStub(weight_dirs[0], report_spans=False) as stub,
        _engine(stub) as engine,
    ):
        samples = _samples(PROMPTS[:2])
        engine.generate(samples, SamplingParams(max_new_tokens=3))
        assert all(s.versions == [0, 0, 0] for s in samples)
        httpx.post(
            stub.url + "/update_weight_version",
            json={"new_version": "3", "abort_all_requests": False},
        )
        with pytest.raises(EngineError, match="tagged it version 0"):
            engine.generate(_samples(PROMPTS[:1]), SamplingParams(max_new_tokens=3))


def test_pause_waits_for_a_request_that_reaches_the_server_after_the_abort(stub, weight_dirs):
    """A request sent just before pause() can reach the server after the server-wide abort;
    pause() aborts it by id and returns only once its partial output is recorded, so the
    weight update cannot fall inside it."""
    weights = [tiny_lm.load_weights(d) for d in weight_dirs]
    with _engine(stub) as engine:
        entered, release = threading.Event(), threading.Event()
        original = engine._server_generate
        calls = []

        def delayed(server, request, refresh):
            calls.append(request)
            if len(calls) == 1:
                entered.set()
                release.wait()
            return original(server, request, refresh)

        engine._server_generate = delayed
        stub.set_hold(2)
        samples = _samples(PROMPTS[:1])
        _, join = _in_thread(engine.generate, samples, SamplingParams(max_new_tokens=5, seed=9))
        entered.wait()
        pause_thread, pause_join = _in_thread(engine.pause)
        stub.wait_requests("/abort_request", 1)  # pause() is aborting the straggler by id ...
        assert pause_thread.is_alive()  # ... and has not returned
        release.set()  # the request reaches the server only now, after the server-wide abort
        pause_join()
        assert {b["rid"] for b in stub.requests_to("/abort_request")} == {calls[0].request_id}
        (sample,) = samples
        k = sample.output_len  # recorded before pause() returned: 0..2 tokens, as the abort fell
        assert k <= 2 and sample.versions == [0] * k
        engine.update_weights(WeightUpdate(version=1, path=weight_dirs[1]))
        engine.resume()
        stub.release()
        join()
    assert sample.versions == [0] * k + [1] * (5 - k)
    assert sample.old_logprobs[:k] == pytest.approx(
        tiny_lm.score(weights[0], sample.input_ids, 3)[:k], abs=1e-9
    )
    assert sample.proximal_logprobs_t[:k] == pytest.approx(
        tiny_lm.score(weights[1], sample.input_ids, 3)[:k], abs=1e-9
    )


def test_an_abort_no_pause_explains_is_retried_then_reported(stub):
    stub.set_hold(0)
    with _engine(stub, max_unexplained_aborts=2) as engine:
        samples = _samples(PROMPTS[:1])
        _, join = _in_thread(engine.generate, samples, SamplingParams(max_new_tokens=4))
        seen: set[str] = set()
        for _ in range(3):
            rid = stub.wait_new_holding(seen)
            seen.add(rid)
            # SGLang matches rids by prefix: the first 8 characters abort this request
            httpx.post(stub.url + "/abort_request", json={"rid": rid[:8]})
        with pytest.raises(EngineError, match="aborted sample .* 3 times without a pause"):
            join()


def test_close_aborts_the_requests_in_flight(stub):
    stub.set_hold(1)
    engine = _engine(stub)
    samples = _samples(PROMPTS[:2])
    _, join = _in_thread(engine.generate, samples, SamplingParams(max_new_tokens=5))
    stub.wait_holding(2)
    live = set(stub.state.live)
    engine.close()
    with pytest.raises(EngineError, match="closed"):
        join()
    assert {b["rid"] for b in stub.requests_to("/abort_request")} == live


# ---------------------------------------------------------------------- several servers
def test_load_is_spread_and_resubmissions_stick_to_their_server(weight_dirs):
    with sglang_stub.SGLangStub(weight_dirs[0]) as a, sglang_stub.SGLangStub(weight_dirs[0]) as b:
        a.set_hold(2)
        b.set_hold(2)
        with SGLangEngine([a.url, b.url], RemoteOptions(ignore_eos=True, http=FAST)) as engine:
            samples = _samples()
            _, join = _in_thread(engine.generate, samples, SamplingParams(max_new_tokens=6))
            a.wait_holding(2)  # least-loaded placement: two samples on each server
            b.wait_holding(2)
            engine.pause()
            engine.update_weights(WeightUpdate(version=1, path=weight_dirs[1]))
            assert a.weight_version == b.weight_version == "1"
            engine.resume()
            a.wait_holding(2)
            b.wait_holding(2)
            a.release()
            b.release()
            join()
        prompts_a = {tuple(x["input_ids"][:1]) for x in a.requests_to("/generate")}
        prompts_b = {tuple(x["input_ids"][:1]) for x in b.requests_to("/generate")}
        assert len(prompts_a) == len(prompts_b) == 2 and not prompts_a & prompts_b
        assert all(s.versions == [0, 0, 1, 1, 1, 1] for s in samples)


# ------------------------------------------------------------------- transport failures
def test_unreachable_server_is_one_line_naming_the_address():
    port = free_port()
    with pytest.raises(EngineUnavailable) as err:
        SGLangEngine(
            [f"http://127.0.0.1:{port}"],
            RemoteOptions(http=HttpOptions(max_retries=1, backoff_initial_s=0.01)),
        )
    message = str(err.value)
    assert (
        "\n" not in message and f"127.0.0.1:{port}" in message and "sglang.launch_server" in message
    )


def test_5xx_is_retried_and_a_dropped_connection_gets_a_fresh_rid(stub):
    http = HttpOptions(max_retries=2, backoff_initial_s=0.001)
    with _engine(stub, http=http) as engine:
        stub.inject("/generate", 503)
        stub.inject("/generate", "drop")
        samples = _samples(PROMPTS[:1])
        engine.generate(samples, SamplingParams(max_new_tokens=3))
    assert samples[0].output_len == 3
    rids = [b["rid"] for b in stub.requests_to("/generate")]
    # 503, dropped, then answered: three attempts, each with its own rid (no duplicate-rid 400)
    assert len(rids) == 3 and len(set(rids)) == 3


def test_retries_are_bounded(stub):
    http = HttpOptions(max_retries=2, backoff_initial_s=0.001)
    with _engine(stub, http=http) as engine:
        stub.inject("/generate", 503, times=3)
        samples = _samples(PROMPTS[:1])
        with pytest.raises(EngineError, match="failed after 3 attempt.*HTTP 503"):
            engine.generate(samples, SamplingParams(max_new_tokens=3))
    assert samples[0].output_len == 0


@pytest.mark.parametrize(
    ("fault", "message"),
    [("bad_json", "malformed JSON"), ("mismatch", "3 token ids but 2 logprobs")],
)
def test_malformed_answers_are_rejected_and_the_sample_is_not_used(stub, fault, message):
    with _engine(stub) as engine:
        stub.inject("/generate", fault)
        samples = _samples(PROMPTS[:1])
        with pytest.raises(EngineError, match=message):
            engine.generate(samples, SamplingParams(max_new_tokens=3))
    assert samples[0].output_len == 0 and samples[0].finish_reason is None


def test_client_errors_are_not_retried_and_name_the_route(stub):
    with _engine(stub, http=HttpOptions(max_retries=3, backoff_initial_s=0.001)) as engine:
        stub.inject("/generate", 400)
        with pytest.raises(EngineError, match=r"/generate answered HTTP 400: .*injected 400"):
            engine.generate(_samples(PROMPTS[:1]), SamplingParams(max_new_tokens=3))
    assert len(stub.requests_to("/generate")) == 1


def test_a_connection_closed_by_the_server_while_idle_is_survived(weight_dirs):
    # The stub closes idle keep-alive connections after 0.05 s (uvicorn: 5 s); the client keeps
    # them for 60 s, so its next request meets a connection the server has closed.
    http = HttpOptions(max_retries=1, backoff_initial_s=0.001, keepalive_expiry_s=60.0)
    with (
        sglang_stub.SGLangStub(weight_dirs[0], idle_timeout_s=0.05) as stub,
        _engine(stub, http=http) as engine,
    ):
        for round_ in range(1, 4):
            samples = _samples(PROMPTS[:1])
            engine.generate(samples, SamplingParams(max_new_tokens=2))
            assert samples[0].output_len == 2
            stub.wait_closed_connections(round_)  # the server dropped the idle connection


def test_without_retries_a_connection_dropped_mid_request_is_an_error(stub):
    # what retries protect against: the server closes the connection without answering
    with _engine(stub, http=HttpOptions(max_retries=0)) as engine:
        stub.inject("/generate", "drop")
        with pytest.raises(EngineError, match="server closed the connection"):
            engine.generate(_samples(PROMPTS[:1]), SamplingParams(max_new_tokens=2))


def test_api_key_is_sent_and_never_logged(weight_dirs, caplog):
    secret = "sk-test-5f3a9c"
    caplog.set_level("DEBUG")
    with sglang_stub.SGLangStub(weight_dirs[0], api_key=secret) as stub:
        options = RemoteOptions(ignore_eos=True, http=HttpOptions(max_retries=0, api_key=secret))
        with SGLangEngine([stub.url], options) as engine:
            engine.generate(_samples(PROMPTS[:1]), SamplingParams(max_new_tokens=2))
        assert set(stub.state.auth_headers) == {f"Bearer {secret}"}
        assert secret not in repr(options)
        wrong = RemoteOptions(http=HttpOptions(max_retries=0, api_key="sk-wrong-1"))
        with pytest.raises(EngineError, match=r"HTTP 401 .*; set engine.api_key") as err:
            SGLangEngine([stub.url], wrong)
        assert "sk-wrong-1" not in str(err.value)
    assert not any(secret in record.getMessage() for record in caplog.records)


# -------------------------------------------------------------------------- temperature
def test_temperature_other_than_one_is_refused_with_sglangs_reason(stub):
    # SGLang scales its sampled logprobs by 1/T but not its prefill ones (docs/engines.md
    # "Temperature"): the scores, hence π_prox_t, would not match old_logprobs
    with pytest.raises(
        EngineError,
        match=r"temperature=0.7: SGLang's sampled-token logprobs are log softmax\(z / T\) but its "
        r"prefill logprobs are not temperature-scaled.*use temperature=1.0 or set "
        r"engine.allow_temperature_mismatch=true",
    ):
        SGLangEngine([stub.url], RemoteOptions(temperature=0.7))


def test_temperature_opt_out_warns_and_the_mismatch_is_real(stub, weight_dirs):
    weights = tiny_lm.load_weights(weight_dirs[0])
    with pytest.warns(RuntimeWarning, match="not temperature-scaled"):
        engine = SGLangEngine(
            [stub.url],
            RemoteOptions(
                temperature=0.5, allow_temperature_mismatch=True, ignore_eos=True, http=FAST
            ),
        )
    with engine:
        samples = _samples(PROMPTS[:1])
        engine.generate(samples, SamplingParams(max_new_tokens=4))
        (scored,) = engine.score([samples[0].input_ids], [samples[0].prompt_len])
    s = samples[0]
    # sampled logprobs are log_softmax(z / 0.5); the prefill is untempered log_softmax(z)
    tempered = [
        float(tiny_lm.next_logprobs(weights, s.input_ids[: s.prompt_len + t], 0.5)[s.output_ids[t]])
        for t in range(4)
    ]
    assert s.old_logprobs == pytest.approx(tempered, abs=1e-9)
    assert scored == pytest.approx(tiny_lm.score(weights, s.input_ids, s.prompt_len), abs=1e-9)
    assert max(abs(a - b) for a, b in zip(scored, s.old_logprobs)) > 1e-3


# ------------------------------------------------------------------------------- launch
def test_launch_starts_the_server_and_close_stops_it(weight_dirs, tmp_path):
    fake = Path(__file__).parent / "stubs" / "fake_sglang"
    config = SGLangLaunchConfig(
        model=str(weight_dirs[0]),
        python=sys.executable,
        env={"PYTHONPATH": f"{fake}:{Path(__file__).parent}"},
        startup_timeout_s=60,
    )
    engine = SGLangEngine.launch(
        config, tmp_path / "run", RemoteOptions(ignore_eos=True, http=FAST), version=4
    )
    (managed,) = engine._managed
    try:
        samples = _samples(PROMPTS[:1])
        engine.generate(samples, SamplingParams(max_new_tokens=3))
        assert samples[0].versions == [4, 4, 4]
        assert "--weight-version 4" in " ".join(managed.spec.command)
    finally:
        engine.close()
    assert managed.pid is None and (tmp_path / "run" / "sglang_server.log").is_file()


def test_one_seed_gives_distinct_and_reproducible_samples(stub):
    def run() -> list[tuple[int, ...]]:
        with _engine(stub) as engine:
            samples = _samples([[5, 6, 7]] * 4)
            engine.generate(samples, SamplingParams(max_new_tokens=8, seed=42))
        return [tuple(s.output_ids) for s in samples]

    first = run()
    # a GRPO group shares one seed, yet its samples must differ; the same seed repeats them
    assert run() == first and len(set(first)) == 4


# ----------------------------------------------------------------- from the run config
def _run_cfg(**engine):
    """The fields of the run config that build_engine reads for a server (schema.EngineConfig)."""
    from types import SimpleNamespace

    defaults = dict(
        kind="sglang", urls=[], launch=True, python="python", host="127.0.0.1", port=0, dtype="float32",
        startup_timeout_s=30.0, request_timeout_s=30.0, retries=0, api_key_env=None,
        allow_temperature_mismatch=False, extra_args=[], reconnect_timeout_s=30.0,
    )  # fmt: skip
    return SimpleNamespace(
        engine=SimpleNamespace(**{**defaults, **engine}), rollout=SimpleNamespace(temperature=1.0)
    )


def test_build_from_the_run_config_attaches_with_the_key_from_the_environment(
    weight_dirs, tmp_path, monkeypatch
):
    from sdp_cli.engine.factory import build_engine

    monkeypatch.setenv("SDP_TEST_SGLANG_KEY", "sk-env-42")
    with sglang_stub.SGLangStub(weight_dirs[0], api_key="sk-env-42") as stub:
        cfg = _run_cfg(urls=[stub.url], api_key_env="SDP_TEST_SGLANG_KEY", retries=2)
        with build_engine(cfg, policy=None, run_dir=tmp_path) as engine:
            assert isinstance(engine, SGLangEngine) and engine.options.http.max_retries == 2
            samples = _samples(PROMPTS[:1])
            engine.generate(samples, SamplingParams(max_new_tokens=2))
            # a run's engine stops at EOS (no ignore_eos here), so one token is a full answer too
            (s,) = samples
            assert 1 <= s.output_len <= 2
            stopped = s.output_ids[-1] == sglang_stub.EOS_ID
            assert s.finish_reason == ("stop" if stopped else "length") and (stopped or s.output_len == 2)


@pytest.mark.parametrize(
    ("engine_fields", "message"),
    [
        (
            {"api_key_env": "SDP_TEST_UNSET_KEY"},
            "engine.api_key_env=SDP_TEST_UNSET_KEY, but that environment variable is empty",
        ),
        ({"launch": False}, "has no engine.urls and engine.launch=false"),
        ({"kind": "tgi"}, "engine.kind='tgi' is not an engine; choose one of local, vllm, sglang"),
    ],
)
def test_build_from_the_run_config_refuses_bad_settings(
    tmp_path, monkeypatch, engine_fields, message
):
    from sdp_cli.engine.factory import build_engine
    from sdp_cli.errors import UserError

    monkeypatch.delenv("SDP_TEST_UNSET_KEY", raising=False)
    with pytest.raises(UserError, match=message):
        build_engine(_run_cfg(**engine_fields), policy=None, run_dir=tmp_path)


# ------------------------------------------------- the stub keeps SGLang's documented rules
def test_stub_rejects_unknown_sampling_keys_and_duplicate_live_rids(stub):
    body = {
        "input_ids": [5, 6],
        "sampling_params": {"max_new_tokens": 2, "top_q": 1},
        "return_logprob": True,
    }
    answer = httpx.post(stub.url + "/generate", json=body)
    assert answer.status_code == 400 and "unknown field: sampling_params.top_q" in answer.text
    stub.set_hold(0)
    live = {"rid": "f" * 32, "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
    first, _ = _in_thread(lambda: httpx.post(stub.url + "/generate", json=live, timeout=30))
    stub.wait_holding(1)
    duplicate = httpx.post(stub.url + "/generate", json=live)
    assert duplicate.status_code == 400 and "Duplicate request ID" in duplicate.text
    stub.release()
    first.join(30)


def test_stub_blocks_generate_while_paused(stub):
    httpx.post(stub.url + "/pause_generation", json={"mode": "abort"})
    answers = []
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
    thread, _ = _in_thread(
        lambda: answers.append(httpx.post(stub.url + "/generate", json=body, timeout=30))
    )
    stub.wait_requests("/generate", 1)
    thread.join(0.2)
    assert thread.is_alive() and not answers  # received, blocked until continue_generation
    httpx.post(stub.url + "/continue_generation", json={})
    thread.join(30)
    meta = answers[0].json()["meta_info"]
    assert len(meta["output_token_logprobs"]) == 2 and meta["finish_reason"]["type"] == "length"


def test_a_request_admitted_just_before_pause_is_waited_for(stub, weight_dirs, monkeypatch):
    """The request id is registered in the same step that admits the request, so a pause()
    that starts right after admission cannot miss it (it would run through the update)."""
    import sdp_cli.engine.remote_server as remote_server

    entered, release = threading.Event(), threading.Event()
    original = remote_server.new_request_id
    calls = []

    def slow_first_id() -> str:
        calls.append(1)
        if len(calls) == 1:
            entered.set()
            release.wait()  # the producer thread is descheduled right at admission
        return original()

    monkeypatch.setattr(remote_server, "new_request_id", slow_first_id)
    stub.set_hold(2)
    with _engine(stub) as engine:
        samples = _samples(PROMPTS[:1])
        _, join = _in_thread(engine.generate, samples, SamplingParams(max_new_tokens=4))
        entered.wait()
        pause_thread, pause_join = _in_thread(engine.pause)
        pause_thread.join(0.2)
        assert pause_thread.is_alive(), "pause() returned while a request was being admitted"
        release.set()
        pause_join()
        engine.update_weights(WeightUpdate(version=1, path=weight_dirs[1]))
        engine.resume()
        stub.release()
        join()
    (sample,) = samples
    k = sample.versions.count(0)
    assert sample.versions == [0] * k + [1] * (4 - k)
