"""The engine/trainer log-prob mismatch in bfloat16 on a GPU (docs/engines.md "Engine dtype";
docs/design.md §1): the quantity segment-wise's weight is designed to cancel.

The local engine holds the Qwen2.5-0.5B-shaped model in bf16 and samples; on the same tokens:

- ``trainer_bf16``: the trainer's bf16-autocast forward over float32 master weights against the
  engine's sampling log-probs. Decoupled's lag-0 weight π_prox/π_behav carries it (a run's
  ``mismatch/lag0_*``);
- ``trainer_fp32``: a float32 trainer against the same bf16 engine
  (``engine.dtype=bfloat16 train.dtype=float32``);
- ``engine_self``: the engine's own prefill scores of its samples against its sampling
  log-probs. Segment-wise takes π_prox_t and π_behav both from the engine, so this is what is
  left of the mismatch in its weight. Decoding (one query on a KV cache) and prefill round
  differently in bf16, on a CPU too: on this model on the CPU (2026-11-26) engine_self was 0.059
  nats mean, trainer_bf16 0.077 and trainer_fp32 0.072; on a GPU their kernels differ as well.

Segment-wise's premise is ``engine_self`` < ``trainer_bf16``: the test checks it and records
all three in the JUnit XML that bench/gpu.py reads.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from sdp_cli.core.metrics import lag0_mismatch
from sdp_cli.engine.base import SamplingParams
from sdp_cli.engine.local import LocalEngine
from sdp_cli.rollout.records import RolloutGroup, RolloutSample
from sdp_cli.train.step.batch import assemble_batch
from sdp_cli.train.step.response_logprobs import ResponseLogprobs

from .qwen_shape import BOS_ID, EOS_ID, PAD_ID

pytestmark = pytest.mark.gpu

GROUPS, GROUP_SIZE, PROMPT_LEN, NEW_TOKENS = 8, 4, 32, 32


def _sampled_groups(engine: LocalEngine, vocab: int) -> list[RolloutGroup]:
    gen = torch.Generator().manual_seed(7)
    groups = []
    for gid in range(GROUPS):
        prompt = [BOS_ID, *torch.randint(3, vocab, (PROMPT_LEN - 1,), generator=gen).tolist()]
        groups.append(RolloutGroup(gid, [RolloutSample(prompt_ids=list(prompt), group_id=gid) for _ in range(GROUP_SIZE)]))
    samples = [s for g in groups for s in g.samples]
    engine.generate(samples, SamplingParams(max_new_tokens=NEW_TOKENS))
    for sample in samples:
        sample.reward = 0.0
    return groups


def _trainer_logprobs(model, batch, device, bf16: bool) -> torch.Tensor:
    forward = ResponseLogprobs(
        temperature=1.0,
        device=device,
        autocast_dtype=torch.bfloat16 if bf16 else None,
        unwrap=lambda m: m,
        share_prefixes=False,
    )
    values, _ = forward.forward(model, batch, grad=False, with_entropy=False)
    return values.cpu()


def test_engine_agrees_with_itself_more_closely_than_with_the_trainer(model, device, record_property):
    engine = LocalEngine(
        copy.deepcopy(model),
        dtype=torch.bfloat16,
        device=device,
        temperature=1.0,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        seed=0,
    )
    groups = _sampled_groups(engine, model.config.vocab_size)
    samples = [s for g in groups for s in g.samples]
    scores = engine.score([s.input_ids for s in samples], [s.prompt_len for s in samples])
    batch = assemble_batch(groups, pad_token_id=PAD_ID, trainer_version=0)
    selected = batch.mask > 0
    # the engine's scores in the batch's layout: output token t of row i at column prompt_len + t − 1
    engine_scores = torch.zeros_like(batch.old_logprobs)
    for row, (sample, values) in enumerate(zip(samples, scores)):
        engine_scores[row, sample.prompt_len - 1 : sample.prompt_len - 1 + len(values)] = torch.tensor(values)
    model.eval()
    found = {
        "trainer_bf16": lag0_mismatch(batch.old_logprobs, _trainer_logprobs(model, batch, device, True), selected),
        "trainer_fp32": lag0_mismatch(batch.old_logprobs, _trainer_logprobs(model, batch, device, False), selected),
        "engine_self": lag0_mismatch(batch.old_logprobs, engine_scores, selected),
    }
    for name, values in found.items():
        for key, value in values.items():
            record_property(f"{name}_{key}", value)
    tokens = int(selected.sum())
    assert tokens > 0 and all(values["tokens"] == tokens for values in found.values())
    for name, values in found.items():
        assert all(math.isfinite(v) for v in values.values()), (name, values)
        assert values["k3_kl"] >= 0, (name, values)
        # bf16 rounding alone gave 0.06-0.08 nats on the CPU (above); 0.3 leaves room for other
        # kernels and flags a gross fault (a weight or RoPE table rounded twice, a wrong cast)
        assert values["abs_mean"] < 0.3, (name, values)
    assert found["engine_self"]["abs_mean"] <= found["trainer_bf16"]["abs_mean"], (
        "the engine's own scores disagree with its samples more than the trainer does: segment-wise "
        f"would not cancel the numeric mismatch here: {found}"
    )
