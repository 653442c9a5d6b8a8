"""bench/ab_train.py: the paired after/before ratios and their verdicts (hand-computed), and a run
end to end on the fast config with one checkout as both sides."""

from __future__ import annotations

import json

import pytest

from .bench_scripts import BENCH, load_bench, run_bench

ROOT = BENCH.parent


@pytest.fixture(scope="module")
def bench():
    return load_bench("ab_train.py")


def test_the_ratios_are_paired_and_their_interval_is_of_the_log_ratios(bench):
    # pairs 10→11, 10→12, 20→22: ratios 1.1, 1.2, 1.1; median 1.1; logs 0.09531, 0.18232,
    # 0.09531: mean 0.12431, geometric mean exp(0.12431) = 1.1324; sd 0.05024, se 0.02900,
    # t(0.975, 2) = 4.3027: interval exp(0.12431 ∓ 0.12479) = 0.9995–1.2829
    result = bench.compare([10.0, 10.0, 20.0], [11.0, 12.0, 22.0])
    assert result["ratios"] == pytest.approx([1.1, 1.2, 1.1])
    assert result["ratio_median"] == pytest.approx(1.1)
    assert result["geometric_mean"] == pytest.approx(1.1324, abs=1e-4)
    assert (result["low"], result["high"]) == pytest.approx((0.9995, 1.2829), abs=1e-4)
    assert result["p"] > 0.05  # the interval holds 1


def test_one_pair_has_no_test(bench):
    result = bench.compare([10.0], [12.0])
    assert result["ratio_median"] == pytest.approx(1.2) and result["p"] is None and result["low"] is None


def test_verdicts_are_holm_adjusted_over_the_configurations(bench):
    # p 0.01, 0.02, 0.2 over three configurations: Holm gives 0.01·3 = 0.03, max(0.03, 0.02·2)
    # = 0.04 (both under 0.05: shown) and max(0.04, 0.2·1) = 0.2 (not shown); a configuration
    # with one pair has no test and no verdict
    rows = [
        {"p": 0.01, "geometric_mean": 1.2},
        {"p": 0.02, "geometric_mean": 0.9},
        {"p": 0.2, "geometric_mean": 1.5},
        {"p": None, "geometric_mean": 2.0},
    ]
    bench.verdicts(rows)
    assert [r.get("verdict") for r in rows] == ["faster", "slower", "no difference shown", None]
    assert rows[0]["p_holm"] == pytest.approx(0.03) and rows[2]["p_holm"] == pytest.approx(0.2)


def test_wall_time_verdicts_say_longer_and_shorter(bench):
    # the same Holm arithmetic as above; a ratio above 1 is a longer command
    rows = [{"p": 0.01, "geometric_mean": 0.7}, {"p": 0.02, "geometric_mean": 1.1}, {"p": 0.2, "geometric_mean": 0.5}]
    bench.verdicts(rows, "wall_seconds")
    assert [r["verdict"] for r in rows] == ["shorter", "longer", "no difference shown"]


def test_one_step_is_refused_unless_the_wall_time_is_measured(tmp_path):
    done = run_bench(
        "ab_train.py", "--before", str(ROOT), "--after", str(ROOT), "--steps", "1", "--out", str(tmp_path / "x.json"),
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "1 with --measure wall_seconds" in done.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "x.json").exists()


def test_end_to_end_with_one_checkout_on_both_sides(tmp_path):
    # one pair (two runs): the statistics of several are tested on hand-computed values above
    out = tmp_path / "ab.json"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    done = run_bench(
        "ab_train.py", "--before", str(ROOT), "--after", str(ROOT), "--pairs", "1", "--steps", "3", "--modes", "decoupled",
        "--etas", "1", "--set", "+debug=fast", "--set", "engine.in_process=true", "--out", str(out), timeout=600,
        env={"TMPDIR": str(scratch)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert list(scratch.glob("sdp-bench-*")) == []  # the runs' directories are gone (torch's cache stays)
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert (row["mode"], row["max_head_offpolicyness"], row["pairs"]) == ("decoupled", 1, 1)
    (before,), (after,) = row["before_steps_per_second"], row["after_steps_per_second"]
    assert before > 0 and after > 0 and row["ratios"] == pytest.approx([after / before])
    assert row["p"] is None and row.get("verdict") is None  # one pair: no test
    assert result["before"]["path"] == str(ROOT) and result["overrides"] == ["+debug=fast", "engine.in_process=true"]
    assert f"{row['ratio_median']:.3f}×" in done.stdout and "one pair: no test" in done.stdout


def test_a_directory_that_is_no_checkout_is_one_line_and_exit_2(tmp_path):
    done = run_bench(
        "ab_train.py", "--before", str(tmp_path), "--after", str(ROOT), "--out", str(tmp_path / "x.json"), timeout=120
    )
    assert done.returncode == 2 and "not an sdp checkout" in done.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "x.json").exists()
