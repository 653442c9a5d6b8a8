"""bench/cache_filter.py runs end to end, its two ways of judging keep the same groups take after
take (the bench checks it), and it writes what its table prints."""

from __future__ import annotations

import json

from .bench_scripts import run_bench


def test_the_bench_writes_one_row_per_length(tmp_path):
    out = tmp_path / "cache_filter.json"
    done = run_bench("cache_filter.py", "--lengths", "3,40", "--takes", "4", "--out", str(out), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["benchmark"] == "cache_filter"
    assert [row["tokens"] for row in result["rows"]] == [3, 40]
    for row in result["rows"]:
        assert row["groups_held"] == 64 and row["takes"] == 4
        for way in ("token_by_token", "now"):
            assert row[f"{way}_filter_ms"] > 0 and row[f"{way}_pass_owed_ms"] > 0
        assert f"{row['now_filter_ms']:8.3f}" in done.stdout


def test_a_bad_length_is_one_line_and_exit_2(tmp_path):
    done = run_bench("cache_filter.py", "--lengths", "3,x", "--out", str(tmp_path / "x.json"), timeout=120)
    assert done.returncode == 2 and "give positive token counts" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "x.json").exists()
