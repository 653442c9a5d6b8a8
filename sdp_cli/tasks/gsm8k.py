"""GSM8K-style word problems: a data-set task with GSM8K's fields, prompt and scoring.

Each record has ``question`` and ``answer``; the answer is a worked solution ending in
``#### <number>``. Warm-start SFT trains on the whole solution; the reward compares only the
final number (``task.reward=final_number``, ``sdp_cli.tasks.rewards``). Every ``task.*`` key of
a data-set task applies (docs/tasks.md). Nothing is downloaded: the default file is the small
sample shipped in ``sdp_cli/data`` (problems written for this project, not the real data set).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from sdp_cli.dataset_options import DatasetOptions
from sdp_cli.errors import UserError
from sdp_cli.tasks.datafile import Record
from sdp_cli.tasks.dataset import DatasetTask
from sdp_cli.tasks.numeric import extract_final_number, parse_number

DEFAULT_TEMPLATE = "Question: {question}\nAnswer: "
DEFAULTS: dict[str, Any] = {
    "prompt_key": "question",
    "prompt_template": DEFAULT_TEMPLATE,
    "reward": "final_number",
    "max_new_tokens": 400,
}
_FIX = "each record needs a 'question' string and an 'answer' string ending in '#### <number>'"


def sample_path() -> Path:
    """The GSM8K-format sample shipped with sdp (21 problems)."""
    return Path(str(resources.files("sdp_cli") / "data" / "gsm8k_sample.jsonl"))


def final_answer(record: Record) -> str:
    """The number after ``####`` in a record's solution; one-line UserError when it has none."""
    for key in ("question", "answer"):
        value = record.data.get(key)
        if not isinstance(value, str) or not value.strip():
            raise UserError(f"{record.where}: no non-empty {key!r} string; {_FIX}")
    solution = record.data["answer"]
    final = extract_final_number(solution) if "####" in solution else None
    if final is None or parse_number(final) is None:
        raise UserError(f"{record.where}: the answer does not end in '#### <number>'; {_FIX}")
    return final


class Gsm8kTask(DatasetTask):
    """Word problems with a numeric final answer.

    The reward is 1.0 when the completion's final number (after ``####`` if present, else its last
    number) equals the reference by value; with ``require_stop`` the policy must also have stopped.
    """

    def __init__(self, options: DatasetOptions):
        template = options.prompt_template
        if template is not None and "{question}" not in template:
            raise UserError(f"gsm8k prompt_template {template!r} has no '{{question}}' placeholder; add one")
        super().__init__(options, name="gsm8k")

    def item_meta(self, record: Record) -> dict[str, Any]:
        return {"final": final_answer(record)}
