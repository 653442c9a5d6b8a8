"""bench/_results.py: every benchmark's JSON names the code it measured (commit, and whether
tracked files differed from it)."""

from __future__ import annotations

import json
import subprocess

from .bench_scripts import load_bench


def _git(repo, *args) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.strip()


def test_the_code_is_the_checkouts_commit_and_whether_tracked_files_changed(tmp_path):
    results = load_bench("_results.py")
    repo = tmp_path / "checkout"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "a.py")
    _git(repo, "commit", "-q", "-m", "one")
    head = _git(repo, "rev-parse", "HEAD")
    (repo / "untracked.txt").write_text("not code that ran\n")
    assert results.code_of(repo) == {"commit": head, "uncommitted_changes": False}
    (repo / "a.py").write_text("x = 2\n")
    assert results.code_of(repo) == {"commit": head, "uncommitted_changes": True}
    assert results.code_of(tmp_path / "elsewhere") == {"commit": None, "uncommitted_changes": None}


def test_every_result_file_names_the_code(tmp_path, monkeypatch):
    results = load_bench("_results.py")
    monkeypatch.setattr(results, "code_of", lambda checkout: {"commit": str(checkout), "uncommitted_changes": False})
    results.write_results(tmp_path / "r.json", "demo", rows=[1])
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["code"] == {"commit": str(results.REPO), "uncommitted_changes": False} and written["rows"] == [1]


#: two processors of a /proc/cpuinfo, as Linux writes it (the flags trimmed)
CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 avx512_vnni sha_ni

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 avx512_vnni sha_ni
"""


def test_the_machine_names_its_processor_and_the_vector_flags_the_kernels_use(tmp_path):
    """Machines of one name differ (an AVX2-only and an AVX-512 EPYC ran the same bench days
    apart): the header says which ran, from the first processor's entry."""
    results = load_bench("_results.py")
    info = tmp_path / "cpuinfo"
    info.write_text(CPUINFO)
    assert results.cpu_of(info) == {
        "model_name": "AMD EPYC",
        "family": 25,
        "model": 17,
        "vector_flags": ["avx2", "avx512_bf16", "avx512_vnni", "avx512bw", "avx512f"],
    }
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2\n")
    assert results.cpu_of(info) == {"model_name": "Some CPU", "family": None, "model": None, "vector_flags": []}
    assert results.cpu_of(tmp_path / "absent") is None  # not Linux


def test_the_written_machine_carries_the_processor(tmp_path, monkeypatch):
    results = load_bench("_results.py")
    monkeypatch.setattr(results, "cpu_of", lambda path=None: {"model_name": "X"})
    results.write_results(tmp_path / "r.json", "demo", rows=[])
    assert json.loads((tmp_path / "r.json").read_text())["machine"]["cpu"] == {"model_name": "X"}
