"""sdp_cli/choices.py is the one list of allowed names: the config groups, the registries and
every module agree with it, and no module keeps a copy of one of its tuples."""

import ast
import json
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from sdp_cli import choices
from sdp_cli.config.compose import compose_config
from sdp_cli.config.schema import SdpConfig
from sdp_cli.config.validation import ConfigValueError, validate

PACKAGE = Path(choices.__file__).parent


def _group(name: str) -> set[str]:
    folder = resources.files("sdp_cli.conf").joinpath(name)
    return {p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml")}


@pytest.mark.parametrize(
    ("group", "names"),
    [
        ("mode", ("bypass", "decoupled", "segment_wise")),
        ("is_agg", choices.IS_LEVELS),
        ("staleness", choices.STALENESS_STRATEGIES),
        ("engine", choices.ENGINE_KINDS),
        ("model", choices.MODEL_KINDS),
        ("task", choices.TASKS),
    ],
)
def test_every_config_group_holds_exactly_the_allowed_names(group, names):
    assert _group(group) == set(names)


def test_registries_are_keyed_by_the_allowed_names():
    from sdp_cli.models.tokenizer import CHARSETS
    from sdp_cli.tasks import TASKS

    assert set(TASKS) == set(choices.TASKS)
    assert set(CHARSETS) == set(choices.CHARSETS)
    assert set(choices.REMOTE_ENGINE_KINDS) < set(choices.ENGINE_KINDS)


def test_the_mode_registry_holds_the_built_in_modes_and_what_they_read():
    from sdp_cli.modes import MODES

    # same names, same order (the order of error messages and of the modes' help)
    assert tuple(MODES) == ("bypass", "decoupled", "segment_wise")
    # what the trainer reads of each: bypass trains against π_behav, the others against π_prox;
    # decoupled's weight reads π_prox, segment_wise's π_prox_t (docs/design.md §1 table)
    assert {name: (m.anchor, m.needs) for name, m in MODES.items()} == {
        "bypass": ("behav", ()),
        "decoupled": ("proximal", ("proximal_logprobs",)),
        "segment_wise": ("proximal", ("proximal_logprobs_t",)),
    }
    # each built-in kernel resolves to the function of core/weights.py named for it
    from sdp_cli.core import weights

    assert [m.function() for m in MODES.values()] == [
        weights.bypass_log_ratio, weights.decoupled_log_ratio, weights.segment_wise_log_ratio
    ]


def test_the_schema_validates_against_the_choices():
    for mode in ("bypass", "decoupled", "segment_wise"):
        cfg, _ = compose_config([f"mode={mode}"])  # validated on the way
        assert cfg.loss.mode == mode
    cfg = SdpConfig()
    cfg.loss.is_level = "tokens"
    with pytest.raises(ConfigValueError, match="loss.is_level"):
        validate(cfg)


def _tuples_of_strings(tree: ast.AST) -> list[tuple[int, tuple[str, ...]]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple) and len(node.elts) > 1:
            values = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            if len(values) == len(node.elts) and all(isinstance(v, str) for v in values):
                found.append((node.lineno, tuple(values)))
    return found


def test_no_module_keeps_its_own_copy_of_a_choices_tuple():
    """A tuple literal holding the same names as one of choices' tuples (in any order) is a copy
    that would drift from the original."""
    originals = {
        frozenset(value): name
        for name, value in vars(choices).items()
        if name.isupper() and isinstance(value, tuple)
    }
    copies = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "choices.py":
            continue
        for line, values in _tuples_of_strings(ast.parse(path.read_text(), str(path))):
            if frozenset(values) in originals:
                rel = path.relative_to(PACKAGE.parent)
                copies.append(f"{rel}:{line} copies choices.{originals[frozenset(values)]}")
    assert not copies, "\n".join(copies)


def test_choices_imports_nothing_heavy():
    code = "import sys, sdp_cli.choices; print(sorted(m for m in ('torch', 'typer') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_config_knows_the_modes_without_importing_torch():
    # validating a config reads the one registry (sdp_cli/modes.py) and never imports torch
    code = (
        "import sys, json; from sdp_cli import modes; from sdp_cli.config.compose import compose_config; "
        "cfg, _ = compose_config(['mode=segment_wise']); m = modes.MODES; "
        "print(json.dumps([list(m), [x.reads_proximal_t for x in m.values()], 'torch' in sys.modules, "
        "[x.has_weight for x in m.values()], [x.takes_drift_clip for x in m.values()], modes.shadow_weights()]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    names, reads, torch_loaded, weighted, drift, shadows = json.loads(out.stdout)
    assert torch_loaded is False
    assert names == ["bypass", "decoupled", "segment_wise"]
    # only segment_wise reads π_prox_t; bypass alone has no weight; segment_wise alone takes κ
    assert reads == [False, False, True]
    assert weighted == [False, True, True]
    assert drift == [False, False, True]
    assert shadows == ["decoupled", "segment_wise", "segment_wise_drift"]
