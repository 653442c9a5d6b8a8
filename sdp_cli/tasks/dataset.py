"""Your own data as a task: ``task=dataset task.path=FILE task.reward=...`` (docs/tasks.md).

Records come from a JSONL, JSON or parquet file (``sdp_cli.tasks.datafile``). The prompt is the
``prompt_key`` field or ``prompt_template`` filled from the record's fields, optionally rendered
with the tokenizer's chat template; the reference answer (``answer_key``) is what the built-in
rewards compare with and what a tiny model's warm start imitates; the whole record goes to the
reward function. Checks run when the task is built, so a bad record stops ``sdp train`` before
it writes anything.

Held-out evaluation: ``eval_path`` (a second file) or ``eval_fraction`` (a fixed share of the
records, the same for every run seed). A held-out prompt that also occurs among the training
prompts is left out of evaluation, so evaluation never sees a training prompt.

Training walks the data in epochs, each in a seeded shuffled order (``stream``); prompts longer
than ``max_prompt_tokens``, or than the room the model's context leaves beside the generation
budget (``Context``), are dropped (counted in ``dropped``) once a tokenizer is known. The tiny
model's warm start skips the records whose prompt + answer + EOS exceed the context
(``fit_warm_start``, counted in ``sft_skipped``).
"""

from __future__ import annotations

import functools
import hashlib
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from sdp_cli.dataset_options import DatasetOptions
from sdp_cli.errors import UserError
from sdp_cli.tasks.base import Context, RewardValue, Task, TaskItem
from sdp_cli.tasks.datafile import Record, read_records
from sdp_cli.tasks.plugins import RewardSpec, call_reward, load_reward
from sdp_cli.tasks.rewards import check_record
from sdp_cli.tasks.templates import as_messages, chat_prompt, has_field, render
from sdp_cli.tasks.templates import field as record_field

#: the eval_fraction split is seeded by this, not by the run seed: every run holds out the same records
SPLIT_SEED = "sdp-eval-split"
TRAIN, EVAL = "train", "eval"


@dataclass(frozen=True)
class _Prompt:
    """A record's prompt before the tokenizer: text, or chat messages."""

    split: str
    index: int
    record: Record
    text: str | None
    messages: list[dict[str, str]] | None


def _zero() -> float:
    return 0.0


class DatasetTask(Task):
    """Prompts and references from a data file, scored by a reward plug-in."""

    name = "dataset"
    charset = "ascii"

    def __init__(self, options: DatasetOptions, *, name: str = "dataset"):
        self.name = name
        self.options = options
        self.max_new_tokens = options.max_new_tokens
        if options.path is None:
            raise UserError(f"task={name} needs task.path=FILE (a .jsonl, .json or .parquet file)")
        if options.reward is None:
            raise UserError(
                f"task={name} needs task.reward: final_number, boxed, regex, package.module:function "
                "or path/to/file.py:function (docs/tasks.md)"
            )
        if options.system_prompt is not None and not options.chat_template:
            raise UserError("task.system_prompt is used by the chat template; set task.chat_template=true too")
        self.path = Path(options.path).expanduser()
        self.reward_spec: RewardSpec = load_reward(options.reward, options.reward_kwargs, answer_key=options.answer_key)
        train = read_records(self.path, key="task.path")
        self._files = [self.path]
        if options.eval_path is not None:
            if options.eval_fraction is not None:
                raise UserError("set one of task.eval_path and task.eval_fraction, not both")
            eval_records = read_records(options.eval_path, key="task.eval_path")
            self._files.append(Path(options.eval_path).expanduser())
        elif options.eval_fraction is not None:
            train, eval_records = self._split(train, options.eval_fraction)
        else:
            eval_records = []
        self._records = {TRAIN: train, EVAL: eval_records}
        self._prompts = {split: [self._prompt(split, i, r) for i, r in enumerate(rs)] for split, rs in self._records.items()}
        self.dropped = {TRAIN: 0, EVAL: 0}
        #: the model's context and generation budget prompts were measured against (``prepare``)
        self.context: Context | None = None
        #: the model's tokenizer they were rendered and counted with (``prepare``): the policy's
        #: load takes it rather than reading it again (seconds for a GGUF file)
        self.tokenizer: Any = None
        #: warm-start problems when ``fit_warm_start`` left some out, else None (all of ``items``)
        self._sft_items: list[TaskItem] | None = None
        self._sft_fit: int | None = None
        self.sft_skipped = 0
        self.eval_overlap = 0
        self.token_counts: dict[tuple[str, int], int] = {}
        self.items: list[TaskItem] = []
        self._eval_items: list[TaskItem] = []
        self._prepared = False
        self._epoch_order: tuple[int, list[int]] = (-1, [])
        if not options.chat_template and options.max_prompt_tokens is None:
            self._build_items(None)

    # -------------------------------------------------------------- records
    def _split(self, records: list[Record], fraction: float) -> tuple[list[Record], list[Record]]:
        count = round(len(records) * fraction)
        if not 0 < count < len(records):
            raise UserError(
                f"task.eval_fraction={fraction} holds out {count} of the {len(records)} records in {self.path}; "
                "choose a fraction that leaves at least one record on each side, or use task.eval_path"
            )
        held = set(random.Random(SPLIT_SEED).sample(range(len(records)), count))
        return [r for i, r in enumerate(records) if i not in held], [r for i, r in enumerate(records) if i in held]

    def _prompt(self, split: str, index: int, record: Record) -> _Prompt:
        opts = self.options
        if opts.prompt_template is not None:
            text: str | None = render(opts.prompt_template, record.data, record.where)
            messages = None
        else:
            if not has_field(record.data, opts.prompt_key):
                fields = ", ".join(sorted(record.data)) or "none"
                raise UserError(
                    f"{record.where}: no field {opts.prompt_key!r} (task.prompt_key; the record has {fields}); "
                    "set task.prompt_key or task.prompt_template"
                )
            value = record_field(record.data, opts.prompt_key)
            messages = as_messages(value, record.where, opts.prompt_key)
            text = value if messages is None else None
            if messages is not None and not opts.chat_template:
                raise UserError(
                    f"{record.where}: the prompt is a list of chat messages; set task.chat_template=true "
                    "to render it with the tokenizer's chat template"
                )
        if text is not None and not text.strip():
            raise UserError(f"{record.where}: the prompt is empty; remove the record or fix the data")
        problem = check_record(opts.reward or "", record.data, opts.answer_key)
        if problem:
            raise UserError(f"{record.where}: the record {problem}; fix the data, task.answer_key or task.reward")
        return _Prompt(split, index, record, text, messages)

    def require_answers(self, reason: str) -> None:
        """Refuse (one line) when a record lacks the reference answer that ``reason`` needs."""
        for prompt in self._prompts[TRAIN]:
            if not has_field(prompt.record.data, self.options.answer_key):
                raise UserError(
                    f"{prompt.record.where}: no field {self.options.answer_key!r} (task.answer_key), "
                    f"which {reason}; add it to the data or set task.answer_key"
                )

    # -------------------------------------------------------------- prompts
    @property
    def needs_tokenizer(self) -> bool:
        """Whether prompts depend on the tokenizer (chat template, length limit)."""
        return self.options.chat_template or self.options.max_prompt_tokens is not None

    def prepare(self, tokenizer: Any, context: Context | None = None) -> None:
        """Render the prompts with ``tokenizer`` (chat template), count their tokens as
        ``encode(text, add_special_tokens=True)`` does and drop those over the limit:
        ``max_prompt_tokens``, or the room ``context`` leaves beside the generation budget
        when that is smaller (docs/tasks.md, "Limits on a record")."""
        self.context = context
        self.tokenizer = tokenizer
        self._build_items(tokenizer)

    def _limit(self) -> int | None:
        """The longest prompt kept, in tokens (None: no limit)."""
        room = None if self.context is None else self.context.prompt_room
        return min((n for n in (self.options.max_prompt_tokens, room) if n is not None), default=None)

    def _context_binds(self) -> bool:
        """Whether the model's context, not ``task.max_prompt_tokens``, sets the limit."""
        user = self.options.max_prompt_tokens
        return self.context is not None and (user is None or self.context.prompt_room < user)

    def _limit_text(self) -> str:
        if not self._context_binds():
            return f"task.max_prompt_tokens={self.options.max_prompt_tokens}"
        assert self.context is not None, "the context binds only when there is one"
        return (
            f"the {self.context.prompt_room} tokens the model's context ({self.context.tokens}) "
            f"leaves beside {self.context.budget_key}"
        )

    def _render(self, prompt: _Prompt, tokenizer: Any) -> str:
        if not self.options.chat_template:
            assert prompt.text is not None, "chat messages without a chat template"
            return prompt.text
        messages = prompt.messages or [{"role": "user", "content": prompt.text or ""}]
        return chat_prompt(tokenizer, messages, self.options.system_prompt, prompt.record.where)

    def _build_items(self, tokenizer: Any) -> None:
        limit = self._limit()
        built: dict[str, list[TaskItem]] = {TRAIN: [], EVAL: []}
        self.dropped = {TRAIN: 0, EVAL: 0}
        self.token_counts = {}
        for split, prompts in self._prompts.items():
            for prompt in prompts:
                text = self._render(prompt, tokenizer)
                if tokenizer is not None:
                    count = len(tokenizer.encode(text, add_special_tokens=True))
                    self.token_counts[(split, prompt.index)] = count
                    if limit is not None and count > limit:
                        self.dropped[split] += 1
                        continue
                built[split].append(self._item(prompt, text))
        if not built[TRAIN]:
            shortest = min((c for (s, _), c in self.token_counts.items() if s == TRAIN), default=0)
            if self._context_binds():
                assert self.context is not None, "the context binds only when there is one"
                fix = f"shorten the prompts or lower {self.context.budget_key.split('=')[0]}"
            else:
                fix = "raise the limit"
            raise UserError(
                f"every training prompt in {self.path} is longer than {self._limit_text()} "
                f"(the shortest has {shortest} tokens); {fix}"
            )
        seen = {item.prompt for item in built[TRAIN]}
        kept = [item for item in built[EVAL] if item.prompt not in seen]
        self.eval_overlap = len(built[EVAL]) - len(kept)
        if built[EVAL] and not kept:
            raise UserError(
                f"every held-out prompt also occurs in the training data ({self.path}); "
                "evaluation would only repeat training prompts: give task.eval_path disjoint data"
            )
        self.items, self._eval_items = built[TRAIN], kept
        self._sft_items, self._sft_fit, self.sft_skipped = None, None, 0
        self._epoch_order = (-1, [])
        self._prepared = True

    def _item(self, prompt: _Prompt, text: str) -> TaskItem:
        answer = record_field(prompt.record.data, self.options.answer_key)
        answer_text = "" if not has_field(prompt.record.data, self.options.answer_key) else str(answer)
        meta = {"split": prompt.split, "index": prompt.index, **self.item_meta(prompt.record)}
        return TaskItem(prompt=text, answer=answer_text, meta=meta)

    def item_meta(self, record: Record) -> dict[str, Any]:
        """Extra JSON-able data a subclass keeps with each item."""
        return {}

    def _ready(self) -> None:
        assert self._prepared, f"task {self.name}: prompts depend on the tokenizer; call prepare(tokenizer) first"

    # ----------------------------------------------------------- Task API
    def __len__(self) -> int:
        self._ready()
        return len(self.items)

    @property
    def num_problems(self) -> int:
        return len(self)

    def sample(self, rng: random.Random, n: int) -> list[TaskItem]:
        """Distinct problems when ``n`` fits in the data, else draws with replacement."""
        self._ready()
        if n <= len(self.items):
            return rng.sample(self.items, n)
        return rng.choices(self.items, k=n)

    def stream(self, rng: random.Random, start: int, n: int) -> list[TaskItem]:
        """Problem k of a run is position k mod N of epoch k // N (seeded by ``seed`` and the epoch)."""
        self._ready()
        size = len(self.items)
        return [self.items[self._order(k // size)[k % size]] for k in range(start, start + n)]

    def _order(self, epoch: int) -> list[int]:
        if self._epoch_order[0] != epoch:  # the producer asks for one epoch after another
            order = list(range(len(self.items)))
            if self.options.shuffle:
                random.Random(f"{self.options.seed}:{epoch}").shuffle(order)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def eval_items(self, n: int, seed: int) -> list[TaskItem]:
        self._ready()
        return random.Random(seed).sample(self._eval_items, min(n, len(self._eval_items)))

    def fit_warm_start(self, tokenizer: Any, context: int) -> int:
        """Leave out of the warm start the training records whose ``prompt + answer + EOS`` (as
        ``sft_batch`` tokenizes them) exceed ``context`` tokens; how many that is. One-line
        UserError when none fits."""
        self._ready()
        if self._sft_fit == context:
            return self.sft_skipped
        kept = []
        for item in self.items:
            prompt, answer = self.sft_example(item)
            length = len(tokenizer.encode(prompt, add_special_tokens=True))
            if length + len(tokenizer.encode(answer, add_special_tokens=False)) + 1 <= context:
                kept.append(item)
        if not kept:
            raise UserError(
                f"no training record of {self.path} fits the model's context of {context} tokens with its answer "
                "(prompt + answer + EOS, what the tiny model's warm start trains on); "
                "shorten the prompts or answers, or set model.warm_start_steps=0"
            )
        self._sft_items, self._sft_fit = kept, context
        self.sft_skipped = len(self.items) - len(kept)
        return self.sft_skipped

    def _sft_pool(self) -> list[TaskItem]:
        self._ready()
        return self.items if self._sft_items is None else self._sft_items

    def sft_sample(self, rng: random.Random, n: int) -> list[TaskItem]:
        """As ``sample``, from the records the warm start may train on (``fit_warm_start``)."""
        pool = self._sft_pool()
        return rng.sample(pool, n) if n <= len(pool) else rng.choices(pool, k=n)

    def validation_items(self, n: int, seed: int) -> list[TaskItem]:
        """At most ``n`` distinct training records chosen by ``seed``, among those the warm start
        may train on (its validation set; see ``Task.validation_items``)."""
        pool = self._sft_pool()
        return random.Random(seed).sample(pool, min(n, len(pool)))

    def record(self, item: TaskItem) -> Record:
        """The data record a problem came from."""
        return self._records[item.meta["split"]][item.meta["index"]]

    def where(self, item: TaskItem) -> str:
        """``record N (file:line)`` of a problem (N counts the file's records from 0), for messages."""
        record = self.record(item)
        return f"record {record.index} ({record.where})"

    def reward_call(self, completion: str, item: TaskItem, *, stopped: bool) -> Callable[[], RewardValue]:
        if self.options.require_stop and not stopped:
            return _zero  # a truncated completion scores 0 without calling the function
        record = self.record(item)
        return functools.partial(call_reward, self.reward_spec, item.prompt, completion, record.data, self.where(item))

    def reward(self, completion: str, item: TaskItem, *, stopped: bool) -> RewardValue:
        return self.reward_call(completion, item, stopped=stopped)()

    def sft_example(self, item: TaskItem) -> tuple[str, str]:
        return item.prompt, item.answer

    def params(self) -> dict[str, Any]:
        digests = [hashlib.sha256(p.read_bytes()).hexdigest() for p in self._files]
        options = asdict(self.options)
        for key in ("path", "eval_path", "seed", "shuffle"):
            options.pop(key)  # the file content counts, not its name; the order does not change SFT
        return {"file_sha256": digests, **options}

    def summary(self) -> str:
        self._ready()
        parts = [f"task {self.name}: {len(self.items)} training prompts from {self.path}"]
        if self._eval_items:
            source = self.options.eval_path or f"task.eval_fraction={self.options.eval_fraction}"
            parts.append(f"{len(self._eval_items)} held out for evaluation ({source})")
        else:
            parts.append("no held-out split (task.eval_path or task.eval_fraction), so no greedy evaluation")
        if self.eval_overlap:
            parts.append(f"{self.eval_overlap} held-out prompts left out because they are also training prompts")
        counts = f"{self.dropped[TRAIN]} training and {self.dropped[EVAL]} held-out prompts dropped"
        if self._context_binds() and (self.dropped[TRAIN] or self.dropped[EVAL]):
            assert self.context is not None, "the context binds only when there is one"
            parts.append(
                f"{counts}: longer than {self._limit_text()} (shorten them or lower "
                f"{self.context.budget_key.split('=')[0]}; task.max_prompt_tokens sets a smaller limit)"
            )
        elif self.options.max_prompt_tokens is not None:
            parts.append(f"{counts} (longer than {self._limit_text()})")
        if self.sft_skipped:
            parts.append(
                f"the warm start skips {self.sft_skipped} training records whose prompt + answer + EOS "
                f"exceed the model's context of {self._sft_fit} tokens"
            )
        return "; ".join(parts)
