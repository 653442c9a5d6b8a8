"""bench/weight_push.py runs end to end on the tiny shape and writes what its table prints."""

from __future__ import annotations

import json

from .bench_scripts import run_bench


def test_the_bench_writes_one_row_per_shape_and_dtype(tmp_path):
    out = tmp_path / "weight_push.json"
    done = run_bench("weight_push.py", "--shapes", "tiny", "--repeats", "2", "--out", str(out), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["benchmark"] == "weight_push" and result["repeats"] == 2
    rows = {row["dtype"]: row for row in result["rows"]}
    assert set(rows) == {"float32", "bfloat16"} and {row["shape"] for row in rows.values()} == {"tiny"}
    # a bfloat16 pack holds the floats at half the bytes (the tiny model's weights are all floats)
    assert rows["bfloat16"]["bytes"] * 2 == rows["float32"]["bytes"]
    for row in rows.values():
        for part in ("pack_fresh", "pack_reused", "write", "slot"):
            assert len(row[f"{part}_ms_all"]) == 2 and row[f"{part}_ms_median"] > 0
        assert f"{row['bytes'] / 1e6:7.1f}" in done.stdout


def test_an_unknown_shape_is_one_line_and_exit_2(tmp_path):
    done = run_bench("weight_push.py", "--shapes", "tiny,huge", "--out", str(tmp_path / "x.json"), timeout=120)
    assert done.returncode == 2 and "unknown shape(s) huge" in done.stderr
    assert not (tmp_path / "x.json").exists()
