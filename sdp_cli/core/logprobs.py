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

``logprobs_from_hidden`` goes one step further for training: it takes the final hidden states
and the output embedding and makes the logits itself, one vocabulary block at a time, so no [N, V]
tensor exists at all — neither the logits nor their gradient (docs/math.md §6.2).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

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


def _chunk_forward(
    x: Tensor, targets: Tensor, probs: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """log p(target), logsumexp and (with a ``probs`` buffer) H of one chunk x = logits / T.

    Works in place: ``x`` is overwritten (it is a scratch chunk).
    """
    target_logit = x.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    # logsumexp(x) = max + log Σ e^{x − max}, computed in place in the scratch.
    top = x.amax(-1, keepdim=True)
    shifted = x.sub_(top)
    exp = torch.exp(shifted, out=probs[: x.shape[0]]) if probs is not None else shifted.exp_()
    total = exp.sum(-1)
    lse = total.log() + top.squeeze(-1)
    entropy = None
    if probs is not None:
        # H = log Σ e^s − Σ e^s·s / Σ e^s with s = x − max.
        entropy = total.log() - torch.linalg.vecdot(exp, shifted) / total
    return target_logit - lse, lse, entropy


def _chunk_backward(
    work: Tensor,
    targets: Tensor,
    log_norm: Tensor,
    grad_logprobs: Tensor,
    entropy: Tensor | None,
    grad_entropy: Tensor | None,
    probs: Tensor | None,
    temperature: float,
    target_grad: Tensor | None = None,
) -> None:
    """Turn ``work`` = logits / T of one chunk into ∂(g·log p_y + h·H)/∂logits, in place.

    ``target_grad`` is what the one-hot term adds at ``targets`` (default g; a vocabulary block
    passes 0 for rows whose target lies in another block).
    """
    dtype = work.dtype
    g_lp = grad_logprobs.to(dtype).unsqueeze(-1)
    work.sub_(log_norm.unsqueeze(-1))  # work := log p
    if grad_entropy is not None:
        assert entropy is not None and probs is not None, "entropy gradient needs H and a buffer"
        # d/dx [g·log p_y + h·H] = g·(onehot_y − p) − h·p·(log p + H)
        g_h = grad_entropy.to(dtype).unsqueeze(-1)
        p = torch.exp(work, out=probs[: work.shape[0]])
        work.add_(entropy.unsqueeze(-1)).mul_(g_h).add_(g_lp).mul_(p).neg_()
    else:
        work.exp_().mul_(g_lp).neg_()
    work.scatter_add_(-1, targets.unsqueeze(-1), g_lp if target_grad is None else target_grad.to(dtype).unsqueeze(-1))
    work.div_(temperature)


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
            lp, lse, ent = _chunk_forward(x, targets[group, rows], probs)
            log_norm[group, rows] = lse
            logprobs[group, rows] = lp
            if with_entropy:
                entropy[group, rows] = ent
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
            if work.data_ptr() != logits[group, rows].data_ptr():
                work.copy_(logits[group, rows])
            work.div_(temperature)
            _chunk_backward(
                work,
                targets[group, rows],
                log_norm[group, rows],
                grad_logprobs[group, rows],
                entropy[group, rows] if use_entropy else None,
                grad_entropy[group, rows] if use_entropy else None,
                probs,
                temperature,
            )
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


def _check_logits_args(logits: Tensor, targets: Tensor, temperature: float, chunk_size: int) -> None:
    """``logprobs_from_logits``' boundary: ValueError naming the first bad argument."""
    check_float_tensor("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(
            f"logits must have a non-empty vocabulary dimension; got shape {tuple(logits.shape)}"
        )
    _check_targets(targets, logits, "logits", "vocabulary")
    check_number("temperature", temperature, above=0)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer; got {chunk_size!r}")
    vocab = logits.shape[-1]
    if targets.numel() and not bool(((targets >= 0) & (targets < vocab)).all()):
        raise ValueError(
            f"targets must be token ids in [0, {vocab}); "
            "pad with any valid id and mask the position"
        )


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
    Its arguments are checked here (``_check_logits_args``), the public entry point; the target
    range check guards the gather. The engine's temperature was validated where it entered
    (rollout.temperature by the config, a batch's by the batch reader).
    """
    _check_logits_args(logits, targets, temperature, chunk_size)
    grouped = _grouped(logits)
    grouped_targets = targets.reshape(grouped.shape[:2]).long()
    logprobs, entropy = _ChunkedLogprobs.apply(
        grouped, grouped_targets, float(temperature), chunk_size, return_entropy, bool(inplace_backward)
    )
    logprobs = logprobs.reshape(targets.shape)
    if return_entropy:
        return logprobs, entropy.reshape(targets.shape)
    return logprobs


#: Elements of one float32 [N, block] scratch in ``logprobs_from_hidden`` (64 MiB).
HIDDEN_BLOCK_ELEMENTS = 1 << 24


class _HiddenLogprobs(torch.autograd.Function):
    """log p(target) and H of softmax((h·Wᵀ + b) / T), the logits made one vocabulary block at a
    time (docs/math.md §6.2).

    Forward keeps a running max m, S = Σ e^{x−m} and U = Σ e^{x−m}·(x − m) per row across
    blocks (an online logsumexp), so lse = m + log S and H = log S − U/S. Backward recomputes
    each block's logits and turns them into the block's columns of ∂/∂logits, which give ∂W for
    those vocabulary rows directly and add their share to ∂h.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        temperature: float,
        block_size: int,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        rows, vocab = hidden.shape[0], weight.shape[0]
        dtype = _compute_dtype(hidden.dtype)
        new = functools.partial(torch.zeros, rows, dtype=dtype, device=hidden.device)
        top, total, spread, target_logit = new().fill_(-math.inf), new(), new(), new()
        scratch = torch.empty(rows * min(block_size, vocab), dtype=dtype, device=hidden.device)
        probs = torch.empty_like(scratch) if with_entropy else None
        for start, x in _blocks(hidden, weight, bias, temperature, block_size, scratch):
            idx, in_block = _block_targets(targets, start, x.shape[1])
            target_logit = torch.where(in_block, x.gather(1, idx.unsqueeze(1)).squeeze(1), target_logit)
            new_top = torch.maximum(top, x.amax(1))
            scale = torch.exp(top - new_top)  # 0 for the first block (top = −inf)
            if with_entropy:
                # U' = scale·(U + (m − m')·S); where S = 0 the product would be (−inf)·0
                shift = torch.where(total > 0, (top - new_top) * total, 0.0)
                spread = scale * (spread + shift)
            x.sub_(new_top.unsqueeze(1))
            exp = torch.exp(x, out=probs[: x.numel()].view_as(x)) if probs is not None else x.exp_()
            total = scale * total + exp.sum(1)
            if with_entropy:
                spread += torch.linalg.vecdot(exp, x)
            top = new_top
        log_norm = top + total.log()
        logprobs = target_logit - log_norm
        entropy = total.log() - spread / total if with_entropy else log_norm.new_empty(0)
        ctx.save_for_backward(hidden, weight, bias, targets, log_norm, entropy)
        ctx.set_materialize_grads(False)
        ctx.temperature = temperature
        ctx.block_size = block_size
        ctx.with_entropy = with_entropy
        ctx.mark_non_differentiable(targets)
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, bias, targets, log_norm, entropy = ctx.saved_tensors
        # backward() may run under autocast; every dtype below is chosen explicitly
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            return _hidden_backward(ctx, hidden, weight, bias, targets, log_norm, entropy, grad_logprobs, grad_entropy)


def _hidden_backward(
    ctx: FunctionCtx,
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    log_norm: Tensor,
    entropy: Tensor,
    grad_logprobs: Tensor | None,
    grad_entropy: Tensor | None,
) -> tuple[Tensor | None, ...]:
    """Backward of ``_HiddenLogprobs``, block by block: ∂W and ∂b of the block's vocabulary rows
    are written once; ∂h accumulates in float32."""
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    rows, vocab = hidden.shape[0], weight.shape[0]
    dtype = log_norm.dtype
    grad_logprobs = torch.zeros_like(log_norm) if grad_logprobs is None else grad_logprobs.to(dtype)
    use_entropy = ctx.with_entropy and grad_entropy is not None
    acc_dtype = torch.promote_types(dtype, torch.float32)
    grad_hidden = torch.zeros(hidden.shape, dtype=acc_dtype, device=hidden.device) if need_h else None
    grad_weight = torch.empty_like(weight) if need_w else None
    grad_bias = torch.empty_like(bias) if need_b else None
    scratch = torch.empty(rows * min(ctx.block_size, vocab), dtype=dtype, device=hidden.device)
    probs = torch.empty_like(scratch) if use_entropy else None
    blocks = _blocks(hidden, weight, bias, ctx.temperature, ctx.block_size, scratch)
    for start, work in blocks:
        cols = slice(start, start + work.shape[1])
        idx, in_block = _block_targets(targets, start, work.shape[1])
        _chunk_backward(
            work,
            idx,
            log_norm,
            grad_logprobs,
            entropy if use_entropy else None,
            grad_entropy if use_entropy else None,
            None if probs is None else probs[: work.numel()].view_as(work),
            ctx.temperature,
            target_grad=torch.where(in_block, grad_logprobs, 0.0),
        )
        # work is now ∂/∂logits of the block; logits = h·W_blockᵀ + b_block
        grad = work.to(hidden.dtype)
        if grad_hidden is not None:
            grad_hidden += grad @ weight[cols].detach().to(hidden.dtype)
        if grad_weight is not None:
            grad_weight[cols] = grad.t() @ hidden
        if grad_bias is not None:
            grad_bias[cols] = work.sum(0)
    return (
        None if grad_hidden is None else grad_hidden.to(hidden.dtype),
        grad_weight,
        grad_bias,
        None,
        None,
        None,
        None,
    )


def _blocks(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, block_size: int, scratch: Tensor
) -> Iterator[tuple[int, Tensor]]:
    """(first vocabulary id, x = (h·W_blockᵀ + b_block) / T) of every block, x [N, block] in the
    compute-dtype ``scratch`` (a flat buffer, so every block's view is contiguous). The matmul
    runs in ``hidden``'s dtype; W is cast to it one block at a time."""
    rows, vocab = hidden.shape[0], weight.shape[0]
    for start in range(0, vocab, block_size):
        w = weight[start : start + block_size].detach().to(hidden.dtype)
        x = scratch[: rows * w.shape[0]].view(rows, w.shape[0])
        b = None if bias is None else bias[start : start + block_size].detach().to(hidden.dtype)
        if hidden.dtype == x.dtype:
            if b is None:
                torch.mm(hidden, w.t(), out=x)
            else:
                torch.addmm(b, hidden, w.t(), out=x)
        else:  # half precision: the matmul runs in it, the softmax in float32
            x.copy_(hidden @ w.t() if b is None else torch.addmm(b, hidden, w.t()))
        yield start, x.div_(temperature)


def _block_targets(targets: Tensor, start: int, width: int) -> tuple[Tensor, Tensor]:
    """Each row's target as a column of the block starting at ``start`` (clamped into it), and
    whether the target lies in the block at all."""
    local = targets - start
    return local.clamp(0, width - 1), (local >= 0) & (local < width)


def _check_hidden_args(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float, block_size: int | None
) -> int:
    """``logprobs_from_hidden``'s boundary: ValueError naming the first bad argument; the block size
    in use (default ``HIDDEN_BLOCK_ELEMENTS // N``)."""
    check_float_tensor("hidden", hidden)
    check_float_tensor("weight", weight)
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1] or weight.shape[0] == 0:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be [..., H] and [V, H] with V > 0"
        )
    vocab = weight.shape[0]
    if bias is not None:
        check_float_tensor("bias", bias)
        if bias.shape != (vocab,):
            raise ValueError(f"bias must have shape ({vocab},); got {tuple(bias.shape)}")
    _check_targets(targets, hidden, "hidden", "feature")
    check_number("temperature", temperature, above=0)
    if block_size is None:
        block_size = max(1, HIDDEN_BLOCK_ELEMENTS // max(targets.numel(), 1))
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer; got {block_size!r}")
    if targets.numel() and not bool(((targets >= 0) & (targets < vocab)).all()):
        raise ValueError(
            f"targets must be token ids in [0, {vocab}); pad with any valid id and mask the position"
        )
    return block_size


def logprobs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    block_size: int | None = None,
    return_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """log softmax((hidden·weightᵀ + bias) / T) at ``targets`` without the logits (docs/math.md §6.2).

    ``hidden`` is [..., H] (the model's final hidden states), ``weight`` the [V, H] output
    embedding, ``targets`` [...] ids in [0, V). The logits exist one block of ``block_size``
    vocabulary entries at a time (default: ``HIDDEN_BLOCK_ELEMENTS // N``), in forward and in
    backward, so no [N, V] tensor is ever allocated. The matmuls run in ``hidden``'s dtype
    (``weight`` is cast to it block by block), the softmax in float32 for half-precision input;
    gradients come back in each input's own dtype (∂h accumulated in float32). Returns float32
    for half-precision hidden states, else their dtype; with ``return_entropy`` also H per token.
    Its arguments are checked here (``_check_hidden_args``), the public entry point; the target
    range check guards the gather. The trainer's temperature is rollout.temperature, validated by
    the config.
    """
    block_size = _check_hidden_args(hidden, weight, bias, targets, temperature, block_size)
    flat = hidden.reshape(-1, hidden.shape[-1])
    # autocast must not recast inside the blocks: the dtypes above are the contract
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        logprobs, entropy = _HiddenLogprobs.apply(
            flat, weight, bias, targets.reshape(-1).long(), float(temperature), block_size, return_entropy
        )
    logprobs = logprobs.reshape(targets.shape)
    if return_entropy:
        return logprobs, entropy.reshape(targets.shape)
    return logprobs


def _check_targets(targets: Tensor, source: Tensor, name: str, last_dim: str) -> None:
    """``targets``: integer token ids shaped like ``source`` without its last dimension."""
    if not isinstance(targets, Tensor) or targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"targets must be an int32/int64 tensor; got {getattr(targets, 'dtype', type(targets))}"
        )
    if targets.shape != source.shape[:-1]:
        raise ValueError(
            f"targets has shape {tuple(targets.shape)} but {name} has shape {tuple(source.shape)};"
            f" targets must match {name} without the {last_dim} dimension"
        )
