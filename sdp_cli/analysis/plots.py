"""Figures of ``sdp inspect-weights --plot``: weight histograms per mode on a log-scale w axis.

matplotlib is imported inside the function (it costs about a second), and the figure is drawn
with ``matplotlib.figure.Figure`` on the Agg canvas: no pyplot, no global backend state, no
display needed. The figure is returned as PNG bytes; writing it is the caller's business.
"""

from __future__ import annotations

import io

import numpy as np

from sdp_cli.analysis.inspect import WeightReport, dropped_samples, weight_samples
from sdp_cli.choices import IS_LEVELS

#: one colour per weighted row, in the report's order (decoupled, segment_wise, segment_wise_drift, …)
_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive")
_BINS = 40


def _log_bins(arrays: list[np.ndarray]) -> np.ndarray:
    """Log-spaced bin edges over the positive values of ``arrays`` (a ±50% window around a
    single value, so that a spike at w = 1 still gets visible bins)."""
    positive = np.concatenate([a[a > 0] for a in arrays]) if arrays else np.zeros(0)
    lo, hi = (float(positive.min()), float(positive.max())) if positive.size else (1.0, 1.0)
    lo, hi = min(lo, 1.0) / 1.5, max(hi, 1.0) * 1.5
    return np.logspace(np.log10(lo), np.log10(hi), _BINS + 1)


def _stat(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _histogram(ax, values: np.ndarray, bins: np.ndarray, label: str, color: str | None) -> None:
    positive = values[values > 0]
    zeros = values.size - positive.size
    if zeros:
        label += f"; {zeros} at w = 0 not shown"
    # y is the share of tokens, so modes and lags covering different token counts compare.
    weights = np.full(positive.size, 1.0 / max(values.size, 1))
    ax.hist(positive, bins=bins, weights=weights, histtype="step", linewidth=1.6, label=label, color=color)


def weight_histograms(report: WeightReport, title: str) -> bytes:
    """PNG bytes: one panel per aggregation (every weighted row over its tokens — decoupled,
    segment-wise, drift-clipped and any registered mode; bypass, w ≡ 1, is the dashed line) and a panel of the factor segment-wise drops,
    π_c/π_{v+1}, one histogram per lag (shown only when the batches carry π_prox)."""
    from matplotlib.figure import Figure

    weighted = [name for name, m in report.modes.items() if not m.reference]
    colors = {name: _COLORS[i % len(_COLORS)] for i, name in enumerate(weighted)}
    modes = [name for name in weighted if report.modes[name].available]
    dropped = dropped_samples(report)
    panels = len(IS_LEVELS) + (dropped is not None)
    fig = Figure(figsize=(6.0 * 2, 4.2 * ((panels + 1) // 2)), layout="constrained")
    axes = fig.subplots((panels + 1) // 2, 2, squeeze=False).ravel()
    for ax, level in zip(axes, IS_LEVELS):
        samples = {m: weight_samples(report, m, level).double().numpy() for m in modes}
        bins = _log_bins(list(samples.values()))
        for mode, values in samples.items():
            stats = report.modes[mode].weights[level]
            label = f"{mode} (std {_stat(stats['std'], '.3g')}, ESS {_stat(stats['ess'], '.3f')})"
            _histogram(ax, values, bins, label, colors[mode])
        ax.axvline(1.0, color="black", linestyle="--", linewidth=1, label="bypass (w = 1)")
        ax.set_xscale("log")
        ax.set_title(f"{level} weights")
        ax.set_xlabel("behavioural weight w (log scale)")
        ax.set_ylabel("share of tokens")
        ax.legend(fontsize="small")
    if dropped is not None:
        ax = axes[len(IS_LEVELS)]
        values, lags = (t.double().numpy() for t in dropped)
        by_lag = {int(lag): values[lags == lag] for lag in np.unique(lags)}
        bins = _log_bins(list(by_lag.values()))
        for lag, vals in by_lag.items():
            _histogram(ax, vals, bins, f"lag {lag} ({vals.size} tokens)", None)
        ax.set_xscale("log")
        ax.set_title(r"factor segment-wise drops, $\pi_c\,/\,\pi_{v+1}$ (1 at lag ≤ 1)")
        ax.set_xlabel(r"$\pi_c\,/\,\pi_{v+1}$ (log scale)")
        ax.set_ylabel("share of the lag's tokens")
        if by_lag:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no tokens", transform=ax.transAxes, ha="center")
    for ax in axes[panels:]:
        ax.set_visible(False)
    fig.suptitle(title)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()
