"""LocalEngine across weight updates mid-generation (docs/design.md §2) and under concurrent callers.

Pauses are driven deterministically: the engine's step callback runs in the generating thread
after each decode step, so it can pause at an exact step and hand control to the test thread
through a queue. References are full unpadded forwards under each version's saved weights.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

from sdp_cli.engine._local_gate import StepGate
from sdp_cli.engine.base import EngineError, SamplingParams, WeightUpdate
from sdp_cli.engine.local import LocalEngine

from .tiny_qwen import EOS, PAD, model_with, prompts, reference_logprobs, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WAIT_S = 60  # a generous bound on any wait: reaching it means the engine hung


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def perturb_(model: torch.nn.Module, seed: int) -> None:
    """Move the weights in place (tied tensors move together: parameters() has each once)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))


def check_versions_and_proximal(samples, states, temperature, model_of=model_with):
    """Every token: old_logprobs from its version's weights. π_prox_t from version + 1's weights
    for every version the sample outlived (an update reached it in flight: docs/design.md §2 steps 2
    and 4); tokens of its last version were never in flight across an update and keep
    π_prox_t = π_behav. ``model_of(state)``: the model holding the weights ``state``."""
    worst_old = worst_prox = 0.0
    for s in samples:
        s.check_consistent()
        assert s.versions == sorted(s.versions), "versions never decrease along a response"
        last = max(s.versions)
        needed = set(s.versions) | {v + 1 for v in s.versions if v < last}
        refs = {
            v: reference_logprobs(model_of(states[v]), s.input_ids, s.prompt_len, temperature)
            for v in needed
        }
        for t, v in enumerate(s.versions):
            worst_old = max(worst_old, abs(s.old_logprobs[t] - refs[v][t]))
            if v == last:
                assert (
                    s.proximal_t_versions[t] == v and s.proximal_logprobs_t[t] == s.old_logprobs[t]
                )
            else:
                assert s.proximal_t_versions[t] == v + 1, (
                    f"token {t} of version {v} was not patched"
                )
                worst_prox = max(worst_prox, abs(s.proximal_logprobs_t[t] - refs[v + 1][t]))
    assert worst_old <= 1e-5 and worst_prox <= 1e-5, (worst_old, worst_prox)


class Pauser:
    """Step callback that pauses the engine after the listed decode steps and reports each pause."""

    def __init__(self, at_steps: set[int]):
        self.engine: LocalEngine | None = None
        self.at_steps = at_steps
        self.steps = 0
        self.paused = queue.Queue()
        self.lock = threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            self.steps += 1
            hit = self.steps in self.at_steps
        if hit:
            self.engine.pause()
            self.paused.put(self.steps)

    def wait(self) -> int:
        return self.paused.get(timeout=WAIT_S)


def start_generate(engine, samples, params) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run():
        try:
            engine.generate(samples, params)
        except BaseException as exc:  # handed to the test thread
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_proximal_t_is_right_across_three_updates_mid_generation(temperature):
    model = tiny_model()
    trainer = tiny_model()  # a separate copy that moves the way a trainer would
    pauser = Pauser({3, 6, 9, 10})
    engine = LocalEngine(
        model,
        temperature=temperature,
        eos_token_id=EOS,
        pad_token_id=PAD,
        seed=7,
        step_callback=pauser,
    )
    pauser.engine = engine
    states = {0: snapshot(trainer)}
    samples = prompts([5, 2, 8, 3, 6, 4])
    thread, errors = start_generate(engine, samples, SamplingParams(max_new_tokens=16))

    for version in (1, 2, 3, 4):
        pauser.wait()
        inflight = engine.inflight_samples()
        assert inflight and all(0 < s.output_len < 16 and not s.is_finished for s in inflight)
        lengths = [s.output_len for s in samples]
        perturb_(trainer, seed=version)
        states[version] = snapshot(trainer)
        engine.update_weights(WeightUpdate(version=version, state_dict=states[version]))
        assert [s.output_len for s in samples] == lengths, "nothing is generated while paused"
        engine.resume()
    thread.join(WAIT_S)
    assert not thread.is_alive() and not errors

    assert all(s.is_finished for s in samples)
    # steps 1-3 ran under version 0, 4-6 under 1, 7-9 under 2, 10 under 3, the rest under 4;
    # the step-10 segment is a single token: a segment boundary right after another
    assert max(max(s.versions) for s in samples) == 4
    assert any(
        s.versions[:11] == [0] * 3 + [1] * 3 + [2] * 3 + [3] + [4]
        for s in samples
        if s.output_len > 10
    )
    check_versions_and_proximal(samples, states, temperature)


def test_resume_without_update_neither_reprefills_nor_patches():
    model = tiny_model()
    prefills = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: (
            prefills.append(kwargs["input_ids"].shape[1])
            if kwargs["input_ids"].shape[1] > 1
            else None
        ),
        with_kwargs=True,
    )
    pauser = Pauser({2, 4})
    engine = LocalEngine(model, eos_token_id=EOS, pad_token_id=PAD, seed=8, step_callback=pauser)
    pauser.engine = engine
    samples = prompts([4, 6, 3])
    thread, errors = start_generate(engine, samples, SamplingParams(max_new_tokens=10))

    pauser.wait()
    engine.resume()  # no update: the KV cache stays valid
    pauser.wait()
    engine.set_version(1)  # a declared version without new weights: still no re-prefill
    engine.resume()
    thread.join(WAIT_S)
    assert not thread.is_alive() and not errors

    assert len(prefills) == 1, "only the initial prefill"
    for s in samples:
        assert s.proximal_logprobs_t == s.old_logprobs and s.proximal_t_versions == s.versions
        assert set(s.versions[:4]) == {0} and set(s.versions[4:]) <= {1}


def test_engine_patches_only_new_minus_one_and_keeps_the_recompute_pass_values():
    """Two updates in one pause, with the recompute pass (docs/design.md §2 step 2) in between:
    tokens of version 0 get π_1 from the pass, the engine must not overwrite them at resume."""
    model = tiny_model()
    trainer = tiny_model()
    pauser = Pauser({3, 5})
    engine = LocalEngine(model, eos_token_id=EOS, pad_token_id=PAD, seed=9, step_callback=pauser)
    pauser.engine = engine
    states = {0: snapshot(trainer)}
    samples = prompts([3, 7, 5, 2])
    thread, errors = start_generate(engine, samples, SamplingParams(max_new_tokens=12))

    pauser.wait()  # 3 tokens of version 0
    for version in (1, 2):
        perturb_(trainer, seed=10 + version)
        states[version] = snapshot(trainer)
        engine.update_weights(WeightUpdate(version=version, state_dict=states[version]))
        if version == 1:
            # recompute pass under weights 1 for the tokens of version 0
            inflight = engine.inflight_samples()
            scored = engine.score([s.input_ids for s in inflight], [s.prompt_len for s in inflight])
            for s, values in zip(inflight, scored, strict=True):
                for t, lp in enumerate(values):
                    if s.versions[t] == 0:
                        s.set_proximal_t(t, lp, 1)
    engine.resume()
    pauser.wait()  # 2 tokens of version 2
    perturb_(trainer, seed=13)
    states[3] = snapshot(trainer)
    engine.update_weights(WeightUpdate(version=3, state_dict=states[3]))
    engine.resume()
    thread.join(WAIT_S)
    assert not thread.is_alive() and not errors

    long = [s for s in samples if s.output_len > 5]
    assert long and all(s.versions[:6] == [0, 0, 0, 2, 2, 3] for s in long)
    # version 0 → π_1 (from the pass), version 2 → π_3 (engine at resume), version 3 final
    check_versions_and_proximal(samples, states, 1.0)


def test_concurrent_callers_with_pauses_and_updates_from_another_thread():
    model = tiny_model()
    trainer = tiny_model()
    pauser = Pauser({8, 20, 33})
    engine = LocalEngine(model, eos_token_id=EOS, pad_token_id=PAD, seed=12, step_callback=pauser)
    pauser.engine = engine
    states = {0: snapshot(trainer)}
    calls = [prompts([3, 5, 2], seed=20 + i) for i in range(4)]
    started = [
        start_generate(engine, samples, SamplingParams(max_new_tokens=18)) for samples in calls
    ]

    def controller():
        for version in (1, 2, 3):
            pauser.wait()
            perturb_(trainer, seed=30 + version)
            states[version] = snapshot(trainer)
            engine.update_weights(WeightUpdate(version=version, state_dict=states[version]))
            engine.resume()

    trainer_thread = threading.Thread(target=controller, daemon=True)
    trainer_thread.start()
    trainer_thread.join(WAIT_S)
    for thread, errors in started:
        thread.join(WAIT_S)
        assert not thread.is_alive() and not errors
    assert not trainer_thread.is_alive()

    everything = [s for samples in calls for s in samples]
    assert all(s.is_finished for s in everything)
    assert engine.inflight_samples() == []
    assert len({v for s in everything for v in s.versions}) >= 3
    check_versions_and_proximal(everything, states, 1.0)


def test_paused_engine_holds_new_calls_and_lists_their_samples():
    engine = LocalEngine(tiny_model(), eos_token_id=EOS, pad_token_id=PAD, seed=13)
    engine.pause()
    samples = prompts([3, 4])
    thread, errors = start_generate(engine, samples, SamplingParams(max_new_tokens=5))
    deadline = time.monotonic() + WAIT_S
    while len(engine.inflight_samples()) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert {s.sample_id for s in engine.inflight_samples()} == {s.sample_id for s in samples}
    time.sleep(0.05)  # a paused engine generates nothing, however long one waits
    assert all(s.output_len == 0 for s in samples)
    engine.resume()
    thread.join(WAIT_S)
    assert not thread.is_alive() and not errors
    assert all(s.is_finished for s in samples) and engine.inflight_samples() == []


def test_pause_returns_only_after_the_running_step():
    model = tiny_model()
    in_forward, release = threading.Event(), threading.Event()

    def hook(module, args, kwargs):
        if kwargs["input_ids"].shape[1] == 1 and not release.is_set():
            in_forward.set()
            release.wait(WAIT_S)

    model.register_forward_pre_hook(hook, with_kwargs=True)
    engine = LocalEngine(model, eos_token_id=EOS, pad_token_id=PAD, seed=15)
    samples = prompts([3, 4])
    thread, errors = start_generate(engine, samples, SamplingParams(max_new_tokens=8))
    assert in_forward.wait(WAIT_S)  # step 1 sampled a token and is in its decode forward
    pausing = threading.Thread(target=engine.pause, daemon=True)
    pausing.start()
    pausing.join(0.1)
    assert pausing.is_alive(), "pause must wait for the running step"
    release.set()
    pausing.join(WAIT_S)
    assert not pausing.is_alive() and engine.is_paused()
    assert [s.output_len for s in samples] == [1, 1]
    time.sleep(0.05)  # a paused engine generates nothing, however long one waits
    assert [s.output_len for s in samples] == [1, 1]
    engine.resume()
    thread.join(WAIT_S)
    assert not thread.is_alive() and not errors and all(s.is_finished for s in samples)


def test_a_failing_step_reaches_its_caller_and_leaves_the_engine_usable():
    model = tiny_model()
    fail = threading.Event()

    decode_forwards = []

    def hook(module, args, kwargs):
        rows, width = kwargs["input_ids"].shape
        if fail.is_set() and rows == 2 and width > 1:  # only the doomed call prefills 2 rows
            raise RuntimeError("injected failure")
        if width == 1:
            decode_forwards.append(rows)
            if len(decode_forwards) == 3 and not fail.is_set():
                raise RuntimeError("injected decode failure")

    model.register_forward_pre_hook(hook, with_kwargs=True)
    engine = LocalEngine(model, eos_token_id=EOS, pad_token_id=PAD, seed=14)
    fail.set()
    doomed = prompts([3, 4])  # the only call with 2 rows: its forwards fail
    healthy = prompts([2, 5, 3])
    bad_thread, bad_errors = start_generate(engine, doomed, SamplingParams(max_new_tokens=6))
    good_thread, good_errors = start_generate(engine, healthy, SamplingParams(max_new_tokens=6))
    for thread in (bad_thread, good_thread):
        thread.join(WAIT_S)
        assert not thread.is_alive()
    assert len(bad_errors) == 1 and str(bad_errors[0]) == "injected failure"
    assert not good_errors and all(s.is_finished for s in healthy)
    assert engine.inflight_samples() == []

    engine.pause()  # returns: no turn is left held
    engine.resume()

    # a failure in the middle of decoding: the caller sees it, its samples stay partial
    fail.clear()
    decode_forwards.clear()
    partial = prompts([4, 2, 6], seed=3)
    with pytest.raises(RuntimeError, match="injected decode failure"):
        engine.generate(partial, SamplingParams(max_new_tokens=10))
    assert [s.output_len for s in partial] == [3, 3, 3] and not any(s.is_finished for s in partial)
    assert engine.inflight_samples() == []
    engine.generate(partial, SamplingParams(max_new_tokens=10))
    assert all(s.is_finished for s in partial)


def test_close_releases_a_call_blocked_by_pause():
    engine = LocalEngine(tiny_model(), eos_token_id=EOS, pad_token_id=PAD)
    engine.pause()
    samples = prompts([3])
    thread, errors = start_generate(engine, samples, SamplingParams(max_new_tokens=4))
    deadline = time.monotonic() + WAIT_S
    while not engine.inflight_samples() and time.monotonic() < deadline:
        time.sleep(0.001)
    engine.close()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], EngineError) and "closed" in str(errors[0])
    assert engine.inflight_samples() == []


def test_decode_turns_go_round_robin():
    gate = StepGate()
    order: list[str] = []

    def caller(name):
        for _ in range(3):
            with gate.decode_turn():
                order.append(name)

    with gate.exclusive_turn():
        threads = []
        for i, name in enumerate("ABC"):
            threads.append(threading.Thread(target=caller, args=(name,), daemon=True))
            threads[-1].start()
            deadline = time.monotonic() + WAIT_S
            while len(gate._queue) < i + 1 and time.monotonic() < deadline:  # queued in this order
                time.sleep(0.001)
    for thread in threads:
        thread.join(WAIT_S)
    # FIFO turns: nobody takes two steps while another caller waits
    assert order == list("ABCABCABC")
