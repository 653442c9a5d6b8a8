"""The embedded ``local`` engine: an in-process transformers causal LM with its own KV-cache loop.

Why not ``model.generate()``: its generation config silently reshapes the distribution (top_k=50
by default, repetition penalties, …), so the logprobs a trainer needs would not be those of the
distribution the tokens were drawn from. Here every token is drawn from softmax(logits / T) over
the full vocabulary and its exact logprob log_softmax(logits / T)[token] is recorded together
with the engine version that produced it (docs/design.md §1, §6).

Concurrency: each ``generate`` call decodes its own samples as one left-padded batch with its own
KV cache. Concurrent calls take turns on the model one decode step at a time (``StepGate``), so
they interleave at token granularity; steps of different calls are not fused into one forward.
Fusing would mean merging KV caches of different lengths, which depends on each architecture's
cache layout (sliding-window and linear-attention layers), while one cache per call works for
any ``*ForCausalLM``. For throughput, pass many samples per call.

Aborts (the local engine's process answers a remote engine's pause with them, docs/engines.md
"The local engine's process"): ``abort`` ends the samples of running calls at the next token
boundary, unfinished; their call returns once none of its samples is left.

Weight updates (docs/design.md §2): ``pause`` stops every call at a token boundary; ``update_weights``
swaps the weights and bumps a weight epoch; at its next turn a call whose cache predates the epoch
re-prefills prompt + partial output under the new weights, takes π_prox_t for its tokens of
version new − 1 from that same forward (step 4), and decodes on with the fresh cache. Tokens of
older versions were patched at earlier resumes (or by the recompute pass) and are left alone.
"""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sdp_cli.core.logprobs import logprobs_from_logits
from sdp_cli.engine._local_gate import StepGate
from sdp_cli.engine._local_weights import copy_weights, read_safetensors_dir
from sdp_cli.engine.base import EngineError, InferenceEngine, SamplingParams, WeightUpdate
from sdp_cli.faults import fault_point
from sdp_cli.models.attention import AttentionLayout, attention_layout, unvouched_kinds
from sdp_cli.models.precision import cast_weights
from sdp_cli.models.kv_cache import returned_cache, with_cache
from sdp_cli.rollout.records import RolloutSample


#: suffixes up to this long are scored at their own length (``scoring_width``)
EXACT_SCORING_WIDTH = 16


def scoring_width(n: int) -> int:
    """The columns ``LocalEngine.score`` runs a suffix of ``n`` tokens in, a function of ``n``
    alone (so a row's scores do not depend on how long the other answers are): ``n`` itself up to 16, above that
    ``n`` rounded up to a multiple of a quarter of its power of two — at most 25 % padding and
    four widths per doubling, so that answers of many lengths (long responses) take a bounded
    number of forwards instead of one each."""
    if n <= EXACT_SCORING_WIDTH:
        return n
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


@dataclass
class _Batch:
    """Decode state of the samples of one ``generate`` call (or one chunk of it).

    Row ``i`` of every tensor belongs to ``rows[i]``; a finished row becomes ``None`` and stays
    in the tensors (its tokens are ignored) until at most half of the rows are live, because
    dropping rows from a KV cache copies the whole cache.
    """

    rows: list[RolloutSample | None]
    #: the longest output row ``i`` may reach (``SamplingParams.max_new_tokens`` or its own limit)
    limits: list[int]
    stop_ids: torch.Tensor  # [S] ids that end a row
    generator: torch.Generator
    live: torch.Tensor | None = None  # [B] bool, False once a row has finished
    remaining: torch.Tensor | None = None  # [B] tokens each row may still generate
    cache: Any = None  # the model's KV cache; None until the first prefill
    attention_mask: torch.Tensor | None = None  # [B, cached + 1], 0 on left padding
    next_positions: torch.Tensor | None = None  # [B, 1] position id of the next input token
    next_logits: torch.Tensor | None = None  # [B, V] logits of the token to sample next
    weights_epoch: int = -1  # weight epoch the cache was computed under


class LocalEngine(InferenceEngine):
    """In-process engine around a Hugging Face causal LM (``*ForCausalLM``).

    Args:
        model: the policy; the engine puts it in eval mode on ``device`` and owns it from then on.
        temperature: T of softmax(logits / T), used for sampling and scoring alike.
        eos_token_id: id (or ids) that end every response; kept as its last token.
        pad_token_id: id written into left padding (masked out, any valid id works).
        max_batch_size: at most this many samples of one call are decoded together; a larger
            call is decoded chunk after chunk. Also the row chunk of ``score``.
        seed: seeds the engine's sampling generator, shared by all calls (so draws repeat only
            for the same order of calls); ``SamplingParams.seed`` gives a call its own generator.
        device: where the model runs.
        dtype: the dtype the engine holds the weights in (its forwards run in it, weight updates
            are cast to it; ``models.precision.cast_weights``); None keeps the model's.
        step_callback: called by the generating thread after each decode step, outside the model
            turn (so it may call ``pause``); for tests and progress meters.

    ``temperature`` and ``max_batch_size`` are trusted: the config validated rollout.temperature and
    engine.max_batch_size, the batch reader a batch's temperature (``sdp recompute``).
    """

    accepts_state_dict = True

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        temperature: float = 1.0,
        eos_token_id: int | Sequence[int],
        pad_token_id: int,
        max_batch_size: int = 256,
        seed: int | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        step_callback: Callable[[], None] | None = None,
    ) -> None:
        self.temperature = float(temperature)
        self.device = torch.device(device)
        if dtype is not None:
            cast_weights(model, dtype)
        self.model = model.to(self.device).eval()
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        eos = [eos_token_id] if isinstance(eos_token_id, int) else [int(t) for t in eos_token_id]
        self.eos_token_ids = tuple(eos)
        self.pad_token_id = int(pad_token_id)
        self._check_ids([*self.eos_token_ids, self.pad_token_id], "eos/pad token id")
        self.max_batch_size = int(max_batch_size)
        self._generator = torch.Generator(self.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self._step_callback = step_callback
        self._gate = StepGate()
        self._version = 0
        # bumped by every weight load: a cache from an older epoch is stale
        self._weights_epoch = 0
        self._inflight: dict[int, RolloutSample] = {}
        self._inflight_lock = threading.Lock()
        #: ids of in-flight samples ``abort`` ended; their rows leave at the next turn
        self._aborted: set[int] = set()
        self._prefill_proximal_tokens = 0  # written inside a model turn, read under the lock
        # which rows may share a prompt's forward (``_forward_shared``)
        self._attention_layout = attention_layout(getattr(self.model, "config", None))
        if self._attention_layout is AttentionLayout.PLAIN:
            warnings.warn(
                "this model's config declares attention that shared prompts are not known to keep exact "
                f"({', '.join(unvouched_kinds(getattr(self.model, 'config', None)))}); "
                "the local engine runs each sample's whole sequence",
                stacklevel=2,
            )

    # ---------------------------------------------------------------- version
    def get_version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        """Declare the version of the loaded weights (recovery); the weights and caches stay."""
        with self._gate.exclusive_turn():
            self._version = int(version)

    # ----------------------------------------------------------- pause/resume
    def pause(self) -> None:
        self._gate.pause()

    def resume(self) -> None:
        self._gate.resume()

    def is_paused(self) -> bool:
        return self._gate.is_paused()

    def inflight_samples(self) -> list[RolloutSample]:
        with self._inflight_lock:
            return list(self._inflight.values())

    def stats(self) -> dict[str, int]:
        with self._inflight_lock:
            return {"prefill_proximal_tokens": self._prefill_proximal_tokens}

    def close(self) -> None:
        self._gate.close()

    def abort(self, sample_ids: Collection[int] | None = None) -> None:
        """End the in-flight samples ``sample_ids`` (None: all) at the next token boundary,
        unfinished; the ``generate`` call of each returns once none of its samples is left."""
        with self._inflight_lock:
            running = self._inflight.keys()
            self._aborted |= set(running) if sample_ids is None else set(sample_ids) & running

    # ---------------------------------------------------------------- weights
    def update_weights(self, update: WeightUpdate) -> None:
        """Load new weights while paused; the version becomes ``update.version``.

        docs/design.md §2 step 3. In-flight calls re-prefill under the new weights at their next turn
        after ``resume``.
        """
        if not self.is_paused():
            raise EngineError("update_weights needs a paused engine; call pause() first")
        if update.version < self._version:
            raise EngineError(
                f"weight update to version {update.version} would go back from version "
                f"{self._version}; versions only grow (use set_version for recovery)"
            )
        if update.state_dict is not None:
            state, source = update.state_dict, f"in-memory weights for version {update.version}"
        else:
            assert update.path is not None, "WeightUpdate guarantees a state_dict or a path"
            state, source = read_safetensors_dir(update.path), str(update.path)
        with self._gate.exclusive_turn():
            if not self.is_paused():
                raise EngineError("the engine was resumed during update_weights; pause it first")
            copy_weights(self.model, state, source)
            self._version = int(update.version)
            self._weights_epoch += 1

    # ---------------------------------------------------------------- scoring
    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        """log p(s[t] | s[:t]) for t ≥ start, under the loaded weights at the engine's T."""
        if len(sequences) != len(starts):
            raise ValueError(f"score: {len(sequences)} sequences but {len(starts)} starts")
        seqs = [[int(t) for t in s] for s in sequences]
        for i, (seq, start) in enumerate(zip(seqs, starts, strict=True)):
            if not 1 <= start <= len(seq):
                raise ValueError(
                    f"score: start {start} of sequence {i} must lie in [1, {len(seq)}]"
                )
        self._check_ids([t for s in seqs for t in s], "token id")
        fault_point("local.score")
        # rows with the same prefix (a GRPO group's prompt) together: they share its forward
        order = sorted(range(len(seqs)), key=lambda i: (seqs[i][: starts[i]], len(seqs[i])))
        results: list[list[float]] = [[] for _ in seqs]
        with self._gate.exclusive_turn(), torch.inference_mode():
            for lo in range(0, len(order), self.max_batch_size):
                chunk = order[lo : lo + self.max_batch_size]
                prefixes = [seqs[i][: starts[i]] for i in chunk]
                suffixes = [seqs[i][starts[i] : -1] for i in chunk]
                for rows, logits in self._forward_by_length(prefixes, suffixes):
                    targets = [seqs[chunk[r]][starts[chunk[r]] :] for r in rows]
                    for r, values in zip(rows, self._target_logprobs(logits, targets), strict=True):
                        results[chunk[r]] = values
        return results

    # ------------------------------------------------------------- generation
    def generate(
        self, samples: Sequence[RolloutSample], params: SamplingParams, *, limits: Sequence[int] | None = None
    ) -> None:
        """Sample every response to the end (stop token or ``params.max_new_tokens``), in place.

        ``max_new_tokens`` bounds the whole response, including a partial output a sample arrives
        with; ``limits`` gives each sample its own bound instead. Blocks while the engine is
        paused; an exception of any step is raised here. A sample ``abort`` ended is left
        unfinished.
        """
        samples = list(samples)
        limits = [params.max_new_tokens] * len(samples) if limits is None else [int(n) for n in limits]
        assert len(limits) == len(samples), f"{len(limits)} limits for {len(samples)} samples"
        self._validate(samples)
        with self._inflight_lock:
            taken = [s.sample_id for s in samples if s.sample_id in self._inflight]
            if taken:
                raise ValueError(
                    f"generate: sample {taken[0]} is already being generated by another call"
                )
            self._inflight.update((s.sample_id, s) for s in samples)
        try:
            todo = []
            for sample, limit in zip(samples, limits, strict=True):
                if sample.output_len >= limit:
                    sample.finish("length")
                    self._forget([sample])
                else:
                    todo.append((sample, limit))
            generator = self._generator
            if params.seed is not None:
                generator = torch.Generator(self.device).manual_seed(params.seed)
            stop_ids = torch.tensor(
                sorted({*self.eos_token_ids, *params.stop_token_ids}),
                dtype=torch.long,
                device=self.device,
            )
            for lo in range(0, len(todo), self.max_batch_size):
                chunk = todo[lo : lo + self.max_batch_size]
                self._decode(_Batch([s for s, _ in chunk], [n for _, n in chunk], stop_ids, generator))
        finally:
            self._forget(samples)

    def _validate(self, samples: list[RolloutSample]) -> None:
        if len({s.sample_id for s in samples}) != len(samples):
            raise ValueError("generate: the same sample appears twice in one call")
        for s in samples:
            if s.is_finished:
                raise ValueError(
                    f"generate: sample {s.sample_id} is already finished ({s.finish_reason})"
                )
            if not s.prompt_ids:
                raise ValueError(f"generate: sample {s.sample_id} has an empty prompt")
            s.check_consistent()
            self._check_ids(s.input_ids, f"token id of sample {s.sample_id}")

    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"{what} {bad} is outside the model's vocabulary [0, {self.vocab_size})"
            )

    def _forget(self, samples: Sequence[RolloutSample]) -> None:
        with self._inflight_lock:
            for s in samples:
                self._inflight.pop(s.sample_id, None)
                self._aborted.discard(s.sample_id)

    def _decode(self, batch: _Batch) -> None:
        """Decode turn after turn until every row of ``batch`` has finished or was aborted."""
        while any(row is not None for row in batch.rows):
            with self._gate.decode_turn(), torch.inference_mode():
                if not self._drop_aborted(batch):
                    return
                if batch.weights_epoch != self._weights_epoch:
                    self._prefill(batch)
                self._sample_and_advance(batch)
            fault_point("local.generate")
            if self._step_callback is not None:
                self._step_callback()

    def _drop_aborted(self, batch: _Batch) -> bool:
        """Retire the rows ``abort`` ended (they stay in the tensors, like finished rows, until
        the next compaction); whether any row is left."""
        with self._inflight_lock:
            if not self._aborted:
                return True
            hit = [i for i, row in enumerate(batch.rows) if row is not None and row.sample_id in self._aborted]
            for i in hit:
                self._aborted.discard(batch.rows[i].sample_id)
                self._inflight.pop(batch.rows[i].sample_id, None)
        for i in hit:
            batch.rows[i] = None
            if batch.live is not None:
                batch.live[i] = False
        return any(row is not None for row in batch.rows)

    def _prefill(self, batch: _Batch) -> None:
        """(Re-)build the KV cache of prompt + output so far under the loaded weights.

        The same forward gives log π_v(token) of the tokens already generated; tokens of version
        v − 1 without a π_prox_t from version v take it (docs/design.md §2 step 4). Samples with the
        same prompt share its forward.
        """
        version = self._version
        live = [(s, n) for s, n in zip(batch.rows, batch.limits, strict=True) if s is not None]
        samples = [s for s, _ in live]
        logits, mask, cache = self._forward_shared(
            [s.prompt_ids for s in samples], [s.output_ids for s in samples], use_cache=True
        )
        need = [
            any(
                tv == version - 1 and pv != version
                for tv, pv in zip(s.versions, s.proximal_t_versions, strict=True)
            )
            for s in samples
        ]
        if any(need):
            rows = [i for i, n in enumerate(need) if n]
            patched = 0
            values = self._target_logprobs(
                logits[rows], [samples[i].output_ids for i in rows]
            )
            for i, logprobs in zip(rows, values, strict=True):
                sample = samples[i]
                for t, lp in enumerate(logprobs):
                    if (
                        sample.versions[t] == version - 1
                        and sample.proximal_t_versions[t] != version
                    ):
                        sample.set_proximal_t(t, lp, version)
                        patched += 1
            with self._inflight_lock:
                self._prefill_proximal_tokens += patched
        lengths = torch.tensor([s.output_len for s in samples], device=self.device)
        batch.rows = list(samples)
        batch.limits = [n for _, n in live]
        batch.live = torch.ones(len(samples), dtype=torch.bool, device=self.device)
        batch.remaining = torch.tensor(
            [n - s.output_len for s, n in live],
            dtype=torch.long,
            device=self.device,
        )
        batch.cache = cache
        batch.attention_mask = mask
        batch.next_positions = mask.sum(dim=1, keepdim=True)
        # the logits after each row's last token (suffixes are right-padded)
        batch.next_logits = logits[torch.arange(len(samples), device=self.device), lengths]
        batch.weights_epoch = self._weights_epoch

    def _sample_and_advance(self, batch: _Batch) -> None:
        """Draw one token per row from softmax(logits / T), record it for the live rows, retire
        finished rows, and run the decode forward that yields the next logits."""
        logprobs = torch.log_softmax(batch.next_logits.float() / self.temperature, dim=-1)
        tokens = torch.multinomial(logprobs.exp(), 1, generator=batch.generator)  # [B, 1]
        token_logprobs = logprobs.gather(1, tokens).squeeze(1)
        version = self._version
        for sample, token, lp in zip(
            batch.rows, tokens.squeeze(1).tolist(), token_logprobs.tolist(), strict=True
        ):
            if sample is not None:
                sample.append_tokens((token,), (lp,), version)

        batch.remaining -= 1
        stopped = torch.isin(tokens.squeeze(1), batch.stop_ids)
        finished = batch.live & (stopped | (batch.remaining == 0))
        if bool(finished.any()):
            done_rows = finished.nonzero().squeeze(1).tolist()
            for row, by_stop in zip(done_rows, stopped[done_rows].tolist(), strict=True):
                batch.rows[row].finish("stop" if by_stop else "length")
            self._forget([batch.rows[row] for row in done_rows])
            for row in done_rows:
                batch.rows[row] = None
            batch.live &= ~finished
            live = int(batch.live.sum())
            if live == 0:
                return
            if 2 * live <= len(batch.rows):
                keep = batch.live.nonzero().squeeze(1)
                batch.cache.batch_select_indices(keep)
                batch.rows = [batch.rows[row] for row in keep.tolist()]
                batch.limits = [batch.limits[row] for row in keep.tolist()]
                batch.live = batch.live[keep]
                batch.attention_mask = batch.attention_mask[keep]
                batch.next_positions = batch.next_positions[keep]
                batch.remaining = batch.remaining[keep]
                tokens = tokens[keep]

        batch.attention_mask = torch.cat(
            [batch.attention_mask, batch.attention_mask.new_ones(len(tokens), 1)], 1
        )
        out = self.model(
            input_ids=tokens,
            attention_mask=batch.attention_mask,
            position_ids=batch.next_positions,
            use_cache=True,
            **with_cache(batch.cache),
        )
        batch.cache = returned_cache(out)
        batch.next_logits = out.logits[:, -1]
        batch.next_positions = batch.next_positions + 1

    # ---------------------------------------------------------------- forwards
    def _forward_shared(
        self, prefixes: list[list[int]], suffixes: list[list[int]], *, use_cache: bool
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """One forward of the rows ``prefixes[i] + suffixes[i]``, in which rows with the same
        prefix share its computation: each distinct prefix runs once (left-padded) and its KV
        cache is copied to its rows, then the suffixes run on it (right-padded).

        Returns logits [B, 1 + S, V] — column 0 predicts suffix token 0 (from the prefix's last
        token), column j predicts suffix token j from token j − 1, S the longest suffix —, the
        attention mask [B, Lp + S] (0 on both kinds of padding) and the KV cache (or None).
        Every prefix must be non-empty.

        Sharing is exact where the model's attention allows its layout (``models/attention.py``):
        full attention always; a sliding window (masked by cache index) unless the cache is kept
        and the suffixes differ in length, since the padding after a short suffix would sit
        between its tokens and the ones decoded next; nothing else. Otherwise ``_forward_rows``.
        """
        layout = self._attention_layout
        if layout is AttentionLayout.PLAIN or (
            layout is AttentionLayout.CONTIGUOUS and use_cache and len({len(s) for s in suffixes}) > 1
        ):
            return self._forward_rows(prefixes, suffixes, use_cache=use_cache)
        logits, mask, cache, owner = self._forward_prefixes(prefixes)
        rows = torch.tensor(owner, dtype=torch.long, device=self.device)
        if max(owner) + 1 < len(prefixes):  # some rows share a prefix: each gets a copy of its cache
            cache.batch_select_indices(rows)
        logits, mask = logits[rows], mask[rows]
        if max(len(s) for s in suffixes):
            logits, mask, cache = self._forward_suffixes(logits, mask, cache, suffixes)
        return logits, mask, cache if use_cache else None

    def _forward_by_length(
        self, prefixes: list[list[int]], suffixes: list[list[int]]
    ) -> list[tuple[list[int], torch.Tensor]]:
        """``_forward_shared``'s logits without a cache, its suffixes run in one forward per
        width (``scoring_width`` of their length): [(rows, logits [len(rows), 1 + width, V])].

        The scoring pass's answers differ in length, and one forward padded to the longest runs
        every row that far (on arith1 4 suffix columns in 10 were padding) and moves a row's
        rounding with the other rows' lengths. Each distinct prefix still runs once; a row's
        suffix forward then holds the rows of its width only, padded to that width, so its
        scores do not depend on how long the other answers are (``sdp recompute`` re-scores them
        beside other answers). Where the model's attention allows no shared prompt
        (``_forward_shared``), every row's whole sequence in one forward.
        """
        if self._attention_layout is AttentionLayout.PLAIN:
            logits, _, _ = self._forward_rows(prefixes, suffixes, use_cache=False)
            return [(list(range(len(prefixes))), logits)]
        prefix_logits, prefix_mask, cache, owner = self._forward_prefixes(prefixes)
        by_width: dict[int, list[int]] = {}
        for r, suffix in enumerate(suffixes):
            by_width.setdefault(scoring_width(len(suffix)), []).append(r)
        parts = []
        for k, (width, rows) in enumerate(sorted(by_width.items())):
            select = torch.tensor([owner[r] for r in rows], dtype=torch.long, device=self.device)
            logits, mask = prefix_logits[select], prefix_mask[select]
            if width:
                # the last width takes the prefixes' cache itself, the others a copy
                rows_cache = cache if k == len(by_width) - 1 else copy.deepcopy(cache)
                rows_cache.batch_select_indices(select)
                logits, _, _ = self._forward_suffixes(
                    logits, mask, rows_cache, [suffixes[r] for r in rows], span=width
                )
            parts.append((rows, logits))
        return parts

    def _forward_prefixes(self, prefixes: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, Any, list[int]]:
        """One left-padded forward of the distinct ``prefixes``: the logits after each one's last
        token [U, 1, V], the attention mask [U, Lp], the KV cache of U rows and, for each of
        ``prefixes``, the index of its distinct prefix."""
        distinct: dict[tuple[int, ...], int] = {}
        owner = [distinct.setdefault(tuple(p), len(distinct)) for p in prefixes]
        unique = [list(p) for p in distinct]
        width = max(len(p) for p in unique)
        ids = torch.tensor(
            [[self.pad_token_id] * (width - len(p)) + p for p in unique],
            dtype=torch.long,
            device=self.device,
        )
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in unique],
            dtype=torch.long,
            device=self.device,
        )
        # positions count real tokens only, so padding does not shift a row
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits, mask, returned_cache(out), owner

    def _forward_suffixes(
        self,
        logits: torch.Tensor,
        mask: torch.Tensor,
        cache: Any,
        suffixes: list[list[int]],
        *,
        span: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Run ``suffixes`` (right-padded to ``span``, default the longest) on the prefixes'
        ``cache`` of the same rows, whose last logits and mask are ``logits`` [B, 1, V] and
        ``mask``; the logits of every column [B, 1 + S, V], the mask grown by the suffixes' and
        the grown cache."""
        span = max(len(s) for s in suffixes) if span is None else span
        lengths = torch.tensor([len(s) for s in suffixes], device=self.device)
        suffix_ids = torch.tensor(
            [s + [self.pad_token_id] * (span - len(s)) for s in suffixes],
            dtype=torch.long,
            device=self.device,
        )
        suffix_mask = (torch.arange(span, device=self.device) < lengths[:, None]).long()
        start = mask.sum(dim=1, keepdim=True)
        mask = torch.cat([mask, suffix_mask], dim=1)
        out = self.model(
            input_ids=suffix_ids,
            attention_mask=mask,
            position_ids=start + torch.arange(span, device=self.device),
            use_cache=True,
            **with_cache(cache),
        )
        return torch.cat([logits, out.logits], dim=1), mask, returned_cache(out)

    def _forward_rows(
        self, prefixes: list[list[int]], suffixes: list[list[int]], *, use_cache: bool
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """``_forward_shared``'s result from one forward of every row's whole sequence,
        left-padded (so a row's tokens sit at consecutive cache indices: exact for any model the
        engine's left-padded decoding is exact for); the mask is [B, L], L the longest row."""
        rows = [p + s for p, s in zip(prefixes, suffixes, strict=True)]
        width = max(len(r) for r in rows)
        span = max(len(s) for s in suffixes)
        ids = torch.tensor(
            [[self.pad_token_id] * (width - len(r)) + r for r in rows], dtype=torch.long, device=self.device
        )
        mask = torch.tensor(
            [[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=self.device
        )
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(dim=1) - 1).clamp(min=0),
            use_cache=use_cache,
            logits_to_keep=span + 1,
        )
        # of the last span + 1 columns, a row with a suffix of n tokens predicts its token j at
        # column span − n + j (its prefix's last token at span − n); beyond n: its last column
        lengths = torch.tensor([len(s) for s in suffixes], device=self.device)
        columns = (span - lengths[:, None] + torch.arange(span + 1, device=self.device)).clamp(max=span)
        logits = out.logits[torch.arange(len(rows), device=self.device)[:, None], columns]
        return logits, mask, returned_cache(out) if use_cache else None

    def _target_logprobs(self, logits: torch.Tensor, targets: list[list[int]]) -> list[list[float]]:
        """log p(targets[i][j]) from ``logits[i, j]`` at the engine's temperature, for each row's
        own number of targets (column j of ``_forward_shared`` predicts suffix token j)."""
        span = max((len(t) for t in targets), default=0)
        if span == 0:
            return [[] for _ in targets]
        padded = torch.tensor(
            [t + [self.pad_token_id] * (span - len(t)) for t in targets],
            dtype=torch.long,
            device=self.device,
        )
        # the formula the trainer uses (docs/design.md §4), chunked so big vocabularies fit in memory
        rows = logprobs_from_logits(logits[:, :span], padded, temperature=self.temperature).tolist()
        return [row[: len(t)] for row, t in zip(rows, targets, strict=True)]
