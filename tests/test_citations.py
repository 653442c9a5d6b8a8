"""Every file, section and module the code and the docs cite exists in the repository.

Scanned: the package, tests, benchmarks, scripts, CI scripts, configs, README and docs/. A citation
is a repository path (``docs/math.md``, ``sdp_cli/rundir.py``, ``tests/engine/stubs/``), a
section of a doc (``docs/design.md §2``, ``docs/engines.md "Temperature"``), a relative Markdown
link in docs/ or the README, or a dotted module name (``sdp_cli.engine.wire.check_segment``).
Documents that live outside the repository (a design note, research notes) may not be cited at all.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCANNED = [
    *sorted((REPO / "sdp_cli").rglob("*.py")),
    *sorted((REPO / "sdp_cli" / "conf").rglob("*.yaml")),
    *sorted((REPO / "tests").rglob("*.py")),
    *sorted((REPO / "bench").glob("*.py")),
    *sorted((REPO / "scripts").glob("*.py")),
    *sorted((REPO / ".ci").iterdir()),
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "README.md",
    REPO / "pyproject.toml",
]
#: repository paths: a top-level directory, then path characters up to a file name or a slash
PATH = re.compile(r"(?<![\w./<{-])((?:sdp_cli|tests|docs|bench|scripts|\.ci|examples)/[\w./-]*[\w/])")
#: a doc path followed by its sections: §2, §2.1, §1–§3, §1, §4, "Title"
SECTIONS = re.compile(r"(docs/[\w-]+\.md)((?:[ ,]*(?:§\s?\d+(?:\.\d+)?(?:\s?[–-]\s?§?\d+(?:\.\d+)?)?|and))*)")
TITLE = re.compile(r"""(docs/[\w-]+\.md),? (?:section )?["“]([^"”]+)["”]""")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
MODULE = re.compile(r"(?<![\w./])(sdp_cli(?:\.[A-Za-z_]\w*)+)")
#: documents that are not in the repository: never cited
FORBIDDEN = re.compile(r"DESIGN\.md|research/|research note|seeds/\d")


def _citing_files() -> list[Path]:
    return [p for p in SCANNED if p.is_file() and p != Path(__file__).resolve()]


@cache
def _headings(doc: Path) -> tuple[set[str], set[str]]:
    """Section numbers (``2``, ``5.2``) and titles of a Markdown file's headings."""
    numbers, titles = set(), set()
    for line in doc.read_text().splitlines():
        if match := re.match(r"#+\s+(?:(\d+(?:\.\d+)?)\.?\s+)?(.*)", line):
            if match.group(1):
                numbers.add(match.group(1))
            titles.add(match.group(2).strip().strip("`"))
        elif match := re.match(r"(?:- )?\*\*([^*]+?)\.?\*\*", line):  # a bold run-in title
            titles.add(match.group(1).strip("`"))
    return numbers, titles


@cache
def _top_level_names(path: Path) -> frozenset[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    if path.name == "__init__.py":  # lazy exports (PEP 562) name their symbols in strings
        names.update(re.findall(r'"(\w+)"', path.read_text()))
    return frozenset(names)


def _module_problem(dotted: str) -> str | None:
    """Why ``sdp_cli.a.b.c`` names nothing, or None: each part is a subpackage, a module, or a
    name defined at the top of the module before it (attributes of that name are not checked)."""
    parts = dotted.split(".")
    where = REPO / parts[0]
    for i, part in enumerate(parts[1:], 1):
        if part.startswith("__"):  # sdp_cli.__file__, __version__: not names of the code
            return None
        if where.is_dir():
            if (where / part).is_dir() or (where / f"{part}.py").is_file():
                where = where / part if (where / part).is_dir() else where / f"{part}.py"
                continue
            init = where / "__init__.py"
            if part in _top_level_names(init):
                return None
            return f"{'.'.join(parts[:i])} has no module or name {part!r}"
        return None if part in _top_level_names(where) else f"{'.'.join(parts[:i])} defines no {part!r}"
    return None


def _problems(path: Path) -> list[str]:
    text = path.read_text()
    rel = path.relative_to(REPO)
    found: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        where = f"{rel}:{number}"
        if FORBIDDEN.search(line):
            found.append(f"{where}: cites a document outside the repository: {line.strip()[:90]}")
        for target in PATH.findall(line):
            if any(c in target for c in "<>*{}") or target.endswith((".", "/.")):
                continue
            if not (REPO / target.rstrip(".")).exists():
                found.append(f"{where}: {target} does not exist")
        for doc, sections in SECTIONS.findall(line):
            numbers, _ = _headings(REPO / doc) if (REPO / doc).is_file() else (set(), set())
            for ref in re.findall(r"§\s?(\d+(?:\.\d+)?)|[–-]\s?(\d+(?:\.\d+)?)", sections):
                section = ref[0] or ref[1]
                if (REPO / doc).is_file() and section not in numbers:
                    found.append(f"{where}: {doc} has no section {section}")
        for doc, title in TITLE.findall(line):
            # a title may leave out the end of a heading ("Several processes (multi-GPU)")
            titles = [t.lower() for t in _headings(REPO / doc)[1]] if (REPO / doc).is_file() else []
            if titles and not any(t.startswith(title.lower()) for t in titles):
                found.append(f"{where}: {doc} has no section titled {title!r}")
        if path.suffix == ".md":
            for link in LINK.findall(line):
                if re.match(r"[a-z]+:", link):
                    continue
                if not (path.parent / link).exists():
                    found.append(f"{where}: link target {link} does not exist")
        for dotted in MODULE.findall(line):
            if problem := _module_problem(dotted):
                found.append(f"{where}: {problem}")
    return found


def test_every_citation_names_something_in_the_repository():
    problems = [p for path in _citing_files() for p in _problems(path)]
    assert not problems, f"{len(problems)} broken citations:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("see DESIGN.md §2", "outside the repository"),
        ("(research/areal.md §0.3)", "outside the repository"),
        ("docs/nothing.md", "docs/nothing.md does not exist"),
        ("docs/math.md §19", "docs/math.md has no section 19"),
        ("docs/math.md §1–§12", "docs/math.md has no section 12"),
        ('docs/engines.md "No such title"', "has no section titled"),
        ("``sdp_cli.engine.nothing``", "sdp_cli.engine has no module or name 'nothing'"),
        ("``sdp_cli.rundir.NoSuchThing``", "sdp_cli.rundir defines no 'NoSuchThing'"),
    ],
)
def test_a_broken_citation_is_found(tmp_path, monkeypatch, line, expected):
    fake = REPO / "tests" / "_citation_probe.md"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: line if self == fake else _read(self))
    assert any(expected in p for p in _problems(fake)), _problems(fake)


def test_good_citations_pass(monkeypatch):
    line = (
        'docs/math.md §5.2, docs/design.md §1–§3, docs/engines.md "Temperature", '
        "sdp_cli/rundir.py, ``sdp_cli.engine.wire.check_segment``, ``sdp_cli.rollout.ProximalRecomputer``"
    )
    fake = REPO / "tests" / "_citation_probe.md"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: line if self == fake else _read(self))
    assert _problems(fake) == []


_read = Path.read_text
