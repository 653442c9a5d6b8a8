"""`sdp train --help-config` shows defaults as YAML, the syntax a user writes on the command line
and in config files (null, false, []), never Python's (None, False)."""

from __future__ import annotations

import math
import re

import pytest
import yaml

from sdp_cli.config.schema import field_docs

from ..cli.run_main import run_main


def _defaults() -> dict[str, str]:
    return {key: default for key, default, _ in field_docs()}


def test_defaults_are_yaml_literals():
    d = _defaults()
    # each expected text is the dataclass default written the way YAML spells it
    assert d["engine.max_model_len"] == "null"  # None
    assert d["train.keep_version_checkpoints"] == "false"  # False
    assert d["engine.enforce_eager"] == "true"  # True
    assert d["engine.urls"] == "[]"  # empty list
    assert d["engine.env"] == "{}"  # empty dict
    assert d["optim.lr"] == "0.0001"  # 1e-4
    assert d["loss.weight_cap"] == "5.0"
    assert d["rollout.recompute"] == "auto"  # a plain string is not quoted
    assert d["run.root"] == "runs"


def test_no_python_literals_anywhere():
    python_words = re.compile(r"\b(None|True|False)\b|^'.*'$")
    offenders = {k: v for k, v in _defaults().items() if python_words.search(v)}
    assert offenders == {}


def test_every_default_reads_back_as_its_value():
    # the shown text, parsed as YAML (what Hydra does with an override), is the default itself
    from dataclasses import fields, is_dataclass

    from sdp_cli.config.schema import SdpConfig

    def leaves(obj, prefix=""):
        for f in fields(obj):
            value = getattr(obj, f.name)
            if is_dataclass(value):
                yield from leaves(value, f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}", value

    shown = _defaults()
    for key, value in leaves(SdpConfig()):
        parsed = yaml.safe_load(shown[key])
        if isinstance(value, float) and math.isinf(value):
            assert parsed == value, key
        else:
            assert parsed == value and type(parsed) is type(value), (key, shown[key], value)


def test_help_config_prints_yaml(capsys):
    code, out, _ = run_main(["train", "--help-config"], capsys)
    assert code == 0
    row = next(line for line in out.splitlines() if line.split()[:1] == ["engine.max_model_len"])
    assert row.split()[1] == "null"
    assert "None" not in out.split() and "False" not in out.split()


def test_meanings_are_one_paragraph_each():
    # a docstring wrapped in the source keeps its line breaks and indentation; the table would
    # print them (loss.mode's second source line, indented, on a line of its own)
    docs = {key: doc for key, _, doc in field_docs()}
    assert 'your own (docs/design.md "Adding a mode"). Registered: bypass — no behavioural weight' in docs["loss.mode"]
    assert {k: d for k, d in docs.items() if "\n" in d or "  " in d or d != d.strip()} == {}


def _help_config_at(width: int, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", str(width))  # rich sizes a console that is not a terminal by it
    code, out, _ = run_main(["train", "--help-config"], capsys)
    assert code == 0
    return out


@pytest.mark.parametrize("width", [50, 60, 80, 120, 200])
def test_nothing_is_cut_short_at_any_width(width, capsys, monkeypatch):
    # run.trackers' default [tensorboard] is 13 characters: a 12-wide default column printed
    # "[tensorboar…" at every width, and at 80 columns a long word of a meaning lost its end
    out = _help_config_at(width, capsys, monkeypatch)
    assert "…" not in out
    assert max(len(line.rstrip()) for line in out.splitlines()) <= width
    words = set(out.split())
    for key, default, doc in field_docs():
        # every word of the key, its default and its meaning is there whole (none is longer than
        # the narrowest meaning column tested, so none needs folding)
        assert {key, *default.split(), *doc.split()} <= words, key


def test_the_meanings_sit_beside_their_keys_from_the_width_that_leaves_them_32_columns(capsys, monkeypatch):
    rows = list(field_docs())
    keys = max(len(key) for key, _, _ in rows)
    defaults = max(len(word) for _, default, _ in rows for word in default.split())
    least = keys + defaults + 6 + 32  # each cell's padding, and the meaning column's least width
    beside = _help_config_at(least, capsys, monkeypatch).splitlines()
    assert beside[0].split() == ["key", "default", "meaning"]  # one table
    below = _help_config_at(least - 1, capsys, monkeypatch).splitlines()
    assert below[0].split() == ["key", "default"] and below[1].split() == ["meaning"]  # each meaning under its key
    assert below[3].startswith("    ") and below[2].split()[0] == rows[0][0]


def test_a_key_and_its_default_share_a_line_at_any_width(capsys, monkeypatch):
    # grep KEY shows the default whatever the terminal's width
    for width in (50, 120):
        out = _help_config_at(width, capsys, monkeypatch)
        line = next(line for line in out.splitlines() if line.split()[:1] == ["run.trackers"])
        assert line.split()[1] == "[tensorboard]", (width, line)


def test_the_registered_modes_and_engines_are_listed_from_their_registries():
    # the list is the registry's: a mode registered by code appears with the first paragraph of its
    # docstring on one line, and is gone once unregistered
    from sdp_cli.engines import ENGINES
    from sdp_cli.modes import MODES, register_mode, unregister

    docs = {key: doc for key, _, doc in field_docs()}
    for name, mode in MODES.items():
        assert f"{name} — {mode.doc}" in docs["loss.mode"]
    for name, engine in ENGINES.items():
        assert f"{name} — {engine.doc}" in docs["engine.kind"]

    @register_mode("cubed_decoupled", needs=("proximal_logprobs",), anchor="proximal")
    def cubed(old, proximal, proximal_t, mask):
        """w = (π_prox/π_behav)³,
        a toy.

        Not shown: a second paragraph."""
        return 3 * (proximal - old)

    try:
        doc = {key: doc for key, _, doc in field_docs()}["loss.mode"]
        assert doc.endswith("; cubed_decoupled — w = (π_prox/π_behav)³, a toy.")
    finally:
        unregister("cubed_decoupled")
    assert "cubed_decoupled" not in {key: doc for key, _, doc in field_docs()}["loss.mode"]
