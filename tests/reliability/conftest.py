"""Fixtures of the reliability suite (``pytest -m reliability``, ``.ci/reliability.sh``).

One warm-start cache for every sdp subprocess of the session, and one vLLM-CPU server (started
through sdp's own launcher, with an API key) shared by the engine-fault tests; it is started in
the background when the session begins, so the crash tests run while it boots. Without
``SDP_VLLM_PYTHON`` the vLLM tests are skipped.

Under pytest-xdist (``.ci/reliability.sh`` runs ``-n 2 --dist loadgroup``) the tests that use the
server form one group, so one worker starts it, when its first such test asks; each worker
hands its report to the controller, which prints and writes the whole one.
"""

from __future__ import annotations

import os
import secrets
import signal
import threading
from pathlib import Path

import pytest

from .harness import FAST, running_in_session, shared_memory_of
from .report import REPORT, merge, records, table, write_json

API_KEY_ENV = "SDP_RELIABILITY_API_KEY"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups of --dist loadgroup
def pytest_collection_modifyitems(config, items):
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            if "vllm_server" in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.xdist_group("vllm"))


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: its records go to the controller
        workeroutput["reliability_report"] = records()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    recorded = getattr(node, "workeroutput", {}).get("reliability_report")
    if recorded:
        merge(recorded)


def pytest_terminal_summary(terminalreporter):
    if not (REPORT.faults or REPORT.inputs):
        return
    terminalreporter.section("reliability report")
    terminalreporter.write_line(table())
    target = os.environ.get("SDP_RELIABILITY_REPORT")
    if target:
        write_json(Path(target))
        terminalreporter.write_line(f"(JSON: {target})")


@pytest.fixture(scope="session")
def sdp_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "sdp-cache"


@pytest.fixture(autouse=True)
def _cache_env(sdp_cache, monkeypatch):
    monkeypatch.setenv("SDP_CACHE_DIR", str(sdp_cache))


class VLLMServer:
    """A vLLM-CPU server on loopback that a test can kill -9 and start again on the same port."""

    def __init__(self, spec, api_key: str):
        from sdp_cli.engine.servers import ManagedServer

        self.spec = spec
        self.api_key = api_key
        self._make = ManagedServer
        self.server = ManagedServer(spec)
        self.error: BaseException | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._boot, daemon=True).start()

    def _boot(self) -> None:
        try:
            self.server.start()
        except BaseException as exc:  # reported by wait_ready() in the test that needs it
            self.error = exc
        finally:
            self._ready.set()

    @property
    def url(self) -> str:
        return self.spec.base_url

    @property
    def log_path(self) -> Path:
        return self.spec.log_path

    def wait_ready(self) -> None:
        self._ready.wait()
        if self.error is not None:
            raise self.error

    def kill(self) -> None:
        """SIGKILL the server and its workers (a crash: nothing is shut down cleanly). What the
        crash leaves is the test's to clean: vLLM's shared memory and semaphores on /dev/shm,
        which its clean exit removes (each kill left two ~200 MB sparse files and a semaphore)."""
        assert self.server.pid is not None, "server not running"
        left = shared_memory_of(running_in_session(self.server.pid))
        os.killpg(self.server.pid, signal.SIGKILL)
        self.server.stop()  # reaps it
        for path in left:
            path.unlink(missing_ok=True)

    def start_again(self) -> None:
        """A fresh process on the same port: it comes back with its start-up weights."""
        self.server = self._make(self.spec)
        self._ready.clear()
        self.error = None
        threading.Thread(target=self._boot, daemon=True).start()

    def stop(self) -> None:
        self._ready.wait()
        self.server.stop()


@pytest.fixture(scope="session", autouse=True)
def _boot_vllm_early(request):
    """Boot the shared server at the start of the session (a no-op without SDP_VLLM_PYTHON, and
    in an xdist worker, which may never be given a test that needs it)."""
    if os.environ.get("SDP_VLLM_PYTHON") and not os.environ.get("PYTEST_XDIST_WORKER"):
        request.getfixturevalue("vllm_server")


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory, sdp_cache):
    """Start the server at the first request for it, in the background (see module docstring)."""
    python = os.environ.get("SDP_VLLM_PYTHON")
    if not python:
        pytest.skip("set SDP_VLLM_PYTHON to a python with vllm-cpu installed (.ci/reliability.sh does)")
    os.environ["SDP_CACHE_DIR"] = str(sdp_cache)
    from sdp_cli.config.compose import compose_config
    from sdp_cli.engine.vllm import VLLMLaunchConfig, launch_spec
    from sdp_cli.models.loader import save_policy
    from sdp_cli.train.session.policy_setup import load_policy_from
    from sdp_cli.train.session.task_setup import build_task_from

    cfg, _ = compose_config(FAST)
    policy = load_policy_from(cfg, build_task_from(cfg))
    model_dir = save_policy(policy, tmp_path_factory.mktemp("vllm-model") / "policy")
    log_dir = Path(os.environ.get("SDP_RELIABILITY_LOG_DIR") or tmp_path_factory.mktemp("vllm-log"))
    api_key = "sdp-secret-" + secrets.token_hex(12)
    config = VLLMLaunchConfig(
        model=str(model_dir),
        python=python,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        cpu_kv_cache_gib=1,
        env={"HF_HUB_OFFLINE": "1"},
        startup_timeout_s=float(os.environ.get("SDP_VLLM_STARTUP_TIMEOUT", "300")),
    )
    server = VLLMServer(launch_spec(config, log_dir, api_key=api_key), api_key)
    yield server
    server.stop()
