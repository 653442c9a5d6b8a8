"""The run's task from its config, checked before anything is written, and the prompt preview.

``prepare_task`` reads and checks the data, imports the reward function and renders the prompts
with the model's tokenizer (chat template), dropping those longer than ``task.max_prompt_tokens``
or than the model's context leaves beside the generation budget (``run_context``; docs/tasks.md
"Limits on a record"), and counts the records the tiny model's warm start skips. ``sdp train`` calls it before it creates the run directory, so bad data, a broken
reward file or a missing model is one line and nothing written. ``show_prompts`` is the
``sdp train --show-prompts N`` dry run: the exact prompts the policy will see, with token counts.
"""

from __future__ import annotations

import random
from typing import Any

from sdp_cli.config.schema import SdpConfig
from sdp_cli.errors import UserError
from sdp_cli.models.context import TINY_CONTEXT, model_context
from sdp_cli.models.gguf import is_gguf
from sdp_cli.models.gguf_cache import load_gguf_tokenizer_cached
from sdp_cli.tasks import DATA_TASKS, DatasetTask, Task, build_task, task_parameters
from sdp_cli.tasks.base import Context


def task_kwargs(cfg: SdpConfig) -> dict[str, Any]:
    """The ``build_task`` arguments of ``cfg.task``: each parameter of the task (a data task's:
    ``sdp_cli.dataset_options``) that is a ``task.*`` key set in the config, and ``seed``, the
    run's; unset (null) keys keep the task's defaults."""
    kwargs: dict[str, Any] = {}
    for name in task_parameters(cfg.task.name):
        value = cfg.seed if name == "seed" else getattr(cfg.task, name, None)
        if value is not None:
            kwargs[name] = dict(value) if isinstance(value, dict) else value
    return kwargs


def build_task_from(cfg: SdpConfig) -> Task:
    """The task of the config, data read and checked (prompts not yet tokenizer-rendered)."""
    return build_task(cfg.task.name, **task_kwargs(cfg))


def load_tokenizer(cfg: SdpConfig, task: Task) -> Any:
    """The policy's tokenizer without its weights: a local or hub model's, or the tiny model's."""
    if cfg.model.kind == "hf" and is_gguf(cfg.model.path):
        return load_gguf_tokenizer_cached(cfg.model.path, cache=cfg.model.gguf_cache)
    if cfg.model.kind == "hf":
        from sdp_cli.models.tokenizer import load_tokenizer as load_saved_tokenizer
        from sdp_cli.models.model_dir import resolve_model_dir

        directory = resolve_model_dir(cfg.model.path or "")
        try:
            return load_saved_tokenizer(directory)
        except (OSError, ValueError) as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise UserError(f"cannot load the tokenizer of model.path={cfg.model.path}: {first}") from None
    from sdp_cli.models.tokenizer import build_tokenizer

    return build_tokenizer(cfg.model.charset or task.charset)


def run_context(cfg: SdpConfig, task: Task) -> Context | None:
    """The model's context and the largest generation budget of the run (rollouts, and greedy
    evaluation when ``train.eval_max_new_tokens`` is larger); None when the model's config does
    not state a context. One-line UserError when the budget leaves no room for a prompt."""
    tokens = model_context(cfg)
    if tokens is None:
        return None
    rollout = cfg.rollout.max_new_tokens or task.max_new_tokens
    evaluation = cfg.train.eval_max_new_tokens or rollout
    key = "rollout.max_new_tokens" if rollout >= evaluation else "train.eval_max_new_tokens"
    budget = max(rollout, evaluation)
    if budget >= tokens:
        raise UserError(
            f"{key}={budget} leaves no room for a prompt in the model's context of {tokens} tokens; lower it"
        )
    return Context(tokens=tokens, budget=budget, budget_key=f"{key}={budget}")


def prepare_task(cfg: SdpConfig, *, tokenizer: Any = None) -> Task:
    """The task, ready to sample: data checked, reward imported, prompts rendered and length
    filtered with the model's tokenizer, warm-start records fitted to the tiny model's context.
    One-line UserError otherwise."""
    task = build_task_from(cfg)
    context = run_context(cfg, task)
    if isinstance(task, DatasetTask):
        if task.needs_tokenizer or tokenizer is not None or context is not None:
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg, task)
            task.prepare(tokenizer, context)
        if cfg.model.kind == "tiny" and cfg.model.warm_start_steps != 0:
            task.require_answers("the tiny model's warm start imitates (or set model.warm_start_steps=0)")
            # as the warm start counts them (sdp_cli/models/warm_start.py), but before anything is written
            task.fit_warm_start(tokenizer, TINY_CONTEXT)
    return task


def show_prompts(cfg: SdpConfig, n: int) -> str:
    """The first ``n`` training prompts of a run, exactly as tokenized, with token counts."""
    task = build_task_from(cfg)
    tokenizer = load_tokenizer(cfg, task)
    if isinstance(task, DatasetTask):
        task.prepare(tokenizer, run_context(cfg, task))
    # the loop's producer draws with this generator (sdp_cli/train/asyncloop/producer.py)
    items = task.stream(random.Random(cfg.seed + 1), 0, n)
    lines = [task.summary()]
    for k, item in enumerate(items):
        ids = tokenizer.encode(item.prompt, add_special_tokens=True)  # as Policy.encode_prompt
        shown = tokenizer.decode(ids, skip_special_tokens=False)
        where = f", {task.where(item)}" if isinstance(task, DatasetTask) else ""
        lines.append(f"--- prompt {k} ({len(ids)} tokens{where}) ---")
        lines.append(shown)
    return "\n".join(lines)


def prompt_comment(cfg: SdpConfig) -> str:
    """``--print-config``'s addition for a data task: its first training prompt as rendered,
    as YAML comments so the output stays valid YAML ("" for generated tasks)."""
    if cfg.task.name not in DATA_TASKS:
        return ""
    task = prepare_task(cfg)
    assert isinstance(task, DatasetTask), f"data task {cfg.task.name} is not a DatasetTask"
    (item,) = task.stream(random.Random(cfg.seed + 1), 0, 1)
    lines = [f"# first training prompt ({task.where(item)}), rendered:"]
    lines += [f"#   {line}" for line in item.prompt.split("\n")]
    return "\n".join(lines) + "\n"
