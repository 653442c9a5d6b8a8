"""`sdp_cli.analysis.plots`: log-spaced bins and the PNG of the weight histograms."""

from __future__ import annotations

import numpy as np
import pytest

from sdp_cli.analysis.inspect import analyse_batches
from sdp_cli.analysis.plots import _log_bins, weight_histograms
from sdp_cli.cli.inspect_weights import EXAMPLE_BATCH
from sdp_cli.rollout.batch_file import read_batch

PNG = b"\x89PNG\r\n\x1a\n"


def test_log_bins_cover_the_values_and_one():
    bins = _log_bins([np.array([0.0, 0.25, 2.0]), np.array([4.0])])
    # zeros cannot sit on a log axis: the range is [0.25, 4] widened by 1.5 on each side
    assert bins[0] == pytest.approx(0.25 / 1.5) and bins[-1] == pytest.approx(4 * 1.5)
    assert np.allclose(np.diff(np.log(bins)), np.log(bins[1] / bins[0]))  # equal widths in log w
    # a spike at w = 1 (bypass, or the dropped factor at lag ≤ 1) still gets a window around 1
    spike = _log_bins([np.ones(5)])
    assert spike[0] == pytest.approx(1 / 1.5) and spike[-1] == pytest.approx(1.5)
    # the window always contains 1, the reference
    assert _log_bins([np.array([3.0, 5.0])])[0] < 1.0


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_histograms_have_a_dropped_factor_panel_only_with_proximal_logprobs():
    batch = read_batch(EXAMPLE_BATCH)
    full = weight_histograms(analyse_batches([batch], ["example"]), "example")
    batch.proximal_logprobs = None
    partial = weight_histograms(analyse_batches([batch], ["example"]), "example")
    # 2 × 2 panels either way (the fourth one hidden without π_prox): same canvas, less ink
    assert _png_size(full) == _png_size(partial)
    assert _png_size(full)[0] > 1000
    assert len(partial) < len(full)
