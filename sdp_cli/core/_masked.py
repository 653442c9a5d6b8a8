"""Masked reductions and argument checks shared by the correction kernels (docs/math.md §0).

``Masked`` wraps a validated [B, T] mask. Inputs are first passed through ``Masked.select``,
which sets every padded position to exactly +0.0 — whatever it held, NaN and inf included —
so nothing at padding reaches a value or a gradient, and afterwards a plain sum is a masked
sum. Every statistic over an empty selection has a defined value instead of NaN: 0 for means,
fractions, std, min and max (the callers document their other conventions).

Speed notes (CPU, measured on 512k-element tensors, see bench/loss.py): ``torch.where`` and
``masked_fill`` run an unvectorised loop about 25× slower than a multiply, and a bool→float
conversion is about 9× slower than going through a uint8 view. ``select`` therefore ANDs the
bit pattern of each value with an all-ones/all-zeros word, and flags become floats via uint8.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: Log-space values are clamped to [-LOG_CLAMP, LOG_CLAMP] before ``exp`` (e^20 ≈ 4.85e8).
LOG_CLAMP = 20.0

_INT_MASK_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise ValueError unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def check_float_tensor(name: str, tensor: object) -> Tensor:
    """Raise ValueError unless ``tensor`` is a floating-point tensor."""
    if not isinstance(tensor, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor; got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor; got dtype {tensor.dtype}")
    return tensor


def check_like(name: str, tensor: object, ref: Tensor, ref_name: str) -> Tensor:
    """Raise ValueError unless ``tensor`` is a float tensor with the shape and dtype of ``ref``."""
    check_float_tensor(name, tensor)
    assert isinstance(tensor, Tensor)
    if tensor.shape != ref.shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)} but {ref_name} has shape {tuple(ref.shape)}"
        )
    if tensor.dtype != ref.dtype:
        raise ValueError(f"{name} has dtype {tensor.dtype} but {ref_name} has dtype {ref.dtype}")
    return tensor


def check_2d(name: str, tensor: Tensor) -> None:
    """Raise ValueError unless ``tensor`` is a padded ``[B, T]`` batch."""
    if tensor.dim() != 2:
        raise ValueError(f"{name} must be a [B, T] tensor; got shape {tuple(tensor.shape)}")


def check_number(
    name: str, value: object, *, above: float, inclusive: bool = False, finite: bool = True
) -> None:
    """Raise ValueError unless ``value`` is a finite number > ``above`` (≥ with ``inclusive``);
    ``finite=False`` also accepts +inf."""
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if not number or math.isnan(value) or (finite and math.isinf(value)):  # type: ignore[arg-type]
        kind = "a finite number" if finite else "a number (inf allowed)"
        raise ValueError(f"{name} must be {kind}; got {value!r}")
    if value < above or (value == above and not inclusive):
        raise ValueError(f"{name} must be {'>=' if inclusive else '>'} {above:g}; got {value!r}")


def as_float(flags: Tensor, dtype: torch.dtype) -> Tensor:
    """Bool flags as 0.0/1.0 of ``dtype`` (through a uint8 view, the fast path on CPU)."""
    return flags.view(torch.uint8).to(dtype)


def count(flags: Tensor) -> Tensor:
    """0-d int32 number of True flags (a uint8 sum: the fast path on CPU)."""
    return flags.view(torch.uint8).sum(dtype=torch.int32)


def _bits(flags: Tensor, word: torch.dtype) -> Tensor:
    """All-ones words where ``flags`` is True, all-zeros elsewhere."""
    return flags.view(torch.uint8).to(word).neg_()


def keep(values: Tensor, flags: Tensor, bits: Tensor | None = None) -> Tensor:
    """``values`` where ``flags`` is True, exactly +0.0 elsewhere, even over NaN or inf.

    Same result as ``torch.where(flags, values, 0)`` for a tensor without grad: the bits of
    each value are ANDed with all-ones (keep) or all-zeros (drop). ``bits`` may pass
    ``_bits(flags, word)`` precomputed for the value width.
    """
    assert not values.requires_grad, "keep() is for values without grad"
    word = _SAME_WIDTH_INT[values.element_size()]
    return (values.view(word) & (_bits(flags, word) if bits is None else bits)).view(values.dtype)


class Masked:
    """A validated 0/1 mask over a [B, T] batch and the counts its statistics divide by.

    Token counts are computed up front; row counts on first use (a token-mean loss needs none).
    """

    def __init__(self, valid: Tensor, weight: Tensor):
        self.valid = valid  #: bool [B, T], True at valid tokens
        self.weight = weight  #: [B, T] 1.0 at valid tokens, 0.0 elsewhere (float ≥ 32 bit)
        self.row_count = weight.sum(-1)  #: [B] valid tokens per row
        self.token_count = self.row_count.sum()  #: 0-d number of valid tokens
        self.n_tokens = self.token_count.clamp_min(1)  #: valid tokens as a safe divisor (≥ 1)
        self._bits: dict[torch.dtype, Tensor] = {}
        self._rows: dict[str, Tensor] = {}

    def _row(self, name: str) -> Tensor:
        if not self._rows:
            divisor = self.row_count.clamp_min(1)
            row_weight = self.row_count.clamp(max=1)  # min(count, 1) of an integer count
            total = row_weight.sum()
            self._rows.update(
                divisor=divisor,
                weight=row_weight,
                rows=row_weight.bool(),
                total=total,
                n=total.clamp_min(1),
            )
        return self._rows[name]

    @property
    def row_divisor(self) -> Tensor:
        """[B] valid tokens per row, at least 1."""
        return self._row("divisor")

    @property
    def row_weight(self) -> Tensor:
        """[B] 1.0 for rows with ≥ 1 valid token."""
        return self._row("weight")

    @property
    def rows(self) -> Tensor:
        """bool [B], rows with ≥ 1 valid token."""
        return self._row("rows")

    @property
    def row_total(self) -> Tensor:
        """0-d number of rows with ≥ 1 valid token."""
        return self._row("total")

    @property
    def n_rows(self) -> Tensor:
        """Number of rows with ≥ 1 valid token as a safe divisor (≥ 1)."""
        return self._row("n")

    def select(self, values: Tensor) -> Tensor:
        """``values`` at valid tokens, exactly +0.0 at padding (see ``keep``)."""
        word = _SAME_WIDTH_INT[values.element_size()]
        if word not in self._bits:
            self._bits[word] = _bits(self.valid, word)
        return keep(values, self.valid, self._bits[word])

    def mean(self, values: Tensor) -> Tensor:
        """Mean over valid tokens of values that are already 0 at padding; 0 when empty."""
        return values.sum() / self.n_tokens

    def row_mean(self, values: Tensor) -> Tensor:
        """[B] mean over each row's valid tokens (values 0 at padding); 0 for an empty row."""
        return values.sum(-1) / self.row_divisor

    def rows_mean(self, values: Tensor) -> Tensor:
        """Mean of finite per-row values [..., B] over rows with ≥ 1 valid token; 0 when none."""
        return (values * self.row_weight).sum(-1) / self.n_rows

    def stats(self, values: Tensor, *, with_std: bool = True) -> dict[str, Tensor]:
        """mean, population std, min and max over valid tokens of finite values; 0 when empty."""
        return _weighted_stats(values, self.weight, self.n_tokens, with_std)

    def row_stats(self, values: Tensor, *, with_std: bool = True) -> dict[str, Tensor]:
        """mean, population std, min and max of finite [B] values over non-empty rows."""
        return _weighted_stats(values, self.row_weight, self.n_rows, with_std)


def extremes(values: Tensor, weight: Tensor, fill: Tensor) -> tuple[Tensor, Tensor]:
    """(min, max) of finite ``values`` where the 0/1 ``weight`` is 1, padding replaced by ``fill``.

    With ``fill`` the selection's mean (0 when it is empty) padding changes neither extreme and
    an empty selection gives (0, 0), in two kernels; lerp is exact at weights 0 and 1. The
    rounded mean of values that are all equal can fall an ulp outside them, so either extreme
    may be an ulp off (faster than an exact fill, which costs several more kernels per call).
    """
    if values.numel() == 0:  # aminmax has no identity on an empty tensor
        return values.new_zeros(()), values.new_zeros(())
    return torch.aminmax(torch.lerp(fill, values, weight))


def _weighted_stats(values: Tensor, weight: Tensor, n: Tensor, with_std: bool) -> dict[str, Tensor]:
    if values.dtype != weight.dtype:
        values = values.to(weight.dtype)
    mean = (values * weight).sum() / n
    low, high = extremes(values, weight, mean)
    stats = {"mean": mean, "min": low, "max": high}
    if with_std:
        stats["std"] = ((values - mean) * weight).square().sum().div(n).sqrt()
    return stats


def masked(mask: object, ref: Tensor, ref_name: str) -> Masked:
    """Validate ``mask`` (bool, integer or float 0/1, shaped like ``ref``) and wrap it."""
    if not isinstance(mask, Tensor):
        raise ValueError(f"mask must be a torch.Tensor; got {type(mask).__name__}")
    if mask.shape != ref.shape:
        raise ValueError(
            f"mask has shape {tuple(mask.shape)} but {ref_name} has shape {tuple(ref.shape)}"
        )
    if (
        mask.dtype != torch.bool
        and mask.dtype not in _INT_MASK_DTYPES
        and not mask.is_floating_point()
    ):
        raise ValueError(f"mask must be bool, integer or float; got dtype {mask.dtype}")
    valid = mask.bool()
    # Counts are exact integers; a half-precision sum would round them (2049 → 2048 in bf16).
    count_dtype = torch.promote_types(ref.dtype, torch.float32)
    if mask.dtype == torch.bool:
        return Masked(valid, as_float(valid, count_dtype))
    weight = mask.to(count_dtype)
    # A mask holding values other than 0 and 1 is a weight, not a mask: refuse to guess.
    # m − m² is 0 exactly for m ∈ {0, 1} (NaN and inf fail too).
    if torch.count_nonzero(torch.addcmul(weight, weight, weight, value=-1)).item():
        raise ValueError("mask must contain only 0 and 1")
    return Masked(valid, weight)


def to_host(values: dict[str, Tensor]) -> dict[str, float | list[float]]:
    """0-d or 1-d tensors (counts, sums, statistics) as python numbers or lists.

    Kernels compute their final scalar metrics from these in python, where scalar arithmetic
    is far cheaper than on 0-d tensors. On CPU reading a tensor is a memory load, so each is
    read on its own; on an accelerator every read is a device sync, so they travel together.
    """
    if all(value.device.type == "cpu" for value in values.values()):
        return {name: value.tolist() for name, value in values.items()}
    return _to_host_batched(values)


def _to_host_batched(values: dict[str, Tensor]) -> dict[str, float | list[float]]:
    """``to_host`` with one transfer: concatenate, copy once, split by size."""
    flat = torch.cat([v.reshape(-1) for v in values.values()]).double().tolist()
    out: dict[str, float | list[float]] = {}
    start = 0
    for name, value in values.items():
        out[name] = flat[start] if value.dim() == 0 else flat[start : start + value.numel()]
        start += value.numel()
    return out
