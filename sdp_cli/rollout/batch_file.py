"""Saved training batches: one safetensors file per batch (docs/design.md §5, docs/batch-format.md).

Packed 1-D tensors over the prompt + output tokens of every sequence, delimited by
``cu_seqlens``; index t of every per-token tensor refers to token t. Prompt tokens have
version −1, zero logprobs/advantages and ``loss_mask`` 0. The reader never unpickles: a file
is taken for safetensors by its own structure first, and only otherwise refused as a pickle or
``torch.save`` archive by its first bytes; the header length is checked before parsing, the
file is copied into memory once (a map of a file that another process shrinks would SIGBUS),
and dtypes, shapes, offsets, every integer's range (bounded by the file's own sizes), the
log-prob range and the metadata numbers are validated (the header part in ``batch_header``).
Every problem is a ``BatchFormatError`` with one line "<path>: <problem>; <fix>".
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sdp_cli import __version__
from sdp_cli.modes import mode_names
from sdp_cli.config.schema import MAX_TEMPERATURE, MIN_TEMPERATURE
from sdp_cli.errors import UserError
from sdp_cli.fileio import atomic_write_bytes
from sdp_cli.rollout.batch_header import (
    ENTRY_DTYPES,
    FIX_RECREATE,
    FORMAT_TAG,
    FORMAT_VERSION,
    REQUIRED_TENSORS,
    BatchFormatError,
    check_entries,
    parse_header,
    parse_metadata,
    read_file,
)
from sdp_cli.rollout.records import RolloutGroup, RolloutSample, samples_of

#: the largest trainer version: exact in float64 and JSON, and v + 1 never overflows int64
MAX_TRAINER_VERSION = 2**53 - 1
#: token ids are int32 in every engine sdp drives (vocabularies are far smaller)
MAX_TOKEN_ID = 2**31 - 1
#: entries of one padded [S, T] tensor (``SavedBatch.to_padded``, what inspect-weights reads):
#: 512 sequences of 131072 tokens; a few such tensors take gigabytes
MAX_PADDED_ENTRIES = 2**26
#: the lowest log-prob accepted (docs/batch-format.md): a logit gap of 1000 at the lowest
#: temperature, 0.01; float32 keeps two decimals there, and sums of such values stay finite
LOGPROB_FLOOR = -1e5

OPTIONAL_TOKEN_FLOATS = ("proximal_logprobs", "logprobs", "advantages")
TOKEN_FLOATS = ("old_logprobs", "proximal_logprobs_t", *OPTIONAL_TOKEN_FLOATS)
LOGPROBS = ("old_logprobs", "proximal_logprobs_t", "proximal_logprobs", "logprobs")
OPTIONAL_TENSORS = (*OPTIONAL_TOKEN_FLOATS, "rewards", "loss_mask")
_TORCH_DTYPES = {"I64": torch.int64, "F32": torch.float32, "U8": torch.uint8}
DTYPES: dict[str, torch.dtype] = {name: _TORCH_DTYPES[st] for name, (st, _) in ENTRY_DTYPES.items()}


def ragged_layout(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, position within its row) of every entry of rows ``lengths[i]`` long laid end to end,
    each [sum(lengths)]: the index that scatters a packed batch into a padded tensor."""
    rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    row_starts = torch.cumsum(lengths, 0) - lengths
    return rows, torch.arange(int(lengths.sum())) - row_starts[rows]


@dataclass(eq=False)
class PaddedBatch:
    """Response tokens right-padded to ``[S, T]`` (T = longest response) — the layout the
    ``sdp_cli.core`` kernels take. Padding: 0 for ids and floats, −1 for versions, False mask.

    Attributes:
        response_ids: [S, T] int64.
        mask: [S, T] bool, the loss mask of the response tokens (False on padding).
        old_logprobs, proximal_logprobs_t: [S, T] float32.
        versions, proximal_t_versions: [S, T] int64.
        proximal_logprobs, logprobs, advantages: [S, T] float32 or None.
        rewards: [S] float32 or None.
        response_lens: [S] int64.
    """

    response_ids: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor
    proximal_logprobs_t: torch.Tensor
    versions: torch.Tensor
    proximal_t_versions: torch.Tensor
    response_lens: torch.Tensor
    proximal_logprobs: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    rewards: torch.Tensor | None = None


@dataclass(eq=False)
class SavedBatch:
    """One training batch in packed form. Per-token tensors have length N (all prompt and
    output tokens); ``cu_seqlens`` has S + 1 entries, ``prompt_lens`` and ``rewards`` S.
    ``loss_mask`` None means every output token counts (see :meth:`effective_loss_mask`)."""

    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    prompt_lens: torch.Tensor
    old_logprobs: torch.Tensor
    versions: torch.Tensor
    proximal_logprobs_t: torch.Tensor
    proximal_t_versions: torch.Tensor
    trainer_version: int
    temperature: float
    model: str
    mode: str
    proximal_logprobs: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    sdp_version: str = __version__

    @property
    def num_sequences(self) -> int:
        return int(self.prompt_lens.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    # ------------------------------------------------------------------ building
    @classmethod
    def from_samples(
        cls,
        samples: Iterable[RolloutSample | RolloutGroup],
        *,
        trainer_version: int,
        temperature: float,
        model: str,
        mode: str,
        proximal_logprobs: Sequence[Sequence[float]] | None = None,
        logprobs: Sequence[Sequence[float]] | None = None,
        advantages: Sequence[Sequence[float]] | None = None,
        loss_mask: Sequence[Sequence[int]] | None = None,
        rewards: Sequence[float] | None = None,
    ) -> SavedBatch:
        """Pack samples (or groups, flattened in order) into a batch.

        The optional per-token arrays hold one entry per sample, each with one value per
        *output* token (prompt positions are filled with 0). ``loss_mask`` defaults to 1 on
        every output token; ``rewards`` defaults to the samples' rewards when all are set.
        """
        flat = [s for item in samples for s in samples_of(item)]
        for s in flat:
            s.check_consistent()
        extras = {
            "proximal_logprobs": proximal_logprobs,
            "logprobs": logprobs,
            "advantages": advantages,
        }
        for name, arrays in (*extras.items(), ("loss_mask", loss_mask)):
            if arrays is not None and len(arrays) != len(flat):
                raise ValueError(f"{name} has {len(arrays)} entries for {len(flat)} samples")

        def packed(
            per_sample: Sequence[Sequence[Any]], prompt_value: Any, dtype: torch.dtype, name: str
        ) -> torch.Tensor:
            parts = []
            for s, values in zip(flat, per_sample):
                values = torch.as_tensor(values, dtype=dtype).reshape(-1)
                if values.numel() != s.output_len:
                    raise ValueError(
                        f"{name} of sample {s.sample_id} has {values.numel()} values for "
                        f"{s.output_len} output tokens"
                    )
                parts += [torch.full((s.prompt_len,), prompt_value, dtype=dtype), values]
            return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)

        lengths = [s.prompt_len + s.output_len for s in flat]
        if rewards is None and flat and all(s.reward is not None for s in flat):
            rewards = [float(s.reward) for s in flat]  # type: ignore[arg-type]
        batch = cls(
            input_ids=torch.tensor([t for s in flat for t in s.input_ids], dtype=torch.int64),
            cu_seqlens=torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0),
            prompt_lens=torch.tensor([s.prompt_len for s in flat], dtype=torch.int64),
            old_logprobs=packed([s.old_logprobs for s in flat], 0.0, torch.float32, "old_logprobs"),
            versions=packed([s.versions for s in flat], -1, torch.int64, "versions"),
            proximal_logprobs_t=packed(
                [s.proximal_logprobs_t for s in flat], 0.0, torch.float32, "proximal_logprobs_t"
            ),
            proximal_t_versions=packed(
                [s.proximal_t_versions for s in flat], -1, torch.int64, "proximal_t_versions"
            ),
            loss_mask=packed(
                loss_mask if loss_mask is not None else [[1] * s.output_len for s in flat],
                0,
                torch.uint8,
                "loss_mask",
            ),
            trainer_version=int(trainer_version),
            temperature=float(temperature),
            model=str(model),
            mode=str(mode),
            rewards=None if rewards is None else torch.tensor(list(rewards), dtype=torch.float32),
            **{
                name: None if arrays is None else packed(arrays, 0.0, torch.float32, name)
                for name, arrays in extras.items()
            },
        )
        validate_batch(batch, "SavedBatch.from_samples", fix="fix the samples passed in")
        return batch

    # ------------------------------------------------------------------ views
    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors to store: required ones, ``loss_mask`` and the optional ones present."""
        names = (*REQUIRED_TENSORS, *OPTIONAL_TENSORS)
        return {n: t.contiguous() for n in names if (t := getattr(self, n)) is not None}

    def metadata(self) -> dict[str, str]:
        return {
            "format": FORMAT_TAG,
            "format_version": str(FORMAT_VERSION),
            "trainer_version": str(self.trainer_version),
            "temperature": repr(float(self.temperature)),
            "model": self.model,
            "mode": self.mode,
            "sdp_version": self.sdp_version,
        }

    def token_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence index, position within its sequence) of every token, each [N]."""
        return ragged_layout(self.cu_seqlens[1:] - self.cu_seqlens[:-1])

    def effective_loss_mask(self) -> torch.Tensor:
        """``loss_mask``, or 1 on every output token and 0 on prompt tokens when it is absent."""
        if self.loss_mask is not None:
            return self.loss_mask
        seq_idx, pos = self.token_layout()
        return (pos >= self.prompt_lens[seq_idx]).to(torch.uint8)

    def to_padded(self) -> PaddedBatch:
        """Right-pad the response tokens into ``[S, T]`` tensors (see :class:`PaddedBatch`);
        refused in one line when S × T exceeds ``MAX_PADDED_ENTRIES`` (a small file of many
        short sequences and one long one pads to tens of gigabytes)."""
        response_lens = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]) - self.prompt_lens
        shape = (self.num_sequences, int(response_lens.max()) if self.num_sequences else 0)
        if shape[0] * shape[1] > MAX_PADDED_ENTRIES:
            raise UserError(
                f"a batch of {shape[0]} sequences × {shape[1]} response tokens = {shape[0] * shape[1]} entries "
                f"per padded tensor, over the {MAX_PADDED_ENTRIES} sdp pads (docs/batch-format.md); "
                "save batches with fewer sequences or shorter responses"
            )
        seq_idx, pos = self.token_layout()
        is_out = pos >= self.prompt_lens[seq_idx]
        rows, cols = seq_idx[is_out], (pos - self.prompt_lens[seq_idx])[is_out]

        def pad(values: torch.Tensor | None, fill: float | int) -> torch.Tensor | None:
            if values is None:
                return None
            out = torch.full(shape, fill, dtype=values.dtype)
            out[rows, cols] = values[is_out]
            return out

        return PaddedBatch(
            response_ids=pad(self.input_ids, 0),  # type: ignore[arg-type]
            mask=pad(self.effective_loss_mask(), 0).bool(),  # type: ignore[union-attr]
            old_logprobs=pad(self.old_logprobs, 0.0),  # type: ignore[arg-type]
            proximal_logprobs_t=pad(self.proximal_logprobs_t, 0.0),  # type: ignore[arg-type]
            versions=pad(self.versions, -1),  # type: ignore[arg-type]
            proximal_t_versions=pad(self.proximal_t_versions, -1),  # type: ignore[arg-type]
            response_lens=response_lens,
            proximal_logprobs=pad(self.proximal_logprobs, 0.0),
            logprobs=pad(self.logprobs, 0.0),
            advantages=pad(self.advantages, 0.0),
            rewards=self.rewards,
        )


# ---------------------------------------------------------------------- validation
def _first(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0])


def validate_batch(batch: SavedBatch, where: str, fix: str = FIX_RECREATE) -> None:
    """Raise ``BatchFormatError`` at the first problem: dtypes, 1-D shapes, lengths, cu_seqlens,
    prompt lengths, finiteness, prompt-token conventions, version ranges, loss_mask, metadata."""

    def fail(problem: str) -> None:
        raise BatchFormatError(where, problem, fix)

    # a registered mode, or the name of a mode of yours (docs/design.md §4): its code is never
    # imported because a file names it, so any identifier is accepted
    if not batch.mode.isidentifier():
        fail(f"mode {batch.mode!r} is not a mode name (e.g. {', '.join(mode_names())})")
    if not 0 <= batch.trainer_version <= MAX_TRAINER_VERSION:
        fail(f"trainer_version {batch.trainer_version} is outside [0, {MAX_TRAINER_VERSION}]")
    if not MIN_TEMPERATURE <= batch.temperature <= MAX_TEMPERATURE:  # also refuses NaN
        fail(f"temperature {batch.temperature} is outside [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]")
    tensors = batch.tensors()
    for name, tensor in tensors.items():
        if tensor.dtype != DTYPES[name]:
            fail(f"tensor {name} has dtype {tensor.dtype}, expected {DTYPES[name]}")
        if tensor.dim() != 1:
            fail(f"tensor {name} has shape {list(tensor.shape)}, expected 1-D")
    n, s = batch.num_tokens, batch.num_sequences
    if s == 0:
        fail("the batch holds no sequences")
    expected_len = {"cu_seqlens": s + 1, "prompt_lens": s, "rewards": s}
    for name, tensor in tensors.items():
        want = expected_len.get(name, n)
        if tensor.numel() != want:
            fail(f"tensor {name} has {tensor.numel()} entries, expected {want}")
    # Bounded first, so the differences below cannot wrap around int64.
    for name, values, high in (("cu_seqlens", batch.cu_seqlens, n), ("input_ids", batch.input_ids, MAX_TOKEN_ID)):
        bad = (values < 0) | (values > high)
        if bool(bad.any()):
            i = _first(bad)
            fail(f"{name}[{i}] = {int(values[i])} is outside [0, {high}]")
    cu = batch.cu_seqlens
    if int(cu[0]) != 0:
        fail(f"cu_seqlens starts at {int(cu[0])}, must start at 0")
    steps = cu[1:] - cu[:-1]
    if bool((steps <= 0).any()):
        i = _first(steps <= 0) + 1
        fail(
            f"cu_seqlens is not strictly increasing at index {i} ({int(cu[i - 1])} → {int(cu[i])})"
        )
    if int(cu[-1]) != n:
        fail(f"cu_seqlens ends at {int(cu[-1])} but input_ids has {n} tokens")
    bad_prompt = (batch.prompt_lens < 1) | (batch.prompt_lens > steps)
    if bool(bad_prompt.any()):
        i = _first(bad_prompt)
        fail(
            f"prompt_lens[{i}] = {int(batch.prompt_lens[i])} is outside [1, {int(steps[i])}] (sequence length)"
        )
    for name in ("rewards", *TOKEN_FLOATS):
        tensor = tensors.get(name)
        if tensor is not None and not bool(torch.isfinite(tensor).all()):
            fail(
                f"tensor {name} holds a non-finite value at index {_first(~torch.isfinite(tensor))}"
            )

    seq_idx, pos = batch.token_layout()
    is_prompt = pos < batch.prompt_lens[seq_idx]

    def where_token(t: int) -> str:
        return f"token {t} (sequence {int(seq_idx[t])})"

    for name, prompt_value in (
        ("versions", -1),
        ("proximal_t_versions", -1),
        ("loss_mask", 0),
        *((name, 0) for name in TOKEN_FLOATS),
    ):
        tensor = tensors.get(name)
        if tensor is not None and bool((is_prompt & (tensor != prompt_value)).any()):
            t = _first(is_prompt & (tensor != prompt_value))
            fail(
                f"{name} of prompt {where_token(t)} is {tensor[t].item()}, prompt tokens must have {prompt_value}"
            )
    for name in LOGPROBS:
        tensor = tensors.get(name)
        if tensor is None:
            continue
        bad = ~is_prompt & ((tensor > 0) | (tensor < LOGPROB_FLOOR))
        if bool(bad.any()):
            t = _first(bad)
            value = float(tensor[t])
            limit = "must be <= 0" if value > 0 else f"below the floor {LOGPROB_FLOOR:g}"
            fail(f"{name} of output {where_token(t)} is {value:.6g}, {limit} (a log-probability)")
    v, pv, c = batch.versions, batch.proximal_t_versions, batch.trainer_version
    bad = ~is_prompt & ((v < 0) | (v > c))
    if bool(bad.any()):
        t = _first(bad)
        fail(f"version of output {where_token(t)} is {int(v[t])}, outside [0, trainer_version={c}]")
    bad = ~is_prompt & (((pv != v) & (pv != v + 1)) | (pv > c))
    if bool(bad.any()):
        t = _first(bad)
        fail(
            f"proximal_t_versions of output {where_token(t)} is {int(pv[t])} for version {int(v[t])}, "
            f"must be {int(v[t])} or {int(v[t]) + 1} and <= trainer_version={c}"
        )
    if batch.loss_mask is not None and bool((batch.loss_mask > 1).any()):
        t = _first(batch.loss_mask > 1)
        fail(f"loss_mask of {where_token(t)} is {int(batch.loss_mask[t])}, must be 0 or 1")


# ------------------------------------------------------------------------- writing
def serialize_batch(batch: SavedBatch, where: str = "<memory>") -> bytes:
    """Validate ``batch`` and return its safetensors bytes (nothing is written)."""
    from safetensors.torch import save

    validate_batch(batch, where, fix="the batch was not written; fix the code that built it")
    return save(batch.tensors(), metadata=batch.metadata())


def write_batch(path: str | os.PathLike[str], batch: SavedBatch) -> Path:
    """Validate and write ``batch`` atomically (``sdp_cli.fileio``): on failure nothing is left
    behind and an existing file is intact."""
    target = Path(path)
    data = serialize_batch(batch, str(target))
    if not target.parent.is_dir():
        raise UserError(f"{target}: directory {target.parent} does not exist; create it first")
    return atomic_write_bytes(target, data)


# ------------------------------------------------------------------------- reading
def read_batch(path: str | os.PathLike[str]) -> SavedBatch:
    """Read and validate a batch file; any problem raises ``BatchFormatError`` (one line)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    target = Path(path)
    where = str(target)
    data, header_len = read_file(where, target)
    header, data_len = parse_header(where, data, header_len)
    meta = parse_metadata(where, header)
    check_entries(where, header, data_len)
    try:
        tensors = load(data)
    except (SafetensorError, ValueError) as err:
        problem = " ".join(str(err).split())
        raise BatchFormatError(where, f"safetensors cannot load it ({problem})") from None
    batch = SavedBatch(
        **{name: tensors[name] for name in REQUIRED_TENSORS},
        **{name: tensors.get(name) for name in OPTIONAL_TENSORS},
        **meta,
    )
    validate_batch(batch, where)
    return batch
