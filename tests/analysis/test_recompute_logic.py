"""`sdp recompute` logic on hand-made batches with a fake scorer: which token is scored under
which checkpoint, what is written back, the exact decomposition, missing checkpoints, targets
and the all-or-nothing commit. No model is loaded here (see test_recompute_models.py)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

import sdp_cli.analysis.recompute as rc
from sdp_cli.analysis.batch_files import batches_run, expand_batch_paths, resolve_targets
from sdp_cli.analysis.checkpoints import MissingCheckpoints, find_checkpoints, format_versions
from sdp_cli.analysis.recompute_plan import (
    ProximalChoice,
    RecomputeOptions,
    chain_versions,
    make_plan,
    missing_spans,
    reads_proximal,
    token_requests,
)
import sdp_cli.analysis.scorers as scorers
from sdp_cli import fileio
from sdp_cli.errors import UserError
from sdp_cli.rollout.batch_file import SavedBatch, read_batch, write_batch


# ----------------------------------------------------------------------------- helpers
def fake_logprob(version: int, position: int) -> float:
    """What the fake scorer returns for the token at ``position`` of a sequence under
    ``version``: −(version + position / 1000), so a value names its version and position."""
    return -(version + position / 1000)


class FakeScorer(scorers.Scorer):
    """Records loads and calls; scores with :func:`fake_logprob`."""

    description = "fake scorer"

    def __init__(self) -> None:
        self.loaded: list[int] = []
        self.version: int | None = None
        self.calls: list[tuple[int, float, list[tuple[int, int]]]] = []
        self.closed = False

    def load(self, version: int, path: Path) -> None:
        assert path.name == f"v{version:06d}"
        self.loaded.append(version)
        self.version = version

    def score(self, temperature, sequences, starts):
        assert self.version is not None
        self.calls.append((self.version, temperature, [(len(s), k) for s, k in zip(sequences, starts)]))
        return [[fake_logprob(self.version, t) for t in range(k, len(s))] for s, k in zip(sequences, starts)]

    def unload(self) -> None:
        self.version = None

    def close(self) -> None:
        self.closed = True


def make_batch(c: int, sequences, *, temperature: float = 1.0, mode: str = "segment_wise") -> SavedBatch:
    """``sequences``: (prompt_len, output versions, output loss mask or None). Token ids are
    the absolute token index mod 7 (any valid id works for the fake scorer); the old logprob
    of absolute token t is −0.1·t − 0.05; π_prox_t is π_behav with tag v (not recomputed)."""
    ids, cu, plens, vers, mask = [], [0], [], [], []
    for prompt_len, versions, loss in sequences:
        plens.append(prompt_len)
        vers += [-1] * prompt_len + list(versions)
        mask += [0] * prompt_len + list(loss if loss is not None else [1] * len(versions))
        cu.append(cu[-1] + prompt_len + len(versions))
    n = cu[-1]
    ids = [t % 7 for t in range(n)]
    versions = torch.tensor(vers, dtype=torch.int64)
    is_out = versions >= 0
    old = torch.where(is_out, -0.1 * torch.arange(n, dtype=torch.float32) - 0.05, torch.zeros(n))
    batch = SavedBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        cu_seqlens=torch.tensor(cu, dtype=torch.int64),
        prompt_lens=torch.tensor(plens, dtype=torch.int64),
        old_logprobs=old,
        versions=versions,
        proximal_logprobs_t=old.clone(),
        proximal_t_versions=versions.clone(),
        trainer_version=c,
        temperature=temperature,
        model="synthetic",
        mode=mode,
        loss_mask=torch.tensor(mask, dtype=torch.uint8),
    )
    return batch


def version_dirs(root: Path, versions) -> Path:
    for v in versions:
        (root / f"v{v:06d}").mkdir(parents=True)
    return root


# The hand-made batch of most tests, trainer version c = 3. Absolute token indices:
#   A: prompt 0–1, outputs 2,3,4,5,6 with versions 0,0,1,2,3
#   B: prompt 7,   outputs 8,9       with versions 3,3
#   C: prompt 10–12, outputs 13,14   with versions 1,2
SEQS = [(2, [0, 0, 1, 2, 3], None), (1, [3, 3], None), (3, [1, 2], None)]


@pytest.fixture
def hand(tmp_path):
    path = tmp_path / "batches" / "b.safetensors"
    path.parent.mkdir()
    write_batch(path, make_batch(3, SEQS))
    return path, version_dirs(tmp_path / "run" / "versions", range(0, 4)).parent


# ------------------------------------------------------------------------ version logic
def test_token_requests_default_rescoring_under_the_next_version():
    requests = token_requests(make_batch(3, SEQS), None)
    got = {k: m.nonzero().squeeze(1).tolist() for k, m in requests.items()}
    # version-v tokens (v < 3) go to v + 1; version-3 tokens (6, 8, 9) and prompts to none
    assert got == {1: [2, 3], 2: [4, 13], 3: [5, 14]}


def test_token_requests_exact_chain_and_proximal():
    batch = make_batch(3, SEQS)
    assert chain_versions(batch) == range(1, 4)  # the oldest lagged token has version 0: 1 … 3
    requests = token_requests(batch, 3, chain_versions(batch))
    got = {k: m.nonzero().squeeze(1).tolist() for k, m in requests.items()}
    # chain: every lagged token under each of v+1 … 3; π_prox: every output token under 3
    assert got == {1: [2, 3], 2: [2, 3, 4, 13], 3: [2, 3, 4, 5, 6, 8, 9, 13, 14]}


def test_which_weights_need_pi_prox_and_so_a_pi_prox_pass():
    # decoupled reads π_prox; segment_wise reads π_prox_t only, but its drift-clipped weight multiplies
    # by π_prox/π_prox_t, so `--mode segment_wise_drift` must compute π_prox too
    assert [reads_proximal(w) for w in ("bypass", "decoupled", "segment_wise", "segment_wise_drift")] == [
        False, True, False, True
    ]
    assert RecomputeOptions(modes=("segment_wise_drift",)).proximal_choice == ProximalChoice()
    assert RecomputeOptions(modes=("segment_wise",)).proximal_choice is None
    assert RecomputeOptions(max_tokens_per_call=1).max_tokens_per_call == 1  # one token a call is allowed
    with pytest.raises(ValueError, match="max_tokens_per_call must be >= 1"):
        RecomputeOptions(max_tokens_per_call=0)


def test_plan_jobs_cover_each_sequence_once_per_version():
    batch = make_batch(3, SEQS)
    plan = make_plan([(Path("b"), batch)], RecomputeOptions(), range(0, 4))
    jobs = {
        k: [(j.sequence, j.start, j.targets.tolist()) for j in js] for (k, t), js in plan.jobs.items()
    }
    ids = batch.input_ids.tolist()
    # a prefill runs up to the last target and starts at the first target of its sequence;
    # checkpoint 3 = c also scores the version-3 tokens 6, 8, 9 (the noise floor)
    assert jobs == {
        1: [(ids[0:4], 2, [2, 3])],
        2: [(ids[0:5], 4, [4]), (ids[10:14], 3, [13])],
        3: [(ids[0:7], 5, [5, 6]), (ids[7:10], 1, [8, 9]), (ids[10:15], 4, [14])],
    }
    assert plan.versions == [1, 2, 3] and plan.tokens() == 9 and plan.tokens(2) == 2


def test_the_noise_floor_needs_checkpoint_c_but_never_fails_without_it():
    batch = make_batch(3, SEQS)
    with pytest.raises(MissingCheckpoints, match=r"version\(s\) 3 are missing"):  # for tokens 5 and 14
        make_plan([(Path("b"), batch)], RecomputeOptions(), [0, 1, 2])
    only_c = make_batch(3, [(1, [3, 3], None)])  # nothing lagged: checkpoint 3 only measures the floor
    plan = make_plan([(Path("b"), only_c)], RecomputeOptions(), [])
    assert plan.jobs == {}
    plan = make_plan([(Path("b"), only_c)], RecomputeOptions(), [3])
    assert [j.targets.tolist() for j in plan.jobs[(3, 1.0)]] == [[1, 2]]


def test_recompute_writes_the_next_version_logprob_and_tag(hand):
    path, run = hand
    scorer = FakeScorer()
    result = rc.recompute([path], run, lambda batches: scorer)
    new = result.outcomes[0].batch
    old = read_batch(path)
    pt = new.proximal_logprobs_t.tolist()
    # token t at position p of its sequence, version v < 3: fake_logprob(v + 1, p)
    expected = {2: (1, 2), 3: (1, 3), 4: (2, 4), 5: (3, 5), 13: (2, 3), 14: (3, 4)}
    for t, (k, p) in expected.items():
        assert pt[t] == pytest.approx(fake_logprob(k, p), abs=1e-6), t
        assert int(new.proximal_t_versions[t]) == int(new.versions[t]) + 1 == k
    for t in (6, 8, 9):  # version c: π_prox_t = π_behav, tag = v
        assert pt[t] == old.old_logprobs[t].item() and int(new.proximal_t_versions[t]) == 3
    assert new.proximal_logprobs is None  # π_prox only on request
    assert scorer.loaded == [1, 2, 3] and scorer.closed
    # every lagged token was retagged (they had tag v); 6 lagged tokens rescored
    assert result.outcomes[0].retagged == 6 and result.outcomes[0].proximal_t.tokens == 6
    # |Δ| vs the old π_prox_t (= old logprob −0.1t − 0.05): token 5 (position 5, k = 3) moves
    # most, |−3.005 − (−0.55)| = 2.455; the six |Δ| are .752 .653 1.554 2.455 .653 1.554
    assert result.outcomes[0].proximal_t.max_abs == pytest.approx(2.455, abs=1e-5)
    assert result.outcomes[0].proximal_t.mean_abs == pytest.approx(7.621 / 6, abs=1e-5)
    # the per-version work `sdp recompute` prints, by hand from the jobs above: (version, tokens scored,
    # π_prox_t tokens, π_prox tokens, sequences prefilled); checkpoint 3 also scores tokens 6, 8, 9
    assert _work(result) == [(1, 2, 2, 0, 1), (2, 2, 2, 0, 2), (3, 5, 2, 0, 3)]


def _work(result):
    return [(w.version, w.tokens, w.proximal_t_tokens, w.proximal_tokens, w.sequences) for w in result.work]


def test_the_work_per_version_counts_the_proximal_tokens_under_their_checkpoint(hand):
    # π_prox under c = 3 scores every output token there (2–6, 8, 9, 13, 14); the other checkpoints
    # are as without it
    path, run = hand
    result = rc.recompute([path], run, lambda batches: FakeScorer(), RecomputeOptions(proximal=ProximalChoice()))
    assert _work(result) == [(1, 2, 2, 0, 1), (2, 2, 2, 0, 2), (3, 9, 2, 9, 3)]


def test_on_policy_tokens_are_reset_to_the_behaviour_logprob(tmp_path):
    batch = make_batch(3, SEQS)
    batch.proximal_logprobs_t[6] = 0.5 + batch.old_logprobs[6]  # a corrupt version-c value
    path = tmp_path / "b.safetensors"
    write_batch(path, batch)
    version_dirs(tmp_path / "versions", range(0, 4))
    result = rc.recompute([path], tmp_path, lambda b: FakeScorer())
    out = result.outcomes[0]
    assert out.batch.proximal_logprobs_t[6] == batch.old_logprobs[6]
    assert out.proximal_t_on_policy.max_abs == pytest.approx(0.5, abs=1e-6)


def test_each_version_loaded_once_across_batches_and_temperatures_grouped(tmp_path):
    # two batches at T=0.7 and one at T=1.3 sharing versions 1 and 2
    specs = [(2, [(1, [0, 1], None)], 0.7), (2, [(2, [1, 1, 2], None)], 1.3), (3, [(1, [1, 2, 3], None)], 0.7)]
    paths = []
    for i, (c, seqs, temp) in enumerate(specs):
        paths.append(tmp_path / f"b{i}.safetensors")
        write_batch(paths[-1], make_batch(c, seqs, temperature=temp))
    version_dirs(tmp_path / "versions", range(0, 4))
    scorer = FakeScorer()
    rc.recompute(paths, tmp_path, lambda b: scorer)
    assert scorer.loaded == [1, 2, 3]
    # version 2 scores the v1 tokens of b0 and b2 at 0.7 and those of b1 at 1.3: one call per
    # temperature (everything fits in one pack), temperatures in increasing order
    assert [(v, t) for v, t, _ in scorer.calls] == [(1, 0.7), (2, 0.7), (2, 1.3), (3, 0.7)]


def test_packs_respect_the_token_budget(hand):
    path, run = hand
    scorer = FakeScorer()
    rc.recompute([path], run, lambda b: scorer, RecomputeOptions(max_tokens_per_call=5))
    # version 2 prefills A[0:5] (5 tokens) and C[10:14] (4 tokens): 9 > 5, so two calls, the
    # shorter first; version 1 has one 4-token prefill; version 3 prefills B[7:10] (3, its
    # version-3 tokens for the noise floor), C[10:15] (5) and A[0:7] (7): 3 + 5 > 5
    assert [(v, [n for n, _ in seqs]) for v, _, seqs in scorer.calls] == [
        (1, [4]),
        (2, [4]),
        (2, [5]),
        (3, [3]),
        (3, [5]),
        (3, [7]),
    ]


def test_nothing_to_score_needs_no_scorer(tmp_path):
    path = tmp_path / "b.safetensors"
    write_batch(path, make_batch(0, [(1, [0, 0], None)]))
    (tmp_path / "empty").mkdir()

    def no_scorer(batches):
        raise AssertionError("no checkpoint is needed for a batch of version-c tokens only")

    result = rc.recompute([path], tmp_path / "empty", no_scorer)
    assert result.work == [] and result.outcomes[0].proximal_t.tokens == 0


# --------------------------------------------------------------------------- π_prox
def test_proximal_trainer_latest_and_fixed(hand):
    path, run = hand
    for text, version in (("trainer", 3), ("latest", 3), ("1", 1)):
        result = rc.recompute(
            [path], run, lambda b: FakeScorer(), RecomputeOptions(proximal=ProximalChoice.parse(text))
        )
        prox = result.outcomes[0].batch.proximal_logprobs
        assert result.outcomes[0].proximal_version == version
        # output token 8 is position 1 of sequence B; 13 is position 3 of C; prompts stay 0
        assert prox[8].item() == pytest.approx(fake_logprob(version, 1), abs=1e-6)
        assert prox[13].item() == pytest.approx(fake_logprob(version, 3), abs=1e-6)
        assert prox[0].item() == 0.0 and prox[7].item() == 0.0
        # no previous π_prox: no Δ statistics, but the token count
        assert result.outcomes[0].proximal.tokens == 9 and result.outcomes[0].proximal.max_abs is None


def test_latest_is_the_newest_checkpoint(hand):
    path, run = hand
    (run / "versions" / "v000007").mkdir()
    result = rc.recompute(
        [path], run, lambda b: FakeScorer(), RecomputeOptions(proximal=ProximalChoice(latest=True))
    )
    assert result.outcomes[0].proximal_version == 7


@pytest.mark.parametrize("text", ["", "v3", "-1", "newest", "1.5"])
def test_proximal_choice_rejects_garbage(text):
    with pytest.raises(UserError, match="--proximal"):
        ProximalChoice.parse(text)


def test_exact_with_another_proximal_version_is_refused():
    with pytest.raises(UserError, match="--exact"):
        RecomputeOptions(proximal=ProximalChoice(version=2), exact=True)
    assert RecomputeOptions(proximal=ProximalChoice(), exact=True).proximal_choice == ProximalChoice()


# ------------------------------------------------------------------- exact decomposition
def test_exact_decomposition_by_hand(tmp_path):
    # token 3 leaves the loss (mask 0): the decomposition covers loss-mask tokens only
    batch = make_batch(3, [(2, [0, 0, 1, 2, 3], [1, 0, 1, 1, 1]), (1, [3, 3], None), (3, [1, 2], None)])
    path = tmp_path / "b.safetensors"
    write_batch(path, batch)
    version_dirs(tmp_path / "versions", range(0, 4))
    result = rc.recompute([path], tmp_path, lambda b: FakeScorer(), RecomputeOptions(exact=True))
    lags = {d.lag: d for d in result.lags}
    assert sorted(lags) == [1, 2, 3]
    # lag 3: token 2 only (v0, position 2): chain old = −0.25, π1 = −1.002, π2 = −2.002, π3 = −3.002
    d = lags[3]
    assert d.tokens == 1
    assert d.step_means == pytest.approx([-1.002 + 0.25, -1.0, -1.0], abs=1e-6)
    assert d.segment_wise.mean == pytest.approx(-0.752, abs=1e-6)
    assert d.decoupled.mean == pytest.approx(-3.002 + 0.25, abs=1e-6)
    assert d.dropped.mean == pytest.approx(-2.0, abs=1e-6) and d.dropped.std == 0.0
    assert d.dropped_ratio_mean == pytest.approx(math.exp(-2.0), rel=1e-6)
    # lag 2: tokens 4 (v1, position 4) and 13 (v1, position 3): π2 − π1 = −1 for both, so
    # dropped = π3 − π2 = −1; seg-wise: π2 − old = (−2.004 + 0.45, −2.003 + 1.35)
    d = lags[2]
    assert d.tokens == 2 and d.dropped.mean == pytest.approx(-1.0, abs=1e-6)
    assert d.segment_wise.mean == pytest.approx(((-2.004 + 0.45) + (-2.003 + 1.35)) / 2, abs=1e-6)
    assert d.segment_wise.max_abs == pytest.approx(2.004 - 0.45, abs=1e-6)
    # lag 1: π_c = π_{v+1}, nothing dropped
    assert lags[1].tokens == 2 and lags[1].dropped.max_abs == 0.0
    for d in lags.values():  # the one-step factors telescope to the full log weight
        assert sum(d.step_means) == pytest.approx(d.decoupled.mean, abs=1e-9)
        assert sum(d.step_means[1:]) == pytest.approx(d.dropped.mean, abs=1e-9)
    # π_prox = π_3 on every output token; the file then gives the dropped factor directly
    new = result.outcomes[0].batch
    assert (new.proximal_logprobs[2] - new.proximal_logprobs_t[2]).item() == pytest.approx(-2.0, abs=1e-5)
    # what each drift clip keeps of the dropped factor (κ = 1.5, 2, 3, 4 by default):
    # lag 3, log d = −2: outside ±log κ for every κ (log 4 = 1.386), so no token is kept whole;
    # the clipped weight keeps log κ of the 2 nats: 0.405/2, 0.693/2, 1.099/2, 1.386/2
    kept = {k.kappa: k for k in lags[3].drift_kept}
    assert sorted(kept) == [1.5, 2.0, 3.0, 4.0]
    for kappa, k in kept.items():
        assert k.tokens_unclipped == 0.0 and k.log_kept == pytest.approx(math.log(kappa) / 2, abs=1e-6)
    # lag 2, log d = −1 on both tokens: inside ±log 4 and ±log 3 (1.099: kept whole), outside
    # ±log 2 (0.693 of 1)
    kept = {k.kappa: k for k in lags[2].drift_kept}
    assert (kept[4.0].tokens_unclipped, kept[4.0].log_kept) == (1.0, pytest.approx(1.0))
    assert (kept[3.0].tokens_unclipped, kept[3.0].log_kept) == (1.0, pytest.approx(1.0))
    assert (kept[2.0].tokens_unclipped, kept[2.0].log_kept) == (0.0, pytest.approx(math.log(2), abs=1e-6))
    # lag 1 drops nothing: every κ keeps it all; the quantiles of d are then all exactly 1
    assert all(k.tokens_unclipped == 1.0 and k.log_kept == 1.0 for k in lags[1].drift_kept)
    assert set(lags[1].dropped_quantiles.values()) == {1.0}
    assert lags[3].dropped_quantiles["q0.5"] == pytest.approx(math.exp(-2.0), rel=1e-6)


def test_exact_decomposition_reports_the_drift_clips_asked_for(tmp_path):
    batch = make_batch(3, [(2, [0, 0, 1, 2, 3], [1, 0, 1, 1, 1])])
    path = tmp_path / "b.safetensors"
    write_batch(path, batch)
    version_dirs(tmp_path / "versions", range(0, 4))
    options = RecomputeOptions(exact=True, drift_clips=(3.0,))
    result = rc.recompute([path], tmp_path, lambda b: FakeScorer(), options)
    assert all([k.kappa for k in d.drift_kept] == [3.0] for d in result.lags)


# ---------------------------------------------------------------------------- checkpoints
def test_find_checkpoints_in_a_run_or_a_versions_directory(tmp_path):
    version_dirs(tmp_path / "run" / "versions", [0, 2, 12])
    (tmp_path / "run" / "versions" / "notes").mkdir()
    (tmp_path / "run" / "versions" / "v000003").write_text("a file, not a checkpoint")
    for root in (tmp_path / "run", tmp_path / "run" / "versions"):
        found = find_checkpoints(root)
        assert sorted(found) == [0, 2, 12] and found[12].name == "v000012"


def test_two_directories_for_one_version_are_refused(tmp_path):
    version_dirs(tmp_path, [12])
    (tmp_path / "v12").mkdir()
    with pytest.raises(UserError, match="two directories for version 12"):
        find_checkpoints(tmp_path)


def test_missing_checkpoints_name_the_versions_and_the_fix(hand):
    path, run = hand
    for v in (1, 2):
        (run / "versions" / f"v{v:06d}").rmdir()
    with pytest.raises(MissingCheckpoints) as err:
        rc.recompute([path], run, lambda b: pytest.fail("no scorer before the check"))
    message = str(err.value)
    assert "version(s) 1–2 are missing" in message and "it has 0, 3" in message
    assert "train.keep_version_checkpoints=true" in message and "\n" not in message


def test_missing_checkpoint_directory(tmp_path, hand):
    path, _ = hand
    with pytest.raises(UserError, match="does not exist"):
        rc.recompute([path], tmp_path / "nope", lambda b: FakeScorer())


def test_format_versions():
    assert format_versions([5, 1, 2, 3, 9, 10]) == "1–3, 5, 9–10"
    assert format_versions([]) == ""


# ------------------------------------------------------------------------------ targets
def test_targets_in_place_directory_and_single_file(tmp_path):
    a, b = tmp_path / "x" / "a.safetensors", tmp_path / "y" / "b.safetensors"
    assert resolve_targets([a, b], None) == [a, b]
    assert resolve_targets([a, b], tmp_path / "out") == [tmp_path / "out" / a.name, tmp_path / "out" / b.name]
    assert resolve_targets([a], tmp_path / "one.safetensors") == [tmp_path / "one.safetensors"]
    assert resolve_targets([a], f"{tmp_path}/dir/") == [tmp_path / "dir" / a.name]
    with pytest.raises(UserError, match="both be written"):
        resolve_targets([a, tmp_path / "z" / "a.safetensors"], tmp_path / "out")
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="is a file"):
        resolve_targets([a, b], tmp_path / "file")


def test_a_directory_argument_expands_and_duplicates_are_refused(tmp_path):
    for name in ("step-2.safetensors", "step-1.safetensors"):
        write_batch(tmp_path / name, make_batch(0, [(1, [0], None)]))
    (tmp_path / "notes.txt").write_text("")
    files = expand_batch_paths([tmp_path])
    assert [f.name for f in files] == ["step-1.safetensors", "step-2.safetensors"]
    with pytest.raises(UserError, match="given twice"):
        expand_batch_paths([tmp_path, tmp_path / "step-1.safetensors"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no \\*.safetensors"):
        expand_batch_paths([tmp_path / "empty"])


# ------------------------------------------------------------------------------- commit
def _two_batches(tmp_path):
    paths = []
    for i in range(2):
        paths.append(tmp_path / f"b{i}.safetensors")
        write_batch(paths[-1], make_batch(3, SEQS))
    version_dirs(tmp_path / "versions", range(0, 4))
    before = {p: p.read_bytes() for p in paths}
    return paths, before


def test_commit_replaces_files_and_keeps_their_permissions(tmp_path):
    paths, before = _two_batches(tmp_path)
    os.chmod(paths[0], 0o644)
    result = rc.recompute(paths, tmp_path, lambda b: FakeScorer())
    assert all(p.read_bytes() == before[p] for p in paths)  # nothing written before commit
    assert rc.commit(result) == paths
    assert all(p.read_bytes() != before[p] for p in paths)
    assert read_batch(paths[1]).proximal_t_versions[2] == 1
    assert (paths[0].stat().st_mode & 0o777) == 0o644
    assert sorted(os.listdir(tmp_path)) == ["b0.safetensors", "b1.safetensors", "versions"]


def test_a_failure_while_staging_leaves_every_file_old(tmp_path, monkeypatch):
    paths, before = _two_batches(tmp_path)
    result = rc.recompute(paths, tmp_path, lambda b: FakeScorer())
    calls = []
    real_stage = fileio.stage_bytes

    def failing_stage(path, data):
        calls.append(path)
        if len(calls) == 2:
            raise UserError(f"{path}: cannot be written (No space left on device); free some space")
        return real_stage(path, data)

    monkeypatch.setattr(fileio, "stage_bytes", failing_stage)
    with pytest.raises(UserError, match="No space left"):
        rc.commit(result)
    assert all(p.read_bytes() == before[p] for p in paths)
    assert sorted(os.listdir(tmp_path)) == ["b0.safetensors", "b1.safetensors", "versions"]


def test_a_failing_rename_leaves_every_file_old(tmp_path, monkeypatch):
    """The first batch is renamed into place, the second rename fails: the first gets its old
    bytes back (all or none, fileio.OutputPlan)."""
    paths, before = _two_batches(tmp_path)
    result = rc.recompute(paths, tmp_path, lambda b: FakeScorer())
    real_replace = os.replace

    def failing_replace(src, dst):
        if str(src).endswith(".tmp") and Path(dst) == paths[1]:
            raise OSError(30, "Read-only file system")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(UserError) as err:
        rc.commit(result)
    assert "Read-only file system" in str(err.value) and "nothing was written" in str(err.value)
    assert "\n" not in str(err.value)
    assert all(p.read_bytes() == before[p] for p in paths)
    assert sorted(os.listdir(tmp_path)) == ["b0.safetensors", "b1.safetensors", "versions"]


def test_a_run_directory_stands_for_its_batches(tmp_path):
    run = tmp_path / "run"
    (run / "batches").mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    for name in ("step-000002.safetensors", "step-000001.safetensors"):
        write_batch(run / "batches" / name, make_batch(0, [(1, [0], None)]))
    files = expand_batch_paths([run])
    assert files == [run / "batches" / "step-000001.safetensors", run / "batches" / "step-000002.safetensors"]
    # the run and one of its batches: one file twice, however it is spelled
    with pytest.raises(UserError, match="is the same file as"):
        expand_batch_paths([run, tmp_path / "run" / "batches" / ".." / "batches" / "step-000001.safetensors"])
    # a run that saved no batches says how to get them; a directory that is no run, what to pass
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.yaml").write_text("{}\n")
    with pytest.raises(UserError, match="train.save_batches=true"):
        expand_batch_paths([tmp_path / "bare"])
    (tmp_path / "bare" / "config.yaml").unlink()
    with pytest.raises(UserError, match="pass batch files, a batches/ directory or a run directory"):
        expand_batch_paths([tmp_path / "bare"])


def test_the_checkpoints_of_batches_default_to_their_run(tmp_path):
    runs = [tmp_path / "a", tmp_path / "b"]
    files = []
    for run in runs:
        (run / "batches").mkdir(parents=True)
        (run / "config.yaml").write_text("{}\n")
        files.append(write_batch(run / "batches" / "step-000001.safetensors", make_batch(0, [(1, [0], None)])))
    assert batches_run([files[0]]) == runs[0]
    assert batches_run(expand_batch_paths([runs[1]])) == runs[1]
    with pytest.MonkeyPatch.context() as mp:  # a bare name, given inside the run's batches/
        mp.chdir(runs[0] / "batches")
        assert batches_run([Path("step-000001.safetensors")]) == runs[0]
    with pytest.raises(UserError, match="two runs.*--checkpoints"):
        batches_run(files)
    loose = write_batch(tmp_path / "step-000001.safetensors", make_batch(0, [(1, [0], None)]))
    with pytest.raises(UserError, match="not in a run's batches/.*pass --checkpoints"):
        batches_run([loose])
    # a batches/ directory copied out of its run has no run around it
    (tmp_path / "copy" / "batches").mkdir(parents=True)
    copied = write_batch(tmp_path / "copy" / "batches" / "step-000001.safetensors", make_batch(0, [(1, [0], None)]))
    with pytest.raises(UserError, match="pass --checkpoints"):
        batches_run([copied])


def test_output_directory_is_created_and_sources_are_untouched(tmp_path):
    paths, before = _two_batches(tmp_path)
    result = rc.recompute(paths, tmp_path, lambda b: FakeScorer(), output=tmp_path / "out")
    rc.commit(result)
    assert all(p.read_bytes() == before[p] for p in paths)
    assert sorted(os.listdir(tmp_path / "out")) == ["b0.safetensors", "b1.safetensors"]
    assert read_batch(tmp_path / "out" / "b0.safetensors").proximal_t_versions[2] == 1


def test_report_dict_is_json_ready(hand):
    import json

    path, run = hand
    result = rc.recompute([path], run, lambda b: FakeScorer(), RecomputeOptions(exact=True))
    data = json.loads(json.dumps(result.to_dict()))
    assert data["batches"][0]["proximal_t"]["tokens"] == 6
    assert [v["version"] for v in data["versions"]] == [1, 2, 3]
    assert [lag["lag"] for lag in data["lags"]] == [1, 2, 3] and data["proximal"] == "trainer"


# ---------------------------------------------------- cost by the versions present (issue 24)
TOP = 2**53 - 1  # the largest trainer version a batch may carry (docs/batch-format.md)


@pytest.fixture
def deadline():
    """Fail a test that runs for more than 10 s (on main, --exact at 2⁵³−1 looped over every
    version below it and never finished; at 200000 it took 154 s and 3.2 GB)."""
    import signal

    def expired(*_):
        raise TimeoutError("took more than 10 s: the cost depends on the versions' magnitude")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_exact_chain_at_the_largest_trainer_version_costs_what_the_versions_present_cost(deadline):
    # one sequence: prompt 0–1, outputs 2,3,4 with versions TOP−2, TOP−1, TOP
    batch = make_batch(TOP, [(2, [TOP - 2, TOP - 1, TOP], None)])
    plan = make_plan([(Path("b"), batch)], RecomputeOptions(exact=True), [TOP - 1, TOP])
    got = {k: m.nonzero().squeeze(1).tolist() for k, m in plan.requests[0].items()}
    # chain: token 2 (v = TOP−2) under TOP−1 and TOP, token 3 (v = TOP−1) under TOP;
    # π_prox under TOP: every output token 2, 3, 4
    assert got == {TOP - 1: [2], TOP: [2, 3, 4]}
    assert plan.versions == [TOP - 1, TOP]


def test_a_chain_over_2_to_the_53_versions_is_refused_at_once_naming_the_gap(deadline):
    # a token of version 0 in a batch of version TOP needs every checkpoint 1 … TOP; there are
    # three: 0, 5 and TOP, so 1–4 and 6–(TOP − 1) are missing
    batch = make_batch(TOP, [(1, [0, TOP], None)])
    with pytest.raises(MissingCheckpoints) as err:
        make_plan([(Path("b"), batch)], RecomputeOptions(exact=True), [0, 5, TOP])
    message = str(err.value)
    assert f"version(s) 1–4, 6–{TOP - 1} are missing" in message, message
    assert "\n" not in message


def test_a_chain_at_200000_with_its_checkpoints_missing_is_refused_at_once(deadline, tmp_path):
    """The red team's case through `sdp recompute --exact`: trainer version 200000, a token of
    version 0, checkpoints only of the versions the batch's own tokens carry."""
    c = 200_000
    path = tmp_path / "b.safetensors"
    write_batch(path, make_batch(c, [(1, [0, c], None)]))
    run = version_dirs(tmp_path / "versions", [1, c])
    with pytest.raises(MissingCheckpoints, match=f"version\\(s\\) 2–{c - 1} are missing"):
        rc.recompute([path], run, lambda b: pytest.fail("no scorer before the check"), RecomputeOptions(exact=True))


def test_missing_spans_by_hand():
    # needed 1 … 9, available 0, 3, 4, 9, 12: gaps 1–2 and 5–8 (0 and 12 are outside)
    assert missing_spans(range(1, 10), [12, 4, 0, 9, 3]) == [(1, 2), (5, 8)]
    assert missing_spans(range(1, 4), [1, 2, 3]) == []
    assert missing_spans(range(0), [1]) == []
    assert missing_spans(range(5, 2**53), []) == [(5, 2**53 - 1)]
