"""The rollout side of the async loop: everything a training step needs but the trainer.

Producer thread (``RolloutProducer``, ``sdp_cli/train/asyncloop/producer.py``, held as
``self.producer``): while the staleness manager grants capacity, generate groups on the engine,
reward them off the generation path and hand them to the queue.

Trainer's calls (``AsyncLoop``, ``sdp_cli/train/asyncloop/loop.py``, in the trainer's thread):
``take_batch`` (queue → cache → filter → B groups) and ``finish_step``, which pushes the step's
new weights following docs/design.md §2: pause (``PauseController``, whose post-pause hook
``_recompute_at_push`` is the recompute pass with the old weights still loaded) → load the new
weights → purge stale queue items → resume. With η > 0 (``train.async_push``, an engine that
stages weights) that push runs on a thread of its own while the next step trains: a take waits
for it only when the batch holds tokens whose π_prox_t the push still owes, and the next push,
a snapshot and a stop wait for it too (``join_push``). In the rollout process the next step's
batch can be set aside while the trainer trains (``reserve_batch``, asked by ``take_ahead``), for
that step's take to claim.

Every group is in exactly one place at a time: in the producer's hands (submitted, possibly
partial), in the queue, in the cache (or set aside from its head for the next take), or
consumed/dropped. The producer moves groups from its
hands to the queue under ``_handoff_lock``, which the weight push also holds, so the recompute
pass sees every sample the system holds exactly once.

Faults (docs/reliability.md): a generate call that raises ``EngineError`` rejects its groups
(their capacity returns) and the producer tries again; ``engine.max_consecutive_faults`` faults
in a row stop the run. Every terminal fate of a group (consumed, dropped, rejected, abandoned
at a resume) is written to the group ledger (``sdp_cli.train.asyncloop.ledger``) in the same
critical section that changes the state, so a snapshot and the ledger length it records agree.

The same object serves the trainer in its own process (``engine.in_process=true``) or, with sdp's
local engine in a process of its own, from the rollout process (``rollout_link.py``), where its
Python work no longer shares the trainer's interpreter (docs/training.md "Three processes").
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field
from queue import Empty, SimpleQueue
from typing import Any, Callable

from sdp_cli.config.schema import SdpConfig, groups_per_request, tracks_proximal_t
from sdp_cli.engine.base import EngineError, InferenceEngine, SamplingParams, WeightUpdate
from sdp_cli.faults import fault_point
from sdp_cli.rollout.buffers import Doorbell, RolloutCache, RolloutQueue
from sdp_cli.rollout.hooks import PauseController, PauseHooks
from sdp_cli.rollout.recompute import ProximalRecomputer, RecomputeStats, pass_targets
from sdp_cli.rollout.records import RolloutGroup, RolloutSample
from sdp_cli.rollout.staleness import FilteredSamplesCapacityModifier, StalenessManager
from sdp_cli.rollout.strategies import StalenessControlStrategy, create_staleness_strategy, settled_head
from sdp_cli.tasks.base import Task
from sdp_cli.tasks.plugins import RewardError
from sdp_cli.train.asyncloop.ledger import LedgerLog, record_fate
from sdp_cli.train.asyncloop.loop_state import (
    LoopCounters,
    LoopInterrupted,
    LoopStopped,
    PassTotals,
    RolloutState,
    TextCodec,
    intra_op_threads,
    rng_state_from_json,
    rng_state_to_json,
)
from sdp_cli.train.asyncloop.producer import RolloutProducer, failure_text
from sdp_cli.train.asyncloop.rewarding import RewardPool, RewardRules

logger = logging.getLogger(__name__)

#: how often ``reserve_batch`` looks again at a cache whose first groups are not all fixed yet,
#: when it cannot watch for the trainer's next request; when it can, how long it waits at most for
#: a change (one it is not rung for: the producer failing or stopping)
RESERVE_POLL_S = 0.005
RESERVE_IDLE_S = 0.1


@dataclass
class StepReport:
    """What the rollout side says at the end of a training step (``RolloutSide.finish_step``)."""

    #: the engine's version after the step's push: the version it loads when the push runs on
    #: (asynchronous), the one still loaded when it failed
    version: int
    #: the step's metrics from this side: a push waited for in this step, the step's own push,
    #: the loop's gauges and the π_prox_t paths, in that order
    metrics: dict[str, float]
    #: the step's push failed (the step is trained and counted; the run stops after recording it)
    push_error: EngineError | None = None
    #: reward calls that failed and scored 0 since the last report, and the first report of each
    #: error not seen before (``RewardPool.take_errors``)
    reward_errors_failed: int = 0
    reward_errors_first: list[RewardError] = field(default_factory=list)


class RolloutSide:
    """Rollout production, the buffers, admission, the recompute passes and the weight push;
    the trainer takes batches from it and hands it new weights."""

    def __init__(
        self,
        cfg: SdpConfig,
        *,
        engine: InferenceEngine,
        task: Task,
        codec: TextCodec,
        stop_token_ids: tuple[int, ...],
        max_new_tokens: int,
        max_consecutive_engine_faults: int = 5,
        ledger: LedgerLog | None = None,
        recompute_threads: int | None = None,
        rollout_threads: int | None = None,
    ):
        self.cfg = cfg
        self.engine = engine
        self.task = task
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
        # rung when a group is queued or a recompute pass writes: what ``reserve_batch`` waits for
        self._held_changed = Doorbell()
        self.queue: RolloutQueue[RolloutGroup] = RolloutQueue(on_put=self._held_changed.ring)
        self.cache: RolloutCache[RolloutGroup] = RolloutCache()
        self.pause_hooks = PauseHooks()
        self.pause_controller = PauseController(engine, self.pause_hooks)
        self.recomputer = ProximalRecomputer(engine, on_write=self._held_changed.ring)
        self.recompute_enabled = tracks_proximal_t(cfg)
        if self.recompute_enabled:
            # docs/design.md §2 step 2: the push's recompute pass runs once the engine is paused,
            # with the old weights still loaded. Its errors (EngineError …) reach the push as is.
            self.pause_hooks.register_post_pause_hook(self._recompute_at_push, wrap_errors=False)
        #: the metrics of the push's recompute pass, left by ``_recompute_at_push`` for ``_load_weights``
        self._push_pass_metrics: dict[str, float] = {}
        # π_prox_t of a token one version stale is scored by the engine when the trainer takes
        # its batch, unless the producer's pass already did: one source, whatever the timing.
        self.score_at_take = self.recompute_enabled and ro.proximal_t_source == "engine"

        self.state = RolloutState(producer_rng=random.Random(cfg.seed + 1).getstate())
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
        self._push_thread = _PushThread()
        self._joined_push_metrics: dict[str, float] = {}
        #: the next step's batch, set aside while the trainer trains (``reserve_batch``), and the
        #: version of the take of one that left filtering the rest of the cache for later
        self._reserved: _Reserved | None = None
        self._filter_owed: int | None = None
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

    # ============================================================= lifecycle
    def start(self) -> None:
        """Start the producer thread."""
        self.producer.start()

    def stop(self, *, wait: bool = True) -> BaseException | None:
        """Stop the producer and wait for it (it finishes the generate call it is in); groups
        still being scored stay in the producer's hands. ``wait=False``: do not wait (an abort;
        the process is about to end). Returns the producer's failure, if it failed."""
        self.producer.stop(wait=wait)
        return self.producer.error

    def close(self) -> None:
        """Close the engine (a launched server or process stops); idempotent. What this side
        holds stays readable (a stop's checkpoint takes a snapshot after it)."""
        self._push_thread.close()
        self.engine.close()

    def shutdown(self) -> None:
        """The session is over: close the engine and the ledger; idempotent."""
        self.close()
        self._held_changed.close()
        if self.ledger is not None:
            self.ledger.close()

    @property
    def log_paths(self) -> tuple[Any, ...]:
        """The engine's log files (a launched server's or process's)."""
        return tuple(self.engine.log_paths)

    @property
    def accepts_state_dict(self) -> bool:
        """Whether a push may hand over the trainer's weights in memory (else a directory)."""
        return self.engine.accepts_state_dict

    # ============================================================= the trainer's calls
    def take_batch(self, trainer_version: int, step: int, *, stop_requested: bool, wait_s: float) -> list[RolloutGroup] | None:
        """The batch of training step ``step`` at trainer version c = ``trainer_version``, or None
        when none is ready within ``wait_s`` seconds (the trainer asks again).

        ``stop_requested``: the trainer was asked to stop; nothing is taken then (a step either
        completes or never starts) and ``LoopInterrupted`` is raised, after a failure of the
        producer, which is raised as ``LoopStopped`` first. The batch ``reserve_batch`` set aside
        for this step and version is the batch (the rest of the cache is filtered at c later, by
        ``_catch_up``); one set aside for another goes back first."""
        deadline = time.monotonic() + wait_s
        reserved = self._release_reserved(keep=(trainer_version, step))
        if reserved is not None:
            try:
                self._raise_if_stopped(stop_requested)
            except BaseException:
                self.cache.put_back(reserved)
                raise
            with self._handoff_lock:
                self._consume(reserved, step)
            # a filter still owed at an older version drops nothing this one does not
            self._filter_owed = trainer_version
            fault_point("loop.batch_taken")
            return reserved
        self._filter_owed = None  # this take filters at c, which drops all an older filter would
        while True:
            self._raise_if_stopped(stop_requested)
            self._filter_cache(trainer_version)
            if self.cache.size() >= self.batch_groups:
                if self._push_in_flight is not None and self._needs_new_weights(
                    self.cache.get_all()[: self.batch_groups], trainer_version
                ):
                    self.join_push()
                # Under the hand-off lock: the producer's recompute pass never writes into a
                # batch being taken, and never scores what the take-time pass scores.
                with self._handoff_lock:
                    if self.score_at_take and self._push_in_flight is None:
                        self._score_at_take(self.cache.get_all()[: self.batch_groups])
                    groups = self.cache.take_first_n(self.batch_groups)
                    self._consume(groups, step)
                fault_point("loop.batch_taken")
                return groups
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                self.cache.add(self.queue.get(timeout=min(0.2, remaining)))
            except Empty:
                pass

    def _filter_cache(self, trainer_version: int) -> None:
        """Move the queue's groups to the cache and drop the cache's stale ones at version c =
        ``trainer_version`` (each written to the ledger), once the push in flight gave them
        what its pass owes them."""
        self._drain_queue()
        if self._push_in_flight is not None and self._pass_owed(self.cache.get_all(), trainer_version):
            # the push's pass still owes them π_{c−1}: the filter would drop them as past
            # their window, a take would train on them without it
            self.join_push()  # outside the hand-off lock, which the push's pass takes
        before = [g.group_id for g in self.cache.get_all()]
        if self.strategy.filter_stale_from_cache(self.cache, trainer_version):
            kept = {g.group_id for g in self.cache.get_all()}
            dropped = [g for g in before if g not in kept]
            record_fate(self.ledger, "dropped", dropped, version=trainer_version, where="cache")

    def _drain_queue(self) -> None:
        while True:
            try:
                self.cache.add(self.queue.get_nowait())
            except Empty:
                return

    def _consume(self, groups: list[RolloutGroup], step: int) -> None:
        record_fate(self.ledger, "consumed", [g.group_id for g in groups], step=step, samples=[len(g.samples) for g in groups])

    # ============================================================= the next batch, ahead
    def take_ahead(self, trainer_version: int, step: int) -> None:
        """Nothing: in sdp's process, taking the next batch ahead would take the trainer's thread
        as long as taking it when due (the rollout process does it: ``reserve_batch``)."""

    def reserve_batch(
        self, trainer_version: int, step: int, *, give_up: Callable[[], bool], watch: int | None = None
    ) -> list[RolloutGroup] | None:
        """Set aside the batch of step ``step`` at trainer version c = ``trainer_version`` while the
        trainer still trains the step before (the rollout process, asked by ``RolloutLink.take_ahead``),
        and return it; ``take_batch`` for that step and version then takes it. None when it cannot
        be known yet: the producer failed or stops, or ``give_up()`` (the trainer's next request
        came) before the cache's first B groups are each *fixed*: kept by the strategy at c and,
        with the recompute pass, settled at c − 1 (``settled_head``: every token older than
        c − 1 and holding π_{v+1}). Nothing can change a fixed group before that take (no pass
        writes into it, the take-time pass has nothing to score in it, its verdict stays), nor
        put a group ahead of it, so they are the groups the take would choose: their take costs
        the trainer no filter, no scan and no encoding (docs/training.md "Three processes").

        It looks again when a group is queued or a recompute pass writes, and when ``watch`` (a
        file descriptor that turns readable as ``give_up()`` turns true: the trainer's link) is
        readable; without ``watch`` it also looks every ``RESERVE_POLL_S``."""
        self._catch_up(may_wait=False)
        assert self._reserved is None, "one batch set aside at a time"
        # Each look judges only what may have changed since the last: a group found fixed stays
        # fixed (above), and a group found not fixed changes only by a recompute pass's write. So
        # a look between a pass and the next, or before the next group comes, costs no scan.
        fixed: dict[int, RolloutGroup] = {}  # by id, holding each group so that its id stays its own
        not_fixed: tuple[RolloutGroup, int] | None = None  # the group, and the pass writes then
        while True:
            self._held_changed.clear()  # before looking: a change after the look rings again
            if self.producer.error is not None or self.producer.stopping:
                return None
            self._drain_queue()
            with self._handoff_lock:  # no pass writes into the groups while they are judged
                front = self.cache.get_all()[: self.batch_groups]
                writes = self.recomputer.writes
                for group in front:
                    if id(group) in fixed:
                        continue
                    if not_fixed is not None and not_fixed[0] is group and not_fixed[1] == writes:
                        break
                    if not self._fixed(group, trainer_version):
                        not_fixed = (group, writes)
                        break
                    fixed[id(group)] = group
                else:
                    if len(front) == self.batch_groups:
                        groups = self.cache.take_first_n(self.batch_groups)
                        self._reserved = _Reserved(groups, trainer_version, step)
                        return groups
            if give_up():
                return None
            # a new group, or a pass settling the ones held, can make the batch fixed
            if watch is None:
                self._held_changed.wait([], RESERVE_POLL_S)
            else:
                self._held_changed.wait([watch], RESERVE_IDLE_S)

    def reserved_batch(self) -> list[RolloutGroup] | None:
        """The batch set aside, if one is."""
        return None if self._reserved is None else self._reserved.groups

    def _fixed(self, group: RolloutGroup, trainer_version: int) -> bool:
        if self.strategy.is_sample_too_stale(group, trainer_version):
            return False
        return not self.recompute_enabled or settled_head(group, trainer_version - 1) is not None

    def _release_reserved(self, keep: tuple[int, int] | None = None) -> list[RolloutGroup] | None:
        """The batch set aside if it is for (trainer version, step) ``keep``; else it goes back
        to the head of the cache (the next take chooses anew) and None is returned."""
        reserved, self._reserved = self._reserved, None
        if reserved is None or (reserved.trainer_version, reserved.step) == keep:
            return None if reserved is None else reserved.groups
        self.cache.put_back(reserved.groups)
        return None

    def _catch_up(self, *, may_wait: bool = True) -> None:
        """The filter a take of a batch set aside left for later (the trainer was not kept
        waiting for it), at that take's version c, as the take would have run it. Not
        ``may_wait``: left for later again if it would wait for the push in flight (a push's
        error is the take's and the snapshot's to raise, not ``reserve_batch``'s)."""
        owed = self._filter_owed
        if owed is None:
            return
        if not may_wait and self._push_in_flight is not None and self._pass_owed(self.cache.get_all(), owed):
            return
        self._filter_owed = None
        self._filter_cache(owed)

    def finish_step(self, update: WeightUpdate, *, last_step: bool, hold_push: bool = False) -> StepReport:
        """Push the step's new weights (``update``, version c + 1) and report the step.

        The push runs in this thread or, with ``async_push`` where the engine stages weights, on
        the push thread (its metrics then join the report of the step that waits for it). The
        last step pushes in this thread, so the run ends with the engine at the trainer's
        version. A failed push is reported, not raised: the step is trained, so it is counted
        (trainer version = step) and a resume hands these weights to the engine.

        ``hold_push``: the push thread starts only at ``release_push`` (or the next join), which
        the rollout process calls once its answer to the trainer is sent: the push's first work
        (the pause, the pass) took the interpreter and the core from that answer
        (docs/training.md "The weight push")."""
        push_error: EngineError | None = None
        try:
            push_metrics = self._push(update, last_step=last_step, hold=hold_push)
        except EngineError as exc:
            push_error = exc
            push_metrics = {"engine/push_failed": 1.0}
        # the engine's version after a synchronous or failed push; the one loading otherwise
        version = update.version if self._push_in_flight is not None else self._version
        metrics = dict(self._joined_push_metrics)  # an asynchronous push, waited for in this step
        self._joined_push_metrics = {}
        metrics.update(push_metrics)
        metrics.update(self._loop_metrics())
        metrics.update(self._proximal_t_paths())
        failed, first = self.producer.rewards.take_errors()
        return StepReport(version, metrics, push_error, failed, first)

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

    def _raise_if_stopped(self, stop_requested: bool) -> None:
        if self.producer.error is not None:
            raise LoopStopped(f"rollout producer failed: {failure_text(self.producer.error)}") from self.producer.error
        if stop_requested:
            raise LoopInterrupted("a stop was requested")
        if self.producer.stopping:
            raise LoopStopped("stopped")

    # ============================================================= weights
    def _push(self, update: WeightUpdate, *, last_step: bool, hold: bool = False) -> dict[str, float]:
        """Push ``update``: in this thread (the push's metrics are returned) or, with
        ``async_push`` where the engine stages it, on the push thread ({} is returned), which
        waits for ``release_push`` first if ``hold``."""
        self.join_push()  # one push at a time, in order
        if self.async_push and not last_step:
            staged = self.engine.stage_weights(update)  # the next step may change the tensors now
            if staged is not None:
                self._push_in_flight = self._push_thread.submit(
                    lambda: self._load_weights(staged, update.version), held=hold
                )
                return {}
        return self._load_weights(update, update.version)

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

    def sync_engine(self, update: WeightUpdate | None, version: int) -> None:
        """Make the engine run the trainer's weights as ``version``: load ``update`` (a server sdp
        attached to runs whatever it ran before), or only declare the version (the engine was
        built from these weights). Before ``start``."""
        assert not self.producer.started, "sync_engine() must be called before start()"
        if update is None:
            self.engine.set_version(version)
        else:
            self.engine.pause()
            try:
                self.engine.update_weights(update)
            finally:
                self.engine.resume()
        self._version = self.engine.get_version()

    def _pass_owed(self, groups: list[RolloutGroup], trainer_version: int) -> bool:
        """Whether ``groups`` hold a token of version c − 2 without π_{c−1} (c the trainer's
        version, which the push in flight loads): the push's pass scores it under the weights it
        replaces (the producer's pass after the previous push usually did already)."""
        loaded = trainer_version - 1  # until the push in flight replaces them
        return self.recompute_enabled and any(
            pass_targets(s.versions, s.proximal_t_versions, loaded)
            for g in groups
            if not self.strategy.settled(g)  # every token holds π_{v+1} already
            for s in g.samples
        )

    def _needs_new_weights(self, groups: list[RolloutGroup], trainer_version: int) -> bool:
        """Whether ``groups`` hold a token of version c − 1: the take-time pass scores it under
        weights c, which the push in flight loads. With η > 1 a batch's tokens are usually
        older, and the push goes on while the step trains."""
        c = trainer_version
        return self.recompute_enabled and any(max(s.versions, default=-1) >= c - 1 for g in groups for s in g.samples)

    def release_push(self) -> None:
        """Let the push thread start the push that ``finish_step`` held, if one is held."""
        self._push_thread.release()

    def join_push(self) -> None:
        """Wait for the push in flight, if any (one still held starts now): its metrics go to the
        current step's report, its error (``EngineError`` …) is raised here."""
        self._push_thread.release()
        push, self._push_in_flight = self._push_in_flight, None
        if push is not None:
            self._joined_push_metrics.update(push.result())

    def settle_push(self) -> None:
        """A stop: wait for the push in flight; its error is logged (the stop's own reason goes
        on, and a resume gives the engine the checkpoint's weights)."""
        try:
            self.join_push()
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

    # ============================================================= metrics
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
            "staleness/filtered_groups_total": float(self.filtered_groups()),
            "buffer/queue": float(self.queue.qsize()),
            "buffer/cache": float(self.cache.size()),
            "throughput/tokens_generated_total": float(self.state.counters.tokens_generated),
            "engine/faults_total": float(self.state.counters.engine_faults),
            "engine/groups_rejected_total": float(self.state.counters.groups_failed),
            # remote engines: segments, resubmissions, aborted segments, restores, ... (this session)
            **{f"engine/{k}": float(v) for k, v in self.engine.stats().items()},
        }

    def filtered_groups(self) -> int:
        """Groups the staleness strategy dropped, over the run."""
        return sum(self.strategy.filtered_by_version.values())

    def counters(self) -> LoopCounters:
        return self.state.counters

    # ============================================================== checkpoint
    def snapshot(self) -> dict[str, Any]:
        """A JSON-safe picture of this side (buffer contents, counters, RNG) taken atomically, with
        no weight push in flight (its pass and purge change what it holds), and the ledger
        durable up to the length it records."""
        self._catch_up()
        self.join_push()
        with self._handoff_lock:
            self._release_reserved()  # the cache holds it again: the next take chooses anew
            snap = {
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
        if self.ledger is not None:
            self.ledger.sync()
        return snap

    def restore(self, snap: dict[str, Any], step: int) -> None:
        """Restore a snapshot taken at training step ``step``, before ``start()``. Groups that
        were in flight when it was taken are gone: their capacity returns (running → 0) and the
        ledger says they were abandoned; queued and cached groups come back. The engine must
        already run the checkpoint's weights: its version becomes the loop's."""
        assert not self.producer.started, "restore() must be called before start()"
        self._version = self.engine.get_version()
        self.state.next_group_id = int(snap["next_group_id"])
        self.state.producer_rng = rng_state_from_json(snap["producer_rng"])
        self.state.counters = LoopCounters.from_dict(snap["counters"])
        self.manager.load_state_dict(snap["manager"], drop_inflight=True)
        self.strategy.load_state_dict(snap["strategy"])
        for data in snap["queue"]:
            self.queue.put(RolloutGroup.from_dict(data))
        for data in snap["cache"]:
            self.cache.add(RolloutGroup.from_dict(data))
        abandoned = list(snap.get("in_flight_group_ids", []))
        record_fate(self.ledger, "abandoned", abandoned, checkpoint_step=step)


@dataclass
class _Reserved:
    """A batch ``reserve_batch`` set aside for training step ``step`` at trainer version
    ``trainer_version``."""

    groups: list[RolloutGroup]
    trainer_version: int
    step: int


class _PushInFlight:
    """A weight push handed to the push thread (``_PushThread``); its result once it is done."""

    def __init__(self, push: Callable[[], dict[str, float]]):
        self.push = push
        self.metrics: dict[str, float] = {}
        self.error: BaseException | None = None
        self.started = time.perf_counter()
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.metrics = self.push()
            self.metrics["time/push_async_s"] = time.perf_counter() - self.started
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that joins
            self.error = exc
        finally:
            self.done.set()

    def result(self) -> dict[str, float]:
        """The push's metrics once it is done; its error is raised in the caller's thread."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.metrics


class _PushThread:
    """The daemon thread (an abort does not wait for it) that loads the pushes handed to it, in
    order. It lives from the first push until ``close``: starting a thread per push cost the
    caller 0.3 ms a step (the new thread ran first and held the interpreter lock), which in the
    rollout process delayed the answer the trainer waits for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: SimpleQueue[_PushInFlight | None] | None = None
        #: a push handed over but not to be started before ``release`` (``close`` releases it
        #: before the thread's jobs go, so while it is held they are ``_jobs``)
        self._held: _PushInFlight | None = None

    def submit(self, push: Callable[[], dict[str, float]], *, held: bool = False) -> _PushInFlight:
        """Hand ``push`` to the thread; ``held``: it starts at ``release``."""
        job = _PushInFlight(push)
        with self._lock:
            assert self._held is None, "a push is held: release it before the next"
            if self._jobs is None:
                self._jobs = SimpleQueue()
                threading.Thread(target=self._run, args=(self._jobs,), name="sdp-weight-push", daemon=True).start()
            if held:
                self._held = job
            else:
                self._jobs.put(job)
        return job

    def release(self) -> None:
        """Start the push held back by ``submit``, if any."""
        with self._lock:
            if self._held is not None:
                assert self._jobs is not None
                self._jobs.put(self._held)
                self._held = None

    @staticmethod
    def _run(jobs: SimpleQueue[_PushInFlight | None]) -> None:
        while (job := jobs.get()) is not None:
            job.run()

    def close(self) -> None:
        """The thread ends once the pushes handed to it (one held, too) are done; a later push
        starts another."""
        self.release()
        with self._lock:
            jobs, self._jobs = self._jobs, None
        if jobs is not None:
            jobs.put(None)
