"""The shared masked helpers (sdp_cli/core/_masked.py)."""

import math

import pytest
import torch

from sdp_cli.core._masked import _to_host_batched, keep, masked, to_host

NAN, INF = float("nan"), float("inf")


def test_keep_writes_positive_zero_over_anything():
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        values = torch.tensor([NAN, INF, -INF, -3.5, 2.0], dtype=dtype)
        flags = torch.tensor([False, False, False, True, False])
        out = keep(values, flags)
        assert out.dtype == dtype
        assert out.tolist() == [0.0, 0.0, 0.0, -3.5, 0.0]
        assert not torch.signbit(out[[0, 1, 2, 4]]).any()  # +0.0, never -0.0


def test_select_agrees_with_where():
    values = torch.randn(4, 9, dtype=torch.float64)
    values[0, 0], values[1, 1] = NAN, -INF
    mask = torch.rand(4, 9) < 0.5
    mask[0, 0] = mask[1, 1] = False
    assert torch.equal(
        masked(mask, values, "values").select(values), torch.where(mask, values, 0.0)
    )


def test_counts_of_a_ragged_mask():
    mk = masked(torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]]), torch.zeros(3, 3), "x")
    assert mk.row_count.tolist() == [2.0, 0.0, 1.0]
    assert mk.token_count.item() == 3.0 and mk.row_total.item() == 2.0
    assert mk.rows.tolist() == [True, False, True]
    assert mk.row_divisor.tolist() == [2.0, 1.0, 1.0]


def test_to_host_paths_agree():
    values = {
        "count": torch.tensor(7, dtype=torch.int32),
        "mean": torch.tensor(0.25),
        "rows": torch.tensor([1.0, 2.5, -3.0], dtype=torch.float64),
    }
    assert (
        to_host(values)
        == _to_host_batched(values)
        == {"count": 7, "mean": 0.25, "rows": [1.0, 2.5, -3.0]}
    )


def test_min_and_max_stay_within_an_ulp_where_the_rounded_mean_falls_outside():
    # Found by hypothesis: three valid tokens truncated up to the floor 0.9 in float32. Their
    # float32 mean rounds to one ulp below float32(0.9), and padding is filled with that mean
    # (sdp_cli/core/_masked.py: extremes), so the reported min may be that ulp low. The weights
    # themselves are exact.
    from sdp_cli.core import importance_weights

    log_ratio = torch.tensor([[0.8590, 0.7056, -0.3406, -1.2720, -1.1948]])
    mask = torch.tensor([[False, True, True, False, True]])
    weights, metrics = importance_weights(log_ratio, mask, level="sequence", floor=0.9)
    floor32 = torch.tensor(0.9)
    one_ulp_below = torch.nextafter(floor32, torch.tensor(-math.inf)).item()
    assert weights[mask].eq(floor32).all()
    assert one_ulp_below <= metrics["rollout_is_min"] <= floor32.item()
    assert metrics["rollout_is_max"] == floor32.item()


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
def test_zero_size_batches_give_zero_statistics(shape):
    from sdp_cli.core import importance_weights, offpolicy_metrics, policy_loss, rejection_mask

    x = torch.zeros(shape)
    mask = torch.zeros(shape, dtype=torch.bool)
    for level in ("token", "sequence", "geometric"):
        _, w_metrics = importance_weights(x, mask, level=level, cap=2.0)
        _, r_metrics = rejection_mask(x, mask, level=level, upper=2.0)
        assert all(v == 0.0 for k, v in w_metrics.items() if k.endswith(("_min", "_max")))
        assert all(math.isfinite(v) for v in [*w_metrics.values(), *r_metrics.values()])
    metrics = offpolicy_metrics(x, x, mask)
    assert metrics["log_ppl_diff_min"] == 0.0 and metrics["log_ppl_diff_max"] == 0.0
    assert policy_loss(x, x, x, mask)[0].item() == 0.0


def test_row_means_leave_out_the_empty_rows():
    # rows 0 and 2 hold tokens, row 1 none: a row's mean is over its own tokens (0 when it has none),
    # the mean over rows is over the non-empty rows alone, whatever value an empty row carries
    mk = masked(torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]]), torch.zeros(3, 3), "values")
    values = torch.tensor([[1.0, 3.0, 0.0], [0.0, 0.0, 0.0], [4.0, 0.0, 0.0]])
    assert mk.row_mean(values).tolist() == [2.0, 0.0, 4.0]
    assert mk.rows_mean(torch.tensor([2.0, 7.0, 4.0])).item() == 3.0
    empty = masked(torch.zeros(2, 2), torch.zeros(2, 2), "values")
    assert empty.rows_mean(torch.tensor([5.0, -1.0])).item() == 0.0
