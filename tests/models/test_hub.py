"""model.path as a Hugging Face hub id, tested offline: a hub-cache layout
(hub/models--org--name/snapshots/<rev>/..., refs/main) in a temporary HF_HOME holds a tiny model
sdp wrote itself; with HF_HUB_OFFLINE=1 sdp loads it from there and never reaches the network.
huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when imported, so each check is a subprocess."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sdp_cli.models import load_policy, save_policy

from ..fast_run import FAST

REPO = "sdp-test/tiny-arith"
REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("hf_home")
    cache = home / "hub" / f"models--{REPO.replace('/', '--')}"
    policy = load_policy("tiny", task="arith1", warm_start_steps=0, hidden_size=32, num_layers=1,
                         num_heads=2, num_kv_heads=2, intermediate_size=64)  # fmt: skip
    save_policy(policy, cache / "snapshots" / REVISION)
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text(REVISION)
    return home


def _env(hf_home: Path, tmp_path: Path) -> dict[str, str]:
    repo_root = Path(__file__).resolve().parents[2]
    return {
        **os.environ,
        "HF_HOME": str(hf_home),
        "HF_HUB_OFFLINE": "1",
        "SDP_CACHE_DIR": str(tmp_path / "cache"),
        "PYTHONPATH": os.pathsep.join([str(repo_root), os.environ.get("PYTHONPATH", "")]),
    }


def test_a_hub_id_resolves_to_its_cached_snapshot(hf_home, tmp_path):
    code = f"from sdp_cli.models.model_dir import resolve_model_dir; print(resolve_model_dir({REPO!r}))"
    out = subprocess.run([sys.executable, "-c", code], env=_env(hf_home, tmp_path), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == hf_home / "hub" / "models--sdp-test--tiny-arith" / "snapshots" / REVISION


def test_sdp_train_runs_a_hub_model_offline(hf_home, tmp_path):
    run_dir = tmp_path / "run"
    args = [*FAST, "model=hf", f"model.path={REPO}", "train.steps=2", "train.save_batches=true", f"run.dir={run_dir}"]
    done = subprocess.run([sys.executable, "-m", "sdp_cli", "train", *args], env=_env(hf_home, tmp_path),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    from sdp_cli.rollout.batch_file import read_batch

    assert read_batch(run_dir / "batches" / "step-000001.safetensors").model == REPO  # named by its hub id


def test_an_uncached_hub_id_offline_is_one_line_and_writes_nothing(hf_home, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run([sys.executable, "-m", "sdp_cli", "train", "model=hf", "model.path=sdp-test/not-cached"],
                          env=_env(hf_home, tmp_path), cwd=work, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "error: model.path=sdp-test/not-cached is no local directory and not in the Hugging Face cache, "
        "and HF_HUB_OFFLINE is set; unset HF_HUB_OFFLINE to download it, or pass a local model directory"
    )
    assert list(work.iterdir()) == []


def test_a_local_directory_wins_over_a_hub_id_of_the_same_name(hf_home, tmp_path, monkeypatch):
    from sdp_cli.models.model_dir import is_hub_id

    monkeypatch.chdir(tmp_path)
    assert is_hub_id(REPO)
    (tmp_path / "sdp-test" / "tiny-arith").mkdir(parents=True)
    assert not is_hub_id(REPO)
    assert not is_hub_id("./model") and not is_hub_id("/abs/model") and not is_hub_id("../x/y")


def test_the_model_type_hint_is_read_without_loading_anything(tmp_path):
    """The engine's process started ahead imports the model code this names (a hint: anything
    it cannot tell without loading or downloading is None, never an error)."""
    from types import SimpleNamespace

    from sdp_cli.models.model_dir import model_type_hint
    from sdp_cli.models.tiny import tiny_arch, tiny_config

    def cfg(kind, path=None):
        return SimpleNamespace(model=SimpleNamespace(kind=kind, path=path))

    assert model_type_hint(cfg("tiny")) == tiny_config(64, tiny_arch()).model_type  # what the tiny model is
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    assert model_type_hint(cfg("hf", str(tmp_path / "llama"))) == "llama"
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")  # cut short
    (tmp_path / "listed").mkdir()
    (tmp_path / "listed" / "config.json").write_text('["model_type"]')
    if importlib.util.find_spec("gguf") is not None:  # a GGUF file's architecture, read from its header
        import gguf

        writer = gguf.GGUFWriter(str(tmp_path / "llama.gguf"), "llama")
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        assert model_type_hint(cfg("hf", str(tmp_path / "llama.gguf"))) == "llama"
    for path in ("HuggingFaceTB/SmolLM2-135M", tmp_path / "broken", tmp_path / "model.gguf", tmp_path / "listed", None):
        assert model_type_hint(cfg("hf", None if path is None else str(path))) is None, path
