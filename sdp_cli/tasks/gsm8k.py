"""GSM8K-style word problems from a local JSONL or parquet file.

Each record has ``question`` and ``answer``; the answer is a worked solution ending in
``#### <number>``. Warm-start SFT trains on the whole solution; the reward compares only the
final number (``sdp_cli.tasks.numeric``). Nothing is downloaded: the default file is the small
sample shipped in ``sdp_cli/data`` (problems written for this project, not the real data set).
"""

from __future__ import annotations

import hashlib
import json
import random
from importlib import resources
from pathlib import Path
from typing import Any

from sdp_cli.errors import UserError
from sdp_cli.tasks.base import Task, TaskItem
from sdp_cli.tasks.numeric import extract_final_number, numbers_equal, parse_number

DEFAULT_TEMPLATE = "Question: {question}\nAnswer: "
_FIX = "each record needs a 'question' string and an 'answer' string ending in '#### <number>'"


def sample_path() -> Path:
    """The GSM8K-format sample shipped with sdp (21 problems)."""
    return Path(str(resources.files("sdp_cli") / "data" / "gsm8k_sample.jsonl"))


def _read_jsonl(path: Path) -> list[tuple[int, Any]]:
    records = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append((lineno, json.loads(line)))
            except json.JSONDecodeError as err:
                raise UserError(f"{path}:{lineno}: not valid JSON ({err.msg}); {_FIX}") from None
    return records


def _read_parquet(path: Path) -> list[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(
            f"reading {path} needs pyarrow, which is not installed; "
            "pip install 'sdp-cli[parquet]' or convert the file to JSONL"
        ) from None
    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several unrelated types for a bad file
        raise UserError(f"{path}: not a readable parquet file ({err}); {_FIX}") from None
    missing = [c for c in ("question", "answer") if c not in table.column_names]
    if missing:
        raise UserError(f"{path}: no column {missing[0]!r} (has {table.column_names}); {_FIX}")
    rows = table.select(["question", "answer"]).to_pylist()
    return [(i + 1, row) for i, row in enumerate(rows)]


def load_problems(path: str | Path) -> list[tuple[str, str, str]]:
    """``(question, solution, final_number)`` for every record; one-line UserError on bad input."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"gsm8k file {path} does not exist; pass path= a local .jsonl or .parquet file")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        records = _read_jsonl(path)
        where = "line"
    elif suffix == ".parquet":
        records = _read_parquet(path)
        where = "row"
    else:
        raise UserError(f"gsm8k file {path} has unknown extension {suffix!r}; use .jsonl or .parquet")
    problems = []
    for number, record in records:
        if not isinstance(record, dict):
            raise UserError(f"{path}: {where} {number} is not an object; {_FIX}")
        question, solution = record.get("question"), record.get("answer")
        for field_name, value in (("question", question), ("answer", solution)):
            if not isinstance(value, str) or not value.strip():
                raise UserError(f"{path}: {where} {number} has no non-empty {field_name!r} string; {_FIX}")
        final = extract_final_number(solution) if "####" in solution else None
        if final is None or parse_number(final) is None:
            raise UserError(f"{path}: {where} {number} answer does not end in '#### <number>'; {_FIX}")
        problems.append((question, solution, final))
    if not problems:
        raise UserError(f"gsm8k file {path} holds no records; {_FIX}")
    return problems


class Gsm8kTask(Task):
    """Word problems with a numeric final answer.

    The reward is 1.0 when the completion's final number (after ``####`` if present, else its last
    number) equals the reference by value; with ``require_stop`` the policy must also have stopped.
    """

    name = "gsm8k"
    charset = "ascii"

    def __init__(
        self,
        path: str | Path | None = None,
        prompt_template: str = DEFAULT_TEMPLATE,
        max_new_tokens: int = 400,
        require_stop: bool = True,
    ):
        if "{question}" not in prompt_template:
            raise UserError(
                f"gsm8k prompt_template {prompt_template!r} has no '{{question}}' placeholder; add one"
            )
        if max_new_tokens < 1:
            raise UserError(f"gsm8k max_new_tokens must be >= 1, got {max_new_tokens}")
        self.path = Path(path).expanduser() if path is not None else sample_path()
        self.prompt_template = prompt_template
        self.max_new_tokens = max_new_tokens
        self.require_stop = require_stop
        problems = load_problems(self.path)
        # Literal replacement, not str.format: templates may contain other braces.
        self.items = [
            TaskItem(
                prompt=prompt_template.replace("{question}", question),
                answer=solution,
                meta={"final": final, "index": i},
            )
            for i, (question, solution, final) in enumerate(problems)
        ]
        self._digest = hashlib.sha256(self.path.read_bytes()).hexdigest()

    def __len__(self) -> int:
        return len(self.items)

    @property
    def num_problems(self) -> int:
        return len(self.items)

    def sample(self, rng: random.Random, n: int) -> list[TaskItem]:
        """Distinct problems when ``n`` fits in the file, else draws with replacement."""
        if n <= len(self.items):
            return rng.sample(self.items, n)
        return rng.choices(self.items, k=n)

    def reward(self, completion: str, item: TaskItem, *, stopped: bool) -> float:
        if self.require_stop and not stopped:
            return 0.0
        predicted = extract_final_number(completion)
        return 1.0 if predicted is not None and numbers_equal(predicted, item.meta["final"]) else 0.0

    def params(self) -> dict[str, Any]:
        return {
            "file_sha256": self._digest,
            "prompt_template": self.prompt_template,
            "require_stop": self.require_stop,
        }
