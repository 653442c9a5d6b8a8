"""The asynchronous RL loop: a rollout producer thread and the trainer, overlapping.

Producer thread (``RolloutProducer``, ``sdp_cli/train/asyncloop/producer.py``, held as ``self.producer``):
while the staleness manager grants capacity, generate groups on the engine, reward them off the
generation path and hand them to the queue.

Trainer (``run``, the calling thread): take B groups (queue → cache → filter → batch), train one
step, then push the new weights following docs/design.md §2: pause (``PauseController``, whose
post-pause hook ``_recompute_at_push`` is the recompute pass with the old weights still loaded) →
load the new weights → purge stale queue items → resume. With η > 0 (``train.async_push``, an
engine that stages weights) that push runs on a thread of its own while the next step trains:
the trainer waits for it only before it takes a batch holding tokens whose π_prox_t the push
still owes, before the next push, and before a checkpoint or a stop (``_join_push``).

Every group is in exactly one place at a time: in the producer's hands (submitted, possibly
partial), in the queue, in the cache, or consumed/dropped. The producer moves groups from its
hands to the queue under ``_handoff_lock``, which the weight push also holds, so the recompute
pass sees every sample the system holds exactly once.

Faults (docs/reliability.md): a generate call that raises ``EngineError`` rejects its groups
(their capacity returns) and the producer tries again; ``engine.max_consecutive_faults`` faults
in a row stop the run. Every terminal fate of a group (consumed, dropped, rejected, abandoned
at a resume) is written to the group ledger (``sdp_cli.train.asyncloop.ledger``) in the same critical
section that changes the state, so a checkpoint's snapshot and the ledger length it records
agree.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from queue import Empty
from typing import Any, Callable

from sdp_cli.config.schema import SdpConfig, groups_per_request, tracks_proximal_t
from sdp_cli.engine.base import EngineError, InferenceEngine, SamplingParams, WeightUpdate
from sdp_cli.faults import fault_point
from sdp_cli.rollout.buffers import RolloutCache, RolloutQueue
from sdp_cli.rollout.hooks import PauseController, PauseHooks
from sdp_cli.rollout.recompute import ProximalRecomputer, RecomputeStats, pass_targets
from sdp_cli.rollout.records import RolloutGroup, RolloutSample
from sdp_cli.rollout.staleness import FilteredSamplesCapacityModifier, StalenessManager
from sdp_cli.rollout.strategies import StalenessControlStrategy, create_staleness_strategy
from sdp_cli.tasks.base import Task
from sdp_cli.train.step.batch import assemble_batch
from sdp_cli.train.asyncloop.ledger import LedgerLog, record_fate
from sdp_cli.train.asyncloop.loop_state import (
    LoopCounters,
    LoopInterrupted,
    LoopState,
    LoopStopped,
    PassTotals,
    StepRecord,
    TextCodec,
    intra_op_threads,
    rng_state_from_json,
    rng_state_to_json,
)
from sdp_cli.train.asyncloop.producer import RolloutProducer, failure_text
from sdp_cli.train.asyncloop.rewarding import EXTRAS, RewardPool, RewardRules, extra_means
from sdp_cli.train.step.trainer import Trainer

__all__ = ["AsyncLoop", "LoopInterrupted", "LoopStopped", "StepRecord", "TextCodec"]

logger = logging.getLogger(__name__)


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
        rollout_threads: int | None = None,
        should_stop: Callable[[], bool] | None = None,
    ):
        self.cfg = cfg
        self.engine = engine
        self.trainer = trainer
        self.task = task
        self.pad_token_id = pad_token_id
        self.push_weights = push_weights
        self.on_batch = on_batch
        self.on_step = on_step
        self.ledger = ledger
        # polled before every batch is taken: a step either completes or never starts
        self.should_stop = should_stop
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
        self.pause_hooks = PauseHooks()
        self.pause_controller = PauseController(engine, self.pause_hooks)
        self.recomputer = ProximalRecomputer(engine)
        self.recompute_enabled = tracks_proximal_t(cfg)
        if self.recompute_enabled:
            # docs/design.md §2 step 2: the push's recompute pass runs once the engine is paused,
            # with the old weights still loaded. Its errors (EngineError …) reach the push as is.
            self.pause_hooks.register_post_pause_hook(self._recompute_at_push, wrap_errors=False)
        #: the metrics of the push's recompute pass, left by ``_recompute_at_push`` for ``_push``
        self._push_pass_metrics: dict[str, float] = {}
        # π_prox_t of a token one version stale is scored by the engine when the trainer takes
        # its batch, unless the producer's pass already did: one source, whatever the timing.
        self.score_at_take = self.recompute_enabled and ro.proximal_t_source == "engine"

        self.state = LoopState(producer_rng=random.Random(cfg.seed + 1).getstate())
        self._handoff_lock = threading.RLock()
        # A recompute pass scores under the loaded weights: a weight push waits for a running
        # one. Lock order: _pass_lock before _handoff_lock.
        self._pass_lock = threading.Lock()
        self._at_take = PassTotals()
        self._prefill_tokens_seen = 0
        # docs/training.md "The weight push": with η > 0 a step's weights load while the next step
        # trains; one push at a time, its metrics reported with the step that waits for it.
        self.async_push = cfg.train.async_push and ro.max_head_offpolicyness > 0
        self._push_in_flight: _PushInFlight | None = None
        self._joined_push_metrics: dict[str, float] = {}
        self.producer = RolloutProducer(
            engine=engine,
            task=task,
            codec=codec,
            params=SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids),
            group_size=ro.group_size,
            groups_per_request=groups_per_request(cfg),
            rewards=RewardPool(
                workers=cfg.task.reward_workers,
                kind=cfg.task.reward_pool,
                name=f"of task {task.name}",
                rules=RewardRules.of(cfg.task),
            ),
            manager=self.manager,
            strategy=self.strategy,
            queue=self.queue,
            cache=self.cache,
            recomputer=self.recomputer,
            recompute_ahead=self.recompute_enabled,
            state=self.state,
            ledger=ledger,
            version=lambda: self._version,
            handoff_lock=self._handoff_lock,
            pass_lock=self._pass_lock,
            max_consecutive_engine_faults=max_consecutive_engine_faults,
            rollout_threads=rollout_threads,
        )

    # ============================================================= trainer side
    def start(self) -> None:
        """Start the producer thread."""
        self.producer.start()

    def stop(self, *, wait: bool = True) -> None:
        """Stop the producer and wait for it (it finishes the generate call it is in); groups
        still being scored stay in the producer's hands. ``wait=False``: do not wait (an abort;
        the process is about to end)."""
        self.producer.stop(wait=wait)

    def run(self) -> None:
        """Train until ``train.steps`` steps are done (continuing from ``state.step``)."""
        if not self.producer.started:
            self.start()
        aborted = False
        try:
            while self.state.step < self.cfg.train.steps:
                self.run_step()
            self._join_push()
        except KeyboardInterrupt:
            aborted = True
            raise
        finally:
            if not aborted:
                self._settle_push()
            self.stop(wait=not aborted)
        if self.producer.error is not None:
            raise self.producer.error

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
        # the engine's version after a synchronous or failed push; the one loading otherwise
        version = self.trainer.version if self._push_in_flight is not None else self._version

        counters = self.state.counters
        counters.wait_seconds += t1 - t0
        counters.train_seconds += t2 - t1
        counters.push_seconds += t3 - t2
        self.state.step += 1
        metrics = dict(output.metrics)
        metrics.update(extra_means([s.meta.get(EXTRAS) for g in groups for s in g.samples]))
        metrics.update(self._joined_push_metrics)  # an asynchronous push, waited for in this step
        self._joined_push_metrics = {}
        metrics.update(push_metrics)
        metrics.update(self._loop_metrics())
        metrics.update(self._proximal_t_paths())
        metrics["time/wait_s"] = t1 - t0
        metrics["time/train_s"] = t2 - t1
        metrics["time/push_s"] = t3 - t2
        record = StepRecord(step=self.state.step, version=version, metrics=metrics, batch=batch, output=output)
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
            if self._push_in_flight is not None and self._pass_owed(self.cache.get_all()):
                # the push's pass still owes them π_{c−1}: the filter would drop them as past
                # their window, a take would train on them without it
                self._join_push()  # outside the hand-off lock, which the push's pass takes
            before = [g.group_id for g in self.cache.get_all()]
            if self.strategy.filter_stale_from_cache(self.cache, version):
                kept = {g.group_id for g in self.cache.get_all()}
                dropped = [g for g in before if g not in kept]
                record_fate(self.ledger, "dropped", dropped, version=version, where="cache")
            if self.cache.size() >= self.batch_groups:
                if self._push_in_flight is not None and self._needs_new_weights(self.cache.get_all()[: self.batch_groups]):
                    self._join_push()
                # Under the hand-off lock: the producer's recompute pass never writes into a
                # batch being taken, and never scores what the take-time pass scores.
                with self._handoff_lock:
                    if self.score_at_take and self._push_in_flight is None:
                        self._score_at_take(self.cache.get_all()[: self.batch_groups])
                    groups = self.cache.take_first_n(self.batch_groups)
                    record_fate(
                        self.ledger,
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

    def _recompute_pass(self, inflight: list[RolloutSample], *, held: bool = True) -> tuple[RecomputeStats, float]:
        """One recompute pass over ``inflight`` (and, if ``held``, the queue and the cache) in
        one go, counted; (stats, seconds). The caller keeps everyone else out of the samples."""
        t0 = time.perf_counter()
        stats = self.recomputer.recompute_all(
            queue=self.queue if held else None, cache=self.cache if held else None, inflight=inflight
        )
        seconds = time.perf_counter() - t0
        self.state.counters.count_recompute(stats, seconds)
        return stats, seconds

    def _raise_if_stopped(self) -> None:
        if self.producer.error is not None:
            raise LoopStopped(f"rollout producer failed: {failure_text(self.producer.error)}") from self.producer.error
        if self.should_stop is not None and self.should_stop():
            raise LoopInterrupted("a stop was requested")
        if self.producer.stopping:
            raise LoopStopped("stopped")

    def _push(self) -> dict[str, float]:
        """Push the trainer's new weights: in this thread (the push's metrics are returned) or,
        with ``async_push`` where the engine stages them, on the push thread ({} is returned; the
        metrics join the record of the step that waits for it). The last step pushes in this
        thread, so the run ends with the engine at the trainer's version."""
        self._join_push()  # one push at a time, in order
        new_version = self.trainer.version
        update = self.push_weights(new_version)
        if self.async_push and self.state.step + 1 < self.cfg.train.steps:
            staged = self.engine.stage_weights(update)  # the next step may change the tensors now
            if staged is not None:
                self._push_in_flight = _PushInFlight(lambda: self._load_weights(staged, new_version))
                return {}
        return self._load_weights(update, new_version)

    def _load_weights(self, update: WeightUpdate, new_version: int) -> dict[str, float]:
        """docs/design.md §2: pause → recompute (old weights) → load new weights → purge → resume.

        The producer usually ran the recompute pass already (``RolloutProducer._recompute_ahead``); this one
        scores whatever is left, including the producer's partial samples.
        """
        # The pause runs the post-pause hooks: the recompute pass (``_recompute_at_push``, under the
        # hand-off lock). The engine stays paused, so no token is made between the pass and the
        # load, and ``_pass_lock`` keeps the producer's pass out: the load itself needs no hand-off
        # lock, and a take goes on meanwhile.
        with self._pass_lock, self.pause_controller.paused():
            metrics, self._push_pass_metrics = self._push_pass_metrics, {}
            fault_point("loop.recomputed")
            self.engine.update_weights(update)
            with self._handoff_lock:
                self._version = new_version
                fault_point("loop.weights_loaded")
                before = [g.group_id for g in self.queue.snapshot()]
                purged = self.strategy.purge_stale_samples_from_queue(self.queue, new_version)
                if purged:
                    kept = {g.group_id for g in self.queue.snapshot()}
                    dropped = [g for g in before if g not in kept]
                    record_fate(self.ledger, "dropped", dropped, version=new_version, where="queue")
                metrics["staleness/purged_groups"] = float(purged)
        self.producer.wake()
        return metrics

    def _pass_owed(self, groups: list[RolloutGroup]) -> bool:
        """Whether ``groups`` hold a token of version c − 2 without π_{c−1} (c the trainer's
        version, which the push in flight loads): the push's pass scores it under the weights it
        replaces (the producer's pass after the previous push usually did already)."""
        loaded = self.trainer.version - 1  # until the push in flight replaces them
        return self.recompute_enabled and any(
            pass_targets(s.versions, s.proximal_t_versions, loaded) for g in groups for s in g.samples
        )

    def _needs_new_weights(self, groups: list[RolloutGroup]) -> bool:
        """Whether ``groups`` hold a token of version c − 1: the take-time pass scores it under
        weights c, which the push in flight loads. With η > 1 a batch's tokens are usually
        older, and the push goes on while the step trains."""
        c = self.trainer.version
        return self.recompute_enabled and any(max(s.versions, default=-1) >= c - 1 for g in groups for s in g.samples)

    def _join_push(self) -> None:
        """Wait for the push in flight, if any: its metrics go to the current step's record, its
        error (``EngineError`` …) is raised here."""
        push, self._push_in_flight = self._push_in_flight, None
        if push is not None:
            self._joined_push_metrics.update(push.result())

    def _settle_push(self) -> None:
        """A stop: wait for the push in flight; its error is logged (the stop's own reason goes
        on, and a resume gives the engine the checkpoint's weights)."""
        try:
            self._join_push()
        except Exception as exc:  # noqa: BLE001 - reported, the stop continues
            logger.warning("the weight push in flight at the stop failed: %s", failure_text(exc))

    def _recompute_at_push(self) -> None:
        """Post-pause hook of the weight push (docs/design.md §2 step 2): the recompute pass over
        every sample the system holds, under ``_handoff_lock`` (``_push`` holds ``_pass_lock``
        and the engine is paused, so the old weights stay loaded and no token is added)."""
        with self._handoff_lock:
            in_hand = [s for g in self.producer.in_hand.values() for s in g.samples]
            with intra_op_threads(self.recompute_threads):
                stats, elapsed = self._recompute_pass(inflight=in_hand)
            self.state.counters.recompute_blocking_seconds += elapsed
            # this version's passes: the producer's since the last push, and this one
            passes = self.producer.take_ahead()
            metrics = {"time/recompute_ahead_s": passes.seconds}
            passes.add(stats, elapsed)
            metrics["recompute/tokens"] = float(passes.tokens)
            metrics["recompute/tokens_ahead"] = float(passes.tokens - stats.tokens_recomputed)
            metrics["recompute/tokens_at_push"] = float(stats.tokens_recomputed)
            metrics["recompute/samples"] = float(passes.samples)
            metrics["recompute/mean_abs_delta"] = passes.delta_sum / passes.tokens if passes.tokens else 0.0
            metrics["time/recompute_s"] = elapsed
            self._push_pass_metrics = metrics

    def _proximal_t_paths(self) -> dict[str, float]:
        """Tokens given π_prox_t this step by the paths that are not the update's passes: the
        take-time pass and the engine's re-prefill of resumed samples (docs/training.md)."""
        if not self.recompute_enabled:
            return {}
        taken, self._at_take = self._at_take, PassTotals()
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
        """A JSON-safe picture of the loop (buffer contents, counters, RNG) taken atomically, with
        no weight push in flight (its pass and purge change what it holds)."""
        self._join_push()
        with self._handoff_lock:
            return {
                "step": self.state.step,
                "version": self._version,
                "next_group_id": self.state.next_group_id,
                "producer_rng": rng_state_to_json(self.state.producer_rng),
                "counters": self.state.counters.to_dict(),
                "manager": self.manager.state_dict(),
                "strategy": self.strategy.state_dict(),
                "queue": [g.to_dict() for g in self.queue.snapshot()],
                "cache": [g.to_dict() for g in self.cache.get_all()],
                "in_flight_groups": len(self.producer.in_hand),
                "in_flight_group_ids": sorted(self.producer.in_hand),
                **({"ledger_offset": None} if self.ledger is None else self.ledger.mark()),
            }

    def restore(self, snap: dict[str, Any]) -> None:
        """Restore a snapshot before ``start()``. Groups that were in flight when it was taken are
        gone: their capacity returns (running → 0) and the ledger says they were abandoned;
        queued and cached groups come back. The engine must already run the checkpoint's
        weights: its version becomes the loop's."""
        assert not self.producer.started, "restore() must be called before start()"
        self.state.step = int(snap["step"])
        self._version = self.engine.get_version()
        self.state.next_group_id = int(snap["next_group_id"])
        self.state.producer_rng = rng_state_from_json(snap["producer_rng"])
        self.state.counters = LoopCounters(**snap["counters"])
        self.manager.load_state_dict(snap["manager"], drop_inflight=True)
        self.strategy.load_state_dict(snap["strategy"])
        for data in snap["queue"]:
            self.queue.put(RolloutGroup.from_dict(data))
        for data in snap["cache"]:
            self.cache.add(RolloutGroup.from_dict(data))
        abandoned = list(snap.get("in_flight_group_ids", []))
        record_fate(self.ledger, "abandoned", abandoned, checkpoint_step=self.state.step)


class _PushInFlight:
    """A weight push running on a daemon thread of its own (an abort does not wait for it)."""

    def __init__(self, push: Callable[[], dict[str, float]]):
        self._push = push
        self._metrics: dict[str, float] = {}
        self._error: BaseException | None = None
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="sdp-weight-push", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._metrics = self._push()
            self._metrics["time/push_async_s"] = time.perf_counter() - self._started
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that joins
            self._error = exc

    def result(self) -> dict[str, float]:
        """The push's metrics once it is done; its error is raised in the caller's thread."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._metrics
