"""The asynchronous RL loop, driven from the trainer's thread: take a batch, train, hand back weights.

The rollout side (``RolloutSide``, ``sdp_cli/train/asyncloop/rollout.py``, held as
``self.rollout``) produces groups while the trainer steps: its producer thread generates and
rewards them, and it keeps the buffers, admission, the recompute passes and the weight-update
protocol of docs/design.md §2. Each step (``run_step``) takes B groups from it (``take_batch``),
trains on them and hands it the new weights (``finish_step``), which it pushes to the engine in
the trainer's time or, with η > 0, while the next step trains; with η > 0 it also asks for the
next step's batch to be made ready meanwhile (``take_ahead``).

The rollout side runs in sdp's process (``engine.in_process=true``) or in a process of its own
(``sdp_cli/train/asyncloop/rollout_link.py``): the loop calls the same methods either way
(``Rollout``). Out of sdp's process its Python work (generation rounds, rewards, the recompute
passes, the push) no longer holds the interpreter lock the trainer's step needs.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol

from sdp_cli.config.schema import SdpConfig
from sdp_cli.engine.base import WeightUpdate
from sdp_cli.rollout.records import RolloutGroup
from sdp_cli.tasks.plugins import RewardError
from sdp_cli.train.asyncloop.loop_state import (
    LoopCounters,
    LoopInterrupted,
    LoopStopped,
    StepRecord,
    StepTimes,
    TextCodec,
)
from sdp_cli.train.asyncloop.rewarding import EXTRAS, extra_means
from sdp_cli.train.asyncloop.rollout import StepReport
from sdp_cli.train.step.batch import assemble_batch
from sdp_cli.train.step.trainer import Trainer

__all__ = ["AsyncLoop", "LoopInterrupted", "LoopStopped", "Rollout", "StepRecord", "TextCodec"]

#: how long one ``take_batch`` call waits for a batch before the loop looks at its stop request
TAKE_POLL_S = 0.2


class Rollout(Protocol):
    """What the loop asks of the rollout side (``RolloutSide``, or ``RolloutLink`` to one in the
    rollout process); the methods are ``RolloutSide``'s, documented there."""

    def start(self) -> None: ...

    def stop(self, *, wait: bool = True) -> BaseException | None: ...

    def take_batch(
        self, trainer_version: int, step: int, *, stop_requested: bool, wait_s: float
    ) -> list[RolloutGroup] | None: ...

    def take_ahead(self, trainer_version: int, step: int) -> None: ...

    def finish_step(self, update: WeightUpdate, *, last_step: bool) -> StepReport: ...

    def join_push(self) -> None: ...

    def settle_push(self) -> None: ...

    def snapshot(self) -> dict[str, Any]: ...

    def restore(self, snap: dict[str, Any], step: int) -> None: ...

    def counters(self) -> LoopCounters: ...

    def filtered_groups(self) -> int: ...


class AsyncLoop:
    """Trains until ``train.steps`` steps are done, on batches of a rollout side that produces
    them concurrently."""

    def __init__(
        self,
        cfg: SdpConfig,
        *,
        rollout: Rollout,
        trainer: Trainer,
        pad_token_id: int,
        push_weights: Callable[[int], WeightUpdate],
        on_batch: Callable[[list[RolloutGroup]], None] | None = None,
        on_step: Callable[[StepRecord], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ):
        self.cfg = cfg
        self.rollout = rollout
        self.trainer = trainer
        self.pad_token_id = pad_token_id
        self.push_weights = push_weights
        self.on_batch = on_batch
        self.on_step = on_step
        # polled before every batch is taken: a step either completes or never starts
        self.should_stop = should_stop
        #: training steps done (a resumed run continues from its checkpoint's)
        self.step = 0
        #: whether the loop stopped inside a step: its batch taken, the step not counted. The
        #: trainer may hold the next version's weights then, and the batch is out of the rollout
        #: side's hands, so the state is no step's: a stop writes no checkpoint of it.
        self.inside_step = False
        self.times = StepTimes()
        self._started = False
        self._reward_errors: tuple[int, list[RewardError]] = (0, [])

    # ============================================================= run
    def start(self) -> None:
        """Start the rollout side's producer."""
        self.rollout.start()
        self._started = True

    def stop(self, *, wait: bool = True) -> BaseException | None:
        """Stop the producer and wait for it (it finishes the generate call it is in); groups
        still being scored stay in its hands. ``wait=False``: do not wait (an abort; the process
        is about to end). Returns the producer's failure, if it failed."""
        return self.rollout.stop(wait=wait)

    def run(self) -> None:
        """Train until ``train.steps`` steps are done (continuing from ``self.step``)."""
        if not self._started:
            self.start()
        aborted = False
        failure: BaseException | None = None
        try:
            while self.step < self.cfg.train.steps:
                self.run_step()
            self.rollout.join_push()
        except KeyboardInterrupt:
            aborted = True
            raise
        finally:
            if not aborted:
                self.rollout.settle_push()
            failure = self.stop(wait=not aborted)
        if failure is not None:
            raise failure

    def run_step(self) -> StepRecord:
        """Take one batch, train on it and hand the new weights to the rollout side."""
        t0 = time.perf_counter()
        groups = self._take_batch()
        self.inside_step = True
        if self.on_batch is not None:
            self.on_batch(groups)  # other training processes train on the same batch
        if self.cfg.rollout.max_head_offpolicyness > 0 and self.step + 1 < self.cfg.train.steps:
            # the next step's batch, made ready while this one trains (at η = 0 it is generated
            # with this step's weights: nothing to make ready)
            self.rollout.take_ahead(self.trainer.version + 1, self.step + 2)
        t1 = time.perf_counter()
        batch = assemble_batch(
            groups,
            pad_token_id=self.pad_token_id,
            trainer_version=self.trainer.version,
            scale_adv_by_std=self.cfg.loss.scale_adv_by_std,
        )
        output = self.trainer.step(batch)
        t2 = time.perf_counter()
        update = self.push_weights(self.trainer.version)
        report = self.rollout.finish_step(update, last_step=self.step + 1 >= self.cfg.train.steps)
        t3 = time.perf_counter()

        self.times.wait_seconds += t1 - t0
        self.times.train_seconds += t2 - t1
        self.times.push_seconds += t3 - t2
        self.step += 1
        self.inside_step = False
        self._reward_errors = (report.reward_errors_failed, report.reward_errors_first)
        metrics = dict(output.metrics)
        metrics.update(extra_means([s.meta.get(EXTRAS) for g in groups for s in g.samples]))
        metrics.update(report.metrics)
        metrics["time/wait_s"] = t1 - t0
        metrics["time/train_s"] = t2 - t1
        metrics["time/push_s"] = t3 - t2
        record = StepRecord(step=self.step, version=report.version, metrics=metrics, batch=batch, output=output)
        if self.on_step is not None:
            self.on_step(record)
        if report.push_error is not None:
            raise report.push_error
        return record

    def _take_batch(self) -> list[RolloutGroup]:
        """The next batch, asking the rollout side until one is ready; a stop request is looked at
        before each ask (nothing is taken after it), and ``train.batch_timeout_s`` without a batch
        stops the run."""
        deadline = time.monotonic() + self.cfg.train.batch_timeout_s
        while True:
            stop_requested = self.should_stop is not None and self.should_stop()
            groups = self.rollout.take_batch(
                self.trainer.version, self.step + 1, stop_requested=stop_requested, wait_s=TAKE_POLL_S
            )
            if groups is not None:
                return groups
            if time.monotonic() > deadline:
                raise LoopStopped(
                    f"no batch arrived within train.batch_timeout_s={self.cfg.train.batch_timeout_s:g}s "
                    f"(the rollout side holds fewer than {self.cfg.rollout.batch_groups} groups)"
                )

    def reward_errors(self) -> tuple[int, list[RewardError]]:
        """The last step's reward errors: calls that failed and scored 0 since the step before,
        and the first report of each error not seen before."""
        errors, self._reward_errors = self._reward_errors, (0, [])
        return errors

    # ============================================================== reporting
    def counters(self) -> dict[str, Any]:
        """The run's counters: the rollout side's and the trainer's times, in one dict."""
        return {**self.rollout.counters().to_dict(), **self.times.to_dict()}

    def filtered_groups(self) -> int:
        return self.rollout.filtered_groups()

    # ============================================================== checkpoint
    def snapshot(self) -> dict[str, Any]:
        """A JSON-safe picture of the loop taken atomically (the rollout side's, with the step and
        every counter), with no weight push in flight."""
        snap = self.rollout.snapshot()
        return {"step": self.step, **snap, "counters": {**snap["counters"], **self.times.to_dict()}}

    def restore(self, snap: dict[str, Any]) -> None:
        """Restore a snapshot before ``start()`` (``RolloutSide.restore``)."""
        assert not self._started, "restore() must be called before start()"
        self.step = int(snap["step"])
        self.times = StepTimes.from_dict(snap["counters"])
        self.rollout.restore(snap, self.step)
