"""Supervised warm start of a tiny model, cached on disk between runs.

Sparse-reward RL from a random or barely trained tiny model almost never sees a reward (a probe
on two-digit addition stayed at about 2 % reward after a 300-step warm start), so a
tiny policy first learns the task format by teacher forcing on ``prompt + answer + EOS`` with the
loss on the answer and EOS tokens only: AdamW, gradient norm clipped at 1, learning rate decayed
linearly to 0 over ``steps``. Records whose ``prompt + answer + EOS`` exceed the model's context
(``max_positions``) are skipped (``Task.fit_warm_start``; counted as ``skipped_records``), and
greedy decoding stops at the context too. With a ``target`` accuracy, training stops early once greedy
accuracy on validation problems reaches it (checked every ``check_interval(steps)`` steps), so that
RL starts from a comparable policy whatever the seed: on arith2 the accuracy jumps from ~0.1 to
~0.9 within 100-200 steps, at a step that varies by hundreds between seeds. Validation problems
are training problems (``Task.validation_items``): held-out problems are left to the run's
evaluation, so the accuracy it reports is measured on problems nothing has selected on.

The result is cached under ``$SDP_CACHE_DIR`` (default ``~/.cache/sdp``) in
``warm_start/<key>/``: a Hugging Face model directory (safetensors + config), the tokenizer files,
and ``warm_start.json`` with the key inputs, the greedy accuracy on the validation problems
(``validation_accuracy``, on ``validation_n`` problems) and the size and sha256 of every other file. The key is a hash of everything that changes the weights (architecture,
charset, task and its parameters, steps, learning rate, batch size, target, seed,
``FORMAT_VERSION``). An entry appears whole or not at all and is verified against its checksums
before every use (sdp_cli/models/cache_entry.py); two processes that train the same key at once
both succeed and one of the two identical results is kept. A damaged entry (truncated or altered
files, unreadable or missing ``warm_start.json``, written without checksums by an older sdp) is
rebuilt with a one-line warning instead of failing every later run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from sdp_cli.errors import UserError, WriteFailed, write_fix
from sdp_cli.fileio import written_by_safetensors
from sdp_cli.models.cache_entry import cache_root, publish, set_aside, staging_dir, verified_info
from sdp_cli.models.evaluate import accuracy_on
from sdp_cli.models.policy import Policy
from sdp_cli.models.tiny import build_tiny_model
from sdp_cli.models.tokenizer import build_tokenizer
from sdp_cli.tasks.base import Task

log = logging.getLogger(__name__)

#: bump when the training recipe or the entry layout changes, so old entries are not reused
#: (3: early stopping and the recorded accuracy use validation problems, not held-out ones)
FORMAT_VERSION = 3
INFO_FILE = "warm_start.json"
#: validation problems the greedy accuracy is measured on (towards the target, and recorded)
EVAL_N = 256
_VALIDATION_SEED_OFFSET = 1_000_003  # validation problems come from another stream than SFT batches


#: a warm start at or above this validation accuracy leaves RL little to learn: ``sdp train`` warns
SOLVED_ACCURACY = 0.9


def warm_start_note(accuracy: float, n: int) -> str:
    """What ``sdp train`` prints about the warm start: its greedy accuracy on ``n`` validation
    problems, and from ``SOLVED_ACCURACY`` up a second line, the warning that RL has little to
    learn and how to start it from a weaker policy (docs/tasks.md "What the warm start trains on")."""
    note = f"warm start: greedy accuracy {accuracy:.2f} on {n} validation problems (training problems)"
    if accuracy < SOLVED_ACCURACY:
        return note
    return (
        f"{note}\nwarning: the warm start already solves {accuracy:.0%} of the validation problems, so RL has "
        "little to learn; start from a weaker policy with model.warm_start_target=0.5 (stop at that accuracy) "
        "or fewer model.warm_start_steps"
    )


@dataclass(frozen=True)
class WarmStartSettings:
    """SFT recipe: at most ``steps`` AdamW steps at peak learning rate ``lr`` on ``batch_size``
    problems each, stopping early at greedy accuracy ``target`` (None: run every step)."""

    steps: int
    lr: float
    batch_size: int
    target: float | None = None


# Measured with one torch thread on the shared 2-core machine, greedy accuracy on 1000 problems:
# arith1, 40 steps: 0.40, 0.50, 0.41 for seeds 0-2 (7-8 s). arith2: at a constant lr, 800 steps
# gave 0.15, 0.90, 0.83, hence decay + target: stops after 500, 425, 600 steps at 0.50, 0.54, 0.48
# (100-155 s). gsm8k solutions are ~200 characters, hence the smaller batch (not tuned).
DEFAULT_SETTINGS: dict[str, WarmStartSettings] = {
    "arith1": WarmStartSettings(steps=40, lr=1e-3, batch_size=64),
    "arith2": WarmStartSettings(steps=800, lr=1e-3, batch_size=64, target=0.4),
    # measured (docs/tasks.md "Running sums"): stopped at 0.6 validation accuracy, RL at lr 2e-5
    # then lifts held-out accuracy to ~0.93 within 40 steps at η = 0; from 0.3 it gained little
    "runsum": WarmStartSettings(steps=3000, lr=1e-3, batch_size=64, target=0.6),
    "gsm8k": WarmStartSettings(steps=100, lr=1e-3, batch_size=16),
}
_FALLBACK_SETTINGS = WarmStartSettings(steps=200, lr=1e-3, batch_size=64)


def check_interval(steps: int) -> int:
    """Steps between two accuracy checks when training towards a target (about 32 checks)."""
    return max(5, steps // 32)


def default_settings(task_name: str) -> WarmStartSettings:
    """The recipe used when the caller does not override it."""
    return DEFAULT_SETTINGS.get(task_name, _FALLBACK_SETTINGS)


def cache_key(
    *,
    arch: dict[str, Any],
    charset: str,
    task: Task,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    target: float | None = None,
) -> tuple[str, dict[str, Any]]:
    """``(key, inputs)``: the hex digest and the JSON-able inputs it hashes."""
    inputs = {
        "format_version": FORMAT_VERSION,
        "model": {"type": "qwen2", **arch},
        "charset": charset,
        "task": {"name": task.name, **task.params()},
        "steps": steps,
        "lr": lr,
        "batch_size": batch_size,
        "target": target,
        "seed": seed,
    }
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:32], inputs


def sft_batch(tokenizer: Any, task: Task, items: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``target_mask`` (1 where the token is part
    of the answer or the final EOS, i.e. where the loss applies) for ``prompt + answer + EOS``."""
    rows, targets = [], []
    for item in items:
        prompt, answer = task.sft_example(item)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)
        answer_ids = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append(prompt_ids + answer_ids)
        targets.append([0] * len(prompt_ids) + [1] * len(answer_ids))
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    target_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, target) in enumerate(zip(rows, targets)):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
        target_mask[i, : len(row)] = torch.tensor(target)
    return input_ids, attention_mask, target_mask


def sft_loss(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, target_mask: torch.Tensor
) -> torch.Tensor:
    """Mean next-token cross-entropy over the target positions (logits at t predict token t+1)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    labels = input_ids[:, 1:]
    mask = target_mask[:, 1:].to(logits.dtype)
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    return (nll * mask).sum() / mask.sum()


def train_sft(
    model: torch.nn.Module,
    tokenizer: Any,
    task: Task,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    stop: Callable[[int], bool] | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Teacher-force ``model`` in place; returns the loss of every step taken.

    The learning rate decays linearly from ``lr`` to 0 over ``steps``. Every
    ``check_interval(steps)`` steps, ``stop(step)`` is called with the model in eval mode and
    training ends if it returns True. ``on_step(step, loss)`` follows every step (progress).
    """
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 1.0 - done / steps)
    interval = check_interval(steps)
    model.train()
    losses = []
    for step in range(1, steps + 1):
        loss = sft_loss(model, *sft_batch(tokenizer, task, task.sft_sample(rng, batch_size)))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
        if stop is not None and step % interval == 0 and step < steps:
            model.eval()
            if stop(step):
                break
            model.train()
    model.eval()
    return losses


def _cannot_write(entry: Path, err: OSError) -> WriteFailed:
    return WriteFailed(
        f"cannot write the warm-start cache entry {entry} ({err.strerror or err}); {write_fix(err)} "
        "or set SDP_CACHE_DIR to another directory (nothing was written)",
        err,
        entry,
    )


def warm_start(
    task: Task,
    *,
    arch: dict[str, Any],
    charset: str,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    target: float | None = None,
    cache_dir: str | Path | None = None,
    eval_n: int = EVAL_N,
    progress: Callable[[str], None] | None = None,
) -> tuple[Path, dict[str, Any]]:
    """The cache entry for these settings, training and writing it first if it does not exist
    (``progress`` gets a short line after every training step and accuracy check).

    Greedy accuracy (towards ``target`` and the one recorded as ``validation_accuracy``) is
    measured on at most ``eval_n`` validation problems, training problems chosen by the seed
    (``Task.validation_items``); held-out problems never reach the warm start. Returns
    ``(entry_dir, info)``; ``entry_dir`` is a Hugging Face model directory with tokenizer.
    """
    assert steps >= 1, f"warm start needs steps >= 1, got {steps}"
    assert target is None or 0.0 < target <= 1.0, f"target accuracy must be in (0, 1], got {target}"
    key, inputs = cache_key(
        arch=arch, charset=charset, task=task, steps=steps, lr=lr, batch_size=batch_size, seed=seed, target=target
    )
    root = cache_root(cache_dir) / "warm_start"
    entry = root / key
    if entry.exists():
        info, problem = verified_info(entry, INFO_FILE)
        if info is not None:
            log.info("warm start: using cached %s", entry)
            return entry, info
        log.warning("warm-start cache entry %s %s; rebuilding it", entry, problem)
        set_aside(entry, "warm-start cache entry")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(
            f"cannot create the cache directory {root} ({err.strerror}); set SDP_CACHE_DIR to a writable directory"
        ) from None

    log.info("warm start: training %s for up to %d steps (cache %s)", task.name, steps, entry)
    started = time.perf_counter()
    tokenizer = build_tokenizer(charset)
    model = build_tiny_model(len(tokenizer), seed=seed, **arch)
    policy = Policy(model, tokenizer, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id, name=key)
    skipped = task.fit_warm_start(tokenizer, arch["max_positions"])
    if skipped:
        log.info("warm start: %d records skipped, longer than the context of %d tokens", skipped, arch["max_positions"])

    validation = task.validation_items(eval_n, seed + _VALIDATION_SEED_OFFSET)

    def accuracy() -> float | None:
        return accuracy_on(policy, task, validation)

    def report(text: str) -> None:
        if progress is not None:
            progress(f"warm start on {task.name} (first use, cached afterwards): {text}")

    def reached_target(step: int) -> bool:
        report(f"step {step}/{steps}, measuring validation accuracy")
        value = accuracy()
        log.info("warm start: step %d validation accuracy %s (target %s)", step, value, target)
        report(f"step {step}/{steps}, validation accuracy {value} (target {target})")
        return value is not None and value >= target

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        losses = train_sft(
            model, tokenizer, task, steps=steps, lr=lr, batch_size=batch_size, seed=seed,
            stop=reached_target if target is not None else None,
            on_step=lambda step, loss: report(f"step {step}/{steps}, loss {loss:.3f}"),
        )
    report(f"{len(losses)} steps done, measuring validation accuracy")
    final_accuracy = accuracy()
    train_seconds = time.perf_counter() - started
    info = {
        "key": key,
        "inputs": inputs,
        "steps_run": len(losses),
        "validation_accuracy": final_accuracy,
        "validation_n": len(validation),
        "skipped_records": skipped,
        "final_loss": losses[-1],
        "train_seconds": round(train_seconds, 3),
    }
    log.info(
        "warm start: %s validation accuracy %s after %d steps, %.1f s",
        task.name,
        final_accuracy,
        len(losses),
        train_seconds,
    )

    try:
        tmp = staging_dir(entry)
    except OSError as err:
        raise _cannot_write(entry, err) from None
    try:
        with written_by_safetensors(tmp, shown_as=entry):
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # transformers writes the weights only on rank 0 once torch.distributed is initialised;
        # never publish an entry without them
        assert (tmp / "config.json").is_file() and any(tmp.glob("*.safetensors")), (
            f"warm start saved no model files into {tmp}: build the policy on rank 0 first"
        )
        publish(tmp, entry, info, INFO_FILE)
    except OSError as err:  # a full disk: the run cannot start without its warm start
        raise _cannot_write(entry, err) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    published, problem = verified_info(entry, INFO_FILE)
    if published is None:
        raise UserError(
            f"warm-start cache entry {entry} {problem} right after it was written; "
            "check the disk holding SDP_CACHE_DIR"
        )
    return entry, published
