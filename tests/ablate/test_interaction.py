"""scripts/interaction.py: the paired difference-in-differences of study S2, by hand."""

import csv
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("interaction", ROOT / "scripts" / "interaction.py")
interaction = importlib.util.module_from_spec(spec)
spec.loader.exec_module(interaction)

COLUMNS = ["mode", "eta", "other", "seed", "run", "acc_end"]


def _table(path, rows):
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(COLUMNS)
        for mode, eta, seed, acc in rows:
            writer.writerow([mode, eta, "", seed, f"{mode}-eta{eta}-seed{seed}", "" if acc is None else acc])
    return path


def test_the_gaps_and_their_difference_by_hand(tmp_path, capsys):
    # sweep A gaps (seg − dec): seed 0 +0.10, seed 1 +0.04, seed 2 +0.07; seed 3 lacks decoupled
    a = _table(tmp_path / "a.csv", [("decoupled", 8, 0, 0.80), ("segment_wise", 8, 0, 0.90),
                                    ("decoupled", 8, 1, 0.86), ("segment_wise", 8, 1, 0.90),
                                    ("decoupled", 8, 2, 0.83), ("segment_wise", 8, 2, 0.90),
                                    ("segment_wise", 8, 3, 0.95)])  # fmt: skip
    # sweep B gaps: seed 0 +0.02, seed 1 +0.02, seed 2 −0.01
    b = _table(tmp_path / "b.csv", [("decoupled", 8, 0, 0.80), ("segment_wise", 8, 0, 0.82),
                                    ("decoupled", 8, 1, 0.88), ("segment_wise", 8, 1, 0.90),
                                    ("decoupled", 8, 2, 0.91), ("segment_wise", 8, 2, 0.90),
                                    ("decoupled", 8, 3, 0.90), ("segment_wise", 8, 3, 0.90)])  # fmt: skip
    runs_a = interaction.read_runs_csv(a)
    runs_b = interaction.read_runs_csv(b)
    first = interaction.gaps(runs_a, "segment_wise", "decoupled", "acc_end")
    assert sorted(first) == [(8, 0), (8, 1), (8, 2)]
    differences = interaction.interaction(first, interaction.gaps(runs_b, "segment_wise", "decoupled", "acc_end"))
    # 0.10 − 0.02, 0.04 − 0.02, 0.07 − (−0.01)
    assert differences == pytest.approx([0.08, 0.02, 0.08])
    assert interaction.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    # mean 0.06; sd of (0.08, 0.02, 0.08) = sqrt(((0.02)² + (0.04)² + (0.02)²)/2) = sqrt(0.0012) = 0.034641;
    # se = 0.02; t = 3.0 on 2 dof: two-sided p = 2·(1 − F(3; 2)) = 1 − 3/sqrt(11) = 0.0955
    assert "3 paired seeds" in out and "difference of the gaps +0.0600" in out and "p = 0.0955" in out


def test_too_few_pairs_is_one_line(tmp_path, capsys):
    a = _table(tmp_path / "a.csv", [("decoupled", 8, 0, 0.8), ("segment_wise", 8, 0, 0.9)])
    assert interaction.main([str(a), str(a)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_one_table_at_two_staleness_levels_pairs_by_seed(tmp_path, capsys):
    # gaps at η = 16: seed 0 −0.30, seed 1 −0.20; at η = 2: seed 0 −0.02, seed 1 +0.04
    t = _table(tmp_path / "t.csv", [("decoupled", 16, 0, 0.90), ("segment_wise", 16, 0, 0.60),
                                    ("decoupled", 16, 1, 0.85), ("segment_wise", 16, 1, 0.65),
                                    ("decoupled", 2, 0, 0.88), ("segment_wise", 2, 0, 0.86),
                                    ("decoupled", 2, 1, 0.84), ("segment_wise", 2, 1, 0.88)])  # fmt: skip
    assert interaction.main([str(t), str(t), "--eta", "16", "2"]) == 0
    out = capsys.readouterr().out
    # differences: −0.30 − (−0.02) = −0.28, −0.20 − 0.04 = −0.24; mean −0.26
    assert "2 paired seeds" in out and "at η = 16: -0.2500" in out and "at η = 2: +0.0100" in out, out
    assert "difference of the gaps -0.2600" in out, out
    # without --eta the cells pair by η: the same table against itself differs by exactly 0
    assert interaction.main([str(t), str(t)]) == 0
    assert "difference of the gaps +0.0000" in capsys.readouterr().out
