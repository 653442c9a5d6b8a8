"""What a config may cost to read (docs/reliability.md, "Config input limits").

Hydra, OmegaConf and PyYAML take time and memory out of all proportion to some small inputs:
a 320-byte YAML alias bomb expands to 10^9 nodes (146 s and 785 MB in OmegaConf, larger ones
never finish), a 50 MB scalar takes minutes, Hydra's override grammar is quadratic in the
items of a list (53 s for 20,000), and interpolations that refer twice to the one before
double the resolution time with every key. Each input is checked against a fixed budget
before those libraries see it, and refused in one line naming the file (and line) or key:

- a YAML file (every file under ``--config-dir``, a run's ``config.yaml``): a regular file of
  at most ``MAX_YAML_BYTES``, UTF-8, whose document, with every alias expanded, has at most
  ``MAX_YAML_NODES`` nodes nested at most ``MAX_YAML_DEPTH`` deep, and no alias inside the node
  it names. The scan composes the node graph (aliases stay shared, so it is linear in the file)
  and counts the expansion with one memo per node.
- command-line overrides (and a resumed run's ``overrides.json``): at most ``MAX_OVERRIDES``,
  each at most ``MAX_OVERRIDE_CHARS`` long, with at most ``MAX_OVERRIDE_ITEMS`` list or mapping
  items together (quoted text is not counted: it parses in linear time).
- interpolations of the composed config: no value may refer, directly or through the values it
  refers to, more than ``MAX_INTERPOLATION_REFS`` times, resolve to more than
  ``MAX_RESOLVED_CHARS`` characters or chain more than ``MAX_YAML_DEPTH`` values deep.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

from sdp_cli.errors import UserError

#: the largest YAML file sdp reads: OmegaConf needs ~0.6 s for a 1 MiB scalar
MAX_YAML_BYTES = 1 << 20
#: nodes of a YAML document with its aliases expanded: OmegaConf builds ~5,000 nodes a second
MAX_YAML_NODES = 10_000
#: nesting depth of a YAML document (sdp's deepest key, loss.rejection.upper, is 3 deep)
MAX_YAML_DEPTH = 64
#: YAML files under one --config-dir
MAX_CONFIG_FILES = 1_000
#: overrides of one command (or one run's overrides.json)
MAX_OVERRIDES = 1_000
#: characters of one override (a path is at most 4,096)
MAX_OVERRIDE_CHARS = 64 << 10
#: list and mapping items in all overrides together: Hydra's grammar parses 1,000 in ~0.25 s
MAX_OVERRIDE_ITEMS = 1_000
#: references a value's interpolations make, counting those of the values they refer to
MAX_INTERPOLATION_REFS = 1_000
#: characters a value resolves to
MAX_RESOLVED_CHARS = 1 << 20


def _yaml() -> Any:
    import yaml

    return yaml


def _loader() -> Any:
    """libyaml's safe loader where PyYAML has it (fast, and it limits flow nesting itself)."""
    yaml = _yaml()
    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


# ---------------------------------------------------------------- YAML files
def read_yaml_file(path: Path) -> str:
    """The text of the YAML file ``path``: a regular file of at most ``MAX_YAML_BYTES`` bytes of
    UTF-8 (a bad byte is named by line and column); nothing beyond the cap is read."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise UserError(f"{path}: not a regular file; remove it or replace it with a YAML file")
        if info.st_size > MAX_YAML_BYTES:
            raise UserError(
                f"{path}: {info.st_size} bytes; a config file may have at most {MAX_YAML_BYTES} (1 MiB); make it smaller"
            )
        with open(path, "rb") as fh:
            data = fh.read(MAX_YAML_BYTES + 1)
    except OSError as exc:
        raise UserError(f"{path}: cannot be read ({exc.strerror or exc}); check the file") from None
    if len(data) > MAX_YAML_BYTES:  # it grew after the stat
        raise UserError(f"{path}: more than {MAX_YAML_BYTES} bytes; a config file may have at most 1 MiB; make it smaller")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise UserError(f"{path}:{line}:{column}: not UTF-8 (byte 0x{data[exc.start]:02x}); save the file as UTF-8") from None


class _Refused(Exception):
    def __init__(self, node: Any, problem: str):
        super().__init__(problem)
        self.node, self.problem = node, problem


def _children(node: Any) -> list[Any]:
    yaml = _yaml()
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _check_expansion(root: Any) -> None:
    """Nodes of the document under ``root`` with every alias expanded, counted once per distinct
    node (memo: size and height), refused past ``MAX_YAML_NODES`` or ``MAX_YAML_DEPTH``."""
    done: dict[int, tuple[int, int]] = {}
    active: set[int] = set()
    aliased = False  # a node met twice: its size counts each time (what the message blames)

    def visit(node: Any, depth: int) -> tuple[int, int]:
        nonlocal aliased
        if depth > MAX_YAML_DEPTH:
            raise _Refused(node, f"nests deeper than {MAX_YAML_DEPTH} levels; flatten it")
        key = id(node)
        if key in done:
            aliased = True
            size, height = done[key]
            if depth + height > MAX_YAML_DEPTH:
                raise _Refused(node, f"nests deeper than {MAX_YAML_DEPTH} levels; flatten it")
            return size, height
        if key in active:
            raise _Refused(node, "an alias refers to a node that contains it; remove the alias")
        active.add(key)
        size, height = 1, 0
        for child in _children(node):
            child_size, child_height = visit(child, depth + 1)
            size, height = size + child_size, max(height, child_height + 1)
            if size > MAX_YAML_NODES:
                raise _Refused(
                    node,
                    f"aliases expand it to more than {MAX_YAML_NODES} nodes; write the values out or use fewer aliases"
                    if aliased
                    else f"has more than {MAX_YAML_NODES} nodes, the most a config file may have; split it",
                )
        active.discard(key)
        done[key] = (size, height)
        return size, height

    visit(root, 0)


def check_yaml_text(text: str, where: str | Path) -> None:
    """Refuse YAML that is invalid, too large expanded, too deep or cyclic, in one line
    ``where:line: problem``; nothing is constructed."""
    yaml = _yaml()
    try:
        root = yaml.compose(text, Loader=_loader())
        if root is not None:
            _check_expansion(root)
    except _Refused as refused:
        raise UserError(f"{where}:{refused.node.start_mark.line + 1}: {refused.problem}") from None
    except RecursionError:  # PyYAML without libyaml composes recursively
        raise UserError(f"{where}: nests deeper than {MAX_YAML_DEPTH} levels; flatten it") from None
    except yaml.YAMLError as err:
        raise UserError(yaml_error_line(_python_parser_error(text) or err, where)) from None


def _python_parser_error(text: str) -> Any:
    """PyYAML's own error for ``text``, which libyaml refused: Hydra reads with PyYAML, so its
    wording is the one users see elsewhere (None where PyYAML has no error of its own)."""
    yaml = _yaml()
    try:
        yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as err:
        return err
    except RecursionError:
        return None
    return None


def yaml_error_line(err: Any, where: str | Path | None = None) -> str:
    """One line for a PyYAML error: ``file:line: not valid YAML (problem[, context at line N])``."""
    mark = getattr(err, "problem_mark", None)
    if mark is not None:
        place = f"{where or mark.name}:{mark.line + 1}"
    else:
        place = str(where or "a config file")
    problem = getattr(err, "problem", None) or next((line for line in str(err).splitlines() if line.strip()), str(err))
    context, context_mark = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and context_mark is not None:
        problem += f", {context} at line {context_mark.line + 1}"
    return f"{place}: not valid YAML ({problem}); fix the file"


def load_yaml_text(text: str, where: str | Path) -> Any:
    """``yaml.safe_load(text)`` after :func:`check_yaml_text`."""
    check_yaml_text(text, where)
    return _yaml().load(text, Loader=_loader())


def load_yaml_file(path: Path) -> Any:
    """The checked YAML file ``path`` as plain data (a run's config.yaml, a defaults list)."""
    return load_yaml_text(read_yaml_file(path), path)


def config_files(directory: Path) -> list[Path]:
    """The YAML files under ``directory`` (at most ``MAX_CONFIG_FILES``), sorted."""
    found: list[Path] = []
    for path in directory.rglob("*.yaml"):
        found.append(path)
        if len(found) > MAX_CONFIG_FILES:
            raise UserError(
                f"--config-dir {directory}: more than {MAX_CONFIG_FILES} YAML files under it; "
                "pass the directory that holds only your configs"
            )
    return sorted(found)


def check_config_dir(directory: Path) -> None:
    """Check every YAML file under a ``--config-dir`` before Hydra reads any: Hydra lists a
    group's files and reads whichever the defaults name."""
    for path in config_files(directory):
        check_yaml_text(read_yaml_file(path), path)


# ---------------------------------------------------------------- overrides
def override_items(override: str) -> int:
    """List and mapping items of an override as Hydra's grammar sees them: the commas and
    opening brackets outside quotes (``a=[x,y]`` has 2; ``a='x,y'`` none)."""
    count, quote, escaped = 0, "", False
    for char in override:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in ",[{":
            count += 1
    return count


def check_override_sizes(overrides: list[str]) -> None:
    """Refuse overrides whose parse would take long: too many, too long, too many items."""
    if len(overrides) > MAX_OVERRIDES:
        raise UserError(
            f"{len(overrides)} overrides; sdp takes at most {MAX_OVERRIDES}; put them in a config file (--config-dir)"
        )
    items = 0
    for override in overrides:
        shown = override[:40] + ("…" if len(override) > 40 else "")
        if len(override) > MAX_OVERRIDE_CHARS:
            raise UserError(
                f"override {shown!r} is longer than {MAX_OVERRIDE_CHARS} characters; "
                "put the value in a config file (--config-dir)"
            )
        items += override_items(override)
        if items > MAX_OVERRIDE_ITEMS:
            raise UserError(
                f"override {shown!r}: the overrides have more than {MAX_OVERRIDE_ITEMS} list or mapping items, "
                "which Hydra parses in quadratic time; put long lists in a config file (--config-dir)"
            )


# ---------------------------------------------------------------- interpolations
#: an innermost interpolation, ${body}; resolver arguments with interpolations match inside out
_INTERPOLATION = re.compile(r"\$\{([^${}]*)\}")


def _flatten(node: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else None
    if items is None:
        out[prefix] = node
    else:
        for name, value in items:
            _flatten(value, f"{prefix}.{name}" if prefix else str(name), out)
    return out


def _target(key: str, body: str) -> str:
    """The absolute key an interpolation body names (``.x`` is a sibling of ``key``, ``..x`` a
    sibling of its parent, ``a[0]`` is ``a.0``)."""
    body = body.strip().replace("[", ".").replace("]", "")
    dots = len(body) - len(body.lstrip("."))
    if not dots:
        return body
    base = key.split(".")[:-1]
    base = base[: max(0, len(base) - (dots - 1))]
    return ".".join([*base, body[dots:]] if body[dots:] else base)


def check_interpolations(values: dict[str, Any]) -> None:
    """Refuse a config (plain data, interpolations unresolved) whose interpolations would
    expand past ``MAX_INTERPOLATION_REFS`` references or ``MAX_RESOLVED_CHARS`` characters, or
    chain deeper than ``MAX_YAML_DEPTH``; one line naming the first such key."""
    flat = _flatten(values, "", {})
    memo: dict[str, tuple[int, int]] = {}
    active: list[str] = []

    def cost(key: str) -> tuple[int, int]:
        """(references, characters) of resolving ``key``."""
        if key in memo:
            return memo[key]
        if key in active:  # a cycle: OmegaConf reports it when it resolves
            return 0, 0
        if key not in flat:  # a section: every value under it; a missing key: nothing
            parts = [cost(k) for k in flat if k.startswith(f"{key}.")]
            return sum(p[0] for p in parts), sum(p[1] for p in parts)
        value = flat[key]
        if not isinstance(value, str) or "${" not in value:
            return 0, len(str(value))
        if len(active) >= MAX_YAML_DEPTH:
            raise UserError(f"{key}: its interpolations chain more than {MAX_YAML_DEPTH} values deep; write the value out")
        active.append(key)
        refs, chars = 0, len(_INTERPOLATION.sub("", value))
        for match in _INTERPOLATION.finditer(value):
            refs += 1
            if ":" not in match.group(1):  # a resolver (oc.env:...) refers to no key
                more_refs, more_chars = cost(_target(key, match.group(1)))
                refs, chars = refs + more_refs, chars + more_chars
            if refs > MAX_INTERPOLATION_REFS:
                raise UserError(
                    f"{key}: its interpolations expand to more than {MAX_INTERPOLATION_REFS} references; write the value out"
                )
            if chars > MAX_RESOLVED_CHARS:
                raise UserError(
                    f"{key}: its interpolations resolve to more than {MAX_RESOLVED_CHARS} characters; write the value out"
                )
        active.pop()
        memo[key] = (refs, chars)
        return refs, chars

    for key in flat:
        cost(key)
