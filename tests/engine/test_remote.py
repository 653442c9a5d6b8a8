"""The shared remote-engine machinery: HTTP transport, server processes, and the segment /
version / π_prox_t bookkeeping, checked as a property over arbitrary abort schedules."""

from __future__ import annotations

import contextlib
import getpass
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sdp_cli.engine.base import EngineError, EngineUnavailable, SamplingParams, WeightUpdate
from sdp_cli.engine.http import HttpOptions, HttpServer
from sdp_cli.engine.remote import RemoteEngine, RemoteOptions
from sdp_cli.engine.remote_server import RemoteServer
from sdp_cli.engine.servers import LaunchSpec, ManagedServer, free_port
from sdp_cli.engine.wire import Segment, expand_spans, new_request_id, request_seed
from sdp_cli.errors import UserError
from sdp_cli.rollout.records import RolloutSample

from ..reliability.harness import gone
from .stubs import tiny_lm


# ---------------------------------------------------------------------------- transport
def _server(handler, **options) -> tuple[HttpServer, list[float]]:
    delays: list[float] = []
    server = HttpServer(
        "http://test.invalid:1",
        HttpOptions(**options),
        label="test server",
        unavailable_hint="start it",
        transport=httpx.MockTransport(handler),
        sleep=delays.append,
    )
    return server, delays


def test_backoff_doubles_up_to_the_cap_and_retries_are_bounded():
    calls = []

    def always_503(request):
        calls.append(request)
        return httpx.Response(503, text="overloaded")

    server, delays = _server(always_503, max_retries=4, backoff_initial_s=0.5, backoff_max_s=2.0)
    with pytest.raises(EngineError, match=r"failed after 5 attempt\(s\): HTTP 503: overloaded"):
        server.post("/generate", {"x": 1})
    # 0.5 · 2^k for k = 0, 1, 2, 3, capped at 2.0: 0.5, 1.0, 2.0, 2.0
    assert delays == [0.5, 1.0, 2.0, 2.0] and len(calls) == 5


def test_each_retry_is_logged_with_its_number_and_delay(caplog):
    server, _ = _server(lambda request: httpx.Response(503, text="busy"), max_retries=2, backoff_initial_s=0.5)
    with caplog.at_level(logging.INFO, logger="sdp_cli.engine.http"), pytest.raises(EngineError):
        server.post("/generate", {"x": 1})
    retries = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    assert retries == [
        "POST http://test.invalid:1/generate failed (HTTP 503: busy); retry 1/2 in 0.5 s",
        "POST http://test.invalid:1/generate failed (HTTP 503: busy); retry 2/2 in 1.0 s",
    ]


def test_a_long_error_answer_is_cut_to_300_characters_on_one_line():
    whole = "x" * 298 + "\n" + "y"  # 300 characters once its whitespace is one space
    server, _ = _server(lambda request: httpx.Response(400, text=whole), max_retries=0)
    with pytest.raises(EngineError) as err:
        server.post("/generate", {})
    assert str(err.value).endswith(": " + "x" * 298 + " y")
    longer = "z" * 400
    server, _ = _server(lambda request: httpx.Response(400, text=longer), max_retries=0)
    with pytest.raises(EngineError) as err:
        server.post("/generate", {})
    assert str(err.value).endswith(": " + "z" * 300 + "…")


def test_a_retry_gets_a_fresh_body_and_success_ends_the_loop():
    bodies = []

    def flaky(request):
        bodies.append(json.loads(request.content))
        if len(bodies) < 3:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.Response(200, json={"ok": True})

    fresh = iter(["b", "c"])
    server, delays = _server(flaky, max_retries=3, backoff_initial_s=0.1)
    answer = server.post("/generate", {"rid": "a"}, refresh=lambda: {"rid": next(fresh)})
    assert (
        answer == {"ok": True}
        and bodies == [{"rid": "a"}, {"rid": "b"}, {"rid": "c"}]
        and delays == [0.1, 0.2]
    )


def test_connection_refused_is_engine_unavailable_in_one_line():
    def refused(request):
        raise httpx.ConnectError("[Errno 111] Connection refused")

    server, _ = _server(refused, max_retries=2, backoff_initial_s=0.0)
    with pytest.raises(EngineUnavailable) as err:
        server.get("/health")
    assert str(err.value) == (
        "cannot reach the test server at http://test.invalid:1 ([Errno 111] Connection refused); start it"
    )


def test_a_read_timeout_is_not_retried():
    calls = []

    def slow(request):
        calls.append(request)
        raise httpx.ReadTimeout("timed out")

    server, delays = _server(slow, max_retries=3, request_timeout_s=7.0)
    with pytest.raises(EngineError, match="no answer within 7.0 s; raise engine.request_timeout_s"):
        server.post("/generate", {})
    assert len(calls) == 1 and delays == []


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (404, "Not Found", "HTTP 404: the server lacks this route"),
        (401, "Unauthorized", r"refused with HTTP 401 \(Unauthorized\); set engine.api_key"),
        (
            400,
            '{"error": "max_tokens must be at least 1"}',
            "HTTP 400: .*max_tokens must be at least 1",
        ),
        (200, "{not json", "answered malformed JSON: {not json"),
    ],
)
def test_error_answers_become_one_line_engine_errors(status, body, message):
    server, delays = _server(lambda r: httpx.Response(status, text=body), max_retries=3)
    with pytest.raises(EngineError, match=message) as err:
        server.post("/route", {})
    assert "\n" not in str(err.value) and delays == []


def test_answer_statuses_are_returned_instead_of_raised():
    server, _ = _server(
        lambda r: httpx.Response(400, json={"success": False, "message": "bad path"})
    )
    assert server.post("/update", {}, answer_statuses=(400,)) == {
        "success": False,
        "message": "bad path",
    }


def test_the_api_key_goes_in_the_header_only():
    seen = []
    server, _ = _server(
        lambda r: (seen.append(r.headers.get("authorization")), httpx.Response(200))[1],
        api_key="k-77",
    )
    server.get("/x")
    assert (
        seen == ["Bearer k-77"]
        and "k-77" not in repr(server)
        and "k-77" not in repr(server.options)
    )


@pytest.mark.parametrize(
    "bad",
    [{"max_retries": -1}, {"request_timeout_s": 0}, {"backoff_initial_s": 5, "backoff_max_s": 1}],
)
def test_http_options_are_validated(bad):
    with pytest.raises(ValueError):
        HttpOptions(**bad)


def test_backoff_may_start_at_zero_or_at_its_cap():
    assert HttpOptions(backoff_initial_s=0, backoff_max_s=0).backoff(3) == 0
    assert HttpOptions(backoff_initial_s=2, backoff_max_s=2).backoff(0) == 2


# ------------------------------------------------------------------------------ parsing
def test_spans_must_tile_the_output():
    server = RemoteServer(HttpServer("http://x.invalid", HttpOptions()))
    spans = [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 2, "end": 5}]
    assert expand_spans(server, "/g", spans, 5) == ["1", "1", "2", "2", "2"]
    with pytest.raises(EngineError, match="do not tile"):
        expand_spans(server, "/g", [{"version": "1", "start": 1, "end": 5}], 5)
    with pytest.raises(EngineError, match="cover 2 tokens, the output has 3"):
        expand_spans(server, "/g", spans[:1], 3)


def test_request_seeds_differ_per_sample_and_segment_and_repeat_per_seed():
    seeds = {request_seed(7, position, done) for position in range(8) for done in range(0, 40, 5)}
    assert len(seeds) == 64 and request_seed(None, 3, 4) is None
    assert request_seed(7, 2, 10) == request_seed(7, 2, 10) != request_seed(8, 2, 10)


# ------------------------------------------------------------------------ server process
def _spec(tmp_path, code: str, *, timeout: float = 30.0, secrets=()) -> LaunchSpec:
    port = free_port()
    return LaunchSpec(
        label="test server",
        command=[sys.executable, "-c", code, str(port)],
        env={},
        host="127.0.0.1",
        port=port,
        health_path="/health",
        log_path=tmp_path / "logs" / "server.log",
        startup_timeout_s=timeout,
        poll_interval_s=0.05,
        secrets=secrets,
    )


HEALTHY = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
print("serving", flush=True)
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_launched_server_is_ready_then_stopped(tmp_path):
    server = ManagedServer(_spec(tmp_path, HEALTHY))
    with server:
        assert httpx.get(server.base_url + "/health").status_code == 200
        pid = server.pid
    assert server.pid is None
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(pid, 0)
    assert "serving" in (tmp_path / "logs" / "server.log").read_text()


def test_a_server_that_exits_at_startup_is_reported_with_its_log(tmp_path):
    code = "import sys; print('unrecognized arguments: --bogus key-123'); sys.exit(3)"
    server = ManagedServer(_spec(tmp_path, code, secrets=("key-123",)))
    with pytest.raises(EngineUnavailable) as err:
        server.start()
    message = str(err.value)
    assert "exited with code 3 during startup: unrecognized arguments: --bogus ***" in message
    assert (
        "key-123" not in message
        and "\n" not in message
        and str(tmp_path / "logs" / "server.log") in message
    )


def test_a_server_that_never_gets_ready_times_out_and_is_stopped(tmp_path):
    server = ManagedServer(_spec(tmp_path, "import time; time.sleep(60)", timeout=0.5))
    with pytest.raises(
        EngineUnavailable,
        match=r"was not ready after 0 s; see .* or raise engine.startup_timeout_s",
    ):
        server.start()
    assert server.pid is None


def test_a_missing_interpreter_is_reported(tmp_path):
    spec = _spec(tmp_path, "")
    spec = LaunchSpec(**{**spec.__dict__, "command": ["/no/such/python", "-m", "x"]})
    with pytest.raises(EngineUnavailable, match="cannot start the test server .*set engine.python"):
        ManagedServer(spec).start()


def test_an_interpreter_that_is_not_executable_is_reported_before_anything_starts(tmp_path, system_tmp):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")  # not executable
    spec = LaunchSpec(**{**_spec(tmp_path, "").__dict__, "command": [str(python), "-m", "x"]})
    with pytest.raises(EngineUnavailable, match=r"\(.*/python: not found, or not executable\); set engine.python"):
        ManagedServer(spec).start()
    assert list(system_tmp.iterdir()) == [] and not spec.log_path.exists()  # nothing made


# A server that leaves files in the temporary directory, as vLLM does (ZMQ sockets, a
# torch.distributed file store), from its own process and from a worker in its session, and
# writes to torch's compile cache where torch finds it from the temporary directory alone.
LITTERING = """
import getpass, os, re, socket, subprocess, sys, tempfile
from http.server import BaseHTTPRequestHandler, HTTPServer
tmp = tempfile.gettempdir()
print("tmpdir", tmp, flush=True)
cache = os.path.join(tmp, "torchinductor_" + re.sub(r'[\\\\/:*?"<>|]', "_", getpass.getuser()))
os.makedirs(cache, exist_ok=True)
open(os.path.join(cache, f"compiled-{os.getpid()}"), "w").close()
open(os.path.join(tmp, "server_dist_store"), "w").close()
sock = socket.socket(socket.AF_UNIX)
sock.bind(os.path.join(tmp, "server.sock"))
worker = subprocess.Popen([sys.executable, "-c",
    "import os, tempfile, time; open(os.path.join(tempfile.gettempdir(), 'worker'), 'w').close(); time.sleep(60)"])
print("pids", os.getpid(), worker.pid, flush=True)
if os.environ.get("IGNORE_SIGTERM"):
    import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.fixture
def system_tmp(monkeypatch):
    """sdp's own temporary directory, empty at the start (what /tmp is to a real run); a short
    path, as a socket's path must be (pytest's tmp_path is too long for one)."""
    root = Path(tempfile.mkdtemp(prefix="st-"))
    monkeypatch.setenv("TMPDIR", str(root))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    yield root
    shutil.rmtree(root, ignore_errors=True)


CACHE = "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())


def _left(root: Path) -> list[str]:
    """What is in ``root`` besides torch's shared compile cache."""
    return sorted(p.name for p in root.iterdir() if p.name != CACHE)


def _server_tmpdirs(log: Path) -> list[str]:
    return [line.split()[1] for line in log.read_text().splitlines() if line.startswith("tmpdir ")]


def test_a_stopped_server_leaves_nothing_in_the_temporary_directory(tmp_path, system_tmp):
    spec = _spec(tmp_path, LITTERING)
    with ManagedServer(spec) as server:
        assert httpx.get(server.base_url + "/health").status_code == 200
    (server_tmp,) = _server_tmpdirs(spec.log_path)
    # the server had a directory of its own inside sdp's, and it is gone with the server
    assert Path(server_tmp).parent == system_tmp
    assert _left(system_tmp) == []


def test_a_killed_and_revived_server_leaves_nothing_behind(tmp_path, system_tmp):
    spec = _spec(tmp_path, LITTERING)
    server = ManagedServer(spec).start()
    try:
        wait_s = time.monotonic() + 10
        while not any(system_tmp.rglob("worker")) and time.monotonic() < wait_s:
            time.sleep(0.05)
        os.killpg(server.pid, signal.SIGKILL)
        wait_s = time.monotonic() + 10
        while not server.revive() and time.monotonic() < wait_s:
            time.sleep(0.05)
        assert server.restarts == 1
        first, second = _server_tmpdirs(spec.log_path)
        assert first != second and not Path(first).exists() and Path(second).is_dir()
    finally:
        server.stop()
    assert _left(system_tmp) == []


def _pids(log: Path) -> list[int]:
    lines = [line.split() for line in log.read_text().splitlines() if line.startswith("pids ")]
    return [int(pid) for pid in lines[-1][1:]]


def test_a_log_that_cannot_be_opened_leaves_no_temporary_directory(tmp_path, system_tmp):
    spec = _spec(tmp_path, LITTERING)
    spec.log_path.parent.mkdir(parents=True)
    spec.log_path.symlink_to(tmp_path / "elsewhere.log")  # sdp never writes through a link
    with pytest.raises(UserError, match="is a symbolic link, not a regular file"):
        ManagedServer(spec).start()
    assert not (tmp_path / "elsewhere.log").exists() and _left(system_tmp) == []


def test_a_server_killed_alone_is_reported_with_its_signal_and_revived(tmp_path, system_tmp, caplog):
    spec = _spec(tmp_path, LITTERING)
    server = ManagedServer(spec).start()
    try:
        first_pid = _pids(spec.log_path)[0]
        os.kill(first_pid, signal.SIGKILL)  # the server's process only, not its session
        deadline = time.monotonic() + 10
        while not server.revive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.restarts == 1 and httpx.get(server.base_url + "/health").status_code == 200
        assert "exited with code -9; starting it again" in caplog.text
        assert gone(first_pid) and _pids(spec.log_path)[0] != first_pid
    finally:
        server.stop()
    assert _left(system_tmp) == []


# a stand-in for sdp: launches the server, reports its pid, then waits to be killed
FAKE_SDP = """
import sys, time
from pathlib import Path
from sdp_cli.engine.servers import LaunchSpec, ManagedServer
grace = {"stop_grace_s": float(sys.argv[4])} if len(sys.argv) > 4 else {}
spec = LaunchSpec(label="test server", command=[sys.executable, "-c", sys.argv[1], sys.argv[2]], env={},
                  host="127.0.0.1", port=int(sys.argv[2]), health_path="/health",
                  log_path=Path(sys.argv[3]), poll_interval_s=0.05, **grace)
ManagedServer(spec).start()
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("ignores_sigterm", [False, True], ids=["stops", "ignores-sigterm"])
def test_a_kill_9_of_sdp_ends_the_server_it_launched_and_its_files(tmp_path, system_tmp, ignores_sigterm):
    log = tmp_path / "server.log"
    env, grace = dict(os.environ), []
    if ignores_sigterm:  # killed 1 s after the SIGTERM it ignores
        env["IGNORE_SIGTERM"], grace = "1", ["1.0"]
    sdp = subprocess.Popen(
        [sys.executable, "-c", FAKE_SDP, LITTERING, str(free_port()), str(log), *grace],
        stdout=subprocess.PIPE, env=env, text=True,
    )  # fmt: skip
    try:
        assert sdp.stdout.readline().strip() == "ready"
        pids = _pids(log)
        deadline = time.monotonic() + 10
        while not any(system_tmp.rglob("worker")) and time.monotonic() < deadline:
            time.sleep(0.05)
        sdp.kill()
        sdp.wait()
        deadline = time.monotonic() + 15
        while not all(map(gone, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(map(gone, pids)), "the server outlived sdp"
        deadline = time.monotonic() + 5
        while list(system_tmp.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _left(system_tmp) == []
    finally:
        sdp.kill()
        sdp.stdout.close()
        for pid in _pids(log) if log.exists() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_server_that_fails_at_startup_leaves_nothing_behind(tmp_path, system_tmp):
    code = "import os, sys, tempfile; open(os.path.join(tempfile.gettempdir(), 'x'), 'w').close(); sys.exit(3)"
    with pytest.raises(EngineUnavailable, match="exited with code 3"):
        ManagedServer(_spec(tmp_path, code)).start()
    assert _left(system_tmp) == []


def test_the_compile_cache_is_shared_between_starts(tmp_path, system_tmp):
    spec = _spec(tmp_path, LITTERING)
    for _ in range(2):
        with ManagedServer(spec):
            pass
    # both servers wrote to the one cache in sdp's temporary directory, and it outlives them
    assert len(list((system_tmp / CACHE).glob("compiled-*"))) == 2
    assert _left(system_tmp) == []


def test_a_temporary_directory_set_for_the_server_holds_its_own_directory(tmp_path, system_tmp):
    chosen = system_tmp / "big-disk"
    chosen.mkdir()
    spec = LaunchSpec(**{**_spec(tmp_path, LITTERING).__dict__, "env": {"TMPDIR": str(chosen)}})
    with ManagedServer(spec):
        (server_tmp,) = _server_tmpdirs(spec.log_path)
        assert Path(server_tmp).parent == chosen
    assert _left(chosen) == [] and _left(system_tmp) == ["big-disk"]


# ------------------------------------------------- π_prox_t bookkeeping, as a property
class MemoryEngine(RemoteEngine):
    """A remote engine whose "server" is ``tiny_lm`` in memory.

    ``schedule`` lists the segments before the last one: each generates ``k`` tokens, is
    aborted by a pause, and that pause runs the recompute pass and one weight update on a
    trainer thread. ``prefill_ran=False`` makes a segment that was aborted before its prefill
    (so it returns no prefill logprobs): its tokens must then be covered by a later pass.
    """

    engine_name = "memory"
    #: False: the prefill's answer carries no version label of its own (the tokens' labels say
    #: which weights ran; a dialect need not repeat it)
    label_prefill = True

    def __init__(self, weight_dirs, schedule):
        self.weight_dirs = weight_dirs
        self.weights = [tiny_lm.load_weights(d) for d in weight_dirs]
        self.loaded, self.label = 0, "0"
        self.schedule = list(schedule)
        self.trainer_threads: list[threading.Thread] = []
        self._abort_seen = threading.Event()
        super().__init__(
            ["memory://server"], RemoteOptions(ignore_eos=True, http=HttpOptions(max_retries=0))
        )

    def _unavailable_hint(self):
        return ""

    def _server_connect(self, server):
        pass

    def _server_set_version(self, server, label):
        self.label = label

    def _server_abort_all(self, server):
        self._abort_seen.set()

    def _server_abort_requests(self, server, request_ids):
        pass

    def _server_load_weights(self, server, path, label):
        self.loaded, self.label = self.weight_dirs.index(path), label

    def _server_score(self, server, sequence, start):
        return tiny_lm.score(self.weights[self.loaded], sequence, start), self.label

    def _server_generate(self, server, request, refresh_id):
        weights, label = self.weights[self.loaded], self.label
        k, prefill_ran = self.schedule.pop(0) if self.schedule else (request.max_new_tokens, True)
        k = min(k, request.max_new_tokens)
        gen = torch.Generator().manual_seed(request.seed or 0)
        ids, logprobs = list(request.input_ids), []
        for _ in range(k):
            lp = tiny_lm.next_logprobs(weights, ids)
            token = int(torch.multinomial(lp.exp(), 1, generator=gen))
            ids.append(token)
            logprobs.append(float(lp[token]))
        prefill = None
        if request.prefill_from is not None and (prefill_ran or k):
            prefill = tiny_lm.score(weights, request.input_ids, request.prefill_from)
        finished = k == request.max_new_tokens
        if not finished:
            # the abort comes from a pause: start the trainer's cycle and answer once it has begun
            thread = threading.Thread(target=self._trainer_cycle, daemon=True)
            self.trainer_threads.append(thread)
            thread.start()
            self._abort_seen.wait()
            self._abort_seen.clear()
        return Segment(
            token_ids=ids[len(request.input_ids) :],
            logprobs=logprobs,
            finish_reason="length" if finished else "abort",
            token_versions=[label] * k,
            prefill_logprobs=prefill,
            prefill_version=label if prefill is not None and self.label_prefill else None,
        )

    def _trainer_cycle(self):
        self.pause()
        loaded = self.get_version()
        for s in self.inflight_samples():  # docs/design.md §2 step 2
            idx = [
                t
                for t in range(s.output_len)
                if s.versions[t] == loaded - 1 and s.proximal_t_versions[t] != loaded
            ]
            if idx:
                (values,) = self.score([s.input_ids], [s.prompt_len + idx[0]])
                for t in idx:
                    s.set_proximal_t(t, values[t - idx[0]], loaded)
        self.update_weights(WeightUpdate(version=loaded + 1, path=self.weight_dirs[loaded + 1]))
        self.resume()


MAX_UPDATES = 5


@pytest.fixture(scope="module")
def version_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("versions")
    return [
        tiny_lm.save_weights(root / f"v{v}", tiny_lm.make_weights(seed=500 + v))
        for v in range(MAX_UPDATES + 1)
    ]


@settings(max_examples=40)
@given(
    schedule=st.lists(st.tuples(st.integers(0, 3), st.booleans()), max_size=MAX_UPDATES),
    budget=st.integers(1, 12),
)
def test_proximal_logprobs_are_right_for_any_abort_schedule(version_dirs, schedule, budget):
    """docs/design.md §2 invariant: every token of version v below the final version has π_prox_t
    from version v+1 (computed here directly from those weights); the others keep π_behav."""
    engine = MemoryEngine(version_dirs, schedule)
    sample = RolloutSample(prompt_ids=[3, 1, 4])
    with engine:
        engine.generate([sample], SamplingParams(max_new_tokens=budget, seed=1))
        for thread in engine.trainer_threads:
            thread.join(30)
        final = engine.get_version()
    weights = engine.weights
    sample.check_consistent()
    assert sample.output_len == budget and sample.finish_reason == "length"
    expected_versions = []
    for version, (k, _) in enumerate(schedule[: len(engine.trainer_threads)]):
        expected_versions += [version] * min(k, budget - len(expected_versions))
    expected_versions += [final] * (budget - len(expected_versions))
    assert sample.versions == expected_versions
    for t, v in enumerate(sample.versions):
        assert sample.old_logprobs[t] == pytest.approx(
            tiny_lm.score(weights[v], sample.input_ids, 3)[t], abs=1e-12
        )
        if v < final:
            assert sample.proximal_t_versions[t] == v + 1
            direct = tiny_lm.score(weights[v + 1], sample.input_ids, 3)[t]
            assert sample.proximal_logprobs_t[t] == pytest.approx(direct, abs=1e-12)
        else:
            assert (sample.proximal_t_versions[t], sample.proximal_logprobs_t[t]) == (
                v,
                sample.old_logprobs[t],
            )


def test_a_prefill_answered_without_its_own_version_label_still_gives_pi_prox_t(version_dirs):
    # two tokens of version 0, aborted by a pause (which scores nothing: the pass covers only
    # version loaded − 1), then the resubmission's prefill under version 1 gives their π_prox_t
    engine = MemoryEngine(version_dirs, [(2, True)])
    engine.label_prefill = False
    sample = RolloutSample(prompt_ids=[3, 1, 4])
    with engine:
        engine.generate([sample], SamplingParams(max_new_tokens=4, seed=1))
        for thread in engine.trainer_threads:
            thread.join(30)
    assert sample.versions == [0, 0, 1, 1]
    direct = tiny_lm.score(engine.weights[1], sample.input_ids, 3)
    assert sample.proximal_t_versions[:2] == [1, 1]
    assert sample.proximal_logprobs_t[:2] == pytest.approx(direct[:2], abs=1e-12)


class ScriptedEngine(MemoryEngine):
    """A memory engine whose answers follow ``script``: ``"lost"`` is one token labelled
    ``default`` (a server restarted with its start-up weights, which sdp discards and restores),
    ``"abort"`` one good token aborted without a pause, ``"finish"`` the rest of the budget. More
    requests than the script holds is an error (a test must not hang on a loop)."""

    def __init__(self, weight_dirs, script):
        super().__init__(weight_dirs, [])
        self.script = list(script)

    def _server_generate(self, server, request, refresh_id):
        if not self.script:
            raise EngineError("the script ran out: more requests than it allows")
        kind = self.script.pop(0)
        k = request.max_new_tokens if kind == "finish" else 1
        tokens, start = [5] * k, len(request.input_ids)
        return Segment(
            token_ids=tokens,
            logprobs=tiny_lm.score(self.weights[self.loaded], [*request.input_ids, *tokens], start),
            finish_reason="length" if kind == "finish" else "abort",
            token_versions=["default" if kind == "lost" else self.label] * k,
        )


def test_a_server_losing_sdps_weights_is_restored_three_times_in_a_row_then_the_sample_fails(version_dirs):
    # each lost answer is discarded and the server restored (relabelled: no weights pushed yet);
    # the fourth restore in a row, with no good answer between, fails the sample in one line
    engine = ScriptedEngine(version_dirs, ["lost"] * 4 + ["finish"])
    sample = RolloutSample(prompt_ids=[3, 1, 4])
    with engine, pytest.raises(EngineError, match="lost sdp's weights or stopped answering 3 times in a row"):
        engine.generate([sample], SamplingParams(max_new_tokens=4, seed=1))
    assert engine.stats()["restores"] == 3 and engine.script == ["finish"]


def test_a_good_answer_between_restores_starts_the_count_again_and_the_counters_add_up(version_dirs):
    engine = ScriptedEngine(version_dirs, ["lost"] * 3 + ["abort"] + ["lost"] * 3 + ["finish"])
    sample = RolloutSample(prompt_ids=[3, 1, 4])
    with engine:
        engine.generate([sample], SamplingParams(max_new_tokens=4, seed=1))
        stats = engine.stats()
        # every restore has ended: a pause has nothing to wait for
        assert [(s.restoring, s.busy) for s in engine.servers] == [(0, False)]
    assert sample.output_len == 4 and sample.finish_reason == "length" and engine.script == []
    # two good answers (the abort, the finish); every request after the first good token is a
    # resubmission (3 lost, the finish); the lost answers count only as restores
    assert stats["segments"] == 2 and stats["aborted_segments"] == 1
    assert stats["resubmissions"] == 4 and stats["restores"] == 6 and stats["restore_checks"] == 6
    assert sample.versions == [0] * 4


def test_request_ids_are_unique_across_threads_and_a_forked_child_and_never_prefix_one_another():
    import os

    ids: list[list[str]] = [[] for _ in range(8)]

    def take(out: list[str]) -> None:
        out.extend(new_request_id() for _ in range(2000))

    threads = [threading.Thread(target=take, args=(out,)) for out in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [i for out in ids for i in out]
    # SGLang aborts by id prefix: one fixed length and no repeat mean no id prefixes another
    assert len(set(every)) == len(every) == 16000
    assert {len(i) for i in every} == {32} and all(int(i, 16) >= 0 for i in every)

    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child)
        os.write(write, " ".join(new_request_id() for _ in range(100)).encode())
        os._exit(0)
    os.waitpid(child, 0)
    os.close(write)
    from_child = os.read(read, 1 << 16).decode().split()
    os.close(read)
    assert len(from_child) == 100 and not set(from_child) & set(every + [new_request_id() for _ in range(100)])
