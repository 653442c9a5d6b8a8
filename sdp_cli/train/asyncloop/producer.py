"""The producer of the rollout side (``sdp_cli/train/asyncloop/rollout.py``), run in its own thread.

While the staleness manager grants capacity: sample prompts, generate G responses per prompt on
the engine (tokens tagged with the engine version) and pass the finished groups to the reward
pool (``sdp_cli/train/asyncloop/rewarding.py``) without waiting for their scores; the pool hands each scored
group to the queue (segment-wise: filtered before enqueue). Until then a group stays in the
producer's hands (``in_hand``). Between generate calls the producer runs the recompute pass of
the loaded version ahead of the weight push (``_recompute_ahead``).

``RolloutSide`` holds one ``RolloutProducer`` (``rollout.producer``) and hands it, at
construction, what the producer shares with the trainer's calls under the rollout side's locks.
"""

from __future__ import annotations

import functools
import logging
import random
import threading
import time
from typing import Callable

from sdp_cli.engine.base import EngineError, InferenceEngine, SamplingParams
from sdp_cli.errors import UserError, describe_exception, describe_os_error
from sdp_cli.faults import fault_point
from sdp_cli.rollout.buffers import RolloutCache, RolloutQueue
from sdp_cli.rollout.recompute import ProximalRecomputer
from sdp_cli.rollout.records import RolloutGroup, RolloutSample, samples_of
from sdp_cli.rollout.staleness import StalenessManager
from sdp_cli.rollout.strategies import StalenessControlStrategy
from sdp_cli.tasks.base import Task, TaskItem
from sdp_cli.train.asyncloop.ledger import LedgerLog, record_fate
from sdp_cli.train.asyncloop.loop_state import PassTotals, RolloutState, TextCodec
from sdp_cli.train.asyncloop.rewarding import EXTRAS, RewardPool

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
    """Rollout production: generate, reward, hand over to the queue; and the recompute ahead.

    It owns its thread, the groups in its hands, the reward pool that scores them, its failure and
    what its recompute passes did since the last weight push. What it shares with the trainer's
    calls (staleness manager and strategy, queue, cache, recomputer, rollout state, ledger, the
    locks and the loaded version) is the rollout side's, handed in: ``handoff_lock`` guards the
    hand-over of groups, the buffers and ``in_hand``; ``pass_lock`` keeps the weights loaded for a whole recompute pass
    (lock order: ``pass_lock`` before ``handoff_lock``).
    """

    def __init__(
        self,
        *,
        engine: InferenceEngine,
        task: Task,
        codec: TextCodec,
        params: SamplingParams,
        group_size: int,
        groups_per_request: int,
        rewards: RewardPool,
        manager: StalenessManager,
        strategy: StalenessControlStrategy,
        queue: RolloutQueue[RolloutGroup],
        cache: RolloutCache[RolloutGroup],
        recomputer: ProximalRecomputer,
        recompute_ahead: bool,
        state: RolloutState,
        ledger: LedgerLog | None,
        version: Callable[[], int],
        handoff_lock: threading.RLock,
        pass_lock: threading.Lock,
        max_consecutive_engine_faults: int,
        rollout_threads: int | None,
    ):
        self.engine = engine
        self.task = task
        self.codec = codec
        self.params = params
        self.group_size = group_size
        self.groups_per_request = groups_per_request
        self.rewards = rewards
        self.manager = manager
        self.strategy = strategy
        self.queue = queue
        self.cache = cache
        self.recomputer = recomputer
        self.recompute_enabled = recompute_ahead
        self.state = state
        self.ledger = ledger
        #: the engine version loaded now (the rollout side's, changed by its weight push)
        self.version = version
        self.handoff_lock = handoff_lock
        self.pass_lock = pass_lock
        self.max_consecutive_engine_faults = max_consecutive_engine_faults
        #: torch's intra-op threads of the producer thread (None: what it inherits)
        self.rollout_threads = rollout_threads
        #: the groups submitted and not yet handed over (possibly partial), by group id
        self.in_hand: dict[int, RolloutGroup] = {}
        #: the first failure of the producer or the reward pool; it stops the run
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # capacity may have grown (a weight push) or the producer is to stop
        self._capacity_changed = threading.Condition()
        # Recompute ahead: the engine version whose pass the producer has run, and what it did
        # since the last push (reported with the push's own pass; guarded by pass_lock).
        self._recomputed_for: int | None = None
        self._ahead = PassTotals()

    # ============================================================ the trainer's calls
    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        """Start the producer thread."""
        assert self._thread is None, "RolloutProducer.start() called twice"
        self._thread = threading.Thread(target=self._produce, name="sdp-rollout-producer", daemon=True)
        self._thread.start()

    def stop(self, *, wait: bool = True) -> None:
        """Stop producing and wait for the thread (it finishes the generate call it is in); groups
        still being scored stay in its hands. ``wait=False``: do not wait (an abort)."""
        self._stop.set()
        self.rewards.close()
        if self.engine.is_paused():
            self.engine.resume()
        self.wake()
        if self._thread is not None and wait:
            self._thread.join(timeout=60)

    @property
    def stopping(self) -> bool:
        """A stop was asked for, or the producer failed."""
        return self._stop.is_set()

    def wake(self) -> None:
        """Capacity may have changed (a weight push): a producer waiting for it looks again."""
        with self._capacity_changed:
            self._capacity_changed.notify_all()

    def take_ahead(self) -> PassTotals:
        """What the recompute passes ahead did since the last call (the weight push's, which
        holds ``pass_lock``)."""
        passes, self._ahead = self._ahead, PassTotals()
        return passes

    # ============================================================ the producer thread
    def _produce(self) -> None:
        if self.rollout_threads is not None:  # per thread: the trainer's own count stays
            import torch  # the engine computes in this process (in sdp's, beside the trainer)

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
            self.wake()

    def _fail(self, exc: BaseException) -> None:
        """Stop the run with ``exc`` (the first failure of the producer or the reward pool)."""
        if self.error is None:
            self.error = exc
        self._stop.set()
        self.wake()

    def _wait_for_capacity(self) -> int:
        with self._capacity_changed:
            while not self._stop.is_set():
                capacity = self.manager.get_capacity()
                if capacity > 0:
                    return min(capacity, self.groups_per_request)
                if self._recompute_due():
                    return 0  # the producer would only wait: it scores first
                self._capacity_changed.wait(timeout=0.5)
        return 0

    def _recompute_due(self) -> bool:
        return self.recompute_enabled and self._recomputed_for != self.version()

    def _recompute_ahead(self) -> None:
        """Run the recompute pass of the loaded version now, in the producer thread.

        Once weights c are loaded, every token of version c − 1 already exists, so π_c can score
        them at any time before weights c are replaced. Doing it here overlaps the pass with
        training instead of blocking the weight push; the push then only scores what is left
        (``RolloutSide._load_weights``; a pass skips tokens already scored under c). Between two
        generate calls the producer holds no partial sample (groups still being scored are left to the
        push's pass). ``pass_lock`` keeps the weights loaded for the whole pass; ``handoff_lock`` is held only
        to plan and to write, so the trainer takes batches while the engine scores, and the
        results of samples it took meanwhile are dropped (the take-time pass scores those).
        """
        if not self._recompute_due():
            return
        with self.pass_lock:
            t0 = time.perf_counter()
            with self.handoff_lock:
                version = self.version()
                if self._recomputed_for == version:
                    return
                plan = self.recomputer.plan(queue=self.queue, cache=self.cache, inflight=[])
            try:
                scores = self.recomputer.score(plan)
            except EngineError as exc:  # the push's pass retries what is left, and fails loudly
                logger.warning("recompute ahead of the weight push failed, the push will redo it: %s", exc)
                scores = None
            if scores is not None:
                with self.handoff_lock:
                    held = {id(s) for item in (*self.queue.snapshot(), *self.cache.get_all()) for s in samples_of(item)}
                    stats = self.recomputer.write(plan, scores, keep=lambda sample: id(sample) in held)
                seconds = time.perf_counter() - t0
                self.state.counters.count_recompute(stats, seconds)
                self._ahead.add(stats, seconds)
            self._recomputed_for = version

    def _new_groups(self, rng: random.Random, n_groups: int) -> list[RolloutGroup]:
        items = self.task.stream(rng, self.state.next_group_id, n_groups)
        self.state.producer_rng = rng.getstate()
        groups = []
        with self.handoff_lock:
            for item in items:
                group_id = self.state.next_group_id
                self.state.next_group_id = group_id + 1
                prompt_ids = self.codec.encode_prompt(item.prompt)
                # the task item is stored as plain data so that queued samples can be checkpointed
                meta = {"prompt": item.prompt, "answer": item.answer, "task_meta": dict(item.meta)}
                samples = [
                    RolloutSample(prompt_ids=list(prompt_ids), group_id=group_id, meta=dict(meta))
                    for _ in range(self.group_size)
                ]
                group = RolloutGroup(group_id=group_id, samples=samples)
                self.manager.on_rollout_enqueued()
                # capacity only falls when the producer admits (docs/design.md §3), so what
                # _wait_for_capacity granted still holds; try_submit checks it atomically anyway
                admitted = self.manager.try_submit()
                assert admitted, f"capacity granted for {n_groups} groups fell before group {group_id} was admitted"
                self.in_hand[group_id] = group
                groups.append(group)
        return groups

    def _give_back(self, groups: list[RolloutGroup], reason: str) -> None:
        """Generation failed: the groups are rejected and their capacity returns."""
        with self.handoff_lock:
            for group in groups:
                self.in_hand.pop(group.group_id, None)
                self.manager.on_rollout_rejected()
                self.state.counters.groups_failed += 1
            record_fate(self.ledger, "rejected", [g.group_id for g in groups], reason=reason)
        self.wake()

    def _score(self, groups: list[RolloutGroup]) -> None:
        """Send the finished groups' reward calls to the pool; ``_scored`` hands each over."""
        jobs = []
        for group in groups:
            calls = []
            for sample in group.samples:
                completion = self.codec.decode_completion(sample.output_ids)
                item = TaskItem(sample.meta["prompt"], sample.meta["answer"], sample.meta["task_meta"])
                calls.append(self.task.reward_call(completion, item, stopped=sample.finish_reason == "stop"))
            # a group's samples share their prompt, so what an error names is the same for all
            wheres = [f"a completion of {group.samples[0].meta['prompt'][:60]!r}"] * len(calls)
            jobs.append((calls, wheres, functools.partial(self._scored, group)))
        self.rewards.submit_groups(jobs)

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
        with self.handoff_lock:
            version = self.version()
            for group in groups:
                for sample in group.samples:
                    self.state.counters.samples_generated += 1
                    self.state.counters.tokens_generated += sample.output_len
                self.in_hand.pop(group.group_id, None)
                self.manager.on_rollout_accepted()
                self.state.counters.groups_generated += 1
                if self.strategy.should_filter_before_enqueue() and not self.strategy.filter_before_enqueue(
                    group, version
                ):
                    record_fate(self.ledger, "dropped", [group.group_id], version=version, where="enqueue")
                    continue
                self.queue.put(group)
                fault_point("producer.handover")
