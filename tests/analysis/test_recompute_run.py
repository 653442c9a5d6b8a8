"""`sdp recompute` on the batches of a real `sdp train` run (segment-wise, η = 3, every batch
and every version checkpoint kept): correct batches stay as they are, corrupted ones are
restored, π_prox matches the trainer's, and the exact chain is consistent with the files."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

import sdp_cli.analysis.recompute as rc
from sdp_cli.analysis.checkpoints import MissingCheckpoints
from sdp_cli.analysis.recompute_plan import ProximalChoice, RecomputeOptions
import sdp_cli.analysis.scorers as scorers
from sdp_cli.rollout.batch_file import read_batch, write_batch

from ..fast_run import FAST, train_run

# The fast model and batch sizes of tests/fast_run.py (FAST), plus: batches and version
# checkpoints kept; weight decay and a larger learning rate so that consecutive versions
# differ measurably even where a group's rewards are all equal (zero advantages) — otherwise
# scoring under the wrong version would go unnoticed; T = 0.9 so the temperature is exercised.
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
TOL = 1e-5


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return train_run(tmp_path_factory.mktemp("recompute-run"), OVERRIDES)


@pytest.fixture(scope="module")
def originals(run_dir):
    paths = sorted((run_dir / "batches").glob("*.safetensors"))
    return {p.name: read_batch(p) for p in paths}


@pytest.fixture
def copy_of_batches(run_dir, tmp_path):
    target = tmp_path / "batches"
    shutil.copytree(run_dir / "batches", target)
    return target


def lagged_mask(batch) -> torch.Tensor:
    return (batch.versions >= 0) & (batch.versions < batch.trainer_version)


def test_the_run_has_multi_step_lags(originals):
    lags = torch.cat([(b.trainer_version - b.versions)[lagged_mask(b)] for b in originals.values()])
    assert len(originals) == 6 and int(lags.max()) >= 2
    # the trainer stored π_prox and filled π_prox_t with the one-step tags
    for b in originals.values():
        assert b.proximal_logprobs is not None
        assert torch.equal(b.proximal_t_versions[lagged_mask(b)], b.versions[lagged_mask(b)] + 1)


def test_correct_batches_change_nothing_and_proximal_matches_the_trainer(run_dir, originals):
    result = rc.recompute(
        [run_dir / "batches"],
        run_dir,
        lambda b: scorers.LocalScorer(),
        RecomputeOptions(proximal=ProximalChoice.parse("trainer")),
    )
    assert sum(o.proximal_t.tokens for o in result.outcomes) > 0
    for outcome in result.outcomes:
        before, after = originals[outcome.source.name], outcome.batch
        assert outcome.retagged == 0
        assert outcome.proximal_t.tokens == 0 or outcome.proximal_t.max_abs <= TOL
        assert torch.equal(after.proximal_t_versions, before.proximal_t_versions)
        assert float((after.proximal_logprobs_t - before.proximal_logprobs_t).abs().max()) <= TOL
        # π_prox from checkpoint c (engine, left-padded) = the trainer's forward, within fp32 noise
        assert outcome.proximal_version == before.trainer_version
        assert outcome.proximal.max_abs <= TOL
        assert float((after.proximal_logprobs - before.proximal_logprobs).abs().max()) <= TOL


def test_adjacent_versions_are_distinguishable(originals):
    """The restore test below can fail: on this run log π_{v+1} − log π_v (stored π_prox_t
    minus the sampled logprob) is far above the tolerance, so scoring under the wrong
    version would show."""
    gap = max(
        float((b.proximal_logprobs_t - b.old_logprobs)[lagged_mask(b)].abs().max())
        for b in originals.values()
        if bool(lagged_mask(b).any())
    )
    assert gap > 100 * TOL


def corrupt(batch, seed: int, *, values: bool, tags: bool):
    """π_prox_t of the lagged tokens perturbed and/or their tags set back to v (not
    recomputed, allowed by the format); version-c tokens moved off π_behav."""
    gen = torch.Generator().manual_seed(seed)
    lagged = lagged_mask(batch)
    prox_t = batch.proximal_logprobs_t.clone()
    pv = batch.proximal_t_versions.clone()
    if values:
        prox_t[lagged] += 0.5 * torch.randn(int(lagged.sum()), generator=gen)
        on_policy = batch.versions == batch.trainer_version
        prox_t[on_policy] += 0.3
    if tags:
        pv[lagged] = batch.versions[lagged]
    return dataclasses.replace(batch, proximal_logprobs_t=prox_t, proximal_t_versions=pv)


def test_corrupted_batches_are_restored_in_place(run_dir, originals, copy_of_batches):
    kinds = [(True, True), (True, False), (False, True)]
    for i, path in enumerate(sorted(copy_of_batches.iterdir())):
        values, tags = kinds[i % 3]
        write_batch(path, corrupt(originals[path.name], i, values=values, tags=tags))
    result = rc.recompute([copy_of_batches], run_dir, lambda b: scorers.LocalScorer())
    assert sum(o.retagged for o in result.outcomes) > 0
    assert max(o.proximal_t.max_abs or 0.0 for o in result.outcomes) > 0.1
    rc.commit(result)
    for path in sorted(copy_of_batches.iterdir()):
        restored, original = read_batch(path), originals[path.name]
        assert torch.equal(restored.proximal_t_versions, original.proximal_t_versions), path.name
        assert float((restored.proximal_logprobs_t - original.proximal_logprobs_t).abs().max()) <= TOL
        for name in ("input_ids", "cu_seqlens", "prompt_lens", "old_logprobs", "versions",
                     "proximal_logprobs", "advantages", "loss_mask", "rewards"):
            assert torch.equal(getattr(restored, name), getattr(original, name)), name
        assert (restored.trainer_version, restored.temperature, restored.mode, restored.model) == (
            original.trainer_version, original.temperature, original.mode, original.model
        )


def test_exact_chain_is_consistent_with_the_files(run_dir, originals):
    result = rc.recompute([run_dir / "batches"], run_dir, lambda b: scorers.LocalScorer(), RecomputeOptions(exact=True))
    lags = {d.lag: d for d in result.lags}
    assert max(lags) >= 2
    # what inspect-weights reads from the files: dropped = π_prox − π_prox_t on loss-mask tokens
    from_files: dict[int, list[torch.Tensor]] = {}
    for outcome in result.outcomes:
        b = outcome.batch
        keep = lagged_mask(b) & b.effective_loss_mask().bool()
        lag = b.trainer_version - b.versions
        for ell in lag[keep].unique().tolist():
            mask = keep & (lag == ell)
            from_files.setdefault(ell, []).append((b.proximal_logprobs - b.proximal_logprobs_t)[mask].double())
    assert sorted(from_files) == sorted(lags)
    for ell, parts in from_files.items():
        dropped = torch.cat(parts)
        assert lags[ell].tokens == dropped.numel()
        assert lags[ell].dropped.mean == pytest.approx(float(dropped.mean()), abs=1e-9)
        assert sum(lags[ell].step_means) == pytest.approx(lags[ell].decoupled.mean, abs=1e-9)
    assert lags[1].dropped.max_abs == 0.0  # π_c = π_{v+1} when the lag is one
    assert any(d.dropped.max_abs > 100 * TOL for d in lags.values() if d.lag >= 2)
    for outcome in result.outcomes:  # the exact π_prox is the trainer's
        before = originals[outcome.source.name]
        assert float((outcome.batch.proximal_logprobs - before.proximal_logprobs).abs().max()) <= TOL


def test_a_missing_version_is_named(run_dir, tmp_path):
    shutil.copytree(run_dir / "versions", tmp_path / "versions", ignore=shutil.ignore_patterns("v000002"))
    with pytest.raises(MissingCheckpoints, match=r"version\(s\) 2 are missing"):
        rc.recompute([run_dir / "batches"], tmp_path, lambda b: pytest.fail("checked before loading"))
