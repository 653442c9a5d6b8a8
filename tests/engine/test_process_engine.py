"""The local engine in its own process (docs/engines.md "The local engine's process"): the
``RemoteEngine`` client path vLLM and SGLang users run, in batches, against sdp's engine server.

The fast tests serve ``process_server``'s routes from a thread of this process (no interpreter
start), the last ones start the real process. References are full unpadded forwards under each
version's weights (tests/engine/tiny_qwen.py), as for the in-process engine: every token carries
the version that sampled it, and π_prox_t of a token of version v is log π_{v+1}, from the
prefill of the resubmission after the update (docs/design.md §2 step 4).
"""

from __future__ import annotations

import dataclasses
import io
import os
import signal
import threading
import time
import types
from pathlib import Path

import httpx
import pytest
import torch

from safetensors.torch import load_file

from sdp_cli.engine import process_server, remote
from sdp_cli.engine.base import EngineError, SamplingParams, WeightUpdate
from sdp_cli.engine.http import HttpOptions, HttpServer
from sdp_cli.engine.local import LocalEngine
from sdp_cli.engine.process import ProcessEngine, WarmProcess, check_scratch_room, local_http_options
from sdp_cli.engine.process_server import BadRequest, EngineService, _Server
from sdp_cli.engine.remote import RemoteOptions
from sdp_cli.engine.servers import free_port
from sdp_cli.engine.wire import SegmentRequest
from sdp_cli.errors import UserError
from sdp_cli.models import loader
from sdp_cli.models.precision import DTYPES, cast_weights
from sdp_cli.processes import SCRATCH_ENV
from sdp_cli.rollout.records import RolloutSample

from ..reliability.harness import gone
from .test_local_segments import WAIT_S, check_versions_and_proximal, perturb_, snapshot, start_generate
from .tiny_qwen import EOS, PAD, prompts, reference_logprobs, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOKEN = "test-token"


class Holder:
    """Step callback of the served engine: after the listed decode steps it stops the
    generating thread at that token boundary until the test releases it."""

    def __init__(self, at_steps: set[int]):
        self.at_steps, self.steps = at_steps, 0
        self.reached, self.go = threading.Event(), threading.Event()

    def __call__(self) -> None:
        self.steps += 1
        if self.steps in self.at_steps:
            self.reached.set()
            assert self.go.wait(WAIT_S), "the test never released the engine"
            self.go.clear()


@dataclasses.dataclass
class Served:
    engine: ProcessEngine
    service: EngineService
    server: _Server


def serve(tmp_path: Path, temperature: float, holder: Holder | None = None, dtype: str | None = None) -> Served:
    """sdp's engine server on a thread of this process, and a client attached to it (``dtype``:
    the engine's weight dtype, as ``engine.dtype`` names it; None: float32, unnamed)."""
    local = LocalEngine(
        tiny_model(),
        temperature=temperature,
        eos_token_id=EOS,
        pad_token_id=PAD,
        seed=7,
        step_callback=holder,
        dtype=DTYPES[dtype] if dtype else None,
    )
    service = EngineService(local)
    port = free_port()
    server = _Server(("127.0.0.1", port), TOKEN, service)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    options = RemoteOptions(temperature=temperature, http=dataclasses.replace(local_http_options(60.0), api_key=TOKEN))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    return Served(
        ProcessEngine([f"http://127.0.0.1:{port}"], options, scratch=scratch, weight_dtype=dtype), service, server
    )


@pytest.fixture
def served(tmp_path):
    made: list[Served] = []

    def make(temperature: float = 1.0, holder: Holder | None = None, dtype: str | None = None) -> Served:
        made.append(serve(tmp_path, temperature, holder, dtype))
        return made[-1]

    yield make
    for s in made:
        s.engine.close()
        s.server.shutdown()
        s.server.server_close()


def pause_while_held(served: Served, holder: Holder) -> None:
    """Pause the client while the engine is held at a token boundary: the abort reaches the
    server first, so the segment in flight ends exactly there."""
    assert holder.reached.wait(WAIT_S), "the engine never reached the step"
    holder.reached.clear()
    pausing = threading.Thread(target=served.engine.pause, daemon=True)
    pausing.start()
    deadline = time.monotonic() + WAIT_S
    while not served.service._aborted:  # the abort has arrived
        assert time.monotonic() < deadline, "the abort never reached the server"
        time.sleep(0.005)
    holder.go.set()
    pausing.join(WAIT_S)
    assert not pausing.is_alive()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_versions_and_proximal_t_across_three_updates_mid_generation(served, temperature):
    holder = Holder({3, 8, 12})
    s = served(temperature, holder)
    trainer = tiny_model()  # moves the way a trainer would
    states = {0: snapshot(trainer)}
    samples = prompts([5, 2, 8, 3, 6, 4])
    thread, errors = start_generate(s.engine, samples, SamplingParams(max_new_tokens=20))
    for version in (1, 2, 3):
        pause_while_held(s, holder)
        # the partial outputs are in the client's samples
        inflight = s.engine.inflight_samples()
        # (a remote engine lists a call's samples until the call returns, finished ones too)
        partial = [x for x in inflight if not x.is_finished]
        assert partial and all(0 < x.output_len < 20 for x in partial)
        lengths = [x.output_len for x in samples]
        perturb_(trainer, seed=version)
        states[version] = snapshot(trainer)
        # in memory: written to the scratch directory (tied embeddings once), loaded from there
        s.engine.update_weights(WeightUpdate(version=version, state_dict=states[version]))
        assert sorted(p.name for p in s.engine.scratch.iterdir()) == [f"v{version:06d}"]
        assert [x.output_len for x in samples] == lengths, "nothing is generated while paused"
        s.engine.resume()
    thread.join(WAIT_S)
    assert not thread.is_alive() and not errors, errors
    assert all(x.is_finished for x in samples)
    # steps 1-3 under version 0; the updates reached samples in flight, so some tokens are of
    # every version and every stale one has π_{v+1} from the resubmission's prefill
    assert {v for x in samples for v in x.versions} == {0, 1, 2, 3}
    check_versions_and_proximal(samples, states, temperature)
    stats = s.engine.stats()
    patched = sum(pv == v + 1 for x in samples for v, pv in zip(x.versions, x.proximal_t_versions))
    assert stats["prefill_proximal_tokens"] == patched > 0


def test_a_staged_push_loads_the_weights_of_the_stage_not_of_the_load(served):
    # docs/training.md "The weight push": at η > 0 the trainer stages its weights and trains on
    # while the push's thread writes and loads them; what loads is what was staged
    s = served(0.7)
    trainer = tiny_model()
    perturb_(trainer, seed=5)
    staged_state = snapshot(trainer)
    live = {name: tensor.detach() for name, tensor in trainer.state_dict().items()}
    staged = s.engine.stage_weights(WeightUpdate(version=1, state_dict=live))
    perturb_(trainer, seed=6)  # the next step changes the trainer's tensors in place
    assert not torch.equal(live["lm_head.weight"], staged_state["lm_head.weight"])
    s.engine.pause()
    s.engine.update_weights(staged)
    s.engine.resume()
    samples = prompts([4, 6])
    scores = s.engine.score([x.input_ids for x in samples], [1, 1])
    reference = tiny_model()
    reference.load_state_dict(staged_state)
    for x, row in zip(samples, scores, strict=True):
        ref = reference_logprobs(reference, x.input_ids, 1, 0.7)
        assert max(abs(a - b) for a, b in zip(row, ref, strict=True)) <= 1e-5
    assert sorted(p.name for p in s.engine.scratch.iterdir()) == ["v000001"]


def test_a_bfloat16_engine_is_pushed_bfloat16_weights_equal_to_its_own_cast(served):
    # The push is packed in the engine's dtype (half the bytes for bfloat16); what the engine
    # holds after it must be bit for bit what casting the trainer's float32 weights itself gives
    s = served(1.0, dtype="bfloat16")
    trainer = tiny_model()
    perturb_(trainer, seed=5)
    s.engine.pause()
    s.engine.update_weights(WeightUpdate(version=1, state_dict=trainer.state_dict()))
    s.engine.resume()
    written = load_file(s.engine.scratch / "v000001" / "model.safetensors")
    assert {t.dtype for t in written.values() if t.is_floating_point()} == {torch.bfloat16}
    engine_state = s.service.engine.model.state_dict()
    for name, tensor in trainer.state_dict().items():
        own_cast = torch.empty_like(engine_state[name]).copy_(tensor)
        assert engine_state[name].dtype == torch.bfloat16, name
        assert torch.equal(engine_state[name].view(torch.int16), own_cast.view(torch.int16)), name
    # scores come from the pushed weights: a bfloat16 model loaded with them gives the same
    reference = cast_weights(tiny_model(), torch.bfloat16)
    reference.load_state_dict(engine_state)
    samples = prompts([4, 6])
    scores = s.engine.score([x.input_ids for x in samples], [1, 1])
    for x, row in zip(samples, scores, strict=True):
        ref = reference_logprobs(reference, x.input_ids, 1, 1.0)
        assert max(abs(a - b) for a, b in zip(row, ref, strict=True)) <= 1e-5


def test_pushes_reuse_the_last_loaded_buffer_and_load_exactly_their_own_weights(served):
    # A push packs into the buffer of the last push the process loaded; a stage made while
    # another is still unwritten takes a fresh one. Every load must still be its own weights.
    s = served(1.0)
    trainer = tiny_model()

    def push(update: WeightUpdate) -> None:
        s.engine.pause()
        s.engine.update_weights(update)
        s.engine.resume()

    def assert_engine_holds(state: dict[str, torch.Tensor]) -> None:
        held = s.service.engine.model.state_dict()
        for name, tensor in state.items():
            assert torch.equal(held[name], tensor), name

    perturb_(trainer, seed=1)
    push(WeightUpdate(version=1, state_dict=trainer.state_dict()))
    assert_engine_holds(snapshot(trainer))
    spare = s.engine._spare
    assert spare is not None
    perturb_(trainer, seed=2)
    second = snapshot(trainer)
    staged_second = s.engine.stage_weights(WeightUpdate(version=2, state_dict=trainer.state_dict()))
    assert s.engine._spare is None  # taken by this stage
    perturb_(trainer, seed=3)
    third = snapshot(trainer)
    staged_third = s.engine.stage_weights(WeightUpdate(version=3, state_dict=trainer.state_dict()))
    push(staged_second)  # its buffer is the spare's, the third's a fresh one
    assert_engine_holds(second)
    assert s.engine._spare.data_ptr() == spare.data_ptr()
    push(staged_third)
    assert_engine_holds(third)
    perturb_(trainer, seed=4)
    push(WeightUpdate(version=4, state_dict=trainer.state_dict()))  # into the third's buffer
    assert_engine_holds(snapshot(trainer))
    s.engine.close()
    assert s.engine._spare is None


def test_scores_over_the_wire_equal_full_forwards(served):
    s = served(0.7)
    samples = prompts([4, 1, 6])
    s.engine.generate(samples, SamplingParams(max_new_tokens=6, seed=11))
    seqs = [x.input_ids for x in samples]
    scores = s.engine.score([*seqs, seqs[0]], [x.prompt_len for x in samples] + [len(seqs[0])])
    assert scores[-1] == []
    model = tiny_model()
    for x, row in zip(samples, scores, strict=False):
        ref = reference_logprobs(model, x.input_ids, x.prompt_len, 0.7)
        assert max(abs(a - b) for a, b in zip(row, ref, strict=True)) <= 1e-5
        # and the sampled logprobs (π_behav) are the same distribution's
        assert max(abs(a - b) for a, b in zip(x.old_logprobs, ref, strict=True)) <= 1e-5


def test_one_servers_scoring_runs_in_the_thread_that_asks(served, monkeypatch):
    # a hand-off to a pool thread and back would take the trainer's interpreter twice per pass
    s = served()
    samples = prompts([3, 5])
    s.engine.generate(samples, SamplingParams(max_new_tokens=4, seed=2))
    threads = []
    original = s.engine._server_score_batch
    monkeypatch.setattr(
        s.engine, "_server_score_batch", lambda *a: (threads.append(threading.get_ident()), original(*a))[1]
    )
    scores = s.engine.score([x.input_ids for x in samples], [x.prompt_len for x in samples])
    assert [len(row) for row in scores] == [x.output_len for x in samples]
    assert threads == [threading.get_ident()]


def test_the_server_refuses_strangers_and_bad_requests_in_one_line(served):
    s = served()
    url = s.engine.servers[0].url
    with httpx.Client(base_url=url) as client:
        assert client.get("/health").status_code == 200  # readiness needs no token
        refused = client.post("/abort", json={"request_ids": None})
        assert refused.status_code == 401 and refused.json() == {"error": "missing or wrong token"}
        auth = {"Authorization": f"Bearer {TOKEN}"}
        bad = client.post("/generate", json={"requests": [{"request_id": "a", "input_ids": [1, "x"]}]}, headers=auth)
        assert bad.status_code == 400
        assert bad.json() == {"error": "request a: input_ids is not a list of token ids"}
        outside = client.post(
            "/generate",
            json={"requests": [{"request_id": "b", "input_ids": [999], "max_new_tokens": 2, "stop_token_ids": []}]},
            headers=auth,
        )
        assert outside.status_code == 400 and "outside the model's vocabulary" in outside.json()["error"]


def test_a_client_gone_before_its_answer_leaves_no_traceback(capfd):
    """A connection queued while the process imports and dropped by sdp's readiness probe before
    the answer: the server's read or write fails with a ConnectionError, which is no engine error
    and must not print a traceback into the engine's log; any other failure still does."""
    import socket
    import struct

    server = _Server(("127.0.0.1", free_port()), TOKEN)  # bound, not yet serving: as during imports
    client = socket.create_connection(server.server_address)
    client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
    client.close()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        # the server still answers the next client, after the dropped one's (queued first)
        assert httpx.get(f"http://127.0.0.1:{server.server_address[1]}/health", timeout=10).status_code == 200
        time.sleep(0.2)  # the dropped request's thread has finished
        assert "Traceback" not in capfd.readouterr().err
        try:
            raise RuntimeError("a failure of the server itself")
        except RuntimeError:
            server.handle_error(None, ("127.0.0.1", 1))
        assert "RuntimeError: a failure of the server itself" in capfd.readouterr().err
    finally:
        server.shutdown()
        server.server_close()


# ------------------------------------------------------------------ the real process
@pytest.fixture
def process_cfg(tmp_path, monkeypatch):
    from sdp_cli.config.compose import compose_config

    from ..fast_run import FAST

    monkeypatch.setenv("SDP_CACHE_DIR", str(tmp_path / "cache"))
    cfg, _ = compose_config([*FAST, "engine.in_process=false"])
    return cfg


def test_a_killed_process_is_started_again_and_close_leaves_nothing(process_cfg, tmp_path):
    """kill -9 of the engine process after a weight push: the next call still completes, every
    token by the pushed weights (the restarted process got them again, not its start-up ones),
    and close() ends the process and removes the scratch directory. (Kills mid-run, during
    generation: tests/reliability/test_engine_process.py.)"""
    from sdp_cli.engine.factory import build_engine
    from sdp_cli.train.session.policy_setup import load_policy_from
    from sdp_cli.train.session.task_setup import build_task_from

    policy = load_policy_from(process_cfg, build_task_from(process_cfg))
    engine = build_engine(process_cfg, policy, tmp_path / "run", threads=1)
    managed = engine._managed[0]
    scratch = engine.scratch
    first_pid = managed.pid
    assert engine.weight_dtype == "float32"  # the launch tells the client its dtype: pushes are written in it
    try:
        assert (tmp_path / "run" / "logs" / "local_engine.log").read_text().count("serving on") == 1
        prompt = policy.tokenizer("12+7=")["input_ids"]
        state = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
        perturb_(policy.model, seed=1)
        engine.pause()
        engine.update_weights(WeightUpdate(version=1, state_dict=policy.model.state_dict()))
        engine.resume()
        os.kill(first_pid, signal.SIGKILL)  # the process dies between calls ...
        samples = [RolloutSample(prompt_ids=list(prompt)) for _ in range(4)]
        engine.generate(samples, SamplingParams(max_new_tokens=6))  # ... and is back for this one
        assert managed.restarts == 1 and managed.pid != first_pid
        assert engine.stats()["restores"] == 1
        # the tokens are version 1's: the restarted process reloaded the pushed weights, not
        # its start-up ones (which differ: the reference under them is far off)
        for x in samples:
            assert set(x.versions) == {1}
            ref1 = reference_logprobs(policy.model.eval(), x.input_ids, x.prompt_len, 1.0)
            assert max(abs(a - b) for a, b in zip(x.old_logprobs, ref1, strict=True)) <= 1e-4
        policy.model.load_state_dict(state)
        ref0 = reference_logprobs(policy.model.eval(), samples[0].input_ids, samples[0].prompt_len, 1.0)
        assert max(abs(a - b) for a, b in zip(samples[0].old_logprobs, ref0, strict=True)) > 1e-3
    finally:
        engine.close()
    assert managed.pid is None and not scratch.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(first_pid, 0)


# ------------------------------------------------------------------ the process started ahead
def _start_with(cfg, policy, run_dir: Path, warm_threads: int | None, *, threads: int = 1, kill_warm: bool = False):
    """``start_local`` as the rollout process runs it: the scratch directory made, the engine's
    process started ahead with ``warm_threads`` (None: none), the policy written, the launch.
    Returns (engine, the pid of the process started ahead or None)."""
    from sdp_cli.engine.factory import prepare_local, start_local, warm_local
    from sdp_cli.processes import make_scratch
    from sdp_cli.rundir import RunDir

    scratch = make_scratch()
    warm = None if warm_threads is None else warm_local(scratch, threads=warm_threads, model_type="qwen2")
    warm_pid = None if warm is None else warm.pid
    if kill_warm:
        os.kill(warm_pid, signal.SIGKILL)
        # a kill lands when the process next runs: on a busy machine it may still be alive at the
        # launch, the case of test_a_process_started_ahead_that_ends_as_it_takes_the_launch_is_replaced
        deadline = time.monotonic() + 30
        while not gone(warm_pid):
            assert time.monotonic() < deadline, f"the process {warm_pid} started ahead outlived its kill -9 by 30 s"
            time.sleep(0.01)
    recipe = prepare_local(cfg, policy, RunDir(run_dir), device="cpu", threads=threads, scratch=scratch)
    return start_local(cfg, recipe, RunDir(run_dir), warm=warm), warm_pid


def _serves_the_policy(engine, policy) -> None:
    """Four samples whose every token's logprob is the policy's own (a full forward)."""
    prompt = policy.tokenizer("12+7=")["input_ids"]
    samples = [RolloutSample(prompt_ids=list(prompt)) for _ in range(4)]
    engine.generate(samples, SamplingParams(max_new_tokens=6))
    for x in samples:
        ref = reference_logprobs(policy.model.eval(), x.input_ids, x.prompt_len, 1.0)
        assert max(abs(a - b) for a, b in zip(x.old_logprobs, ref, strict=True)) <= 1e-4


def test_the_process_started_ahead_is_handed_its_launch_and_serves_the_policy(process_cfg, tmp_path):
    """The rollout process's path (docs/training.md "Start-up"): the engine's process that
    imported while the policy was written is the one that serves it, on the launch's port and
    token, in the run's log, with the launch's threads; close() ends it and removes the scratch."""
    from sdp_cli.train.session.policy_setup import load_policy_from
    from sdp_cli.train.session.task_setup import build_task_from

    policy = load_policy_from(process_cfg, build_task_from(process_cfg))
    engine, warm_pid = _start_with(process_cfg, policy, tmp_path / "run", 1)
    managed, scratch = engine._managed[0], engine.scratch
    try:
        assert managed.pid == warm_pid
        log = (tmp_path / "run" / "logs" / "local_engine.log").read_text()
        assert f"sdp local engine: pid {warm_pid}, 1 thread(s)" in log and log.count("serving on") == 1
        _serves_the_policy(engine, policy)
    finally:
        engine.close()
    assert not scratch.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(warm_pid, 0)


@pytest.mark.parametrize("case", ["another environment", "ended"])
def test_a_launch_the_process_started_ahead_cannot_run_gets_a_new_process(case, process_cfg, tmp_path):
    """Started for two threads (OMP_NUM_THREADS=2 from its start: the launch's one thread would
    not be what a new process runs with), or killed before the launch: a new process serves,
    the one started ahead is ended and reaped, and the engine's log says why it was not used."""
    from sdp_cli.train.session.policy_setup import load_policy_from
    from sdp_cli.train.session.task_setup import build_task_from

    policy = load_policy_from(process_cfg, build_task_from(process_cfg))
    warm_threads = 2 if case == "another environment" else 1
    engine, warm_pid = _start_with(process_cfg, policy, tmp_path / "run", warm_threads, kill_warm=case == "ended")
    try:
        assert engine._managed[0].pid not in (None, warm_pid)
        with pytest.raises(ProcessLookupError):
            os.kill(warm_pid, 0)  # ended and reaped, not a zombie
        why = "it had ended with code -9" if case == "ended" else "the launch's environment differs in OMP_NUM_THREADS"
        log = (tmp_path / "run" / "logs" / "local_engine.log").read_text()
        assert f"sdp: the engine's process {warm_pid} started ahead was not used ({why}); a new process starts" in log
        _serves_the_policy(engine, policy)
    finally:
        engine.close()



def test_a_process_started_ahead_that_ends_as_it_takes_the_launch_is_replaced(process_cfg, tmp_path, monkeypatch):
    """Killed between the check that it lives and its start-up (the window a kill -9 of it, or
    its death on its own, can fall in; the "ended" case above met it by chance): a new process
    serves, and the engine's log says why. Before, the engine's start failed ("exited with code
    -9 during startup")."""
    from sdp_cli.engine.process import WarmProcess
    from sdp_cli.train.session.policy_setup import load_policy_from
    from sdp_cli.train.session.task_setup import build_task_from

    real_hand_over = WarmProcess.hand_over

    def hand_over_then_die(self, spec, env):
        process = real_hand_over(self, spec, env)
        assert process is not None
        os.kill(process.pid, signal.SIGKILL)
        return process

    monkeypatch.setattr(WarmProcess, "hand_over", hand_over_then_die)
    policy = load_policy_from(process_cfg, build_task_from(process_cfg))
    engine, warm_pid = _start_with(process_cfg, policy, tmp_path / "run", 1)
    try:
        assert engine._managed[0].pid not in (None, warm_pid)
        log = (tmp_path / "run" / "logs" / "local_engine.log").read_text()
        assert f"sdp: the process {warm_pid} started ahead ended with code -9 as it took the launch" in log
        _serves_the_policy(engine, policy)
    finally:
        engine.close()
    with pytest.raises(ProcessLookupError):
        os.kill(warm_pid, 0)  # reaped, not a zombie

def test_the_process_started_ahead_leaves_at_the_end_of_its_input_or_when_discarded(tmp_path):
    """Never handed over: the rollout process closes its input (it ended without a recipe) and
    it exits; ``discard`` ends one still importing (idempotent)."""
    from sdp_cli.engine.process import WarmProcess

    for end in ("input closed", "discarded"):
        warm = WarmProcess(tmp_path, threads=1, model_type=None)
        process = warm._process
        if end == "input closed":
            process.stdin.close()
            assert process.wait(timeout=120) == 0
            warm.discard()
        else:
            warm.discard()
            warm.discard()
            assert process.returncode is not None
        assert warm.pid is None


def test_the_scratch_room_check_lets_exactly_enough_through(tmp_path, monkeypatch):
    """The start's weights and one push in each slot: a file system with exactly that much free
    is enough, one byte less is the one line (in MB, rounded up for the need)."""
    policy = types.SimpleNamespace(model=torch.nn.Linear(4, 4))  # 20 float32: 80 bytes
    need = 80 + 3 * 40  # the start's, and three bfloat16 pushes

    def room(free: int) -> None:
        monkeypatch.setattr(os, "statvfs", lambda path: types.SimpleNamespace(f_bavail=free, f_frsize=1))
        check_scratch_room(tmp_path / "scratch", policy, torch.bfloat16)

    room(need)
    with pytest.raises(UserError) as err:
        room(need - 1)
    assert str(err.value).startswith(
        f"the local engine's weight files need 1 MB in {tmp_path} (the start's and 3 pushes'), which has 0 MB free;"
    )


@pytest.mark.parametrize("owned", [True, False], ids=["its own scratch", "the rollout process's scratch"])
def test_a_failed_prepare_removes_what_it_wrote_and_nothing_it_does_not_own(owned, tmp_path, monkeypatch):
    """A start whose weights fail to write half way: a scratch directory prepare made goes
    whole; one another process owns (the rollout process's) keeps everything but launch/."""
    def half_written(policy, path):
        Path(path).mkdir(parents=True)
        (Path(path) / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(loader, "save_policy", half_written)
    monkeypatch.setenv(SCRATCH_ENV, str(tmp_path))
    theirs = None
    if not owned:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        (theirs / "kept").write_text("the owner's")
    with pytest.raises(OSError, match="No space left"):
        ProcessEngine.prepare(types.SimpleNamespace(model=torch.nn.Linear(2, 2)), theirs)
    if owned:
        assert list(tmp_path.iterdir()) == []
    else:
        assert sorted(p.name for p in theirs.iterdir()) == ["kept"]


def _answering(tmp_path, monkeypatch, answers):
    """A ProcessEngine whose one server answers each route with ``answers[route]`` (JSON; the
    connection's /health and version set with {})."""
    def answer(request):
        if request.method == "POST" and request.url.path == "/weight_version":
            return httpx.Response(200, json={})
        return httpx.Response(200, json={"/health": {}, **answers}[request.url.path])

    def mocked(url, options, *, loopback=False, **kwargs):
        return HttpServer(url, options, transport=httpx.MockTransport(answer), **kwargs)

    monkeypatch.setattr(remote, "HttpServer", mocked)
    engine = ProcessEngine(["http://127.0.0.1:9"], RemoteOptions(http=HttpOptions(max_retries=0)), scratch=tmp_path)
    return engine, engine.servers[0]


@pytest.mark.parametrize(
    "route, answer, problem",
    [
        ("/generate", {"segments": []}, "expected 2 segments"),
        ("/generate", {"segments": "two"}, "expected 2 segments"),
        ("/generate", [], "expected 2 segments"),
        ("/score", {"logprobs": [[-1.0]], "weight_version": "3"}, "expected 2 rows of logprobs and a weight_version"),
        ("/score", {"logprobs": [[-1.0], [-2.0]]}, "expected 2 rows of logprobs and a weight_version"),
        ("/score", {"logprobs": [[-1.0], [-2.0]], "weight_version": 3}, "expected 2 rows of logprobs and a weight_version"),
        ("/score", {"logprobs": "rows", "weight_version": "3"}, "expected 2 rows of logprobs and a weight_version"),
        ("/weight_version", {}, "no weight_version string"),
        ("/weight_version", {"weight_version": 3}, "no weight_version string"),
        ("/weight_version", ["3"], "no weight_version string"),
    ],
)  # fmt: skip
def test_a_malformed_answer_of_the_engines_process_is_one_engine_error(route, answer, problem, tmp_path, monkeypatch):
    engine, server = _answering(tmp_path, monkeypatch, {route: answer})
    try:
        with pytest.raises(EngineError) as err:
            if route == "/generate":
                requests = [SegmentRequest(f"r{k}", [1, 2], 4, (EOS,), seed=k) for k in range(2)]
                engine._server_generate_batch(server, requests, lambda: ["r0", "r1"])
            elif route == "/score":
                engine._server_score_batch(server, [[1, 2, 3], [1, 2]], [1, 1])
            else:
                engine._server_get_version(server)
        assert str(err.value) == f"http://127.0.0.1:9{route} answered a malformed response ({problem}); the sample is not used"
    finally:
        engine.close()


def test_a_well_formed_score_and_version_are_read(tmp_path, monkeypatch):
    engine, server = _answering(tmp_path, monkeypatch, {
        "/score": {"logprobs": [[-1.0, -0.5], [-2.0]], "weight_version": "3"},
        "/weight_version": {"weight_version": "4"},
    })  # fmt: skip
    try:
        assert engine._server_score_batch(server, [[1, 2, 3], [1, 2]], [1, 1]) == [([-1.0, -0.5], "3"), ([-2.0], "3")]
        assert engine._server_get_version(server) == "4"
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("output", "tail"),
    [
        (b"", ""),
        (b"ImportError: no module x", "its output:\nImportError: no module x\n"),
        (b"two\nlines\n", "its output:\ntwo\nlines\n"),
    ],
)
def test_the_note_on_a_process_started_ahead_carries_what_it_wrote(output, tail, tmp_path):
    """What the process started ahead wrote before it was refused (an ended one's traceback says
    why it ended) follows the note in the engine's log, ending in one newline; nothing when it
    wrote nothing."""
    log = tmp_path / "local_engine.log"
    log.write_bytes(b"before\n")
    written = io.BytesIO(output)
    written.seek(0, io.SEEK_END)  # where the process's writes left the shared offset
    warm = types.SimpleNamespace(_output=written)
    WarmProcess._note_not_used(warm, log, 4321, "it had ended with code 1")
    note = "sdp: the engine's process 4321 started ahead was not used (it had ended with code 1); a new process starts\n"
    assert log.read_text() == "before\n" + note + tail


def _request(**changes):
    return {"request_id": "r", "input_ids": [5, 6, 7], "max_new_tokens": 1, "stop_token_ids": [2], "seed": None, **changes}


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (None, "expected {'requests': [...]}"),
        ({"requests": {"r": 1}}, "expected {'requests': [...]}"),
        ({"requests": ["x" * 100]}, "a request without a request_id: " + "x" * 80),
        ({"requests": [{"request_id": 7}]}, "a request without a request_id: {'request_id': 7}"),
        ({"requests": [_request(input_ids=[])]}, "request r: input_ids is not a list of token ids"),
        ({"requests": [_request(input_ids="567")]}, "request r: input_ids is not a list of token ids"),
        ({"requests": [_request(prefill_from=0)]}, "request r: prefill_from 0 outside [1, 3]"),
        ({"requests": [_request(prefill_from=4)]}, "request r: prefill_from 4 outside [1, 3]"),
        ({"requests": [_request(prefill_from=2.0)]}, "request r: prefill_from 2.0 outside [1, 3]"),
        ({"requests": [_request(max_new_tokens=0)]}, "request r: bad max_new_tokens, stop_token_ids or seed"),
        ({"requests": [_request(stop_token_ids=2)]}, "request r: bad max_new_tokens, stop_token_ids or seed"),
        ({"requests": [_request(seed="1")]}, "request r: bad max_new_tokens, stop_token_ids or seed"),
    ],
)
def test_a_generate_body_is_checked_field_by_field(body, error):
    with pytest.raises(BadRequest) as err:
        process_server._requests(body)
    assert str(err.value) == error


def test_a_generate_body_at_the_edges_of_each_field_is_taken():
    edges = [_request(request_id="a", prefill_from=1), _request(request_id="b", prefill_from=3, seed=4),
             {"request_id": "c", "input_ids": [9], "max_new_tokens": 1}]  # fmt: skip
    checked = process_server._requests({"requests": edges})
    assert [(r["request_id"], r["prefill_from"], r["seed"], r["stop_token_ids"]) for r in checked] == [
        ("a", 1, None, [2]), ("b", 3, 4, [2]), ("c", None, None, []),
    ]  # fmt: skip
    assert process_server._requests({"requests": []}) == []


def test_only_a_request_that_re_prefills_its_tokens_gets_their_prefill_logprobs():
    """A request that sends tokens it already generated (``prefill_from``) gets their log-probs
    under the engine's current weights and that version's label; a plain one gets neither."""
    model = tiny_model()
    service = EngineService(LocalEngine(model, temperature=1.0, eos_token_id=EOS, pad_token_id=PAD, seed=7))
    ids = [5, 9, 13, 4, 22]
    plain = {"request_id": "plain", "input_ids": ids[:3], "max_new_tokens": 2, "stop_token_ids": []}
    again = {"request_id": "again", "input_ids": ids, "max_new_tokens": 2, "stop_token_ids": [], "prefill_from": 3}
    first, second = service.generate(process_server._requests({"requests": [plain, again]}))["segments"]
    assert first["prefill_logprobs"] is None and first["prefill_version"] is None
    assert second["prefill_version"] == process_server.START_LABEL
    assert second["prefill_logprobs"] == pytest.approx(reference_logprobs(model, ids, 3, 1.0), abs=1e-5)
    assert len(first["token_ids"]) == len(second["token_ids"]) == 2  # new tokens only, the re-prefilled ones not among them


def test_a_label_set_mid_generation_splits_the_answer_into_two_spans_at_that_token():
    """``/weight_version`` relabels the engine's weights without a pause (a server that loaded
    them itself): the tokens before carry the old label, those after the new one, each run of one
    label a single span."""
    steps: list[int] = []
    services: list[EngineService] = []

    def at_each_token() -> None:
        steps.append(1)
        if len(steps) == 3:
            services[0].set_label("v2")

    local = LocalEngine(tiny_model(), temperature=1.0, eos_token_id=EOS, pad_token_id=PAD, seed=7, step_callback=at_each_token)
    services.append(EngineService(local))
    request = {"request_id": "a", "input_ids": [5, 9, 13], "max_new_tokens": 8, "stop_token_ids": []}
    (segment,) = services[0].generate(process_server._requests({"requests": [request]}))["segments"]
    assert len(segment["token_ids"]) == 8, segment  # (this seed draws no EOS in 8 tokens)
    assert segment["weight_versions"] == [
        {"version": process_server.START_LABEL, "start": 0, "end": 3}, {"version": "v2", "start": 3, "end": 8},
    ]  # fmt: skip


def test_requests_of_one_call_with_different_budgets_each_get_their_own():
    """One engine call for the requests that share a sampling setting: the call runs to the
    largest budget, each request stops at its own."""
    service = EngineService(LocalEngine(tiny_model(), temperature=1.0, eos_token_id=EOS, pad_token_id=PAD, seed=7))
    requests = [{"request_id": name, "input_ids": [5, 9, 13], "max_new_tokens": n, "stop_token_ids": []}
                for name, n in (("short", 2), ("long", 7))]  # fmt: skip
    short, long = service.generate(process_server._requests({"requests": requests}))["segments"]
    assert (len(short["token_ids"]), short["finish_reason"]) == (2, "length")
    assert (len(long["token_ids"]), long["finish_reason"]) == (7, "length"), long  # (no EOS at this seed)
