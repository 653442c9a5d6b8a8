"""Security defaults: loopback unless told otherwise, API keys used but never shown or stored.

The vLLM runs of test_engine_faults_vllm.py authenticate with a random key and check that it is
in no file of their run directories and in nothing sdp printed; here the shared server's log
(written through sdp's launcher) is checked, the server is shown to enforce the key (so those
runs really sent it), and it listens on loopback only.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

import sdp_cli
from sdp_cli.config.schema import EngineConfig
from sdp_cli.engine.servers import ManagedServer
from sdp_cli.engine.sglang import SGLangLaunchConfig
from sdp_cli.engine.sglang import launch_spec as sglang_spec
from sdp_cli.engine.vllm import VLLMLaunchConfig
from sdp_cli.engine.vllm import launch_spec as vllm_spec

pytestmark = pytest.mark.reliability


def test_everything_binds_to_loopback_by_default(tmp_path):
    assert EngineConfig().host == "127.0.0.1"
    for spec in (
        vllm_spec(VLLMLaunchConfig(model="m"), tmp_path),
        sglang_spec(SGLangLaunchConfig(model="m"), tmp_path),
    ):
        host = spec.command[spec.command.index("--host") + 1]
        assert host == "127.0.0.1" and spec.base_url.startswith("http://127.0.0.1:")
    # no code path of sdp binds to every interface
    sources = [p for p in Path(sdp_cli.__file__).parent.rglob("*.py")]
    wildcard = [str(p) for p in sources if re.search(r"0\.0\.0\.0|\"::\"|'::'", p.read_text())]
    assert not wildcard, wildcard


def test_api_keys_stay_out_of_argv_and_logs(tmp_path):
    key = "sdp-secret-argv-check"
    spec = vllm_spec(VLLMLaunchConfig(model="m"), tmp_path, api_key=key)
    assert key not in " ".join(spec.command) and spec.env["VLLM_API_KEY"] == key
    # SGLang takes the key only on its command line: sdp hides it in everything it logs
    spec = sglang_spec(SGLangLaunchConfig(model="m"), tmp_path, api_key=key)
    server = ManagedServer(spec)
    assert key in spec.command and key not in server._redacted(spec.command)
    assert key not in repr(spec)
    spec = vllm_spec(VLLMLaunchConfig(model="m"), tmp_path, api_key=key)
    assert key not in repr(spec)


def _listening_addresses(port: int) -> set[str]:
    """Local addresses listening on ``port`` (IPv4 and IPv6), from /proc/net."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A = LISTEN
                found.add(address)
    return found


def test_the_shared_vllm_server_enforced_its_key_kept_it_out_of_its_log_and_listened_on_loopback(
    vllm_server,
):
    vllm_server.wait_ready()
    url = vllm_server.url
    assert httpx.post(url + "/inference/v1/generate", json={}).status_code == 401
    answer = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {vllm_server.api_key}"})
    assert answer.status_code == 200
    log = vllm_server.log_path.read_bytes()
    assert log and vllm_server.api_key.encode() not in log
    port = int(url.rsplit(":", 1)[1])
    assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1, little-endian hex


@pytest.mark.parametrize("key", ["engine.python", "task.reward"])
def test_a_resumed_run_directory_never_names_a_program_to_run(key, tmp_path, sdp_cache):
    """A run directory may come from someone else: its overrides.json must not make `resume`
    start a program (engine.python) or import code (task.reward=file.py:fn) unless the command
    line names it again."""
    import json

    from .harness import FAST, error_line, run_sdp, sdp_env

    run_dir = tmp_path / "run"
    done = run_sdp(["train", *FAST, f"run.dir={run_dir}", "train.steps=2"], sdp_env(sdp_cache))
    assert done.returncode == 0, done.stderr[-3000:]
    marker = tmp_path / "ran"
    if key == "engine.python":
        program = tmp_path / "evil.sh"
        program.write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
        program.chmod(0o755)
        planted = ["engine=vllm", f"engine.python={program}"]
    else:
        program = tmp_path / "evil.py"
        program.write_text(f"open({str(marker)!r}, 'w').close()\ndef reward(*a, **k):\n    return 0.0\n")
        data = tmp_path / "data.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(20)))
        planted = ["task=dataset", f"task.path={data}", f"task.reward={program}:reward"]
    overrides = run_dir / "overrides.json"
    before = json.loads(overrides.read_text())
    overrides.write_text(json.dumps([*before, *planted]))
    config = (run_dir / "config.yaml").read_text()
    done = run_sdp(["train", f"resume={run_dir}", "train.steps=3"], sdp_env(sdp_cache))
    assert not marker.exists(), f"resume ran {program} named by the run directory's overrides.json"
    assert done.returncode == 2, done.stderr[-3000:]
    line = error_line(done.stderr)
    assert key in line and "command line" in line, line
    assert (run_dir / "config.yaml").read_text() == config  # a refused resume rewrites nothing


def test_credentials_in_engine_urls_appear_nowhere(tmp_path, sdp_cache):
    """`http://user:pw@host` in engine.urls: the password is in no line sdp prints and no file
    it writes (overrides.json, config.yaml, events), whatever becomes of the run."""
    from .harness import FAST_SERVER, assert_no_secret, run_sdp, sdp_env

    secret = "s3cret-pw-7781"
    run_dir = tmp_path / "run"
    args = [*FAST_SERVER, "engine=vllm", f"engine.urls=[http://alice:{secret}@127.0.0.1:9]",
            "engine.startup_timeout_s=2", "engine.reconnect_timeout_s=2", f"run.dir={run_dir}"]  # fmt: skip
    done = run_sdp(["train", *args], sdp_env(sdp_cache), timeout=120)
    assert done.returncode != 0, done.stderr[-2000:]
    assert "alice:***@127.0.0.1:9" in done.stderr or "127.0.0.1:9" in done.stderr, done.stderr[-2000:]
    assert_no_secret(secret, tmp_path, done.stdout, done.stderr)


def test_redaction_of_urls_in_text():
    from sdp_cli.redact import redact_urls

    # user:password → user:***; a user alone is no secret; URLs without credentials are unchanged
    text = "cannot reach http://alice:pw@h:8000/v1 and https://tok@h2 or http://h3:1 (x@y.z)"
    assert redact_urls(text) == "cannot reach http://alice:***@h:8000/v1 and https://***@h2 or http://h3:1 (x@y.z)"


def test_a_server_bound_beyond_loopback_needs_an_api_key_and_warns(tmp_path):
    """engine.host=0.0.0.0 exposes the launched server to the network: refused without an API
    key (one line), accepted with one but with a warning."""
    import os
    import subprocess
    import sys

    from sdp_cli.train.session.start import bind_warning

    env = {k: v for k, v in os.environ.items() if k != "SDP_TEST_FAULTS"}
    cmd = [sys.executable, "-m", "sdp_cli", "train", "engine=vllm", "engine.host=0.0.0.0", f"run.dir={tmp_path / 'r'}"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    line = [x for x in done.stderr.splitlines() if x.strip()]
    assert len(line) == 1 and "engine.host=0.0.0.0" in line[0] and "engine.api_key_env" in line[0], done.stderr
    assert not (tmp_path / "r").exists()
    from sdp_cli.config.compose import compose_config

    cfg, _ = compose_config(["engine=vllm", "engine.host=::", "engine.api_key_env=K"])
    assert "engine.host=::" in bind_warning(cfg) and "network" in bind_warning(cfg)
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        cfg, _ = compose_config(["engine=vllm", f"engine.host={host}"])
        assert bind_warning(cfg) is None, host
