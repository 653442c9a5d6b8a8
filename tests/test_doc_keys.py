"""Every config key the docs name exists (issue 24, item 14): docs/reliability.md once told users
to set `train.reward_workers`, which is `task.reward_workers`.

The keys are read from the schema (``field_docs``), never from a list here, so a key added to
the schema is known at once and a key removed from it fails every page that still names it.
A candidate is a dotted name starting with a schema section (``train.steps``,
``model.lora.r``, ``+engine.env.MY_VAR=1``) in code spans and prose alike; it is not a key when
it is part of a longer dotted or slashed name (``sdp_cli.train.asyncloop.loop``, ``sdp_cli/train/session/run.py``,
``cfg.train.steps``), a call (``model.eval()``) or a file name (``NOT_KEYS``). The few dotted
names of other things (a function, a checkpoint field, a typo shown on purpose) are listed in
``NOT_CONFIG`` with what each is.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sdp_cli.config.schema import field_docs

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]

#: the last parts that make a dotted name a file, not a key (``train.py``, ``model.safetensors``)
NOT_KEYS = {"py", "md", "yaml", "yml", "json", "jsonl", "safetensors", "sh", "txt", "csv", "png",
            "parquet", "toml", "log", "gguf", "pt", "bin", "html"}  # fmt: skip

#: dotted names in the docs that are no config keys, each with what it is instead
NOT_CONFIG = {
    "loss.policy_loss": "the function policy_loss of sdp_cli/core/loss.py (docs/math.md §5)",
    "run.run_id": "a field of a checkpoint's state.json",
    "run.metrics_written": "a kill point of sdp_cli/faults.py",
    "model.embed_tokens.weight": "a parameter of a model, quoted from an error message",
    "task.pth": "a typo on purpose: the example of the unknown-key error (docs/tasks.md)",
    "train.stpes": "a typo on purpose: the example of the nearest-key hint (docs/tasks.md)",
}

LEAVES = {key: default for key, default, _ in field_docs()}
#: every dotted prefix of a key: the sections (loss, model.lora, ...)
SECTIONS = {key.rsplit(".", i)[0] for key in LEAVES for i in range(1, key.count(".") + 1)}
#: leaves that hold the user's own keys (engine.env, task.reward_kwargs): anything may follow
MAPPINGS = {key for key, default in LEAVES.items() if default.startswith("{")}
TOP = sorted({key.split(".")[0] for key in SECTIONS}, key=len, reverse=True)

#: a dotted name starting with a top-level section (also inside ${...}); not inside a longer
#: dotted, slashed or hyphenated name (preceded by a word character, '.', '/' or '-'), and not
#: a call in code (followed by '(')
CANDIDATE = re.compile(rf"(?<![\w./-])(?:{'|'.join(TOP)})(?:\.[A-Za-z_][\w]*)+(?![\w(/-])")


def problem(name: str) -> str | None:
    """Why the dotted ``name`` is no config key, or None when it is one (or no key at all)."""
    if name.rpartition(".")[2] in NOT_KEYS or name in NOT_CONFIG:
        return None
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if prefix in MAPPINGS:
            return None  # engine.env.MY_VAR: the rest is the user's own key
        if prefix in LEAVES:
            return None if i == len(parts) else f"{prefix} is a value, it has no key {'.'.join(parts[i:])}"
        if prefix not in SECTIONS:
            return f"no config key {prefix}"
    return None  # a section (model.lora)


def test_the_schema_is_read():
    assert "train.steps" in LEAVES and "task.reward_workers" in LEAVES and "model.lora.r" in LEAVES
    assert {"train", "model.lora", "loss.rejection"} <= SECTIONS and "engine.env" in MAPPINGS


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("set `train.reward_workers=4`", ["train.reward_workers"]),
        ("`+engine.env.MY_VAR=1` and model.lora.r and task.reward_kwargs.pattern", ["engine.env.MY_VAR", "model.lora.r", "task.reward_kwargs.pattern"]),
        ("in sdp_cli/train/session/run.py, sdp_cli.train.asyncloop.loop, cfg.train.steps", []),
        ("run.name=${task.name}-${seed}", ["run.name", "task.name"]),
        ("`model.eval()` and train-time and rollout/lag_mean and the loss.", []),
        ("`train.py`, `run.sh` and `model.safetensors`", ["train.py", "run.sh", "model.safetensors"]),
    ],
)  # fmt: skip
def test_candidates_are_dotted_names_of_sections(text, found):
    assert CANDIDATE.findall(text) == found


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("train.reward_workers", "no config key train.reward_workers"),
        ("task.reward_workers", None),
        ("model.lora", None),
        ("train.steps.max", "train.steps is a value, it has no key max"),
        ("engine.env.ANY_NAME", None),
        ("train.py", None),
    ],
)
def test_a_name_is_checked_against_the_schema(name, expected):
    assert problem(name) == expected


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_config_key_named_in_the_docs_exists(page):
    problems = []
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        for name in CANDIDATE.findall(line):
            found = problem(name)
            if found:
                problems.append(f"{page.name}:{number}: {name}: {found}")
    assert not problems, "\n".join(problems)
