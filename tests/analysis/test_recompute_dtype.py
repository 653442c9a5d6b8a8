"""`sdp recompute` on runs whose engine or trainer computed in bfloat16: intact batches recompute
to the stored π_prox_t within float32 noise (the scorer runs the engine's dtype and numerics),
π_prox moves by the run's engine/trainer mismatch and is called dtype noise, and damage is still
called damage (docs/recompute.md "Noise floor")."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import sdp_cli.analysis.recompute as rc
import sdp_cli.analysis.scorers as scorers
from sdp_cli.analysis.noise import EXACT_TOLERANCE
from sdp_cli.analysis.recompute_plan import ProximalChoice, RecomputeOptions
from sdp_cli.rollout.batch_file import read_batch, write_batch
from sdp_cli.train.session.policy_setup import native_bf16

from ..cli.run_main import run_main
from ..fast_run import FAST, train_run

#: |Δ| of one log-probability computed in two shapes with emulated bfloat16: 2⁻⁷, bfloat16's
#: machine epsilon
EMULATED_BF16_TOLERANCE = 2.0**-7

# as tests/analysis/test_recompute_run.py: segment-wise, η = 3, every batch and version kept,
# versions that differ measurably, T = 0.9
OVERRIDES = [
    *FAST,
    "train.checkpoint_every=0",
    "train.steps=6",
    "train.save_batches=true",
    "train.keep_version_checkpoints=true",
    "+preset=segment_wise",
    "rollout.max_head_offpolicyness=3",
    "optim.lr=3e-3",
    "optim.weight_decay=1.0",
    "rollout.temperature=0.9",
]


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    """train.dtype=bfloat16: autocast trainer, and a bf16 engine (engine.dtype null follows)."""
    return train_run(tmp_path_factory.mktemp("bf16"), [*OVERRIDES, "train.dtype=bfloat16"])


@pytest.fixture(scope="module")
def trainer_filled_run(tmp_path_factory):
    """A bf16 engine against a float32 trainer, π_prox_t of one-stale tokens from the trainer."""
    return train_run(
        tmp_path_factory.mktemp("filled"),
        [*OVERRIDES, "engine.dtype=bfloat16", "rollout.proximal_t_source=trainer"],
    )


def _recompute(run_dir, batches=None, **options):
    return rc.recompute(
        [batches or run_dir / "batches"], run_dir, lambda b: scorers.LocalScorer(), RecomputeOptions(**options)
    )


def test_intact_bf16_batches_recompute_within_float32_noise(bf16_run):
    """Before the engine kept RoPE's inv_freq in float32 this showed mean |Δ| ~4e-4, max 8e-3
    (the engine's bf16 copy and a bf16 load of the same weights computed different positions)."""
    result = _recompute(bf16_run, proximal=ProximalChoice.parse("trainer"))
    assert result.scorer == "local engine (cpu, bfloat16)"  # the checkpoints' dtype, the engine's
    assert result.numerics is not None and result.numerics.train_dtype == "bfloat16"
    assert sum(o.proximal_t.tokens for o in result.outcomes) > 0
    for outcome in result.outcomes:
        assert outcome.retagged == 0
        assert outcome.proximal_t.tokens == 0 or outcome.proximal_t.max_abs <= EXACT_TOLERANCE, outcome.source.name
        assert outcome.proximal_t_verdict.kind == "unchanged"
    # the engine floor: the scorer against π_behav on version-c tokens, same weights, same dtype.
    # With bfloat16 instructions the scoring forward and the decode steps agree to float32 noise;
    # where bfloat16 is emulated (an AVX2-only CPU: 2e-3 at most, 9e-5 on average, also before the
    # scoring forward ran by length), the two shapes round differently, within bfloat16's precision
    engine = result.floors["engine"]
    assert engine.tokens > 0
    assert engine.max_abs <= (EXACT_TOLERANCE if native_bf16() else EMULATED_BF16_TOLERANCE)
    # π_prox: the trainer's autocast forward against the bf16 engine's: more than float32 noise,
    # no more than the run's own lag-0 mismatch allows
    trainer = result.floors["trainer"]
    assert trainer.tokens > 0 and trainer.max_abs > 10 * EXACT_TOLERANCE
    assert max(o.proximal.max_abs for o in result.outcomes) > 10 * EXACT_TOLERANCE
    assert {o.proximal_verdict.kind for o in result.outcomes} == {"dtype noise"}


def test_damage_in_a_bf16_run_is_still_damage(bf16_run, tmp_path):
    target = tmp_path / "batches"
    target.mkdir()
    gen = torch.Generator().manual_seed(0)
    for path in sorted((bf16_run / "batches").glob("*.safetensors")):
        b = read_batch(path)
        lagged = (b.versions >= 0) & (b.versions < b.trainer_version)
        prox_t = b.proximal_logprobs_t.clone()
        prox_t[lagged] += 0.5 * torch.randn(int(lagged.sum()), generator=gen)
        write_batch(target / path.name, dataclasses.replace(b, proximal_logprobs_t=prox_t))
    result = _recompute(bf16_run, target)
    verdicts = [o.proximal_t_verdict for o in result.outcomes if o.proximal_t.tokens]
    assert verdicts and all(v.kind == "damaged" and v.beyond > 0 for v in verdicts)


def test_trainer_filled_proximal_t_is_dtype_noise(trainer_filled_run):
    config = json.loads((trainer_filled_run / "versions" / "v000001" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"  # the version checkpoints hold what the engine ran
    result = _recompute(trainer_filled_run)
    assert result.numerics.trainer_fills_proximal_t
    moved = [o for o in result.outcomes if o.proximal_t.tokens and o.proximal_t.max_abs > EXACT_TOLERANCE]
    assert moved, "tokens one version stale carry the trainer's float32 numbers, not the engine's bf16"
    assert {o.proximal_t_verdict.kind for o in result.outcomes if o.proximal_t.tokens} <= {"unchanged", "dtype noise"}
    assert any(o.proximal_t_verdict.kind == "dtype noise" for o in moved)


def test_the_command_reports_dtypes_floors_and_verdicts(bf16_run, capsys):
    args = ["recompute", bf16_run / "batches", "-c", bf16_run, "--proximal", "trainer", "--dry-run"]
    code, out, err = run_main(args, capsys)
    assert code == 0, err
    flat = " ".join(out.split())  # long lines wrap at the console's width
    assert "trainer bfloat16; π_prox_t from the engine" in flat and "local engine (cpu, bfloat16) in" in flat
    assert "scorer vs the run's engine (judges π_prox_t) mean" in flat and "trainer vs engine" in flat
    assert "dtype noise" in out and "unchanged" in out and "DAMAGED" not in out
    code, out, err = run_main([*args, "--json"], capsys)
    report = json.loads(out)
    assert report["run"]["train_dtype"] == "bfloat16" and not report["run"]["trainer_fills_proximal_t"]
    assert report["scorer"] == "local engine (cpu, bfloat16)"
    floor = report["noise_floor"]["trainer"]
    assert floor["tokens"] > 0 and floor["tolerance"] == pytest.approx(8 * floor["max_abs"])
    assert {b["proximal_verdict"]["kind"] for b in report["batches"]} == {"dtype noise"}
    assert {b["proximal_t_verdict"]["kind"] for b in report["batches"]} == {"unchanged"}
