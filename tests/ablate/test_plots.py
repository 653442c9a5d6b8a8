"""What sdp ablate's plots draw: the points, bars and offsets, read back from the figure (the
other tests check only that each PNG is written)."""

from __future__ import annotations

import types

import pytest
from hypothesis import given, strategies as st

from sdp_cli.ablate import plots
from sdp_cli.ablate.records import GroupRow, shadows


@given(st.lists(st.floats(-1e3, 1e3), max_size=30), st.integers(1, 8))
def test_the_smoothing_is_the_mean_of_the_last_window_values(values, window):
    smoothed = plots._smooth(values, window)
    assert len(smoothed) == len(values)
    for i, got in enumerate(smoothed):
        last = values[max(0, i - window + 1) : i + 1]  # shorter at the start
        assert got == pytest.approx(sum(last) / len(last), abs=1e-8)  # a running sum: rounding of its size


def test_the_smoothing_by_hand():
    assert plots._smooth([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert plots._smooth([1.0, 2.0, 3.0, 4.0], 3) == [1.0, 1.5, 2.0, 3.0]


@pytest.mark.parametrize("count", [1, 2, 3, 6])
def test_series_at_one_eta_are_spread_evenly_around_it(count):
    offsets = [plots._dodge(i, count) for i in range(count)]
    assert sum(offsets) == pytest.approx(0.0, abs=1e-12)  # centred on η
    assert all(b - a == pytest.approx(0.08) for a, b in zip(offsets, offsets[1:]))


class _Axes:
    """What ``_line`` hands matplotlib."""

    def __init__(self):
        self.calls = []

    def errorbar(self, xs, ys, *, yerr, **style):
        self.calls.append((list(xs), list(ys), [list(yerr[0]), list(yerr[1])]))


def _group(eta: int, mean: float | None, std: float | None, mode: str = "decoupled") -> GroupRow:
    return GroupRow(mode, eta, (), [0, 1], mean={"m": mean}, std={"m": std})


def test_a_line_skips_missing_means_and_stops_a_std_bar_at_zero():
    rows = [_group(0, 0.05, 0.2), _group(2, None, 0.1), _group(4, 0.5, 0.2), _group(8, 0.3, None)]
    ax = _Axes()
    plots._line(ax, rows, "m", 0.04)
    (xs, ys, (below, above)), = ax.calls
    assert xs == [0.04, 4.04, 8.04] and ys == [0.05, 0.5, 0.3]
    assert below == above == [0.2, 0.2, 0.0]  # a std that is None (one seed) draws no bar
    ax = _Axes()
    plots._line(ax, rows, "m", nonnegative=True)
    (_, _, (below, above)), = ax.calls
    assert below == [0.05, 0.2, 0.0] and above == [0.2, 0.2, 0.0]  # a std never drawn below 0
    ax = _Axes()
    plots._line(ax, [_group(0, None, None)], "m")
    assert ax.calls == []


def test_series_are_sorted_by_label_and_each_by_eta():
    groups = [_group(4, 1.0, None, "segment_wise"), _group(0, 1.0, None, "segment_wise"), _group(2, 1.0, None)]
    series = plots._series(groups)
    assert list(series) == ["decoupled", "segment_wise"]
    assert [g.max_head_offpolicyness for g in series["segment_wise"]] == [0, 4]


def test_the_differences_plot_draws_each_interval_and_stars_the_primary(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.append(fig) or path)

    def contrast(treatment, eta, difference, interval, primary=False):
        test = None if interval is None else types.SimpleNamespace(mean=difference, low=interval[0], high=interval[1])
        return types.SimpleNamespace(treatment=treatment, extra=(), max_head_offpolicyness=eta, difference=difference,
                                     test=test, primary=primary)  # fmt: skip

    contrasts = [
        contrast("segment_wise", 4, 0.10, (0.02, 0.30), primary=True),
        contrast("segment_wise", 0, -0.05, None),  # one pair: a point alone
        contrast("bypass", 4, None, None),  # no difference: not drawn
    ]
    study = types.SimpleNamespace(alpha=0.05, metric="reward_last", baseline="decoupled")
    plots.plot_differences(contrasts, study, tmp_path / "d.png")
    (fig,) = drawn
    (ax,) = fig.axes
    (bars,) = ax.containers  # one series: segment_wise
    line = bars.lines[0]
    assert list(line.get_xdata()) == [0.0, 4.0] and list(line.get_ydata()) == [-0.05, 0.10]  # by η, one series: no dodge
    (segments,) = bars.lines[2]
    ends = sorted((float(seg[0][1]), float(seg[1][1])) for seg in segments.get_segments())
    assert ends == [(-0.05, -0.05), (pytest.approx(0.02), pytest.approx(0.30))]  # the t interval, as given
    stars = [ln for ln in ax.lines if ln.get_marker() == "*"]
    assert len(stars) == 1 and list(stars[0].get_xydata()[0]) == [4.0, 0.10]
    assert ax.get_ylabel() == "reward_last − decoupled (paired, 95% t CI)"
    assert [t for t in ax.get_xticks()] == [0.0, 4.0]


def test_the_weights_plot_gives_every_mode_and_weight_its_own_offset_at_one_eta(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.append(fig) or path)
    weights = shadows()
    groups = []
    for mode in ("decoupled", "segment_wise"):
        values = {f"w_{w.short}_{stat}": 0.5 for w in weights for stat in ("std", "ess")}
        groups.append(GroupRow(mode, 2, (), [0, 1], mean=values, std=dict.fromkeys(values, 0.1)))
    plots.plot_weights(groups, tmp_path / "w.png")
    (fig,) = drawn
    ax_std, ax_ess = fig.axes
    for ax in (ax_std, ax_ess):
        xs = [float(bars.lines[0].get_xdata()[0]) for bars in ax.containers]
        assert len(xs) == 2 * len(weights) and len(set(xs)) == len(xs)  # none drawn over another
        assert sum(x - 2 for x in xs) == pytest.approx(0.0, abs=1e-12)  # centred on η = 2
    assert ax_std.get_yscale() == "symlog" and ax_ess.get_ylim()[1] == pytest.approx(1.01)


def test_the_reward_curves_take_one_panel_per_eta_three_to_a_row(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.append(fig) or path)
    steps = list(range(1, 21))
    curves = {("decoupled", eta, ()): (steps, [0.1 * eta] * 20, [0.0] * 20) for eta in (0, 1, 2, 4)}
    curves[("segment_wise", 4, ())] = ([], [], [])  # a group with no step yet: no line
    plots.plot_reward_curves(curves, tmp_path / "c.png")
    (fig,) = drawn
    assert len(fig.axes) == 6  # 4 panels: two rows of three, the last two blank
    shown = [ax for ax in fig.axes if ax.axison]
    assert [ax.get_title() for ax in shown] == ["η = 0", "η = 1", "η = 2", "η = 4"]
    last = shown[-1]
    assert len(last.lines) == 1 and list(last.lines[0].get_ydata()) == pytest.approx([0.4] * 20)
