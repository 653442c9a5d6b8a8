"""Classes own their state: no class declares attributes at class level that it never assigns,
as a mixin does for the state of the class it is mixed into (STYLE.md, "Classes own their state").

Declarations without a value are what dataclasses, protocols and typed tuples are made of, and an
abstract base (``abc.ABC``) may declare the attributes every implementation sets (``Task.name``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import sdp_cli

ROOT = Path(sdp_cli.__file__).parent
#: bases and decorators whose classes declare fields by annotation
DECLARING = ("dataclass", "Protocol", "NamedTuple", "TypedDict", "ABC", "abc.ABC")


def _declares_fields(node: ast.ClassDef) -> bool:
    names = [ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list]
    names += [ast.unparse(b.value if isinstance(b, ast.Subscript) else b) for b in node.bases]
    return any(name.split(".")[-1] in {d.split(".")[-1] for d in DECLARING} for name in names)


def borrowed_attributes(root: Path) -> list[str]:
    """``file: Class.attribute`` for each bare class-level annotation of an ordinary class."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and not _declares_fields(node):
                for statement in node.body:
                    if isinstance(statement, ast.AnnAssign) and statement.value is None:
                        found.append(f"{path.relative_to(root.parent)}: {node.name}.{ast.unparse(statement.target)}")
    return found


def test_no_class_declares_attributes_it_does_not_assign():
    found = borrowed_attributes(ROOT)
    assert not found, "attributes declared, never assigned by their class (a mixin?):\n" + "\n".join(found)


def test_the_check_finds_a_mixin(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "mixin.py").write_text(
        "from dataclasses import dataclass\n\n"
        "class Producer:\n    queue: list\n\n    def put(self, x):\n        self.queue.append(x)\n\n"
        "@dataclass\nclass Options:\n    path: str\n"
    )
    assert borrowed_attributes(package) == ["pkg/mixin.py: Producer.queue"]
