"""`sdp recompute` with real models: hand-made batches over checkpoints of distinct tiny
policies, checked against an independent reference (one unpadded forward per sequence and
log_softmax(logits / T), not the engine's padded scoring)."""

from __future__ import annotations

import random

import pytest
import torch

import sdp_cli.analysis.recompute as rc
from sdp_cli.analysis.recompute_plan import ProximalChoice, RecomputeOptions
import sdp_cli.analysis.scorers as scorers
from sdp_cli.engine.local import LocalEngine
from sdp_cli.errors import UserError
from sdp_cli.models.loader import load_policy, save_policy
from sdp_cli.rollout.batch_file import SavedBatch, write_batch

VERSIONS = range(0, 4)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Versions 0–3 of a tiny policy, each a random step away from the previous one, saved
    as Hugging Face directories; returns (run dir, {version: in-memory model})."""
    root = tmp_path_factory.mktemp("run")
    policy = load_policy(
        "tiny", task="arith1", warm_start_steps=0, hidden_size=32, num_layers=1, num_heads=2,
        num_kv_heads=2, intermediate_size=64,
    )
    models = {}
    gen = torch.Generator().manual_seed(0)
    for v in VERSIONS:
        if v:
            with torch.no_grad():
                for p in policy.model.parameters():
                    p.add_(0.3 * torch.randn(p.shape, generator=gen))
        save_policy(policy, root / "versions" / f"v{v:06d}")
        models[v] = load_policy("hf", path=root / "versions" / f"v{v:06d}").model
    return root, models, policy


def reference(model, sequence: list[int], temperature: float) -> list[float]:
    """log p(s[t] | s[:t]) for t ≥ 1 from one unpadded forward; entry t − 1 is token t."""
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0].double()
    logprobs = torch.log_softmax(logits[:-1] / temperature, dim=-1)
    return logprobs.gather(1, torch.tensor(sequence[1:])[:, None]).squeeze(1).tolist()


def random_batch(seed: int, c: int, temperature: float, n_seqs: int = 5) -> SavedBatch:
    """Random ids in [3, 32); each sequence's output versions are non-decreasing in [c−3, c]."""
    rng = random.Random(seed)
    ids, cu, plens, vers = [], [0], [], []
    for _ in range(n_seqs):
        p, o = rng.randint(1, 4), rng.randint(2, 7)
        versions = sorted(rng.randint(max(0, c - 3), c) for _ in range(o))
        ids += [rng.randrange(3, 32) for _ in range(p + o)]
        vers += [-1] * p + versions
        plens.append(p)
        cu.append(cu[-1] + p + o)
    versions = torch.tensor(vers)
    out = versions >= 0
    old = torch.where(out, torch.full((len(vers),), -2.0), torch.zeros(len(vers)))
    return SavedBatch(
        input_ids=torch.tensor(ids),
        cu_seqlens=torch.tensor(cu),
        prompt_lens=torch.tensor(plens),
        old_logprobs=old,
        versions=versions,
        proximal_logprobs_t=old.clone(),
        proximal_t_versions=versions.clone(),
        trainer_version=c,
        temperature=temperature,
        model="tiny",
        mode="segment_wise",
    )


def expected_under(models, batch: SavedBatch, version_of_token) -> torch.Tensor:
    """[N] reference logprob of every output token under ``version_of_token(t)`` (NaN on prompts)."""
    values = torch.full((batch.num_tokens,), float("nan"), dtype=torch.float64)
    cu = batch.cu_seqlens.tolist()
    for s in range(batch.num_sequences):
        lo, hi = cu[s], cu[s + 1]
        seq = batch.input_ids[lo:hi].tolist()
        for t in range(lo + int(batch.prompt_lens[s]), hi):
            k = version_of_token(t)
            if k is not None:
                values[t] = reference(models[k], seq[: t - lo + 1], batch.temperature)[-1]
    return values


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    root = tmp_path_factory.mktemp("batches")
    made = [random_batch(1, 3, 0.7), random_batch(2, 2, 1.3), random_batch(3, 3, 0.7)]
    paths = []
    for i, batch in enumerate(made):
        paths.append(root / f"b{i}.safetensors")
        write_batch(paths[-1], batch)
    return paths, made


@pytest.fixture(scope="module")
def exact_result(checkpoints, batches):
    root, _, _ = checkpoints
    paths, _ = batches
    return rc.recompute(paths, root, lambda b: scorers.LocalScorer(), RecomputeOptions(exact=True))


def test_proximal_t_is_the_next_versions_logprob_at_the_batch_temperature(checkpoints, batches, exact_result):
    _, models, _ = checkpoints
    _, made = batches
    for batch, outcome in zip(made, exact_result.outcomes):
        v, c = batch.versions, batch.trainer_version
        lagged = (v >= 0) & (v < c)
        assert int(lagged.sum()) > 0
        want = expected_under(models, batch, lambda t: int(v[t]) + 1 if 0 <= v[t] < c else None)
        got = outcome.batch.proximal_logprobs_t.double()
        assert torch.allclose(got[lagged], want[lagged], atol=2e-5, rtol=0)
        # the check can fail: the versions' logprobs differ by far more than the tolerance
        wrong = expected_under(models, batch, lambda t: int(v[t]) if 0 <= v[t] < c else None)
        assert float((wrong[lagged] - want[lagged]).abs().max()) > 1e-2
        on_policy = v == c
        assert torch.equal(outcome.batch.proximal_logprobs_t[on_policy], batch.old_logprobs[on_policy])


def test_proximal_is_the_trainer_versions_logprob(checkpoints, batches, exact_result):
    _, models, _ = checkpoints
    _, made = batches
    for batch, outcome in zip(made, exact_result.outcomes):
        out = batch.versions >= 0
        want = expected_under(models, batch, lambda t: batch.trainer_version)
        assert torch.allclose(outcome.batch.proximal_logprobs.double()[out], want[out], atol=2e-5, rtol=0)


def test_exact_chain_matches_the_reference(checkpoints, batches, exact_result):
    _, models, _ = checkpoints
    _, made = batches
    steps: dict[int, list[list[float]]] = {}
    for batch in made:
        c = batch.trainer_version
        per_version = {k: expected_under(models, batch, lambda t, k=k: k) for k in range(0, c + 1)}
        for t in range(batch.num_tokens):
            v = int(batch.versions[t])
            if 0 <= v < c:
                chain = [float(batch.old_logprobs[t])] + [float(per_version[k][t]) for k in range(v + 1, c + 1)]
                steps.setdefault(c - v, []).append([b - a for a, b in zip(chain, chain[1:])])
    got = {d.lag: d for d in exact_result.lags}
    assert sorted(got) == sorted(steps)
    for lag, rows in steps.items():
        means = torch.tensor(rows, dtype=torch.float64).mean(0)
        assert got[lag].tokens == len(rows)
        assert got[lag].step_means == pytest.approx(means.tolist(), abs=2e-5)
        dropped = torch.tensor([sum(r[1:]) for r in rows], dtype=torch.float64)
        assert got[lag].dropped.mean == pytest.approx(float(dropped.mean()), abs=2e-5)
        assert got[lag].dropped_ratio_mean == pytest.approx(float(dropped.exp().mean()), rel=1e-4)


def test_each_checkpoint_is_loaded_once(checkpoints, batches, monkeypatch):
    root, _, _ = checkpoints
    paths, _ = batches
    loads = []
    scorer = scorers.LocalScorer()
    real_load = scorer.load
    monkeypatch.setattr(scorer, "load", lambda v, p: (loads.append(v), real_load(v, p)))
    rc.recompute(paths, root, lambda b: scorer, RecomputeOptions(exact=True))
    assert loads == [1, 2, 3]


def test_engine_scorer_loading_from_disk_agrees_with_the_local_scorer(checkpoints, batches, exact_result):
    """The server path (pause, update_weights(path), score) over the local engine."""
    root, models, policy = checkpoints
    paths, made = batches
    engine = LocalEngine(
        load_policy("hf", path=root / "versions" / "v000000").model,
        temperature=0.7,
        eos_token_id=policy.eos_token_id,
        pad_token_id=policy.pad_token_id,
    )
    at_07 = [p for p, b in zip(paths, made) if b.temperature == 0.7]
    result = rc.recompute(
        at_07, root, lambda b: scorers.EngineScorer(engine, "local engine from disk"), RecomputeOptions(exact=True)
    )
    local = [o for o in exact_result.outcomes if o.batch.temperature == 0.7]
    for a, b in zip(result.outcomes, local, strict=True):
        assert torch.allclose(a.batch.proximal_logprobs_t, b.batch.proximal_logprobs_t, atol=1e-6, rtol=0)
        assert torch.allclose(a.batch.proximal_logprobs, b.batch.proximal_logprobs, atol=1e-6, rtol=0)


def test_engine_scorer_refuses_another_temperature(checkpoints, batches):
    root, _, policy = checkpoints
    paths, made = batches
    engine = LocalEngine(
        load_policy("hf", path=root / "versions" / "v000000").model,
        temperature=1.0,
        eos_token_id=policy.eos_token_id,
        pad_token_id=policy.pad_token_id,
    )
    with pytest.raises(UserError, match="scores at temperature 1.0 but a batch was sampled at 0.7"):
        rc.recompute(paths[:1], root, lambda b: scorers.EngineScorer(engine, "local engine"))


def test_token_outside_the_checkpoints_vocabulary(checkpoints, tmp_path):
    root, _, _ = checkpoints
    batch = random_batch(4, 1, 1.0)
    batch.input_ids[0] = 500  # the first prompt token: in every prefill of its sequence
    path = tmp_path / "b.safetensors"
    write_batch(path, batch)
    with pytest.raises(UserError) as err:
        rc.recompute([path], root, lambda b: scorers.LocalScorer(), RecomputeOptions(proximal=ProximalChoice()))
    assert "token id 500, outside the vocabulary [0, 32)" in str(err.value) and "\n" not in str(err.value)


def test_a_directory_that_is_not_a_model_is_one_line(tmp_path):
    (tmp_path / "versions" / "v000001").mkdir(parents=True)
    path = tmp_path / "b.safetensors"
    write_batch(path, random_batch(5, 1, 1.0))
    with pytest.raises(UserError, match="has no config.json"):
        rc.recompute([path], tmp_path, lambda b: scorers.LocalScorer())


def test_reference_helper_agrees_with_a_hand_softmax(checkpoints):
    """Guards the reference itself: token 1 of [5, 7] at T = 2 is log softmax(logits_0 / 2)[7]."""
    _, models, _ = checkpoints
    with torch.no_grad():
        logits = models[0](torch.tensor([[5, 7]])).logits[0, 0].double()
    by_hand = float(logits[7] / 2 - torch.logsumexp(logits / 2, 0))
    assert reference(models[0], [5, 7], 2.0) == pytest.approx([by_hand], abs=1e-9)
