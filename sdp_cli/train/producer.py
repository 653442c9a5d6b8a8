"""The producer half of the async loop (``sdp_cli/train/loop.py``), run in its own thread.

While the staleness manager grants capacity: sample prompts, generate G responses per prompt on
the engine (tokens tagged with the engine version) and pass the finished groups to the reward
pool (``sdp_cli/train/rewarding.py``) without waiting for their scores; the pool hands each scored
group to the queue (segment-wise: filtered before enqueue). Until then a group stays in the
producer's hands (``_in_hand``). Between generate calls the producer runs the recompute pass of
the loaded version ahead of the weight push (``_recompute_ahead``).

``RolloutProducer`` is a mixin of ``AsyncLoop``: the state it works on (buffers, manager, locks,
counters) is created by ``AsyncLoop.__init__`` and shared with the trainer side under the locks
documented there.
"""

from __future__ import annotations

import functools
import logging
import random
import threading
import time
from typing import Any, Iterator

import torch

from sdp_cli.config.schema import SdpConfig
from sdp_cli.engine.base import EngineError, InferenceEngine, SamplingParams
from sdp_cli.errors import UserError, describe_exception, describe_os_error
from sdp_cli.faults import fault_point
from sdp_cli.rollout.buffers import RolloutCache, RolloutQueue
from sdp_cli.rollout.recompute import ProximalRecomputer, RecomputeStats
from sdp_cli.rollout.records import RolloutGroup, RolloutSample, samples_of
from sdp_cli.rollout.staleness import StalenessManager
from sdp_cli.rollout.strategies import StalenessControlStrategy
from sdp_cli.tasks.base import Task, TaskItem
from sdp_cli.train.ledger import LedgerLog
from sdp_cli.train.loop_state import LoopState, PassTotals, TextCodec
from sdp_cli.train.rewarding import EXTRAS, RewardPool

logger = logging.getLogger(__name__)


def failure_text(exc: BaseException) -> str:
    """What the run says after "rollout producer failed: ": a UserError's own line, a failed file
    operation's, anything else named by its type (a bare ``SystemExit(3)`` would say "3" and a
    ``KeyboardInterrupt`` nothing)."""
    if isinstance(exc, UserError):
        return str(exc)
    if isinstance(exc, OSError):
        return describe_os_error(exc)
    return describe_exception(exc)


class RolloutProducer:
    """Rollout production: generate, reward, hand over to the queue; and the recompute ahead."""

    cfg: SdpConfig
    engine: InferenceEngine
    task: Task
    codec: TextCodec
    params: SamplingParams
    max_consecutive_engine_faults: int
    ledger: LedgerLog | None
    manager: StalenessManager
    strategy: StalenessControlStrategy
    queue: RolloutQueue[RolloutGroup]
    cache: RolloutCache[RolloutGroup]
    recomputer: ProximalRecomputer
    recompute_enabled: bool
    rewards: RewardPool
    state: LoopState
    _version: int
    _in_hand: dict[int, RolloutGroup]
    _handoff_lock: threading.RLock
    _pass_lock: threading.Lock
    _capacity_changed: threading.Condition
    _stop: threading.Event
    _producer_error: BaseException | None
    _group_ids: Iterator[int]
    _recomputed_for: int | None
    _ahead: PassTotals
    rollout_threads: int | None

    def _produce(self) -> None:
        if self.rollout_threads is not None:  # per thread: the trainer's own count stays
            torch.set_num_threads(self.rollout_threads)
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
                # capacity only falls when the producer admits (docs/design.md §3), so what
                # _wait_for_capacity granted still holds; try_submit checks it atomically anyway
                admitted = self.manager.try_submit()
                assert admitted, f"capacity granted for {n_groups} groups fell before group {group_id} was admitted"
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
