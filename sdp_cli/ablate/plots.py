"""PNG plots of an aggregated sweep (matplotlib with the Agg backend, imported on first use).

- ``weights_vs_eta.png``: std and ESS of the shadow weights vs η, one colour per training mode;
  solid = decoupled weight π_prox/π_behav, dashed = segment-wise weight π_{v+1}/π_behav,
  dotted = drift-clipped weight (dash-dot and onwards: any registered mode).
- ``difference_vs_eta.png``: the study's contrasts (``sdp_cli.ablate.contrasts``): each mode's
  paired difference to the baseline in the study's metric vs η, with its paired t interval;
  the primary contrast is drawn as a star.
- ``reward_vs_eta.png``: final reward and greedy accuracy vs η per mode.
- ``reward_curves.png``: reward per step (mean over seeds, band = ± std, moving average) per η;
  not from a runs.csv, which has no per-step numbers.
- ``throughput_vs_eta.png``: generated tokens/s and training steps/s vs η per mode.

Error bars are ± one sample std over seeds (none for a single seed); series are shifted
slightly along η so that their bars do not overlap.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sdp_cli.ablate.contrasts import Contrast
from sdp_cli.ablate.records import Curves, GroupRow, shadows
from sdp_cli.ablate.study import Study
from sdp_cli.fileio import atomic_write_bytes

#: line styles of the shadow weights, in ``records.shadows`` order (decoupled, segment-wise,
#: drift-clipped, then any registered mode)
WEIGHT_DASHES = ("-", "--", ":", "-.")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(groups: Sequence[GroupRow]) -> dict[str, list[GroupRow]]:
    """Groups by series label (mode plus any other swept value), each sorted by η."""
    out: dict[str, list[GroupRow]] = {}
    for g in groups:
        out.setdefault(g.label, []).append(g)
    return {label: sorted(rows, key=lambda g: g.max_head_offpolicyness) for label, rows in sorted(out.items())}


def _dodge(index: int, count: int) -> float:
    """Horizontal offset of series ``index`` of ``count`` so that error bars at one η stay apart."""
    return (index - (count - 1) / 2) * 0.08


def _line(
    ax: Any,
    rows: list[GroupRow],
    key: str,
    offset: float = 0.0,
    *,
    nonnegative: bool = False,
    **style: Any,
) -> None:
    """Mean ± seed std of ``key`` vs η; ``nonnegative`` stops the lower bar at 0 (a std)."""
    points = [
        (g.max_head_offpolicyness + offset, g.mean[key], g.std[key] or 0.0) for g in rows if g.mean[key] is not None
    ]
    if not points:
        return
    xs, ys, es = zip(*points, strict=True)
    below = [min(e, max(y, 0.0)) for y, e in zip(ys, es, strict=True)] if nonnegative else es
    ax.errorbar(xs, ys, yerr=[below, es], marker="o", markersize=4, capsize=3, **style)


def _offpolicyness_axis(ax: Any, groups: Sequence[GroupRow]) -> None:
    ax.set_xticks(sorted({g.max_head_offpolicyness for g in groups}))
    ax.set_xlabel("η (max_head_offpolicyness)")
    ax.grid(alpha=0.3)


def _colours(labels: Sequence[str]) -> dict[str, Any]:
    plt = _pyplot()
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {label: cycle[i % len(cycle)] for i, label in enumerate(labels)}


def _save(fig: Any, path: Path) -> Path:
    """The figure as a PNG, written by a rename (never through a link in the sweep directory)."""
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    _pyplot().close(fig)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def plot_weights(groups: Sequence[GroupRow], path: Path) -> Path:
    """Both shadow weights' std (log scale) and ESS fraction vs η, per training mode."""
    plt = _pyplot()
    series = _series(groups)
    colours = _colours(list(series))
    fig, (ax_std, ax_ess) = plt.subplots(1, 2, figsize=(11, 4.2))
    weights = shadows()
    count = len(series) * len(weights)
    for i, (label, rows) in enumerate(series.items()):
        for j, weight in enumerate(weights):
            offset = _dodge(i * len(weights) + j, count)
            dash = WEIGHT_DASHES[j % len(WEIGHT_DASHES)]
            style = {"color": colours[label], "linestyle": dash, "label": f"{label}: {weight.legend}"}
            _line(ax_std, rows, f"w_{weight.short}_std", offset, nonnegative=True, **style)
            _line(ax_ess, rows, f"w_{weight.short}_ess", offset, **style)
    ax_std.set_yscale("symlog", linthresh=0.1)
    ax_std.set_ylim(bottom=0)
    ax_std.set_ylabel("std of the behavioural weight (all tokens)")
    ax_ess.set_ylabel("ESS fraction (mean over steps)")
    ax_ess.set_ylim(top=1.01)
    for ax in (ax_std, ax_ess):
        _offpolicyness_axis(ax, groups)
    ax_ess.legend(fontsize=7, loc="lower left")
    fig.suptitle("Behavioural weights measured on the same tokens (colour: training mode)")
    return _save(fig, path)


def _two_metrics_vs_offpolicyness(
    groups: Sequence[GroupRow], path: Path, left: tuple[str, str], right: tuple[str, str]
) -> Path:
    """Two panels side by side, each one metric (key, axis label) vs η per mode."""
    plt = _pyplot()
    series = _series(groups)
    colours = _colours(list(series))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (key, label) in zip(axes, (left, right), strict=True):
        for i, (name, rows) in enumerate(series.items()):
            _line(ax, rows, key, _dodge(i, len(series)), color=colours[name], label=name)
        ax.set_ylabel(label)
        _offpolicyness_axis(ax, groups)
    axes[0].legend(fontsize=8)
    return _save(fig, path)


def plot_rewards(groups: Sequence[GroupRow], path: Path) -> Path:
    """Final reward and final greedy accuracy vs η per mode."""
    return _two_metrics_vs_offpolicyness(
        groups,
        path,
        ("reward_last", "reward, mean of the last steps"),
        ("acc_end", "greedy accuracy after training"),
    )


def _smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_reward_curves(curves: Curves, path: Path) -> Path:
    """One panel per η: reward per step of every mode (moving average, ± std band)."""
    plt = _pyplot()
    bounds = sorted({bound for _, bound, _ in curves})
    labels = sorted({" ".join([mode, *extra]) for mode, _, extra in curves})
    colours = _colours(labels)
    cols = min(len(bounds), 3)
    rows = -(-len(bounds) // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False, sharey=True
    )
    for ax, bound in zip(axes.flat, bounds):
        for (mode, group_bound, extra), (steps, means, stds) in sorted(curves.items()):
            if group_bound != bound or not steps:
                continue
            window = max(1, len(steps) // 10)
            mean = _smooth(means, window)
            std = _smooth(stds, window)
            label = " ".join([mode, *extra])
            ax.plot(steps, mean, color=colours[label], label=label)
            ax.fill_between(
                steps,
                [m - s for m, s in zip(mean, std)],
                [m + s for m, s in zip(mean, std)],
                color=colours[label],
                alpha=0.15,
            )
        ax.set_title(f"η = {bound}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(bounds) :]:
        ax.axis("off")
    axes.flat[0].set_ylabel("reward (moving average)")
    axes.flat[0].legend(fontsize=7)
    return _save(fig, path)


def plot_throughput(groups: Sequence[GroupRow], path: Path) -> Path:
    """Generated tokens/s and training steps/s vs η per mode."""
    return _two_metrics_vs_offpolicyness(
        groups,
        path,
        ("tokens_per_s", "generated tokens / s"),
        ("steps_per_s", "training steps / s"),
    )


def plot_differences(contrasts: Sequence[Contrast], study: Study, path: Path) -> Path:
    """Each mode's paired difference to the study's baseline vs η, with its paired t interval
    (a point alone where there is one pair); the primary contrast is a star."""
    plt = _pyplot()
    shown = [c for c in contrasts if c.difference is not None and c.max_head_offpolicyness is not None]
    labels = sorted({" ".join([c.treatment, *c.extra]) for c in shown})
    colours = _colours(labels)
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    for i, label in enumerate(labels):
        points = sorted(
            (c for c in shown if " ".join([c.treatment, *c.extra]) == label), key=lambda c: c.max_head_offpolicyness
        )
        xs = [c.max_head_offpolicyness + _dodge(i, len(labels)) for c in points]
        ys = [c.difference for c in points]
        low = [0.0 if c.test is None else c.test.mean - c.test.low for c in points]
        high = [0.0 if c.test is None else c.test.high - c.test.mean for c in points]
        ax.errorbar(xs, ys, yerr=[low, high], marker="o", markersize=4, capsize=3, color=colours[label], label=label)
        for x, y, c in zip(xs, ys, points, strict=True):
            if c.primary:
                ax.plot([x], [y], marker="*", markersize=14, color=colours[label], label=f"{label} (primary)")
    ax.axhline(0.0, color="black", linewidth=1)
    level = f"{1 - study.alpha:.0%}"
    ax.set_ylabel(f"{study.metric} − {study.baseline} (paired, {level} t CI)", fontsize=8)
    ax.set_xticks(sorted({c.max_head_offpolicyness for c in shown}))
    ax.set_xlabel("η (max_head_offpolicyness)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def write_plots(
    groups: Sequence[GroupRow],
    curves: Curves | None,
    directory: Path,
    contrasts: Sequence[Contrast],
    study: Study,
) -> list[Path]:
    """Write every plot into ``directory`` (``reward_curves.png`` only with ``curves``)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = [
        plot_weights(groups, directory / "weights_vs_eta.png"),
        plot_rewards(groups, directory / "reward_vs_eta.png"),
        plot_throughput(groups, directory / "throughput_vs_eta.png"),
    ]
    if curves is not None:
        paths.append(plot_reward_curves(curves, directory / "reward_curves.png"))
    if any(c.difference is not None and c.max_head_offpolicyness is not None for c in contrasts):
        paths.append(plot_differences(contrasts, study, directory / "difference_vs_eta.png"))
    return sorted(paths)
