"""engine=sglang against a real SGLang server on a GPU (skipped without one).

Needs ``SDP_SGLANG_PYTHON`` (a python with sglang 0.5.6–0.5.23 installed) and
``SDP_SGLANG_MODEL`` (a local Hugging Face model directory); run with ``pytest -m gpu``.
The same directory serves as every "new" version, so π_prox_t must equal a fresh score.
"""

from __future__ import annotations

import os
import shutil
import threading

import pytest

from sdp_cli.engine.base import SamplingParams, WeightUpdate
from sdp_cli.engine.remote import RemoteOptions
from sdp_cli.engine.sglang import SGLangEngine, SGLangLaunchConfig
from sdp_cli.rollout.records import RolloutSample

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    python, model = os.environ.get("SDP_SGLANG_PYTHON"), os.environ.get("SDP_SGLANG_MODEL")
    if not python or not model or shutil.which("nvidia-smi") is None:
        pytest.skip("needs a GPU, SDP_SGLANG_PYTHON and SDP_SGLANG_MODEL")
    config = SGLangLaunchConfig(
        model=model,
        python=python,
        dtype="bfloat16",
        extra_args=("--enable-deterministic-inference",),
    )
    with SGLangEngine.launch(
        config, tmp_path_factory.mktemp("sglang"), RemoteOptions(ignore_eos=True)
    ) as launched:
        yield launched


def test_abort_resume_and_scores_on_a_real_server(engine):
    model = os.environ["SDP_SGLANG_MODEL"]
    samples = [RolloutSample(prompt_ids=[1, 2, 3, 4, 5]) for _ in range(4)]
    thread = threading.Thread(
        target=engine.generate, args=(samples, SamplingParams(max_new_tokens=256, seed=3))
    )
    thread.start()
    for version in (1, 2, 3):
        thread.join(0.5)  # let the requests run for a while (non-streamed: no progress event)
        engine.pause()
        engine.update_weights(WeightUpdate(version=version, path=model))
        engine.resume()
    thread.join(600)
    scores = engine.score([s.input_ids for s in samples], [s.prompt_len for s in samples])
    for s, scored in zip(samples, scores):
        assert s.output_len == 256 and s.versions == sorted(s.versions)
        stale = [t for t, v in enumerate(s.versions) if v < 3]
        assert all(s.proximal_t_versions[t] == s.versions[t] + 1 for t in stale)
        # deterministic inference: prefill and decode agree up to bf16 kernels
        assert [s.proximal_logprobs_t[t] for t in stale] == pytest.approx(
            [scored[t] for t in stale], abs=5e-2
        )
        assert s.old_logprobs == pytest.approx(scored, abs=5e-2)
