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
