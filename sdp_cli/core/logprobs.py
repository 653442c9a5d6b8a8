"""Token log-probabilities (and entropy) from logits, chunked over tokens (docs/math.md §6).

The naive ``log_softmax(logits / T).gather(...)`` materialises several [N, V] float32 tensors
in forward and backward. Here forward works in one reused [chunk, V] scratch and saves only the
per-token log-normaliser; backward recomputes each chunk's softmax from the logits and writes
the gradient straight into the [N, V] gradient it must return, so the extra memory stays
O(chunk · V) instead of O(N · V). The logits are never copied, sliced ones included.

That returned gradient is itself [N, V]. With ``inplace_backward=True`` backward writes it
into the logits' own storage instead (chunk by chunk, each chunk read before it is
overwritten), so forward + backward allocate no [N, V] tensor at all. The logits then hold
the gradient after backward; any other autograd node that saved them fails loudly (torch's
in-place version check), never silently.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from sdp_cli.core._masked import check_float_tensor, check_number

#: Rows per chunk. 256 × 49,152 float32 logits = 48 MiB of scratch per chunk.
DEFAULT_CHUNK_SIZE = 256


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision softmax loses too much: compute (and return) float32 for fp16/bf16 input.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _chunks(groups: int, rows: int, chunk_size: int):
    """(group, row slice) of every chunk of a [G, R, V] batch, each of ≤ chunk_size rows."""
    for group in range(groups):
        for start in range(0, rows, chunk_size):
            yield group, slice(start, start + chunk_size)


class _ChunkedLogprobs(torch.autograd.Function):
    """log p(target) = x_target − logsumexp(x) and H = logsumexp(x) − Σ p·x, x = logits / T.

    Works on a [G, R, V] view of the logits (see ``_grouped``); per-token outputs are [G, R].
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        logits: Tensor,
        targets: Tensor,
        temperature: float,
        chunk_size: int,
        with_entropy: bool,
        inplace_backward: bool,
    ) -> tuple[Tensor, Tensor]:
        groups, rows_per_group, vocab = logits.shape
        dtype = _compute_dtype(logits.dtype)
        logprobs = torch.empty(groups, rows_per_group, dtype=dtype, device=logits.device)
        log_norm = torch.empty_like(logprobs)
        entropy = torch.empty_like(logprobs) if with_entropy else logprobs.new_empty(0)
        # One scratch chunk reused by every chunk (a fresh one each time costs page faults).
        scratch = torch.empty(
            min(chunk_size, rows_per_group), vocab, dtype=dtype, device=logits.device
        )
        probs = torch.empty_like(scratch) if with_entropy else None
        for group, rows in _chunks(groups, rows_per_group, chunk_size):
            chunk = logits[group, rows]
            x = scratch[: chunk.shape[0]]
            x.copy_(chunk).div_(temperature)  # half precision is widened before dividing
            target_logit = x.gather(-1, targets[group, rows].unsqueeze(-1)).squeeze(-1)
            # logsumexp(x) = max + log Σ e^{x − max}, computed in place in the scratch.
            top = x.amax(-1, keepdim=True)
            shifted = x.sub_(top)
            exp = torch.exp(shifted, out=probs[: x.shape[0]]) if with_entropy else shifted.exp_()
            total = exp.sum(-1)
            lse = total.log() + top.squeeze(-1)
            log_norm[group, rows] = lse
            logprobs[group, rows] = target_logit - lse
            if with_entropy:
                # H = log Σ e^s − Σ e^s·s / Σ e^s with s = x − max.
                entropy[group, rows] = total.log() - torch.linalg.vecdot(exp, shifted) / total
        ctx.save_for_backward(logits, targets, log_norm, entropy)
        # Unused outputs then arrive as None in backward instead of as tensors of zeros.
        ctx.set_materialize_grads(False)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.with_entropy = with_entropy
        ctx.inplace_backward = inplace_backward
        ctx.mark_non_differentiable(targets)
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None):
        logits, targets, log_norm, entropy = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        groups, rows_per_group, vocab = logits.shape
        dtype = log_norm.dtype
        grad_logprobs = (
            torch.zeros_like(log_norm) if grad_logprobs is None else grad_logprobs.to(dtype)
        )
        use_entropy = ctx.with_entropy and grad_entropy is not None
        # In place: each chunk of the logits is read (copied or widened into ``work``) before
        # the same rows receive their gradient.
        grad_logits = logits.detach() if ctx.inplace_backward else torch.empty_like(logits)
        # Work in place inside the returned gradient when its dtype is the compute dtype;
        # otherwise in one reused float32 scratch chunk.
        size = (min(chunk_size, rows_per_group), vocab)
        scratch = (
            None if logits.dtype == dtype else torch.empty(size, dtype=dtype, device=logits.device)
        )
        probs = torch.empty(size, dtype=dtype, device=logits.device) if use_entropy else None
        for group, rows in _chunks(groups, rows_per_group, chunk_size):
            out = grad_logits[group, rows]
            work = out if scratch is None else scratch[: out.shape[0]]
            g_lp = grad_logprobs[group, rows].unsqueeze(-1)
            # work := log p = x − logsumexp(x)
            if work.data_ptr() != logits[group, rows].data_ptr():
                work.copy_(logits[group, rows])
            work.div_(temperature)
            work.sub_(log_norm[group, rows].unsqueeze(-1))
            if use_entropy:
                # d/dx [g_lp·log p_y + g_H·H] = g_lp·(onehot_y − p) − g_H·p·(log p + H)
                g_h = grad_entropy[group, rows].to(dtype).unsqueeze(-1)
                p = torch.exp(work, out=probs[: out.shape[0]])
                work.add_(entropy[group, rows].unsqueeze(-1)).mul_(g_h).add_(g_lp).mul_(p).neg_()
            else:
                work.exp_().mul_(g_lp).neg_()
            work.scatter_add_(-1, targets[group, rows].unsqueeze(-1), g_lp)
            work.div_(temperature)
            if scratch is not None:
                out.copy_(work)
        return grad_logits, None, None, None, None, None


def _grouped(logits: Tensor) -> Tensor:
    """A [G, R, V] view of ``logits`` [..., V] that does not copy them.

    One flat [1, N, V] view when the rows are evenly strided; otherwise one group per leading
    index, e.g. for ``logits[:, :-1]`` (the next-token shift), whose rows jump between
    sequences. Only exotic strides force a copy.
    """
    vocab = logits.shape[-1]
    shapes = [(1, -1, vocab)] + ([(-1, *logits.shape[-2:])] if logits.dim() > 1 else [])
    for shape in shapes:
        try:
            return logits.view(shape)
        except RuntimeError:
            continue
    return logits.reshape(shapes[-1])


def logprobs_from_logits(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    return_entropy: bool = False,
    inplace_backward: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """log softmax(logits / T) at ``targets``, shape ``targets.shape`` (docs/math.md §6).

    ``logits`` is [..., V] and ``targets`` [...] with ids in [0, V). Returns float32 for
    half-precision logits, else the logits dtype; with ``return_entropy`` also the entropy of
    softmax(logits / T) per token.

    ``inplace_backward=True`` stores the logits' gradient in the logits themselves (no
    [N, V] allocation in backward); use it when nothing else reads the logits after this call,
    e.g. a model's output that only feeds this function. Other autograd users of the same
    logits then raise torch's in-place modification error.
    """
    check_float_tensor("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(
            f"logits must have a non-empty vocabulary dimension; got shape {tuple(logits.shape)}"
        )
    if not isinstance(targets, Tensor) or targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"targets must be an int32/int64 tensor; got {getattr(targets, 'dtype', type(targets))}"
        )
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets has shape {tuple(targets.shape)} but logits has shape {tuple(logits.shape)};"
            " targets must match logits without the vocabulary dimension"
        )
    check_number("temperature", temperature, above=0)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer; got {chunk_size!r}")
    vocab = logits.shape[-1]
    if targets.numel() and not bool(((targets >= 0) & (targets < vocab)).all()):
        raise ValueError(
            f"targets must be token ids in [0, {vocab}); "
            "pad with any valid id and mask the position"
        )

    grouped = _grouped(logits)
    grouped_targets = targets.reshape(grouped.shape[:2]).long()
    logprobs, entropy = _ChunkedLogprobs.apply(
        grouped, grouped_targets, float(temperature), chunk_size, return_entropy, bool(inplace_backward)
    )
    logprobs = logprobs.reshape(targets.shape)
    if return_entropy:
        return logprobs, entropy.reshape(targets.shape)
    return logprobs
