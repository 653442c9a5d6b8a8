"""``engine.dtype`` for the local engine: a bfloat16 engine against a float32 trainer, the lag-0
mismatch metric, and what segment-wise does with it (docs/engines.md "Engine dtype").

Two real runs of the fast config (segment-wise, η = 1, every batch and version kept): one with
engine and trainer in float32, one with engine.dtype=bfloat16 and train.dtype=float32.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from sdp_cli.config.compose import compose_config
from sdp_cli.config.schema import engine_weight_dtype
from sdp_cli.core.metrics import lag0_mismatch
from sdp_cli.engine.base import WeightUpdate
from sdp_cli.engine.factory import build_engine
from sdp_cli.errors import UserError
from sdp_cli.models.loader import load_policy
from sdp_cli.rollout.batch_file import read_batch

from ..fast_run import FAST, fast_with, train_run

RUN = [
    *FAST,
    "train.steps=4",
    "train.checkpoint_every=0",
    "train.save_batches=true",
    "train.keep_version_checkpoints=true",
    "+preset=segment_wise",
    "rollout.max_head_offpolicyness=1",
]


def _rows(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "mismatch/lag0_tokens" in r]


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    return train_run(tmp_path_factory.mktemp("fp32"), RUN)


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    return train_run(tmp_path_factory.mktemp("bf16"), [*RUN, "engine.dtype=bfloat16"])


# ------------------------------------------------------------------ the metric, by hand


def test_lag0_mismatch_by_hand():
    engine = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, 0.0]])
    trainer = torch.tensor([[-1.5, -2.0, -0.5], [-2.0, -9.0, 0.0]])
    selected = torch.tensor([[True, True, False], [True, False, False]])
    m = lag0_mismatch(engine, trainer, selected)
    # d = trainer − engine on the selected tokens: −0.5, 0, +1
    assert m["tokens"] == 3
    assert m["abs_mean"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert m["abs_max"] == pytest.approx(1.0)
    # k3 per token e^d − 1 − d: e^−0.5 − 0.5 = 0.10653, 0, e − 2 = 0.71828
    assert m["k3_kl"] == pytest.approx((math.exp(-0.5) - 0.5 + math.e - 2) / 3, rel=1e-12)


def test_lag0_mismatch_of_nothing_and_of_equal_values():
    lp = torch.tensor([[-1.0, -2.0]])
    assert lag0_mismatch(lp, lp + 1, torch.zeros(1, 2, dtype=torch.bool)) == {"tokens": 0.0}
    same = lag0_mismatch(lp, lp.clone(), torch.ones(1, 2, dtype=torch.bool))
    assert same == {"tokens": 2.0, "abs_mean": 0.0, "abs_max": 0.0, "k3_kl": 0.0}


def test_lag0_k3_is_second_order_for_small_gaps():
    """d = 1e-4 on every token: k3 = e^d − 1 − d = d²/2 + d³/6 ≈ 5.0002e-9; float64 keeps it."""
    engine = torch.full((1, 4), -2.0, dtype=torch.float64)
    m = lag0_mismatch(engine, engine + 1e-4, torch.ones(1, 4, dtype=torch.bool))
    assert m["k3_kl"] == pytest.approx(1e-8 / 2 + 1e-12 / 6, rel=1e-6)


# ------------------------------------------------------------------ config


def _cfg(*overrides):
    return compose_config(fast_with(overrides))[0]


def test_engine_dtype_resolution():
    assert engine_weight_dtype(_cfg()) == "float32"
    assert engine_weight_dtype(_cfg("train.dtype=bfloat16")) == "bfloat16"  # null follows train.dtype
    assert engine_weight_dtype(_cfg("engine.dtype=bfloat16")) == "bfloat16"
    assert engine_weight_dtype(_cfg("train.dtype=bfloat16", "engine.dtype=float32")) == "float32"
    # servers: null is float32, whatever train.dtype; the engine groups set their own
    assert engine_weight_dtype(_cfg("engine.kind=vllm", "train.dtype=bfloat16")) == "float32"
    assert engine_weight_dtype(_cfg("engine=sglang")) == "bfloat16"
    assert engine_weight_dtype(_cfg("engine=vllm")) == "float32"


def test_a_server_only_dtype_on_the_local_engine_is_one_line():
    for value in ("float16", "auto"):
        with pytest.raises(UserError) as err:
            _cfg(f"engine.dtype={value}")
        assert str(err.value) == (
            f"engine.dtype={value} is for launched servers; the local engine runs float32 or bfloat16 "
            "(null follows train.dtype)"
        )
    with pytest.raises(UserError, match="engine.dtype='int8' is not valid"):
        _cfg("engine.dtype=int8")
    assert _cfg("engine=vllm", "engine.dtype=float16").engine.dtype == "float16"


# ------------------------------------------------------------------ the engine's copy


def test_the_engine_holds_its_own_bf16_copy_and_casts_pushes(tmp_path):
    cfg = _cfg("engine.dtype=bfloat16", f"run.dir={tmp_path}")
    policy = load_policy(
        "tiny", task="arith1", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
        intermediate_size=128, warm_start_steps=0,
    )
    engine = build_engine(cfg, policy, tmp_path)
    trainer_params = dict(policy.model.named_parameters())
    for name, param in engine.model.named_parameters():
        assert param.dtype == torch.bfloat16, name
        assert param.data_ptr() != trainer_params[name].data_ptr(), name
        assert torch.equal(param, trainer_params[name].detach().to(torch.bfloat16)), name
    assert all(p.dtype == torch.float32 for p in policy.model.parameters())  # the trainer's untouched
    # RoPE's computed inv_freq stays float32, as from_pretrained(dtype=bfloat16) keeps it
    for name, buffer in engine.model.named_buffers():
        assert buffer.dtype == torch.float32, name
    # a push of float32 weights lands cast, in the engine's own storage
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.01)
    master = {k: v.clone() for k, v in policy.model.state_dict().items()}
    engine.pause()
    engine.update_weights(WeightUpdate(version=1, state_dict=master))
    engine.resume()
    own = engine.model.state_dict()
    for name, tensor in master.items():
        assert own[name].dtype == torch.bfloat16 and torch.equal(own[name], tensor.to(torch.bfloat16)), name
    engine.close()


# ------------------------------------------------------------------ real runs


def test_fp32_engine_and_trainer_agree_at_lag_0(fp32_run):
    rows = [r for r in _rows(fp32_run) if r["mismatch/lag0_tokens"] > 0]
    assert rows, "the run has steps with lag-0 tokens"
    for r in rows:
        assert r["mismatch/lag0_abs_mean"] <= 1e-5 and r["mismatch/lag0_abs_max"] <= 1e-4, r["step"]
        assert 0 <= r["mismatch/lag0_k3_kl"] <= 1e-9, r["step"]


def test_bf16_engine_against_fp32_trainer_shows_the_mismatch(bf16_run):
    rows = [r for r in _rows(bf16_run) if r["mismatch/lag0_tokens"] > 0]
    assert rows
    for r in rows:
        # bf16 keeps 8 significant bits: log-probs move by ~1e-3 on this model, 100× the fp32 bound
        assert r["mismatch/lag0_abs_mean"] > 1e-4, r["step"]
        assert r["mismatch/lag0_k3_kl"] > 0, r["step"]
    # the version checkpoints hold what the engine ran
    config = json.loads((bf16_run / "versions" / "v000001" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"


def test_segment_wise_lag0_weight_is_exactly_one_decoupled_is_not(bf16_run):
    rows = [r for r in _rows(bf16_run) if r.get("shadow/segment_wise/lag0/tokens", 0) > 0]
    assert rows
    for r in rows:
        assert r["shadow/segment_wise/lag0/behav_imp_weight/avg"] == 1.0
        assert r["shadow/segment_wise/lag0/behav_imp_weight/std"] == 0.0
        assert r["shadow/decoupled/lag0/behav_imp_weight/std"] > 1e-4
    lag0_tokens = 0
    for path in sorted((bf16_run / "batches").glob("*.safetensors")):
        b = read_batch(path)
        on_policy = (b.versions == b.trainer_version) & (b.versions >= 0)
        lag0_tokens += int(on_policy.sum())
        # π_prox_t := π_behav bit for bit; the trainer's π_prox differs (float32 vs bf16 numerics)
        assert torch.equal(b.proximal_logprobs_t[on_policy], b.old_logprobs[on_policy])
        if bool(on_policy.any()):
            assert float((b.proximal_logprobs - b.old_logprobs)[on_policy].abs().max()) > 1e-4
    assert lag0_tokens > 0


def test_the_engine_process_runs_in_engine_dtype(tmp_path):
    """engine.in_process=false (the default outside tests): the engine's own process holds the
    bf16 copy (the mismatch against the fp32 trainer shows, > 1e-4 as above; a float32 process
    would stay under the fp32 run's 1e-5) and lag-0 tokens' π_prox_t is their π_behav bit for bit
    after the trip over the wire (JSON floats round-trip exactly)."""
    run_dir = train_run(tmp_path, [*RUN, "engine.in_process=false", "engine.dtype=bfloat16"])
    rows = [r for r in _rows(run_dir) if r["mismatch/lag0_tokens"] > 0]
    assert rows
    for r in rows:
        assert r["mismatch/lag0_abs_mean"] > 1e-4, r["step"]
        assert r["shadow/segment_wise/lag0/behav_imp_weight/avg"] == 1.0, r["step"]
    lag0_tokens = 0
    for path in sorted((run_dir / "batches").glob("*.safetensors")):
        b = read_batch(path)
        on_policy = (b.versions == b.trainer_version) & (b.versions >= 0)
        lag0_tokens += int(on_policy.sum())
        assert torch.equal(b.proximal_logprobs_t[on_policy], b.old_logprobs[on_policy])
    assert lag0_tokens > 0


def test_a_bf16_lora_run_recomputes_exactly(tmp_path):
    """Under LoRA the trained base itself is cast to bfloat16; cast with ``Module.to`` (as before),
    RoPE's inv_freq went bf16 in the trainer and the engine's copy, and recompute's fresh bf16 load
    disagreed by up to 2e-3 per token. With the buffers kept float32 the engine's π_prox_t is what
    a load of its version checkpoint computes."""
    import sdp_cli.analysis.recompute as rc
    import sdp_cli.analysis.scorers as scorers
    from sdp_cli.models import save_policy

    model = tmp_path / "tiny-qwen2"
    small = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128)
    save_policy(load_policy("tiny", task="arith1", warm_start_steps=0, seed=1, **small), model)
    run = train_run(
        tmp_path,
        [
            *FAST, "model=hf", f"model.path={model}", "model.lora.r=4", "train.dtype=bfloat16",
            "+preset=segment_wise", "train.steps=3", "train.checkpoint_every=0",
            "train.keep_version_checkpoints=true", "train.save_batches=true", "optim.lr=0.02",
        ],
    )
    result = rc.recompute([run / "batches"], run, lambda b: scorers.LocalScorer())
    assert sum(o.proximal_t.tokens for o in result.outcomes) > 0
    for outcome in result.outcomes:
        assert outcome.proximal_t.tokens == 0 or outcome.proximal_t.max_abs <= 1e-5
        assert outcome.proximal_t_verdict.kind == "unchanged"
