"""The GPU check's script runs on a machine without a GPU (``--dry-run``), so it is known to work
before a GPU is lent (scripts/gpu_check.sh, bench/gpu.py; docs/engines.md "Checking on a GPU").

The fast tests run the script for its install step and the model part, and its refusals; the
slow one runs every part at the tiny shape on the CPU and checks the report's numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from .bench_scripts import load_bench

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def _run(tmp_path: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update(PYTHON=sys.executable, TMPDIR=str(_scratch(tmp_path)))
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _scratch(tmp_path: Path) -> Path:
    path = tmp_path / "scratch"
    path.mkdir(exist_ok=True)
    return path


def _report(out: Path) -> dict:
    return json.loads((out / "gpu_check.json").read_text())


def _probe_wheel(directory: Path) -> Path:
    """A minimal pure-Python wheel (one module), to see the install step put it on the path."""
    directory.mkdir()
    path = directory / "sdp_gpu_check_probe-1.0-py3-none-any.whl"
    info = "sdp_gpu_check_probe-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("sdp_gpu_check_probe.py", "VALUE = 42\n")
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: sdp-gpu-check-probe\nVersion: 1.0\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
    return path


def test_dry_run_installs_the_wheels_and_builds_the_tiny_model(tmp_path):
    wheels = tmp_path / "wheels"
    probe = _probe_wheel(wheels)
    out = tmp_path / "out"
    done = _run(tmp_path, "--dry-run", "--out", str(out), "--wheels", str(wheels), "--parts", "model")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = _report(out)
    parts = report["parts"]
    assert report["dry_run"] is True and report["shape"] == "tiny" and report["device"] == "cpu"
    # the probe's distribution is found, and from the directory the script installed it into
    assert probe.name.startswith("sdp_gpu_check_probe-1.0-")
    assert parts["install"]["wheels"] == {"sdp_gpu_check_probe": {"wheel": "1.0", "found": "1.0", "from_site": True}}
    assert parts["install"]["status"] == "ok"
    assert parts["gpu_memory"] == {"status": "skipped", "reason": "skipped (no CUDA)"}
    assert list(parts) == ["install", "gpu_memory", "model"]  # only the parts asked for
    # sdp runs from this checkout, not from an installed copy
    assert report["environment"]["imported_from"]["sdp_cli"] == str(REPO / "sdp_cli")
    assert report["environment"]["sdp_cli_version"].startswith("sdp ")
    model = parts["model"]
    assert model["status"] == "ok"
    # tiny Qwen2, tied embeddings: embedding 512·64 = 32768; per layer q 64·64+64 = 4160,
    # k and v 64·32+32 = 2080 each (2 KV heads of 16), o 64·64 = 4096, MLP 3·64·128 = 24576,
    # two norms 128 → 37120; two layers + the final norm (64): 32768 + 74240 + 64
    assert model["parameters"] == 107072 and model["vocab_size"] == 512
    table = (out / "gpu_check.md").read_text()
    assert "| model | ok |" in table and "| gpu_memory | skipped |" in table
    log = (out / "gpu_check.log").read_text()
    assert "installing 1 wheel(s)" in log and "[gpu_check] model: ok" in log
    assert not list(_scratch(tmp_path).glob("sdp_gpu_check.*")), "the scratch directory was left behind"


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["--bogus"], 2, "unknown argument --bogus"),
        (["--parts", "model,nonsense"], 2, "unknown part(s) nonsense"),
    ],
)
def test_bad_arguments_are_refused(tmp_path, args, code, message):
    done = _run(tmp_path, "--dry-run", "--out", str(tmp_path / "out"), *args)
    assert done.returncode == code and message in done.stdout + done.stderr


def test_an_empty_wheels_directory_is_one_line_and_a_report(tmp_path):
    (tmp_path / "wheels").mkdir()
    out = tmp_path / "out"
    done = _run(tmp_path, "--dry-run", "--out", str(out), "--wheels", str(tmp_path / "wheels"))
    assert done.returncode == 1
    assert f"gpu_check: no *.whl in {tmp_path / 'wheels'}; download them first" in done.stdout
    assert _report(out)["parts"]["install"]["status"] == "failed"


@pytest.mark.slow
def test_the_whole_dry_run_passes_with_sane_numbers(tmp_path):
    out = tmp_path / "out"
    done = _run(tmp_path, "--dry-run", "--out", str(out))
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-3000:]
    parts = _report(out)["parts"]
    assert parts.pop("install")["status"] in ("ok", "skipped")  # ok where a .whl/ folder is at hand
    assert {name: p["status"] for name, p in parts.items()} == {
        "gpu_memory": "skipped", "model": "ok", "train": "ok", "gpu_tests": "ok", "engine": "ok", "fsdp": "ok",
        "async": "ok",
    }  # fmt: skip
    train = parts["train"]
    assert all(train["checks"].values()) and train["steps"] == 4 and train["exit_code"] == 0
    assert train["tokens_per_second"] > 0 and train["recompute_tokens"]["tokens"] > 0
    assert train["gpu_peak_gib"] == "skipped (no CUDA)"
    # bf16 engine and bf16-autocast trainer on the CPU: float noise, far below bf16's own rounding
    assert 0 <= train["mismatch_lag0_abs_mean"] < 1e-3
    assert train["mismatch_lag0_first_step"] == 1 and 0 <= train["mismatch_lag0_first_abs_mean"] < 1e-3
    assert train["entropy_first"] >= 0 and train["entropy_last"] >= 0 and train["train_s_mean"] > 0
    rows = [json.loads(line) for line in (out / "train_metrics.jsonl").read_text().splitlines()]
    # every batch: 4 prompts × 4 samples of 8 tokens. A prompt is BOS, the few-shot prefix (7
    # examples "a+b=c." of 6 characters and 5 of 7: 77) and "a+b=" (4): 82 tokens. A row's last
    # column predicts nothing, so the plain forward runs 16 rows of 89 = 1424 positions, the
    # shared one each prompt once and 7 answer positions a row: 4·82 + 16·7 = 440
    saved = [r["batch/positions_saved"] for r in rows if "batch/positions_saved" in r]
    assert saved == [pytest.approx(1 - 440 / 1424)] * 4
    tests = parts["gpu_tests"]
    assert tests["device"] == "cpu" and tests["counts"] == {"passed": 5, "failure": 0, "error": 0, "skipped": 0}
    (row,) = parts["engine"]["rows"]
    assert row["batch"] == 8 and row["new_tokens"] == 8 and row["tokens_per_second"] > 0
    assert parts["fsdp"]["steps"] == 2 and parts["fsdp"]["exit_code"] == 0
    # the train part's run again at η = 0, and the ratio of the two runs' steps per second
    timing = parts["async"]
    assert timing["eta0"]["steps"] == 4 and all(timing["checks"].values())
    assert timing["speedup"] == pytest.approx(timing["eta2_steps_per_second"] / timing["eta0"]["steps_per_second"])
    assert timing["eta2_steps_per_second"] == train["steps_per_second"]
    step0, step2 = timing["eta0"]["step_s_second_half_median"], timing["eta2_step_s_second_half_median"]
    assert step0 > 0 and step2 == train["step_s_second_half_median"] > 0
    assert timing["second_half_speedup"] == pytest.approx(step0 / step2)
    # what comes back from a lent machine: at most 8 files, none of them the model
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_check.json", "gpu_check.log", "gpu_check.md", "gpu_tests.xml", "train_metrics.jsonl",
    ]  # fmt: skip


def test_the_second_half_step_is_the_median_gap_between_the_later_rows():
    gpu = load_bench("gpu.py")
    # steps 1..6 at these times: the gaps into steps 4, 5 and 6 are 2, 5 and 3 (the first
    # steps' 10 s of warm-up left out); a row without a time is skipped
    rows = [{"step": k, "time": t} for k, t in enumerate([100.0, 110.0, 111.0, 113.0, 118.0, 121.0], start=1)]
    assert gpu.second_half_step_s(rows) == 3.0
    assert gpu.second_half_step_s(rows[:2]) == 10.0  # two rows: their one gap
    assert gpu.second_half_step_s(rows[:1]) is None and gpu.second_half_step_s([]) is None
    # step 2 without a time: five timed rows, the gaps into the last three are 2, 5 and 3
    assert gpu.second_half_step_s([rows[0], {"step": 2}, *rows[2:]]) == 3.0
