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
        ("mode", choices.MODES),
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


def test_the_mode_registry_holds_exactly_the_config_modes():
    from sdp_cli.core.weights import MODE_WEIGHTS

    # same names, same order (the order of error messages and of the modes' help)
    assert tuple(MODE_WEIGHTS) == choices.MODES
    # what the trainer reads of each: bypass trains against π_behav, the others against π_prox;
    # decoupled's weight reads π_prox, segment_wise's π_prox_t (docs/design.md §1 table)
    assert {name: (w.anchor, w.needs) for name, w in MODE_WEIGHTS.items()} == {
        "bypass": ("behav", ()),
        "decoupled": ("proximal", ("proximal_logprobs",)),
        "segment_wise": ("proximal", ("proximal_logprobs_t",)),
    }


def test_the_schema_validates_against_the_choices():
    for mode in choices.MODES:
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


def test_the_config_knows_the_modes_without_torch_and_agrees_with_the_registry():
    # without the registry loaded (a fresh process, torch never imported) ...
    code = (
        "import sys, json; from sdp_cli.config import modes; from sdp_cli.choices import MODES; "
        "print(json.dumps([modes.mode_names(), [modes.reads_proximal_t(m) for m in MODES], 'torch' in sys.modules, "
        "[modes.has_weight(m) for m in MODES], [modes.takes_drift_clip(m) for m in MODES], modes.shadow_weights()]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    names, reads, torch_loaded, weighted, drift, shadows = json.loads(out.stdout)
    assert torch_loaded is False
    # ... and with it: the same names and the same answers (only segment_wise reads π_prox_t)
    from sdp_cli.config import modes
    from sdp_cli.core.weights import MODE_WEIGHTS

    assert tuple(names) == modes.mode_names() == tuple(MODE_WEIGHTS) == choices.MODES
    assert reads == [modes.reads_proximal_t(m) for m in choices.MODES] == [m == "segment_wise" for m in choices.MODES]
    # bypass alone has no weight (it reads neither π_prox nor π_prox_t); segment_wise alone takes κ
    assert weighted == [modes.has_weight(m) for m in choices.MODES] == [m != "bypass" for m in choices.MODES]
    assert drift == [modes.takes_drift_clip(m) for m in choices.MODES] == [m == "segment_wise" for m in choices.MODES]
    assert tuple(shadows) == modes.shadow_weights() == ("decoupled", "segment_wise", "segment_wise_drift")
