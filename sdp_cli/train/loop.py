"""The asynchronous RL loop: a rollout producer thread and the trainer, overlapping.

Producer thread (``_produce``): while the staleness manager grants capacity, sample prompts,
generate G responses per prompt on the engine (tokens tagged with the engine version) and pass
the finished groups to the reward pool (``sdp_cli/train/rewarding.py``) without waiting for
their scores; the pool hands each scored group to the queue (segment-wise: filtered before
enqueue). Until then a group stays in the producer's hands.

Trainer (``run``, the calling thread): take B groups (queue → cache → filter → batch), train one
step, then push the new weights following docs/design.md §2: pause (hooks) → recompute pass with the
old weights still loaded → load the new weights → purge stale queue items → resume (hooks).

Every group is in exactly one place at a time: in the producer's hands (submitted, possibly
partial), in the queue, in the cache, or consumed/dropped. The producer moves groups from its
hands to the queue under ``_handoff_lock``, which the weight push also holds, so the recompute
pass sees every sample the system holds exactly once.

Faults (docs/reliability.md): a generate call that raises ``EngineError`` rejects its groups
(their capacity returns) and the producer tries again; ``engine.max_consecutive_faults`` faults
in a row stop the run. Every terminal fate of a group (consumed, dropped, rejected, abandoned
at a resume) is written to the group ledger (``sdp_cli.train.ledger``) in the same critical
section that changes the state, so a checkpoint's snapshot and the ledger length it records
agree.
"""

from __future__ import annotations

import functools
import itertools
import logging
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from queue import Empty
from typing import Any, Callable, Protocol

import torch

from sdp_cli.config.schema import SdpConfig, tracks_proximal_t
from sdp_cli.engine.base import EngineError, InferenceEngine, SamplingParams, WeightUpdate
from sdp_cli.faults import fault_point
from sdp_cli.rollout.buffers import RolloutCache, RolloutQueue
from sdp_cli.rollout.hooks import PauseController
from sdp_cli.rollout.recompute import ProximalRecomputer, RecomputeStats
from sdp_cli.rollout.records import RolloutGroup, RolloutSample, samples_of
from sdp_cli.rollout.staleness import FilteredSamplesCapacityModifier, StalenessManager
from sdp_cli.rollout.strategies import StalenessControlStrategy, create_staleness_strategy
from sdp_cli.tasks.base import Task, TaskItem
from sdp_cli.train.batch import TrainBatch, assemble_batch
from sdp_cli.train.ledger import LedgerLog
from sdp_cli.train.rewarding import EXTRAS, RewardPool, extra_means
from sdp_cli.train.trainer import StepOutput, Trainer

logger = logging.getLogger(__name__)


class TextCodec(Protocol):
    """Prompt encoding / completion decoding (a tokenizer)."""

    def encode_prompt(self, text: str) -> list[int]: ...

    def decode_completion(self, token_ids: list[int]) -> str: ...


class LoopStopped(RuntimeError):
    """The loop was asked to stop (or its producer failed) while waiting for a batch."""


@dataclass
class StepRecord:
    """What the loop hands to its observer after each step."""

    step: int
    version: int
    metrics: dict[str, float]
    batch: TrainBatch
    output: StepOutput


@dataclass
class LoopCounters:
    """Monotone counters that describe the run; checkpointed with the loop."""

    groups_generated: int = 0
    groups_failed: int = 0
    samples_generated: int = 0
    tokens_generated: int = 0
    engine_faults: int = 0
    recompute_tokens: int = 0
    #: time the recompute pass took, wherever it ran (producer thread or weight push)
    recompute_seconds: float = 0.0
    #: the part of it the trainer waited for (the pass at the weight push)
    recompute_blocking_seconds: float = 0.0
    push_seconds: float = 0.0
    train_seconds: float = 0.0
    wait_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class LoopState:
    """Everything beyond the trainer needed to resume the loop exactly."""

    step: int = 0
    next_group_id: int = 0
    producer_rng: Any = None
    counters: LoopCounters = field(default_factory=LoopCounters)


@dataclass
class _PassTotals:
    """What recompute passes did, summed (the mean |Δ| kept as a token-weighted sum)."""

    tokens: int = 0
    samples: int = 0
    delta_sum: float = 0.0
    seconds: float = 0.0

    def add(self, stats: RecomputeStats, seconds: float) -> None:
        self.tokens += stats.tokens_recomputed
        self.samples += stats.samples_recomputed
        self.delta_sum += stats.mean_abs_delta * stats.tokens_recomputed
        self.seconds += seconds


@contextmanager
def intra_op_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op threads for the calling thread set to ``count`` inside the block."""
    before = torch.get_num_threads()
    if count is None or count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class AsyncLoop:
    """Runs rollout production and training concurrently until ``train.steps`` steps are done."""

    def __init__(
        self,
        cfg: SdpConfig,
        *,
        engine: InferenceEngine,
        trainer: Trainer,
        task: Task,
        codec: TextCodec,
        pad_token_id: int,
        stop_token_ids: tuple[int, ...],
        max_new_tokens: int,
        push_weights: Callable[[int], WeightUpdate],
        on_batch: Callable[[list[RolloutGroup]], None] | None = None,
        on_step: Callable[[StepRecord], None] | None = None,
        max_consecutive_engine_faults: int = 5,
        ledger: LedgerLog | None = None,
        recompute_threads: int | None = None,
    ):
        self.cfg = cfg
        self.engine = engine
        self.trainer = trainer
        self.task = task
        self.codec = codec
        self.pad_token_id = pad_token_id
        self.params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)
        self.push_weights = push_weights
        self.on_batch = on_batch
        self.on_step = on_step
        self.max_consecutive_engine_faults = max_consecutive_engine_faults
        self.ledger = ledger
        # The producer is paused during the recompute pass, so its core is free for scoring.
        self.recompute_threads = recompute_threads

        ro = cfg.rollout
        self.batch_groups = ro.batch_groups
        self._version = engine.get_version()
        self.manager = StalenessManager(
            max_concurrent_rollouts=ro.max_concurrent_rollouts or 2 * ro.batch_groups,
            consumer_batch_size=ro.batch_groups,
            max_head_offpolicyness=ro.max_head_offpolicyness,
            version_provider=lambda: self._version,
        )
        self.filtered_capacity = FilteredSamplesCapacityModifier()
        self.manager.register_capacity_modifier(self.filtered_capacity)
        self.strategy: StalenessControlStrategy = create_staleness_strategy(
            cfg.staleness.strategy,
            max_head_offpolicyness=ro.max_head_offpolicyness,
            on_filtered=self.manager.on_samples_filtered,
        )
        self.queue: RolloutQueue[RolloutGroup] = RolloutQueue()
        self.cache: RolloutCache[RolloutGroup] = RolloutCache()
        self.pause_controller = PauseController(engine)
        self.recomputer = ProximalRecomputer(engine)
        self.recompute_enabled = tracks_proximal_t(cfg)
        # π_prox_t of a token one version stale is scored by the engine when the trainer takes
        # its batch, unless the producer's pass already did: one source, whatever the timing.
        self.score_at_take = self.recompute_enabled and ro.proximal_t_source == "engine"

        self.state = LoopState(producer_rng=random.Random(cfg.seed + 1).getstate())
        self._in_hand: dict[int, RolloutGroup] = {}
        self._handoff_lock = threading.RLock()
        # A recompute pass scores under the loaded weights: a weight push waits for a running
        # one. Lock order: _pass_lock before _handoff_lock.
        self._pass_lock = threading.Lock()
        self._capacity_changed = threading.Condition()
        self._stop = threading.Event()
        self._producer_error: BaseException | None = None
        self._producer: threading.Thread | None = None
        self._group_ids = itertools.count(self.state.next_group_id)
        # Recompute ahead: the engine version whose pass the producer has run, and what it did
        # since the last push (reported with the push's own pass).
        self._recomputed_for: int | None = None
        self._ahead = _PassTotals()
        self._at_take = _PassTotals()
        self._prefill_tokens_seen = 0
        self.rewards = RewardPool(
            workers=cfg.task.reward_workers, kind=cfg.task.reward_pool, name=f"of task {task.name}"
        )

    # ============================================================ producer side
    def _produce(self) -> None:
        rng = random.Random()
        rng.setstate(self.state.producer_rng)
        consecutive_faults = 0
        try:
            while not self._stop.is_set():
                self._recompute_ahead()
                n_groups = self._wait_for_capacity()
                if n_groups == 0:
                    continue
                groups = self._new_groups(rng, n_groups)
                try:
                    self.engine.generate([s for g in groups for s in g.samples], self.params)
                except EngineError as exc:
                    consecutive_faults += 1
                    self._give_back(groups, str(exc))
                    self.state.counters.engine_faults += 1
                    logger.warning(
                        "engine fault %d in a row (%d groups rejected, their capacity returned): %s",
                        consecutive_faults,
                        len(groups),
                        exc,
                    )
                    if consecutive_faults >= self.max_consecutive_engine_faults:
                        raise
                    time.sleep(min(2.0**consecutive_faults * 0.1, 5.0))
                    continue
                consecutive_faults = 0
                fault_point("producer.generated")
                self._score(groups)
        except BaseException as exc:  # surfaced to the trainer thread, which stops the run
            self._fail(exc)
        finally:
            with self._capacity_changed:
                self._capacity_changed.notify_all()

    def _fail(self, exc: BaseException) -> None:
        """Stop the run with ``exc`` (the first failure of the producer or the reward pool)."""
        if self._producer_error is None:
            self._producer_error = exc
        self._stop.set()
        with self._capacity_changed:
            self._capacity_changed.notify_all()

    def _wait_for_capacity(self) -> int:
        with self._capacity_changed:
            while not self._stop.is_set():
                capacity = self.manager.get_capacity()
                if capacity > 0:
                    return min(capacity, self.cfg.rollout.groups_per_request)
                if self._recompute_due():
                    return 0  # the producer would only wait: it scores first
                self._capacity_changed.wait(timeout=0.5)
        return 0

    def _recompute_due(self) -> bool:
        return self.recompute_enabled and self._recomputed_for != self._version

    def _recompute_ahead(self) -> None:
        """Run the recompute pass of the loaded version now, in the producer thread.

        Once weights c are loaded, every token of version c − 1 already exists, so π_c can score
        them at any time before weights c are replaced. Doing it here overlaps the pass with
        training instead of blocking the weight push; the push then only scores what is left
        (``_push``; a pass skips tokens already scored under c). Between two generate calls the
        producer holds no partial sample (groups still being scored are left to the push's pass).
        ``_pass_lock`` keeps the weights loaded for the whole pass; ``_handoff_lock`` is held only
        to plan and to write, so the trainer takes batches while the engine scores, and the
        results of samples it took meanwhile are dropped (the take-time pass scores those).
        """
        if not self._recompute_due():
            return
        with self._pass_lock:
            t0 = time.perf_counter()
            with self._handoff_lock:
                version = self._version
                if self._recomputed_for == version:
                    return
                plan = self.recomputer.plan(queue=self.queue, cache=self.cache, inflight=[])
            try:
                scores = self.recomputer.score(plan)
            except EngineError as exc:  # the push's pass retries what is left, and fails loudly
                logger.warning("recompute ahead of the weight push failed, the push will redo it: %s", exc)
                scores = None
            if scores is not None:
                with self._handoff_lock:
                    held = {id(s) for item in (*self.queue.snapshot(), *self.cache.get_all()) for s in samples_of(item)}
                    stats = self.recomputer.write(plan, scores, keep=lambda sample: id(sample) in held)
                self._ahead.add(*self._counted(stats, time.perf_counter() - t0))
            self._recomputed_for = version

    def _recompute_pass(
        self, inflight: list[RolloutSample], *, held: bool = True
    ) -> tuple[RecomputeStats, float]:
        """One recompute pass over ``inflight`` (and, if ``held``, the queue and the cache) in
        one go, counted; (stats, seconds). The caller keeps everyone else out of the samples."""
        t0 = time.perf_counter()
        stats = self.recomputer.recompute_all(
            queue=self.queue if held else None, cache=self.cache if held else None, inflight=inflight
        )
        return self._counted(stats, time.perf_counter() - t0)

    def _counted(self, stats: RecomputeStats, seconds: float) -> tuple[RecomputeStats, float]:
        self.state.counters.recompute_tokens += stats.tokens_recomputed
        self.state.counters.recompute_seconds += seconds
        return stats, seconds

    def _new_groups(self, rng: random.Random, n_groups: int) -> list[RolloutGroup]:
        items = self.task.stream(rng, self.state.next_group_id, n_groups)
        self.state.producer_rng = rng.getstate()
        groups = []
        with self._handoff_lock:
            for item in items:
                group_id = next(self._group_ids)
                self.state.next_group_id = group_id + 1
                prompt_ids = self.codec.encode_prompt(item.prompt)
                # the task item is stored as plain data so that queued samples can be checkpointed
                meta = {"prompt": item.prompt, "answer": item.answer, "task_meta": dict(item.meta)}
                samples = [
                    RolloutSample(prompt_ids=list(prompt_ids), group_id=group_id, meta=dict(meta))
                    for _ in range(self.cfg.rollout.group_size)
                ]
                group = RolloutGroup(group_id=group_id, samples=samples)
                self.manager.on_rollout_enqueued()
                self.manager.on_rollout_submitted()
                self._in_hand[group_id] = group
                groups.append(group)
        return groups

    def _give_back(self, groups: list[RolloutGroup], reason: str) -> None:
        """Generation failed: the groups are rejected and their capacity returns."""
        with self._handoff_lock:
            for group in groups:
                self._in_hand.pop(group.group_id, None)
                self.manager.on_rollout_rejected()
                self.state.counters.groups_failed += 1
            self._record("rejected", [g.group_id for g in groups], reason=reason)
        with self._capacity_changed:
            self._capacity_changed.notify_all()

    def _score(self, groups: list[RolloutGroup]) -> None:
        """Send each finished group's reward calls to the pool; ``_scored`` hands it over."""
        for group in groups:
            calls, wheres = [], []
            for sample in group.samples:
                completion = self.codec.decode_completion(sample.output_ids)
                item = TaskItem(sample.meta["prompt"], sample.meta["answer"], sample.meta["task_meta"])
                calls.append(self.task.reward_call(completion, item, stopped=sample.finish_reason == "stop"))
                wheres.append(f"a completion of {item.prompt[:60]!r}")
            self.rewards.submit(calls, wheres, functools.partial(self._scored, group))

    def _scored(
        self, group: RolloutGroup, results: list[tuple[float, dict[str, float]]] | None, error: BaseException | None
    ) -> None:
        """Reward pool callback: store the rewards and hand the group over, or stop the run."""
        if error is None:
            assert results is not None and len(results) == len(group.samples), "one reward per sample"
            try:
                for sample, (score, extras) in zip(group.samples, results):
                    sample.reward = score
                    if extras:
                        sample.meta[EXTRAS] = extras
                self._hand_over([group])
                return
            except BaseException as exc:
                error = exc
        self._fail(error)

    def _hand_over(self, groups: list[RolloutGroup]) -> None:
        """Move scored groups from the producer's hands into the queue."""
        with self._handoff_lock:
            version = self._version
            for group in groups:
                for sample in group.samples:
                    self.state.counters.samples_generated += 1
                    self.state.counters.tokens_generated += sample.output_len
                self._in_hand.pop(group.group_id, None)
                self.manager.on_rollout_accepted()
                self.state.counters.groups_generated += 1
                if self.strategy.should_filter_before_enqueue() and not self.strategy.filter_before_enqueue(
                    group, version
                ):
                    self._record("dropped", [group.group_id], version=version, where="enqueue")
                    continue
                self.queue.put(group)
                fault_point("producer.handover")

    def _record(self, event: str, group_ids: list[int], **fields: Any) -> None:
        """Write a fate to the ledger. Callers hold ``_handoff_lock`` or are the trainer thread,
        which also takes the snapshots, so every fate falls on one side of a snapshot."""
        if self.ledger is not None and group_ids:
            self.ledger.write(event, group_ids, **fields)

    # ============================================================= trainer side
    def start(self) -> None:
        """Start the producer thread."""
        assert self._producer is None, "AsyncLoop.start() called twice"
        self._producer = threading.Thread(target=self._produce, name="sdp-rollout-producer", daemon=True)
        self._producer.start()

    def stop(self) -> None:
        """Stop the producer and wait for it (it finishes the generate call it is in); groups
        still being scored stay in the producer's hands."""
        self._stop.set()
        self.rewards.close()
        if self.engine.is_paused():
            self.engine.resume()
        with self._capacity_changed:
            self._capacity_changed.notify_all()
        if self._producer is not None:
            self._producer.join(timeout=60)

    def run(self) -> None:
        """Train until ``train.steps`` steps are done (continuing from ``state.step``)."""
        if self._producer is None:
            self.start()
        try:
            while self.state.step < self.cfg.train.steps:
                self.run_step()
        finally:
            self.stop()
        if self._producer_error is not None:
            raise self._producer_error

    def run_step(self) -> StepRecord:
        """Take one batch, train on it and push the new weights."""
        t0 = time.perf_counter()
        groups = self._next_batch()
        if self.on_batch is not None:
            self.on_batch(groups)  # other training processes train on the same batch
        t1 = time.perf_counter()
        batch = assemble_batch(
            groups,
            pad_token_id=self.pad_token_id,
            trainer_version=self.trainer.version,
            scale_adv_by_std=self.cfg.loss.scale_adv_by_std,
        )
        output = self.trainer.step(batch)
        t2 = time.perf_counter()
        push_error: EngineError | None = None
        try:
            push_metrics = self._push()
        except EngineError as exc:
            # The step is trained, so it is counted: its metrics and checkpoint stay consistent
            # (trainer version = step), and a resume hands these weights to the engine.
            push_error = exc
            push_metrics = {"engine/push_failed": 1.0}
        t3 = time.perf_counter()

        counters = self.state.counters
        counters.wait_seconds += t1 - t0
        counters.train_seconds += t2 - t1
        counters.push_seconds += t3 - t2
        self.state.step += 1
        metrics = dict(output.metrics)
        metrics.update(extra_means([s.meta.get(EXTRAS) for g in groups for s in g.samples]))
        metrics.update(push_metrics)
        metrics.update(self._loop_metrics())
        metrics.update(self._proximal_t_paths())
        metrics["time/wait_s"] = t1 - t0
        metrics["time/train_s"] = t2 - t1
        metrics["time/push_s"] = t3 - t2
        record = StepRecord(step=self.state.step, version=self._version, metrics=metrics, batch=batch, output=output)
        if self.on_step is not None:
            self.on_step(record)
        if push_error is not None:
            raise push_error
        return record

    def _next_batch(self) -> list[RolloutGroup]:
        deadline = time.monotonic() + self.cfg.train.batch_timeout_s
        while True:
            self._raise_if_stopped()
            version = self.trainer.version
            while True:
                try:
                    self.cache.add(self.queue.get_nowait())
                except Empty:
                    break
            before = [g.group_id for g in self.cache.get_all()]
            if self.strategy.filter_stale_from_cache(self.cache, version):
                kept = {g.group_id for g in self.cache.get_all()}
                self._record("dropped", [g for g in before if g not in kept], version=version, where="cache")
            if self.cache.size() >= self.batch_groups:
                # Under the hand-off lock: the producer's recompute pass never writes into a
                # batch being taken, and never scores what the take-time pass scores.
                with self._handoff_lock:
                    if self.score_at_take:
                        self._score_at_take(self.cache.get_all()[: self.batch_groups])
                    groups = self.cache.take_first_n(self.batch_groups)
                    self._record(
                        "consumed",
                        [g.group_id for g in groups],
                        step=self.state.step + 1,
                        samples=[len(g.samples) for g in groups],
                    )
                fault_point("loop.batch_taken")
                return groups
            try:
                self.cache.add(self.queue.get(timeout=0.2))
            except Empty:
                if time.monotonic() > deadline:
                    raise LoopStopped(
                        f"no batch arrived within train.batch_timeout_s={self.cfg.train.batch_timeout_s:g}s "
                        f"(cache holds {self.cache.size()} of {self.batch_groups} groups)"
                    ) from None

    def _score_at_take(self, groups: list[RolloutGroup]) -> None:
        """Engine scores for the tokens of the batch that are one version stale and still lack
        π_prox_t (the producer's pass has not reached them yet). The engine runs the trainer's
        weights c, so this is π_{v+1} for tokens of version c − 1; tokens of older versions had
        their window at earlier updates. A failure leaves the groups in the cache."""
        samples = [s for g in groups for s in g.samples]
        self._at_take.add(*self._recompute_pass(inflight=samples, held=False))

    def _raise_if_stopped(self) -> None:
        if self._producer_error is not None:
            raise LoopStopped(f"rollout producer failed: {self._producer_error}") from self._producer_error
        if self._stop.is_set():
            raise LoopStopped("stopped")

    def _push(self) -> dict[str, float]:
        """docs/design.md §2: pause → recompute (old weights) → load new weights → purge → resume.

        The producer usually ran the recompute pass already (``_recompute_ahead``); this one
        scores whatever is left, including the producer's partial samples.
        """
        new_version = self.trainer.version
        update = self.push_weights(new_version)
        metrics: dict[str, float] = {}
        with self._pass_lock, self.pause_controller.paused():
            with self._handoff_lock:
                if self.recompute_enabled:
                    in_hand = [s for g in self._in_hand.values() for s in g.samples]
                    with intra_op_threads(self.recompute_threads):
                        stats, elapsed = self._recompute_pass(inflight=in_hand)
                    self.state.counters.recompute_blocking_seconds += elapsed
                    # this version's passes: the producer's since the last push, and this one
                    passes, self._ahead = self._ahead, _PassTotals()
                    metrics["time/recompute_ahead_s"] = passes.seconds
                    passes.add(stats, elapsed)
                    metrics["recompute/tokens"] = float(passes.tokens)
                    metrics["recompute/tokens_ahead"] = float(passes.tokens - stats.tokens_recomputed)
                    metrics["recompute/tokens_at_push"] = float(stats.tokens_recomputed)
                    metrics["recompute/samples"] = float(passes.samples)
                    metrics["recompute/mean_abs_delta"] = passes.delta_sum / passes.tokens if passes.tokens else 0.0
                    metrics["time/recompute_s"] = elapsed
                fault_point("loop.recomputed")
                self.engine.update_weights(update)
                self._version = new_version
                fault_point("loop.weights_loaded")
                before = [g.group_id for g in self.queue.snapshot()]
                purged = self.strategy.purge_stale_samples_from_queue(self.queue, new_version)
                if purged:
                    kept = {g.group_id for g in self.queue.snapshot()}
                    self._record("dropped", [g for g in before if g not in kept], version=new_version, where="queue")
                metrics["staleness/purged_groups"] = float(purged)
        with self._capacity_changed:
            self._capacity_changed.notify_all()
        return metrics

    def _proximal_t_paths(self) -> dict[str, float]:
        """Tokens given π_prox_t this step by the paths that are not the update's passes: the
        take-time pass and the engine's re-prefill of resumed samples (docs/training.md)."""
        if not self.recompute_enabled:
            return {}
        taken, self._at_take = self._at_take, _PassTotals()
        prefilled = int(self.engine.stats().get("prefill_proximal_tokens", 0))
        new_prefilled, self._prefill_tokens_seen = prefilled - self._prefill_tokens_seen, prefilled
        return {
            "recompute/tokens_at_take": float(taken.tokens),
            "recompute/tokens_prefill": float(new_prefilled),
            "time/recompute_take_s": taken.seconds,
        }

    def _loop_metrics(self) -> dict[str, float]:
        stats = self.manager.get_stats()
        size = self.task.num_problems
        # a data set: epochs of prompts drawn for generation (sdp_cli/tasks/dataset.py)
        epoch = {"data/epoch": self.state.next_group_id / size} if size else {}
        return {
            **epoch,
            "staleness/capacity": float(self.manager.get_capacity()),
            "staleness/accepted": float(stats.accepted),
            "staleness/running": float(stats.running),
            "staleness/rejected": float(stats.rejected),
            "staleness/filtered_groups_total": float(sum(self.strategy.filtered_by_version.values())),
            "buffer/queue": float(self.queue.qsize()),
            "buffer/cache": float(self.cache.size()),
            "throughput/tokens_generated_total": float(self.state.counters.tokens_generated),
            "engine/faults_total": float(self.state.counters.engine_faults),
            "engine/groups_rejected_total": float(self.state.counters.groups_failed),
            # remote engines: segments, resubmissions, aborted segments, restores, ... (this session)
            **{f"engine/{k}": float(v) for k, v in self.engine.stats().items()},
        }

    # ============================================================== checkpoint
    def snapshot(self) -> dict[str, Any]:
        """A JSON-safe picture of the loop (buffer contents, counters, RNG) taken atomically."""
        with self._handoff_lock:
            return {
                "step": self.state.step,
                "version": self._version,
                "next_group_id": self.state.next_group_id,
                "producer_rng": _rng_state_to_json(self.state.producer_rng),
                "counters": self.state.counters.to_dict(),
                "manager": self.manager.state_dict(),
                "strategy": self.strategy.state_dict(),
                "queue": [g.to_dict() for g in self.queue.snapshot()],
                "cache": [g.to_dict() for g in self.cache.get_all()],
                "in_flight_groups": len(self._in_hand),
                "in_flight_group_ids": sorted(self._in_hand),
                "ledger_offset": None if self.ledger is None else self.ledger.offset(),
            }

    def restore(self, snap: dict[str, Any]) -> None:
        """Restore a snapshot before ``start()``. Groups that were in flight when it was taken are
        gone: their capacity returns (running → 0) and the ledger says they were abandoned;
        queued and cached groups come back. The engine must already run the checkpoint's
        weights: its version becomes the loop's."""
        assert self._producer is None, "restore() must be called before start()"
        self.state.step = int(snap["step"])
        self._version = self.engine.get_version()
        self.state.next_group_id = int(snap["next_group_id"])
        self._group_ids = itertools.count(self.state.next_group_id)
        self.state.producer_rng = _rng_state_from_json(snap["producer_rng"])
        self.state.counters = LoopCounters(**snap["counters"])
        self.manager.load_state_dict(snap["manager"], drop_inflight=True)
        self.strategy.load_state_dict(snap["strategy"])
        for data in snap["queue"]:
            self.queue.put(RolloutGroup.from_dict(data))
        for data in snap["cache"]:
            self.cache.add(RolloutGroup.from_dict(data))
        self._record("abandoned", list(snap.get("in_flight_group_ids", [])), checkpoint_step=self.state.step)


def _rng_state_to_json(state: Any) -> list[Any]:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _rng_state_from_json(data: list[Any]) -> Any:
    version, internal, gauss = data
    return (version, tuple(internal), gauss)
