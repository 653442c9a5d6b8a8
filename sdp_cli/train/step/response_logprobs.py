"""Log-probs (and entropy) of a batch's response tokens under a causal LM: the one forward the
trainer runs for π_θ, π_prox and π_ref (docs/math.md §6.2, docs/training.md "Precision and
memory").

The model is asked for its final hidden states (``logits_to_keep=1``: one position's logits,
not [N, L, V]); ``core.logprobs_from_hidden`` makes the logits of the response tokens one
vocabulary block at a time. On the first forward the head is checked against the model's own
last-position logits: a model that post-processes its logits (soft-capping, a logit scale)
falls back to full logits and ``core.logprobs_from_logits``, with a warning.

With ``share_prefixes`` each distinct prompt of a batch runs once (``train/step/shared_prefix.py``).
That is exact for full and sliding-window attention; a model whose config declares any other
attention pattern (chunked, linear, recurrent, unknown: ``models/attention.py``) runs the plain
forward, with a warning. The first batch that can share is also run plainly and the two
compared: a model whose forward does not take position ids and a KV cache the way the shared
forward needs falls back to the plain forward, with a warning.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable

import torch

from sdp_cli.core.logprobs import logprobs_from_hidden, logprobs_from_logits
from sdp_cli.models.attention import AttentionLayout, attention_layout, unvouched_kinds
from sdp_cli.train.step.batch import TrainBatch
from sdp_cli.train.step.shared_prefix import PrefixPlan, plan_shared_prefix, shared_prefix_hidden


class ResponseLogprobs:
    """``forward(model, batch)`` at one temperature, device and training precision."""

    def __init__(
        self,
        *,
        temperature: float,
        device: torch.device,
        autocast_dtype: torch.dtype | None,
        unwrap: Callable[[torch.nn.Module], torch.nn.Module],
        share_prefixes: bool = True,
        every_process: Callable[[bool], bool] | None = None,
    ):
        """``autocast_dtype``: bfloat16 for autocast, None for none. ``unwrap`` strips a
        data-parallel wrapper (the output embedding is looked up on the bare model).
        ``share_prefixes``: run each distinct prompt once per forward. ``every_process(flag)``:
        whether ``flag`` holds in every training process (a collective; None with one process)."""
        self.temperature = float(temperature)
        self.device = device
        self.autocast_dtype = autocast_dtype
        self.unwrap = unwrap
        self.every_process = every_process or (lambda flag: flag)
        #: whether logits = hidden · Wᵀ (+ b); decided at the first forward
        self.hidden_path: bool | None = None
        #: whether to share prefixes; None = allowed but not yet checked against the plain forward
        self.share_prefixes: bool | None = None if share_prefixes else False
        #: the fraction of token positions the last forward did not run (0: a plain forward)
        self.positions_saved = 0.0

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The training precision as a context: bfloat16 autocast, or nothing for float32."""
        dtype = self.autocast_dtype
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None)

    def forward(
        self, model: torch.nn.Module, batch: TrainBatch, *, grad: bool, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs [N, L-1] (float32, 0 outside the response) and, ``with_entropy``, the
        entropy of π at each response token, from one forward of ``model``."""
        ids = batch.input_ids.to(self.device)
        attention_mask = batch.attention_mask.to(self.device)
        response = batch.mask.to(self.device) > 0
        targets = ids[:, 1:][response]
        # The one-time checks are no-grad forwards, each in an autocast region of its own: inside
        # this forward's region, autocast would keep the bf16 copies they make of an FSDP-sharded
        # model's gathered weights and hand them, without their graph, to this forward, whose
        # decoder layers would then get no gradient (tests/train/test_fsdp_autocast.py).
        if self.hidden_path is None:
            with self.autocast():
                self.hidden_path = self._logits_are_hidden_times_head(model, ids, attention_mask)
        plan = self._prefix_plan(model, batch) if self.hidden_path else None
        if plan is not None and self.share_prefixes is None:
            with self.autocast():
                same = self._shared_matches_plain(model, plan, ids, attention_mask, response)
            self.share_prefixes = self.every_process(same)
        with torch.set_grad_enabled(grad), self.autocast():
            if self.hidden_path:
                self.positions_saved = 0.0
                if plan is not None and self.share_prefixes:
                    hidden, self.positions_saved = shared_prefix_hidden(
                        model, plan, self.device, unwrapped=self.unwrap(model)
                    )
                else:
                    hidden = self._plain_hidden(model, ids, attention_mask)[response]
                head = self.unwrap(model).get_output_embeddings()
                result = logprobs_from_hidden(
                    hidden.to(self.autocast_dtype or hidden.dtype),
                    head.weight,
                    targets,
                    bias=head.bias,
                    temperature=self.temperature,
                    return_entropy=with_entropy,
                )
            else:
                out = model(input_ids=ids, attention_mask=attention_mask, use_cache=False)
                # The logits feed nothing else: backward may store their gradient in place.
                result = logprobs_from_logits(
                    out.logits[:, :-1][response],
                    targets,
                    temperature=self.temperature,
                    return_entropy=with_entropy,
                    inplace_backward=grad,
                )
        values, entropy = result if with_entropy else (result, None)
        zeros = torch.zeros(response.shape, dtype=torch.float32, device=self.device)
        logprobs = zeros.masked_scatter(response, values.float())
        return logprobs, None if entropy is None else zeros.masked_scatter(response, entropy.float())

    @staticmethod
    def _plain_hidden(model: torch.nn.Module, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The final hidden states [N, L-1, hidden] that predict tokens 1…L-1, from one forward over
        every row's sequence but its last column (whose state predicts nothing: causal attention
        keeps the others the same without it)."""
        out = model(
            input_ids=ids[:, :-1],
            attention_mask=attention_mask[:, :-1],
            use_cache=False,
            output_hidden_states=True,
            logits_to_keep=1,
        )
        return out.hidden_states[-1]

    def _prefix_plan(self, model: torch.nn.Module, batch: TrainBatch) -> PrefixPlan | None:
        """The shared-prefix plan of ``batch``, or None for a plain forward: sharing is off or
        was refused, the batch (in any process) gains too little, or gradient checkpointing is
        on (its layers run without a KV cache)."""
        if self.share_prefixes is None and not self._attention_allows_sharing(model):
            self.share_prefixes = False
        if self.share_prefixes is False or _checkpoints_activations(model):  # the same in every process
            return None
        plan = plan_shared_prefix(batch.input_ids, batch.attention_mask, batch.mask > 0)
        # Every process takes the same path: a sharded or DDP model's forward runs collectives,
        # and the shared path calls it twice where the plain one calls it once.
        return plan if self.every_process(plan is not None) else None

    def _attention_allows_sharing(self, model: torch.nn.Module) -> bool:
        """Whether the model's config declares only attention that the shared forward keeps
        exact (full and sliding-window: ``models/attention.py``); if not, warn once. The config
        is the same in every process, so every process decides alike."""
        config = getattr(self.unwrap(model), "config", None)
        if attention_layout(config) is not AttentionLayout.PLAIN:
            return True
        warnings.warn(
            f"this model's config declares attention the shared-prompt forward is not known to keep "
            f"exact ({', '.join(unvouched_kinds(config))}); every row runs its whole sequence instead "
            "(train.share_prefixes=false silences this)",
            stacklevel=5,
        )
        return False

    @torch.no_grad()
    def _shared_matches_plain(
        self,
        model: torch.nn.Module,
        plan: PrefixPlan,
        ids: torch.Tensor,
        attention_mask: torch.Tensor,
        response: torch.Tensor,
    ) -> bool:
        """Whether the shared-prefix forward gives the plain forward's hidden states on this
        batch (up to summation order); if not (or if it fails: a forward that mishandles the
        cache or the packed windows' 4-D mask may raise), warn once."""
        plain = self._plain_hidden(model, ids, attention_mask)[response].float()
        try:
            shared = shared_prefix_hidden(model, plan, self.device, unwrapped=self.unwrap(model))[0].float()
        except RuntimeError:
            shared = None
        low_precision = self.autocast_dtype is not None or any(
            p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters()
        )
        tolerance = (5e-2 if low_precision else 1e-4) * float(plain.abs().max()) + 1e-5
        same = (
            shared is not None and shared.shape == plain.shape and bool((shared - plain).abs().max() <= tolerance)
        )
        if not same:
            warnings.warn(
                "this model's forward does not reproduce its hidden states when a prompt's KV cache "
                "is shared by its samples (position ids or cache handling differ); every row runs "
                "its whole sequence instead (train.share_prefixes=false silences this)",
                stacklevel=4,
            )
        return same

    @torch.no_grad()
    def _logits_are_hidden_times_head(
        self, model: torch.nn.Module, ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> bool:
        """Whether the model's logits are its last hidden state times the output embedding (+
        bias), checked on the first row; if not, warn once."""
        out = model(
            input_ids=ids[:1],
            attention_mask=attention_mask[:1],
            use_cache=False,
            output_hidden_states=True,
            logits_to_keep=1,
        )
        hidden = out.hidden_states[-1][:, -1:] if out.hidden_states else None
        head = self.unwrap(model).get_output_embeddings()
        same = False
        if hidden is not None and isinstance(head, torch.nn.Linear):
            expected, got = head(hidden).float(), out.logits[:, -1:].float()
            same = bool(torch.allclose(expected, got, rtol=1e-3, atol=1e-3 * float(got.abs().max()) + 1e-5))
        if not same:
            warnings.warn(
                "this model's logits are not its last hidden state times the output embedding "
                "(e.g. logit soft-capping or scaling); log-probs are computed from full logits, "
                "which needs [tokens × vocab] memory",
                stacklevel=4,
            )
        return same


def _checkpoints_activations(model: torch.nn.Module) -> bool:
    """Whether any layer of ``model`` recomputes its activations in backward (transformers marks
    such layers with ``gradient_checkpointing = True``; they run without a KV cache)."""
    return any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules())
