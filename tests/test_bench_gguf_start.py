"""bench/gguf_start.py: its check of the cached copy on a tiny GGUF file, the arms' rotation and
the paired ratios it writes (from given wall times, hand-computed), and bad input in one line."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from .bench_scripts import load_bench, run_bench
from .models.gguf_files import tiny_llama, write_gguf

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf extra")


@pytest.fixture(scope="module")
def bench():
    return load_bench("gguf_start.py")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tiny_llama(seed=5), quant="Q8_0")


def test_the_copy_check_compares_every_weight_and_the_prompts_ids(bench, tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SDP_CACHE_DIR", str(tmp_path / "elsewhere"))  # restored after the test
    check = bench.check_copy(tiny, tmp_path / "cache", loads=2)
    assert check["weights_equal"] is True and check["tokenizer_ids_equal"] is True
    assert check["prompts_compared"] == 21 and check["tied_embeddings"] is False
    assert len(check["load_converted_s"]) == len(check["load_cached_s"]) == 2
    assert check["entry_bytes"] > 0 and check["gguf_bytes"] == tiny.stat().st_size
    assert len(list((tmp_path / "cache" / "gguf").iterdir())) == 1


def test_the_arms_rotate_and_the_ratios_are_paired_per_repeat(bench, tiny, tmp_path, monkeypatch):
    # converted 10, 20, 10; first 11, 22, 12; cached 2, 4, 3: cached/converted 0.2, 0.2, 0.3
    # (median 0.2), first/converted 1.1, 1.1, 1.2 (median 1.1)
    walls = {"converted": [10.0, 20.0, 10.0], "first": [11.0, 22.0, 12.0], "cached": [99.0, 2.0, 4.0, 3.0]}
    calls = []

    def fake_run(gguf, root, cache, *extra):
        if extra == ("model.gguf_cache=false",):
            arm = "converted"
        else:
            arm = "first" if cache.name.startswith("cache-first-") else "cached"
            assert not extra
        calls.append(arm)
        return walls[arm].pop(0)

    monkeypatch.setattr(bench, "timed_run", fake_run)
    monkeypatch.setattr(bench, "check_copy", lambda gguf, cache, loads: {
        "weights_equal": True, "tokenizer_ids_equal": True, "prompts_compared": 21,
        "load_converted_median_s": 20.0, "load_cached_median_s": 0.5,
    })  # fmt: skip
    out = tmp_path / "gguf_start.json"
    monkeypatch.setattr(sys, "argv", ["gguf_start.py", "--gguf", str(tiny), "--repeats", "3", "--out", str(out)])
    bench.main()
    # the untimed run that fills the cached arm's cache, then each repeat's rotation
    assert calls == ["cached", "converted", "first", "cached", "first", "cached", "converted", "cached", "converted", "first"]
    result = json.loads(out.read_text())
    assert result["walls"] == {"converted": [10.0, 20.0, 10.0], "first": [11.0, 22.0, 12.0], "cached": [2.0, 4.0, 3.0]}
    rows = {row["arm"]: row for row in result["rows"]}
    assert rows["cached"]["ratios"] == pytest.approx([0.2, 0.2, 0.3]) and rows["cached"]["ratio_median"] == pytest.approx(0.2)
    assert rows["first"]["ratio_median"] == pytest.approx(1.1)
    assert result["medians"] == {"converted": 10.0, "first": 12.0, "cached": 3.0}
    assert rows["cached"]["verdict"] == "shorter" and rows["cached"]["p_holm"] < 0.05
    assert rows["first"]["verdict"] in ("longer", "no difference shown")


def test_no_gguf_file_is_one_line_and_exit_2(tmp_path):
    done = run_bench("gguf_start.py", "--gguf", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "x.json"), timeout=120)
    assert done.returncode == 2 and "no GGUF file: give --gguf FILE" in done.stderr
    assert not (tmp_path / "x.json").exists()
