"""``sdp train`` end to end: components, the async loop, checkpoints, summary.

The run directory (``runs/<timestamp>-<mode>-<task>/``) is laid out by ``sdp_cli.rundir.RunDir``;
creating it and tidying it after a crash is ``sdp_cli.train.session.recovery``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from sdp_cli.config.compose import ConfigSource
from sdp_cli.config.schema import SdpConfig, tracks_proximal_t
from sdp_cli.engine.base import WeightUpdate
from sdp_cli.engine.factory import build_engine
from sdp_cli.engines import engine_kind
from sdp_cli.errors import Interrupted, UserError
from sdp_cli.faults import fault_point
from sdp_cli.faults import enabled as faults_enabled
from sdp_cli.fileio import atomic_write_text
from sdp_cli.models.warm_start import warm_start_note
from sdp_cli.modes import resolve_mode
from sdp_cli.rollout.records import RolloutGroup
from sdp_cli.rundir import RunDir, superseded_versions
from sdp_cli.stopsignals import Abort, StopRequest, handling, signal_name
from sdp_cli.tasks import Task
from sdp_cli.train.session import checkpoint as ckpt
from sdp_cli.models.policy import PromptCodec
from sdp_cli.train.asyncloop.ledger import LedgerLog
from sdp_cli.train.asyncloop.rollout import RolloutSide
from sdp_cli.train.asyncloop.rollout_link import RolloutLink
from sdp_cli.train.asyncloop.loop import AsyncLoop, LoopInterrupted, LoopStopped, StepRecord
from sdp_cli.train.step.batch import assemble_batch
from sdp_cli.train.asyncloop.distributed import Coordinator
from sdp_cli.processes import pin_process
from sdp_cli.train.session.placement import core_split, thread_counts
from sdp_cli.train.session.policy_setup import (
    WholePolicy,
    bf16_note,
    describe_policy,
    load_for_training,
    load_policy_from,
    save_checkpoint_policy,
    save_version,
)
from sdp_cli.train.session.recovery import discard_past, past_resume_note, recover_after_crash
from sdp_cli.train.session.rollout_process import LOG_NAME as ROLLOUT_LOG, RolloutProcessStart
from sdp_cli.train.session.resume_check import STAMP, read_identity, stamp
from sdp_cli.train.session.display import Progress, StartDisplay, start_evaluation_title
from sdp_cli.train.session.reporting import EventLog, MetricsLog
from sdp_cli.train.asyncloop.rewarding import RewardPool, RewardRules, user_code_running
from sdp_cli.train.session.session_end import SavedAtStop, SessionEnd, summary_line
from sdp_cli.train.session.start import RunStart, config_dict, open_run
from sdp_cli.train.session.trackers import active_trackers, open_trackers
from sdp_cli.train.session.task_setup import prepare_task
from sdp_cli.train.step.trainer import Trainer


# ---------------------------------------------------------------------- run
class TrainingRun:
    """One ``sdp train`` invocation (fresh or resumed)."""

    def __init__(
        self,
        cfg: SdpConfig,
        raw: Any,
        overrides: list[str],
        run_dir: RunDir,
        *,
        resuming: bool,
        coordinator: Coordinator,
        task: Task | None = None,
        checkpoint: ckpt.Checkpoint | None = None,
        stop_request: StopRequest | None = None,
        display: StartDisplay | None = None,
        rollout_process: RolloutProcessStart | None = None,
    ):
        self.cfg = cfg
        self.task = task
        self.raw = raw
        self.overrides = overrides
        self.run_dir = run_dir
        self.resuming = resuming
        #: the checkpoint a resume continues from, checked by sdp_cli/train/session/resume_check.py
        self.resume_from = checkpoint
        self.coordinator = coordinator
        # set by a signal (sdp_cli/stopsignals.py); the loop polls it before every batch
        self.stop_request = stop_request or StopRequest()
        #: the rollout side: producer, buffers, engine and ledger (rank 0), or the link to it
        self.rollout: RolloutSide | RolloutLink | None = None
        #: the rollout process, started as the command began (``RolloutProcessStart.early_start``)
        #: or as setup begins, until it gets its recipe (rank 0)
        self._rollout_process = rollout_process
        self.loop: AsyncLoop | None = None
        #: the greedy evaluation's reward calls, under the training rewards' rules (rank 0)
        self.eval_rewards: RewardPool | None = None
        self.start_step = 0
        self._last_checkpoint: tuple[int, Path] | None = None
        # only rank 0 writes to the run directory
        self.events = EventLog(run_dir.events) if coordinator.is_main else None
        #: what the session's end records and says
        self.end = SessionEnd(cfg, run_dir, self.events)
        #: a resume past its checks, which may write into the run (its end is then an event)
        self.resume_accepted = False
        self.display = display or StartDisplay(enabled=False)

    # -- setup --------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one live display per run is enough
        torch.set_num_threads(thread_counts(cfg)[0])
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)

        if self.coordinator.is_main and engine_kind(cfg.engine.kind).own_process(cfg):
            # its imports run while the policy loads; it gets its recipe in _start_rollout
            if self._rollout_process is None:
                self._rollout_process = RolloutProcessStart(cfg, self.run_dir)
            else:  # started as the command began, before the run directory existed
                self._rollout_process.run_dir_made(self.run_dir)
        elif self._rollout_process is not None:
            self._rollout_process.cancel()
            self._rollout_process = None
        checkpoint = self.resume_from
        # a resume without a checkpoint starts over: what the earlier sessions logged is dropped
        over = self.resuming and checkpoint is None

        if self.task is None:
            self.task = prepare_task(cfg)
        keep_versions = cfg.train.keep_version_checkpoints and self.coordinator.is_main
        # rank 0 first: it may train and cache the warm start, which the others then load
        with self.display.phase("loading model") as phase:
            self.policy, reference = self.coordinator.main_first(
                lambda: load_for_training(
                    cfg,
                    lambda path: load_policy_from(cfg, self.task, path=path, progress=phase.update),
                    checkpoint_policy=checkpoint.policy_dir if checkpoint else None,
                    version_base=self.run_dir.version_base if keep_versions else None,
                )
            )
            phase.result = describe_policy(self.policy)
        if checkpoint is None and self.policy.load_note and self.coordinator.is_main:
            print(self.policy.load_note, file=sys.stderr)
        note = bf16_note(cfg, self.coordinator.accelerator.device)
        if note is not None and self.coordinator.is_main:
            print(note, file=sys.stderr)
        if self.policy.warm_start_accuracy is not None and self.coordinator.is_main:
            print(warm_start_note(*self.policy.warm_start_accuracy), file=sys.stderr)
        stop_ids = (int(self.policy.eos_token_id),)
        self.codec = PromptCodec(self.policy)
        max_new = cfg.rollout.max_new_tokens or self.task.max_new_tokens
        self.trainer = Trainer(
            self.policy.model,
            # the Dr.GRPO normaliser's constant length defaults to the generation budget
            loss=dataclasses.replace(cfg.loss, norm_length=cfg.loss.norm_length or max_new),
            optim=cfg.optim,
            temperature=cfg.rollout.temperature,
            seed=cfg.seed,
            track_proximal_t=tracks_proximal_t(cfg),
            proximal_t_source=cfg.rollout.proximal_t_source,
            accelerator=self.coordinator.accelerator,
            batch_sequences=cfg.rollout.batch_groups * cfg.rollout.group_size,
            dtype=cfg.train.dtype,
            reference=reference,
            parallel=cfg.train.parallel,
            share_prefixes=cfg.train.share_prefixes,
        )
        self.coordinator.register_training(self.trainer.placed, self.stop_request)
        self.whole = WholePolicy(self.policy, self.trainer, lambda: self.coordinator.call("model_state"))
        if self.resuming and self.coordinator.is_main:
            # the model loaded: from here on the resume is accepted and may tidy the directory
            ckpt.remove_stale_temporaries(self.run_dir.checkpoints)
            recover_after_crash(self.run_dir, self.events)
            self.resume_accepted = True
        if faults_enabled():  # test-only (sdp_cli/faults.py): a crash between optimizer steps
            optimizer = getattr(self.trainer.placed.optimizer, "optimizer", self.trainer.placed.optimizer)
            optimizer.register_step_post_hook(lambda *_: fault_point("trainer.optimizer_step"))
        self.start_step = 0
        if checkpoint is not None:
            self.trainer.load_state_dict(ckpt.trainer_state(checkpoint))
            if checkpoint.state["optimizer"] is None:  # train.save_optimizer=false (docs/training.md)
                print(
                    f"warning: {checkpoint.path.name} holds no optimizer state (train.save_optimizer=false); "
                    "AdamW restarts from zero moments",
                    file=sys.stderr,
                )
            self.start_step = checkpoint.step
        discarded = []
        if self.resuming and self.coordinator.is_main:
            discarded = discard_past(self.run_dir, self.start_step, self.trainer.version)
            if discarded:
                print(past_resume_note(discarded, self.start_step), file=sys.stderr)
        self.stamp = stamp(read_identity(self.run_dir), config_dict(self.raw))
        if not self.coordinator.is_main:
            return
        if cfg.train.parallel == "fsdp" and not self.coordinator.distributed:
            print("note: train.parallel=fsdp in one process: nothing to shard, the model trains whole", file=sys.stderr)

        self.eval_rewards = RewardPool(kind=cfg.task.reward_pool, name=f"of task {self.task.name}", rules=RewardRules.of(cfg.task))
        kind = engine_kind(cfg.engine.kind)
        how = f"attaching to {len(cfg.engine.urls)} server(s)" if kind.attaches(cfg) else "starting"
        what = f"rollout process and {cfg.engine.kind} engine" if kind.own_process(cfg) else f"{cfg.engine.kind} engine"
        with self.display.phase(f"{what}: {how}") as phase:
            # A resume cuts the ledger back to the checkpoint: later fates belong to the crashed
            # session (sdp_cli/train/asyncloop/ledger.py).
            self.rollout = self._start_rollout(
                stop_ids, max_new, ledger_offset=checkpoint.state["loop"].get("ledger_offset") if checkpoint else 0
            )
            logs = ", ".join(str(path) for path in self.rollout.log_paths)
            phase.result = f"ready (log: {logs})" if logs else "ready"
        self.loop = AsyncLoop(
            cfg,
            rollout=self.rollout,
            trainer=self.trainer,
            pad_token_id=int(self.policy.pad_token_id),
            push_weights=self._weight_update,
            on_batch=self.coordinator.send_batch,
            on_step=self._on_step,
            should_stop=lambda: self.stop_request.requested,
        )
        if checkpoint is not None:
            self._last_checkpoint = (checkpoint.step, checkpoint.path)
        if checkpoint is not None or engine_kind(cfg.engine.kind).attaches(cfg):
            self._sync_engine(self.trainer.version)
        if checkpoint is not None:
            self.loop.restore(checkpoint.state["loop"])
            self.events.write(
                "resumed",
                step=self.start_step,
                version=self.trainer.version,
                checkpoint=str(checkpoint.path),
                optimizer_restarted=checkpoint.state["optimizer"] is None,
                **({"discarded": discarded} if discarded else {}),
            )
        else:
            self.events.write(
                "started",
                overrides=self.overrides,
                processes=self.coordinator.num_processes,
                task=self.task.summary(),
                **({"note": "no complete checkpoint: started over"} if over else {}),
                **({"discarded": discarded} if discarded else {}),
            )
            if cfg.train.keep_version_checkpoints:
                self._save_version(0)

        start_step = self.start_step
        cut = checkpoint is not None or over  # a start over drops what was logged
        self.metrics = MetricsLog(self.run_dir.metrics, resume_step=start_step if cut else None)
        names = active_trackers(cfg.run.trackers, cfg.run.tensorboard)
        remote = [n for n in names if n != "tensorboard"]
        with self.display.phase(f"starting {', '.join(remote)}") if remote else contextlib.nullcontext():
            self.trackers = open_trackers(
                names,
                self.run_dir,
                project=cfg.run.project,
                config=config_dict(self.raw),
                resume_step=start_step if cut else None,
            )

    def _start_rollout(
        self, stop_ids: tuple[int, ...], max_new: int, *, ledger_offset: int | None
    ) -> RolloutSide | RolloutLink:
        """The rollout side of the run, with its engine and the group ledger (opened after the
        engine starts, so that a failed start leaves a resumed run's ledger as it was): in the
        rollout process when the engine builds in two halves (docs/training.md "Three
        processes"), else in this process."""
        cfg = self.cfg
        if self._rollout_process is not None:
            split = self._core_split()
            process, self._rollout_process = self._rollout_process, None
            return process.begin(
                cfg,
                policy=self.whole.get(),
                run_dir=self.run_dir,
                stop_token_ids=stop_ids,
                max_new_tokens=max_new,
                ledger_offset=ledger_offset,
                device=self.coordinator.accelerator.device,
                engine_threads=thread_counts(cfg)[1],
                cores=None if split is None else split[1],
            )
        engine = build_engine(
            cfg, self.whole.get(), self.run_dir, device=self.coordinator.accelerator.device, threads=thread_counts(cfg)[1]
        )
        try:
            ledger = LedgerLog(self.run_dir.ledger, truncate_to=ledger_offset)
        except BaseException:
            engine.close()
            raise
        return RolloutSide(
            cfg,
            engine=engine,
            task=self.task,
            codec=self.codec,
            stop_token_ids=stop_ids,
            max_new_tokens=max_new,
            max_consecutive_engine_faults=cfg.engine.max_consecutive_faults,
            ledger=ledger,
            recompute_threads=cfg.train.threads or os.cpu_count(),
            rollout_threads=thread_counts(cfg)[1],
        )

    def _core_split(self) -> tuple[list[int], list[int]] | None:
        """The cores of (this process, the rollout process) while the loop runs, or None
        (``placement.core_split``)."""
        cfg = self.cfg
        own = engine_kind(cfg.engine.kind).own_process(cfg)
        return core_split(cfg, own_process=own, device=self.coordinator.accelerator.device.type)

    def _sync_engine(self, version: int) -> None:
        """Make the engine run the trainer's weights as ``version``. The local engine and a
        launched server were built from them, so only the version is declared; servers sdp
        attached to (engine.urls) run whatever they ran before (another run's weights, or a
        crashed session's newer ones), so they load these weights."""
        if not engine_kind(self.cfg.engine.kind).attaches(self.cfg):
            self.rollout.sync_engine(None, version)
            return
        target = self.run_dir.weights_of(version)
        self._save_policy(target)
        self.rollout.sync_engine(WeightUpdate(version=version, path=target), version)

    # -- weights ------------------------------------------------------------
    def _weight_update(self, version: int) -> WeightUpdate:
        if self.cfg.train.keep_version_checkpoints:
            self._save_version(version)
        if self.rollout.accepts_state_dict:
            return WeightUpdate(version=version, state_dict=self.whole.weights())
        target = self.run_dir.weights_of(version)
        self._save_policy(target)
        for old in superseded_versions(self.run_dir.weights, version):
            shutil.rmtree(old, ignore_errors=True)
        return WeightUpdate(version=version, path=target)

    def _save_policy(self, directory: Path) -> None:
        from sdp_cli.models import save_policy

        save_policy(self.whole.get(), directory)

    def _save_version(self, version: int) -> None:
        save_version(self.whole.get(), self.cfg, self.run_dir.version(version))

    # -- per step -----------------------------------------------------------
    def _on_step(self, record: StepRecord) -> None:
        cfg = self.cfg
        metrics = dict(record.metrics)
        metrics["version"] = float(record.version)
        metrics.update(self._reward_errors(record.step))
        self.metrics.write(record.step, metrics)
        fault_point("run.metrics_written")
        self.trackers.log(record.step, metrics)
        self.progress.update(record.step, metrics)
        # after the step's row: a batch file too large for the disk stops the run at this step,
        # which its row then records (a resume goes on from the next: the row could not come later)
        if cfg.train.save_batches:
            self._save_batch(record)
        every = cfg.train.checkpoint_every
        if (every and record.step % every == 0) or record.step == cfg.train.steps:
            self.checkpoint(record.step)
        if cfg.train.eval_every and record.step % cfg.train.eval_every == 0 and record.step != cfg.train.steps:
            self._evaluate(record.step)
        self.whole.release()  # gathered weights live for one step
        self.coordinator.agree_stop(self.stop_request)

    def _save_batch(self, record: StepRecord) -> None:
        from sdp_cli.train.step.batch_io import write_train_batch

        write_train_batch(
            self.run_dir.batch(record.step),
            record.batch,
            record.output,
            temperature=self.cfg.rollout.temperature,
            model=self.policy.name,
            mode=resolve_mode(self.cfg.loss.mode).name,
        )

    def checkpoint(self, step: int) -> Path:
        if self._last_checkpoint is not None and self._last_checkpoint[0] == step:
            return self._last_checkpoint[1]  # e.g. a stop right after a scheduled checkpoint
        # the trainer's state through its state_dict; the optimizer's from a gather every rank joins
        optimizer = self.coordinator.call("optimizer_state") if self.cfg.train.save_optimizer else None
        optimizer_state, trainer_entry = ckpt.trainer_parts(
            {**self.trainer.state_dict(model=False, optimizer=False), "optimizer": optimizer}
        )
        policy = self.whole.get()
        path = ckpt.write_checkpoint(
            self.run_dir.checkpoints,
            step,
            save_policy=lambda directory: save_checkpoint_policy(policy, directory),
            optimizer_state=optimizer_state,
            state={"trainer": trainer_entry, "loop": self.loop.snapshot(), STAMP: self.stamp},
            keep=self.cfg.train.keep_checkpoints,
        )
        self._last_checkpoint = (step, path)
        self.events.write("checkpoint", step=step, path=str(path))
        return path

    def _evaluate(self, step: int, progress: Callable[[int, int], None] | None = None) -> float | None:
        """Greedy accuracy on held-out problems; None (nothing written) when the task has none."""
        from sdp_cli.models import greedy_accuracy

        cfg = self.cfg
        budget = cfg.train.eval_max_new_tokens or cfg.rollout.max_new_tokens or self.task.max_new_tokens
        with self.trainer.autocast():  # the training precision
            acc = greedy_accuracy(
                self.whole.get(), self.task, n=cfg.train.eval_samples, seed=cfg.seed + 7, max_new_tokens=budget,
                progress=progress, score=self._eval_scores,
            )  # fmt: skip
        if acc is None:  # no held-out problems, or a stop came first
            return None
        self.metrics.write(step, {"eval/greedy_accuracy": acc})
        self.trackers.log(step, {"eval/greedy_accuracy": acc})
        self.events.write("eval", step=step, greedy_accuracy=acc)
        return acc

    def _eval_scores(self, calls: list[Callable[[], Any]], wheres: list[str]) -> list[tuple[float, dict[str, float]]] | None:
        """Score the evaluation's completions on its own reward pool, so that a reward that hangs
        keeps no stop waiting: None once a stop was requested (nothing is written then)."""
        assert self.eval_rewards is not None, "evaluation runs on rank 0"
        return self.eval_rewards.score(calls, wheres, give_up=lambda: self.stop_request.requested)

    # -- main ---------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Evaluate, train to ``train.steps``, evaluate; a stop (a signal, an engine fault, a
        reward of yours failing, a full disk) ends the session with a checkpoint of the step it
        reached (none inside a step) and raises ``Interrupted`` or ``UserError``."""
        cfg = self.cfg
        title = start_evaluation_title(self.start_step)
        try:
            acc_start = self._shown_evaluation(title, self.start_step) if cfg.train.eval_samples else None
        except (UserError, OSError) as exc:  # a reward of yours failing on a held-out problem, a full disk
            self.close()
            raise self._stop(exc)
        self.progress = Progress(cfg.train.steps, start=self.start_step, enabled=cfg.run.progress)
        # Counters are checkpointed: a resumed session's rates use only what it did itself.
        session_start = self.loop.counters()
        stopped: BaseException | None = None
        # What setup built (modules, model, tokenizer) lives as long as the loop: frozen, it is
        # out of the cyclic collector's full passes, each of which walked it with the GIL held
        # (0.3 s on 2 cores, stalling the trainer, the producer and the reward threads at once).
        gc.collect()
        gc.freeze()
        # The session's clock (its steps/s) times the loop alone: not that collection, which is
        # setup's, nor closing the engine and the pools below.
        split = self._core_split()
        everywhere = os.sched_getaffinity(0)
        if split is not None:
            pin_process(split[0])  # the trainer's half (docs/training.md "Staleness and threads")
        t0 = time.perf_counter()
        try:
            self.loop.run()
        except (LoopStopped, UserError, OSError) as exc:  # an engine fault, a reward, your mode, a full disk
            stopped = exc
        except BaseException:  # an abort (a second Ctrl-C) or a bug: no collective, no waiting; the
            self.close()  # logs stay open for the aborted event (_train)
            raise
        finally:
            gc.unfreeze()  # a process that trains again (a sweep's worker) can free this run's objects
            if split is not None:
                pin_process(everywhere)  # the final evaluation, and a process that trains again
        wall = time.perf_counter() - t0
        # the other ranks still follow: checkpoints and evaluations may gather from them
        self.close()
        if not self.coordinator.call("in_sync"):
            error = UserError("the training processes ended with different weights; report this as a bug")
            self._end_session(error.exit_code)
            raise error
        if stopped is not None:
            raise self._stop(stopped)
        try:  # the run is trained: what fails now stops it at its last step, checkpointed
            acc_end = self._shown_evaluation("final evaluation", cfg.train.steps) if cfg.train.eval_samples else None
            self._end_evaluation()
            summary = self.end.summary(
                self.loop.step,
                self.loop.counters(),
                self.loop.filtered_groups(),
                start_step=self.start_step,
                wall=wall,
                acc_start=acc_start,
                acc_end=acc_end,
                session_start=session_start,
            )
            atomic_write_text(self.run_dir.summary, json.dumps(summary, indent=2) + "\n")
            self.events.write("finished", **{k: v for k, v in summary.items() if not isinstance(v, dict)})
        except (UserError, OSError) as exc:
            raise self._stop(exc)
        self._end_session(0)
        self._close_logs()
        return summary

    def _shown_evaluation(self, title: str, step: int) -> float | None:
        """``_evaluate`` as a phase of the start display (a long one on a real model)."""
        with self.display.phase(f"{title} (greedy, held-out prompts)") as phase:
            acc = self._evaluate(step, progress=lambda done, total: phase.update(f"{done}/{total} prompts"))
            phase.result = "no held-out prompts" if acc is None else f"greedy accuracy {acc:.2f}"
        return acc

    def follow(self) -> int:
        """Ranks other than 0: train on each batch rank 0 sends and join the collectives it asks
        for, until it ends the run; returns the exit status it sent."""
        pad, scale = int(self.policy.pad_token_id), self.cfg.loss.scale_adv_by_std

        def train(groups: list[RolloutGroup]) -> None:
            batch = assemble_batch(groups, pad_token_id=pad, trainer_version=self.trainer.version, scale_adv_by_std=scale)
            try:
                self.trainer.step(batch)
            except UserError:
                # your correction mode failed on this batch before any update: on every rank, each
                # weighing the whole batch. Rank 0 stops the run there; this rank follows it to the end.
                pass

        return self.coordinator.serve(train)

    # -- end (what it records and says: self.end, sdp_cli/train/session/session_end.py) -----------------
    def _end_session(self, code: int) -> None:
        """Release the other ranks, which exit with ``code`` as rank 0 will (0, 1 or 2, or 128 +
        the signal); after the last collective this session needs (checkpoint, evaluation)."""
        self.coordinator.end(code)

    def close(self, *, abort: bool = False) -> None:
        """Stop what this session started that outlives it (a launched server); idempotent.
        ``abort``: the process is about to end, the evaluation's reward workers and the logs
        are closed too."""
        if getattr(self, "progress", None) is not None:
            self.progress.close()
        if self._rollout_process is not None:  # setup stopped before the rollout side started
            self._rollout_process.cancel(keep_output=self.run_dir.logs / ROLLOUT_LOG)
        if self.rollout is not None:
            self.rollout.close()
        if abort:
            self._end_evaluation()
            self._close_logs(ok=False)

    def _end_evaluation(self) -> None:
        """No evaluation follows: end its reward workers (a call still running is left to them)."""
        if self.eval_rewards is not None:
            self.eval_rewards.close()

    def _reward_errors(self, step: int) -> dict[str, float]:
        """``reward/errors`` (task.reward_errors=zero): the reward calls that failed and scored 0
        since the last step; and a ``reward_error`` event with the first traceback of each error
        not seen before (greedy evaluation's included)."""
        failed, first = self.loop.reward_errors()
        if self.eval_rewards is not None:
            first += self.eval_rewards.take_errors()[1]
        for error in first:
            self.end.event("reward_error", step=step, error=str(error), traceback=error.details or None)
        return {"reward/errors": float(failed)} if self.cfg.task.reward_errors == "zero" else {}

    def _close_logs(self, *, ok: bool = True) -> None:
        """Close the run's logs and end the rollout side (its ledger); ``ok``: the session finished
        (trackers mark a run that did not)."""
        if self.rollout is not None:
            self.rollout.shutdown()
        for log in ("metrics", "events"):
            if getattr(self, log, None) is not None:
                getattr(self, log).close()
        if getattr(self, "trackers", None) is not None:
            self.trackers.close(ok=ok)

    def _checkpoint_at_stop(self, step: int) -> SavedAtStop:
        """The checkpoint of ``step`` (written now unless it exists), or the error that kept it
        from being written (a full disk)."""
        if step == self.start_step and self._last_checkpoint is None:
            return None  # a fresh run that never stepped: a resume starts it over
        try:
            return self.checkpoint(step)
        except OSError as err:
            return err

    def _stopped(self, exc: BaseException) -> Interrupted | UserError:
        """The end of a session stopped: by a signal (``LoopInterrupted``, at a step boundary:
        that step is checkpointed), or by an error you can fix, an engine fault, a failed producer
        or reward, a full disk (checkpointed if it trained a step, unless it came inside one:
        ``AsyncLoop.inside_step``)."""
        step = self.loop.step
        self._end_evaluation()
        signal = isinstance(exc, LoopInterrupted)
        inside = self.loop.inside_step  # (a signal stops the loop between steps only)
        saved = self._checkpoint_at_stop(step) if not inside and (signal or step > self.start_step) else None
        self._reward_errors(step)
        if signal:
            end = self.end.interrupted(step, self.stop_request, saved)
        else:
            end = self.end.stopped(step, exc, saved, inside_step=inside)
        self._close_logs(ok=False)
        return end

    def _stop(self, exc: BaseException) -> Interrupted | UserError:
        """``_stopped``, the other ranks released with its exit status: the error to raise."""
        end = self._stopped(exc)
        self._end_session(end.exit_code)
        return end

    def aborted(self, signum: int) -> Interrupted:
        """The end of a session aborted by a second Ctrl-C: no checkpoint, the last complete one
        is the resume point."""
        step = self.loop.step if self.loop is not None else self.start_step
        end = self.end.aborted(step, signum)
        self.close(abort=True)
        return end

    def crashed(self, exc: BaseException) -> None:
        """The end of a session ended by a bug (an exception no stop expects): close what it
        opened, and add to the traceback how to go on from the last complete checkpoint."""
        self.close(abort=True)
        exc.add_note(self.end.crash_note(self.loop.step if self.loop is not None else self.start_step))


def run_training(
    cfg: SdpConfig,
    raw: Any,
    *,
    overrides: list[str],
    source: ConfigSource = ConfigSource(),
    stop: StopRequest | None = None,
    keep_lock: bool = False,
    rollout_process: RolloutProcessStart | None = None,
) -> dict[str, Any] | None:
    """Start (or resume) a run and return its summary (None on ranks other than 0).
    ``rollout_process``: the run's, started as the command began (``early_start``); the run
    gives it its recipe, or ends it.

    SIGINT, SIGTERM and SIGHUP stop it at a step boundary with a checkpoint (``Interrupted``); a
    second SIGINT aborts at once (docs/reliability.md, "Signals"). One process per run directory:
    ``keep_lock`` leaves the directory locked on return, until the process ends (``sdp train``,
    which exits right after: no second process gets the directory while this one still tears
    down); otherwise the lock is given up on return, unless a reward call still runs.
    """
    from accelerate import Accelerator

    from sdp_cli.train.asyncloop.distributed import Coordinator, check_launch

    check_launch(os.environ)
    coordinator = Coordinator(Accelerator(cpu=not torch.cuda.is_available()))
    # ranks other than 0 follow rank 0, which decides where the run stops (no abort of their own)
    stop = stop or StopRequest(abortable=coordinator.is_main)
    # several processes: rank 0 ignores SIGTERM once the run is over (Coordinator.end), and
    # restoring the default handler at the end of the block would undo that
    with handling(stop, restore=not coordinator.distributed):
        return _train(cfg, raw, overrides, source, coordinator, stop, keep_lock, rollout_process)


def _train(
    cfg: SdpConfig,
    raw: Any,
    overrides: list[str],
    source: ConfigSource,
    coordinator: Coordinator,
    stop: StopRequest,
    keep_lock: bool,
    rollout_process: RolloutProcessStart | None,
) -> dict[str, Any] | None:
    start: RunStart | None = None
    run: TrainingRun | None = None
    try:
        start = open_run(cfg, raw, overrides, source, coordinator)
        owned = start.owned
        display = StartDisplay(enabled=start.cfg.run.progress and coordinator.is_main)
        if coordinator.is_main:
            if not start.resuming:  # a resume announced its checkpoint and step (train/session/start.py)
                display.line(f"run dir {start.run_dir.path}")
            print(start.task.summary(), file=sys.stderr)
        run = TrainingRun(
            start.cfg,
            start.raw,
            overrides,
            start.run_dir,
            resuming=start.resuming,
            coordinator=coordinator,
            task=start.task,
            checkpoint=start.checkpoint,
            stop_request=stop,
            display=display,
            rollout_process=rollout_process if coordinator.is_main else None,
        )
        try:
            run.setup()
            if coordinator.is_main:  # (a full disk here: the engine set up is closed too)
                for path, text in start.deferred:
                    atomic_write_text(path, text)
        except BaseException as exc:
            # a resume accepted records its end, so that the next one finds no crash
            if run.resume_accepted and isinstance(exc, Abort):
                raise  # its aborted event, then the close (below: run.aborted)
            if run.resume_accepted and isinstance(exc, UserError):
                run.end.event("stopped", step=run.start_step, reason=str(exc), checkpoint=None)
            run.close(abort=True)
            if owned is not None and owned.created:
                owned.remove(exc)  # nothing was trained: a failed start leaves nothing behind
                run = None
            raise
        if not coordinator.is_main:
            coordinator.end_follower(run.follow())
        summary = run.run()
        print(summary_line(summary, run.end.resume_command(f"train.steps={2 * summary['steps']}")))
        return summary
    except Abort as abort:
        if run is None:
            raise Interrupted(f"aborted (second {signal_name(abort.signum)}) before training started", 128 + abort.signum) from None
        raise run.aborted(abort.signum) from None
    except BaseException as exc:
        if run is not None and not isinstance(exc, (UserError, Interrupted)):
            run.crashed(exc)
        raise
    finally:
        # A reward call still running (abandoned at its timeout, or cut off by the stop) may do
        # anything until the process ends: the lock stays held until then, and the kernel
        # releases it when the process, which waits for no such call, exits (cli/main.py _exit).
        if start is not None and start.owned is not None:
            if keep_lock or user_code_running(grace_s=1.0):
                start.owned.lock.keep()
            else:
                start.owned.lock.release()
