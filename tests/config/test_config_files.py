"""Config files that hang or crash the reader (issue 24, items 23 and 24): every YAML file sdp
reads is checked before Hydra, OmegaConf or PyYAML's constructor sees it (size, encoding,
aliases expanded, depth), a defaults cycle, an unset ${oc.env:...} and a primary config that
does not build on sdp's are one line naming the file (and line), and interpolations that expand
without bound are refused before anything resolves them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from sdp_cli.config import limits
from sdp_cli.config.compose import compose_config, config_source
from sdp_cli.errors import UserError

#: the 320-byte alias bomb of the issue: 9 levels of 9 aliases each, 9^9 ≈ 3.9·10^8 nodes expanded
ALIAS_BOMB = "# @package _global_\na: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{','.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8)
)


def _refused(
    overrides, directory: Path | None = None, name: str | None = None, *, seconds: float = 5.0,
    megabytes: int | None = None,
) -> str:  # fmt: skip
    """The one line composing refuses with, within ``seconds`` and, where given, ``megabytes``
    of Python allocations (traced: tracemalloc makes Python about twice as slow)."""
    if megabytes is not None:
        tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(UserError) as info:
            compose_config(overrides, source=config_source(directory, name))
    finally:
        elapsed = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1] if megabytes is not None else 0
        tracemalloc.stop()
    message = str(info.value)
    assert "\n" not in message
    assert elapsed < seconds, (elapsed, message)
    assert megabytes is None or peak < megabytes << 20, (peak, message)
    return message


def _task_dir(tmp_path: Path, text: str | bytes, name: str = "mine") -> Path:
    (tmp_path / "task").mkdir(exist_ok=True)
    path = tmp_path / "task" / f"{name}.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def test_the_alias_bomb_is_small_and_would_expand_past_the_budget():
    # the file is the size; what it stands for: 9 plain scalars under a, each later
    # level 9 times the one before, 9·9^8 = 9^9 = 387,420,489 scalars under the last key
    assert 280 <= len(ALIAS_BOMB.encode()) <= 340
    assert 9**9 > limits.MAX_YAML_NODES


def test_an_alias_bomb_in_a_task_file_is_refused_at_once(tmp_path):
    path = _task_dir(tmp_path, ALIAS_BOMB)
    message = _refused(["task=mine"], tmp_path, megabytes=20)
    # expanded sizes: a = 1 + 9 = 10 nodes, b = 1 + 9·10 = 91, c = 820, d = 7,381, e = 66,430:
    # e, on line 6, is the first node past the 10,000 budget
    assert message.startswith(f"{path}:6: ")
    assert f"aliases expand it to more than {limits.MAX_YAML_NODES} nodes" in message


def test_an_alias_bomb_as_the_primary_config_is_refused_at_once(tmp_path):
    (tmp_path / "exp.yaml").write_text("defaults:\n  - config\n  - _self_\n" + ALIAS_BOMB.split("\n", 1)[1])
    message = _refused([], tmp_path, "exp", megabytes=20)
    # three defaults lines before a: e is on line 8
    assert message.startswith(f"{tmp_path / 'exp.yaml'}:8: ") and "aliases expand" in message


def test_a_file_not_chosen_is_checked_too(tmp_path):
    # Hydra reads a group's files to list its options; a bomb anywhere under --config-dir is refused
    _task_dir(tmp_path, ALIAS_BOMB, "unused")
    assert "aliases expand" in _refused([], tmp_path)


def test_a_huge_scalar_is_refused_by_its_size_unread(tmp_path):
    path = _task_dir(tmp_path, b"# @package _global_\nrun:\n  name: " + b"a" * (50 << 20) + b"\n")
    size = 20 + 5 + 8 + (50 << 20) + 1  # the header line, "run:", "  name: ", the scalar, its newline
    message = _refused(["task=mine"], tmp_path, megabytes=20)
    assert message == (
        f"{path}: {size} bytes; a config file may have at most {limits.MAX_YAML_BYTES} "
        "(1 MiB); make it smaller"
    )


def test_a_file_just_under_the_size_cap_is_read():
    text = "run:\n  name: " + "a" * (limits.MAX_YAML_BYTES - 20) + "\n"
    assert len(text.encode()) <= limits.MAX_YAML_BYTES
    limits.check_yaml_text(text, "x.yaml")  # one scalar: no error


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        # libyaml's own nesting limit, or (without libyaml) Python's recursion limit
        ("a: " + "[" * 100_000 + "]" * 100_000 + "\n", ("not valid YAML", "nests deeper than")),
        ("a:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 200)) + "  " * 200 + "v: 1\n",
         (f"nests deeper than {limits.MAX_YAML_DEPTH} levels",)),
        ("a: &x [1, *x]\n", ("an alias refers to a node that contains it",)),
        ("a: [" + ", ".join(["1"] * 20_000) + "]\n", (f"more than {limits.MAX_YAML_NODES} nodes",)),
    ],
    ids=["flow nesting 100000", "block nesting 200", "self-referencing alias", "20000 plain nodes"],
)  # fmt: skip
def test_deep_cyclic_or_large_documents_are_refused_in_one_line(tmp_path, text, fragments):
    path = _task_dir(tmp_path, "# @package _global_\n" + text)
    message = _refused(["task=mine"], tmp_path)
    assert message.startswith(f"{path}:") and any(f in message for f in fragments), message


def test_a_legitimate_anchor_still_works(tmp_path):
    _task_dir(tmp_path, "# @package _global_\nengine:\n  extra_args: &args [--a, --b]\nmodel:\n  lora:\n    target_modules: [q_proj]\n")
    cfg, _ = compose_config(["task=mine"], source=config_source(tmp_path, None))
    assert cfg.engine.extra_args == ["--a", "--b"]


def test_a_non_utf8_file_names_its_line_and_column(tmp_path):
    path = _task_dir(tmp_path, b"# @package _global_\ntrain:\n  steps: \xff\xfe 5\n")
    # line 3 holds the bad byte; "  steps: " is 9 characters, so it is column 10
    assert _refused(["task=mine"], tmp_path) == f"{path}:3:10: not UTF-8 (byte 0xff); save the file as UTF-8"


def test_a_non_utf8_primary_config_names_its_line(tmp_path):
    (tmp_path / "exp.yaml").write_bytes(b"defaults:\n  - config\n  - _self_\ntrain:\n  steps: \xe9\n")
    assert _refused([], tmp_path, "exp").startswith(f"{tmp_path / 'exp.yaml'}:5:10: not UTF-8 (byte 0xe9)")


def test_a_syntax_error_is_found_by_the_scan_with_its_line(tmp_path):
    path = _task_dir(tmp_path, "# @package _global_\ntrain:\n  steps: [1, 2\nmodel: {}\n")
    message = _refused(["task=mine"], tmp_path)
    assert message.startswith(f"{path}:") and "not valid YAML" in message


def test_a_fifo_under_config_dir_is_refused_not_read(tmp_path):
    """A FIFO named like a config would block Hydra's reader forever; in a fresh process with a
    deadline, so that a regression fails instead of hanging the suite."""
    (tmp_path / "task").mkdir()
    os.mkfifo(tmp_path / "task" / "pipe.yaml")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, "-m", "sdp_cli", "train", "--config-dir", str(tmp_path), "task=pipe", "--print-config"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: {tmp_path / 'task' / 'pipe.yaml'}: not a regular file; remove it or replace it with a YAML file"


def test_the_guarded_loader_refuses_a_bomb_and_reads_a_config():
    with pytest.raises(UserError, match="aliases expand"):
        limits.load_yaml_text(ALIAS_BOMB, "config.yaml")
    assert limits.load_yaml_text("a: &x [1, 2]\nb: *x\n", "config.yaml") == {"a": [1, 2], "b": [1, 2]}


# ------------------------------------------------------------------ interpolations
STRING_KEYS = ["run.root", "run.project", "run.name", "task.system_prompt", "task.prompt_template",
               "task.reward", "task.eval_path", "task.answer_key", "task.prompt_key", "engine.host",
               "engine.python", "model.path", "model.charset", "resume", "task.path"]  # fmt: skip


def test_interpolations_that_double_each_time_are_refused_before_resolving():
    """run.root="abcdefgh" and each next key ${prev}${prev}: 14 doublings took 23 s under load
    and every further one doubles it; the last key refers 2 + 4 + ... + 2^14 = 32766 times."""
    overrides = ["run.root=abcdefgh"] + [
        f"{key}=${{{prev}}}${{{prev}}}" for prev, key in zip(STRING_KEYS, STRING_KEYS[1:])
    ]
    message = _refused(overrides, seconds=10.0, megabytes=50)
    assert f"expand to more than {limits.MAX_INTERPOLATION_REFS} references" in message


def test_a_long_value_copied_by_interpolations_is_refused():
    # 60 KiB under 20 references in one value is 1,228,800 characters resolved, more than 1 MiB
    overrides = [f"run.root='{'a' * (60 << 10)}'", "run.name=" + "${run.root}" * 20]
    # (Hydra's grammar alone takes ~30 MB for a 60 KiB override)
    assert "resolve to more than" in _refused(overrides, seconds=10.0, megabytes=100)


def test_ordinary_interpolations_still_resolve():
    cfg, _ = compose_config(["run.name=${task.name}-${loss.mode}-${seed}", "run.project=${run.name}"])
    assert cfg.run.name == "arith1-decoupled-0" and cfg.run.project == cfg.run.name


# ------------------------------------------------------------------ overrides
def test_an_override_whose_parse_is_quadratic_is_refused_at_once():
    # Hydra's grammar took 53 s for a 20000-element list (2.4 s at 4000): a cap on the items
    message = _refused(["engine.extra_args=[" + ",".join(["x"] * 20_000) + "]"], seconds=2.0)
    assert f"more than {limits.MAX_OVERRIDE_ITEMS} list or mapping items" in message


def test_quoted_commas_do_not_count_as_items():
    cfg, _ = compose_config(["run.name='" + "a, " * 5000 + "'"])
    assert cfg.run.name.count(",") == 5000


def test_an_overlong_override_is_refused():
    message = _refused([f"run.name='{'a' * (limits.MAX_OVERRIDE_CHARS + 1)}'"], seconds=2.0)
    assert f"longer than {limits.MAX_OVERRIDE_CHARS} characters" in message


# ------------------------------------------------------------------ item 24
def test_a_defaults_cycle_is_one_line_naming_the_cycle(tmp_path):
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "one.yaml").write_text("# @package _global_\ndefaults:\n  - /task/two\n")
    (tmp_path / "task" / "two.yaml").write_text("# @package _global_\ndefaults:\n  - /task/one\n")
    # Hydra recurses to the interpreter's limit first: slow under tracemalloc, but bounded
    message = _refused(["task=one"], tmp_path, seconds=30.0)
    assert "recursion" not in message
    assert message == (
        f"{tmp_path}: the defaults lists include each other in a cycle (task/one → task/two → task/one); "
        "remove one of the entries"
    )


def test_a_config_that_includes_itself_is_a_cycle(tmp_path):
    (tmp_path / "exp.yaml").write_text("defaults:\n  - config\n  - exp\n")
    message = _refused([], tmp_path, "exp", seconds=30.0)
    assert "in a cycle (exp → exp)" in message


def test_an_unset_environment_variable_in_a_file_names_file_and_line(tmp_path, monkeypatch):
    monkeypatch.delenv("SDP_NO_SUCH_VARIABLE", raising=False)
    path = _task_dir(tmp_path, "# @package _global_\ntask:\n  name: dataset\n  path: ${oc.env:SDP_NO_SUCH_VARIABLE}\n  reward: final_number\n")
    assert _refused(["task=mine"], tmp_path) == (
        f"{path}:4: task.path: environment variable SDP_NO_SUCH_VARIABLE is not set; "
        "export it or give a default, ${oc.env:SDP_NO_SUCH_VARIABLE,default}"
    )


def test_an_unset_environment_variable_on_the_command_line_names_the_key(monkeypatch):
    monkeypatch.delenv("SDP_NO_SUCH_VARIABLE", raising=False)
    assert _refused(["run.name=${oc.env:SDP_NO_SUCH_VARIABLE}"]) == (
        "run.name: environment variable SDP_NO_SUCH_VARIABLE is not set; "
        "export it or give a default, ${oc.env:SDP_NO_SUCH_VARIABLE,default}"
    )


def test_an_interpolation_to_nowhere_in_a_file_names_file_and_line(tmp_path):
    path = _task_dir(tmp_path, "# @package _global_\ntrain:\n  eval_every: 1\n  steps: ${nope}\n")
    message = _refused(["task=mine"], tmp_path)
    assert message.startswith(f"{path}:4: train.steps: ") and "nope" in message


@pytest.mark.parametrize(
    "overrides", [["train.steps=3"], ["mode=bypass"], ["+preset=segment_wise"], []],
    ids=["a key", "a group", "a preset", "nothing"],
)  # fmt: skip
def test_a_primary_that_does_not_build_on_sdps_config_says_so(tmp_path, overrides):
    """It used to say "unknown config key 'train'; the nearest valid key is train"."""
    (tmp_path / "exp.yaml").write_text("defaults:\n  - _self_\nloss:\n  clip: 0.3\n")
    assert _refused(overrides, tmp_path, "exp") == (
        f"{tmp_path / 'exp.yaml'} does not build on sdp's config; make its first defaults entry `- config`"
    )


def test_a_config_file_of_exactly_the_limit_is_read_and_one_byte_more_is_not(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_bytes(b"#" * (limits.MAX_YAML_BYTES - 1) + b"\n")
    assert len(limits.read_yaml_file(path)) == limits.MAX_YAML_BYTES
    path.write_bytes(b"#" * limits.MAX_YAML_BYTES + b"\n")
    with pytest.raises(UserError, match=rf"big.yaml: {limits.MAX_YAML_BYTES + 1} bytes; a config file may have at most"):
        limits.read_yaml_file(path)


class _Mark:
    def __init__(self, line):
        self.line, self.name = line, "<unicode string>"


class _YamlError(Exception):
    """What PyYAML's MarkedYAMLError carries, set by hand."""

    def __init__(self, text, problem=None, problem_mark=None, context=None, context_mark=None):
        super().__init__(text)
        self.problem, self.problem_mark, self.context, self.context_mark = problem, problem_mark, context, context_mark


@pytest.mark.parametrize(
    ("err", "line"),
    [
        (_YamlError("x", "found a tab", _Mark(2)), "f.yaml:3: not valid YAML (found a tab); fix the file"),
        (
            _YamlError("x", "expected ']'", _Mark(4), "while parsing a flow sequence", _Mark(1)),
            "f.yaml:5: not valid YAML (expected ']', while parsing a flow sequence at line 2); fix the file",
        ),
        # a context mark without a context says nothing more
        (_YamlError("x", "expected ']'", _Mark(4), None, _Mark(1)), "f.yaml:5: not valid YAML (expected ']'); fix the file"),
        # no problem attribute: the first non-empty line of the error's text
        (_YamlError("\n  unacceptable character #x0007\nmore"), "f.yaml: not valid YAML (  unacceptable character #x0007); fix the file"),
    ],
)
def test_a_yaml_error_is_one_line_with_its_place(err, line):
    assert limits.yaml_error_line(err, "f.yaml") == line


def test_yaml_nesting_and_interpolation_chains_at_their_limits():
    """64 levels below the top are allowed, 65 refused; a chain of 64 interpolating values is
    allowed, 65 refused (MAX_YAML_DEPTH bounds both)."""
    def nested(n):  # the scalar sits n + 1 levels below the top mapping
        return "a: " + "{b: " * n + "1" + "}" * n + "\n"

    limits.load_yaml_text(nested(limits.MAX_YAML_DEPTH - 1), "f.yaml")
    with pytest.raises(UserError, match=r"^f.yaml:1: nests deeper than 64 levels; flatten it$"):
        limits.load_yaml_text(nested(limits.MAX_YAML_DEPTH), "f.yaml")

    def chain(n):  # k0 → k1 → … → k{n-1} → "x": n values that interpolate
        values = {f"k{i}": "${k%d}" % (i + 1) for i in range(n)}
        return {**values, f"k{n}": "x"}

    limits.check_interpolations(chain(limits.MAX_YAML_DEPTH))
    with pytest.raises(UserError, match=r"^k64: its interpolations chain more than 64 values deep; write the value out$"):
        limits.check_interpolations(chain(limits.MAX_YAML_DEPTH + 1))


def test_a_config_dir_may_hold_1000_yaml_files_and_not_1001(tmp_path):
    for i in range(limits.MAX_CONFIG_FILES):
        (tmp_path / f"c{i:04d}.yaml").write_text("a: 1\n")
    assert len(limits.config_files(tmp_path)) == limits.MAX_CONFIG_FILES
    (tmp_path / "one_more.yaml").write_text("a: 1\n")
    with pytest.raises(UserError, match=r"more than 1000 YAML files under it; pass the directory that holds only your configs"):
        limits.config_files(tmp_path)


def test_a_config_of_10000_nodes_is_read_and_one_more_is_refused_naming_what_grew():
    """Nodes counted: the top mapping, its key, the sequence and its items (k + 3)."""
    def listing(k):
        return "a: [" + ",".join(["1"] * k) + "]\n"

    limits.load_yaml_text(listing(limits.MAX_YAML_NODES - 3), "f.yaml")
    with pytest.raises(UserError) as err:
        limits.load_yaml_text(listing(limits.MAX_YAML_NODES - 2), "f.yaml")
    # no alias in it: the message does not blame aliases
    assert str(err.value) == "f.yaml:1: has more than 10000 nodes, the most a config file may have; split it"


def test_an_alias_reused_deep_may_reach_the_depth_limit_and_not_pass_it():
    """&A is 4 levels tall (3 mappings and a scalar); reused under m mappings below "deep" its
    scalar sits m + 4 levels below the top: 64 allowed, 65 refused, though A was first met shallow."""
    def document(m):
        return "base: &A " + "{b: " * 3 + "1" + "}" * 3 + "\ndeep: " + "{c: " * m + "*A" + "}" * m + "\n"

    limits.load_yaml_text(document(60), "f.yaml")
    with pytest.raises(UserError, match=r"nests deeper than 64 levels"):
        limits.load_yaml_text(document(61), "f.yaml")


def test_relative_interpolations_name_their_target():
    assert limits._target("a.b.c", ".x") == "a.b.x"  # a sibling
    assert limits._target("a.b.c", "..x") == "a.x"  # a sibling of the parent
    assert limits._target("a.b.c", "..") == "a"
    assert limits._target("a.b.c", " x[0] ") == "x.0"


def test_a_value_may_interpolate_1000_references_and_not_1001():
    limits.check_interpolations({"x": "1", "k": "${x}" * limits.MAX_INTERPOLATION_REFS})
    with pytest.raises(UserError, match=r"^k: its interpolations expand to more than 1000 references"):
        limits.check_interpolations({"x": "1", "k": "${x}" * (limits.MAX_INTERPOLATION_REFS + 1)})


def test_a_value_may_resolve_to_1_mib_of_characters_and_not_one_more():
    """Counted: the value's own characters outside interpolations plus what each resolves to."""
    filler = "y" * (limits.MAX_RESOLVED_CHARS - 1)
    limits.check_interpolations({"x": "1", "k": "${x}" + filler})
    with pytest.raises(UserError, match=r"^k: its interpolations resolve to more than 1048576 characters"):
        limits.check_interpolations({"x": "12", "k": "${x}" + filler})


def test_a_config_file_that_cannot_be_read_names_the_os_reason(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("a: 1\n")

    def failing_disk(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(limits, "open", failing_disk, raising=False)  # the module's name for the builtin
    with pytest.raises(UserError) as err:
        limits.read_yaml_file(path)
    assert str(err.value) == f"{path}: cannot be read (Input/output error); check the file"
