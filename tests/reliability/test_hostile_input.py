"""Hostile input: malformed files, configs and command-line values, and fuzzing.

Every malformed input must end in one line on stderr (``error: ...``), a non-zero exit and no
file written; the readers must never raise anything but a one-line ``UserError`` on arbitrary
bytes, never hang, never unpickle; oversized safetensors headers are refused before they are
read. Commands run in-process through ``sdp_cli.cli.main.main`` (the console-script entry
point) in an empty working directory, so "nothing written" is checked on the whole tree.
"""

from __future__ import annotations

import ast
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors.torch import save, save_file

import sdp_cli
from sdp_cli.cli.main import main
from sdp_cli.config.compose import compose_config
from sdp_cli.config.schema import field_docs
from sdp_cli.errors import UserError
from sdp_cli.rollout.batch_file import BatchFormatError, read_batch
from sdp_cli.rollout.batch_header import MAX_HEADER_BYTES

from . import report
from .harness import error_line

pytestmark = pytest.mark.reliability

EXAMPLE = Path(sdp_cli.__file__).parent / "data" / "example_batch.safetensors"


# ----------------------------------------------------------------------------- file builders
def _example_tensors() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(EXAMPLE), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())


def _edited_batch(path: Path, edit) -> Path:
    """The example batch with ``edit(tensors, metadata)`` applied, written without validation."""
    tensors, meta = _example_tensors()
    edit(tensors, meta)
    save_file(tensors, str(path), metadata=meta)
    return path


def _with_header(path: Path, header: bytes, declared: int | None = None, tail: bytes = b"") -> Path:
    length = len(header) if declared is None else declared
    path.write_bytes(struct.pack("<Q", length) + header + tail)
    return path


def _nan_logprob(t, m):
    t["old_logprobs"][-1] = math.nan


def _cu_not_increasing(t, m):
    t["cu_seqlens"][2] = t["cu_seqlens"][1]


def _newer_format(t, m):
    m["format_version"] = "99"


def _cu_wraps_int64(t, m):
    # differences stay positive in int64: 2^62 − 0, (−2^63 + 100) − 2^62 → 2^62 + 100,
    # 34 − (−2^63 + 100) → 2^63 − 66; unbounded, this was SIGSEGV (inspect) and SIGFPE (recompute)
    t["cu_seqlens"][1] = 2**62
    t["cu_seqlens"][2] = -(2**63) + 100


def _trainer_version_2_70(t, m):
    m["trainer_version"] = str(2**70)


def _positive_logprob(t, m):
    t["old_logprobs"][t["versions"] >= 0] = 0.5


def _logprob_near_float_min(t, m):
    t["proximal_logprobs"][t["versions"] >= 0] = -3e38


def _tiny_temperature(t, m):
    m["temperature"] = "1e-300"


def _token_id_negative(t, m):
    t["input_ids"][3] = -5


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _existing(path: Path) -> Path:
    path.write_bytes(EXAMPLE.read_bytes())  # a training batch the user keeps
    return path


def _hard_link(tmp: Path) -> Path:
    os.link(_copy_example(tmp), tmp / "alias.safetensors")
    return tmp / "alias.safetensors"


def _versions_with_a_truncated_one(tmp: Path) -> Path:
    """v000008 and v000009 (the versions the example batch needs), v000008's weights cut in half."""
    from sdp_cli.models import load_policy, save_policy

    policy = load_policy("tiny", task="arith1", warm_start_steps=0, hidden_size=32, num_layers=1,
                         num_heads=2, num_kv_heads=2, intermediate_size=64)  # fmt: skip
    for version in (8, 9):
        save_policy(policy, tmp / "run" / "versions" / f"v{version:06d}")
    weights = tmp / "run" / "versions" / "v000008" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return tmp / "run"


def _run_dir(tmp: Path, overrides: str) -> Path:
    run = tmp / "oldrun"
    run.mkdir()
    (run / "overrides.json").write_text(overrides)
    return run


# (name, builder(tmp) -> argv, fragment of the one error line)
MALFORMED = [
    ("train: negative step count", lambda t: ["train", "train.steps=-1"], "train.steps=-1 must be > 0"),
    ("train: step count not an integer", lambda t: ["train", "train.steps=abc"], "train.steps"),
    ("train: step count overflows", lambda t: ["train", "train.steps=1e999"], "train.steps"),
    ("train: unknown key", lambda t: ["train", "nope.key=1"], "unknown config key 'nope'"),
    ("train: unknown group option", lambda t: ["train", "mode=bogus"], "mode=bogus: no such option"),
    ("train: unknown preset", lambda t: ["train", "+preset=nope"], "preset=nope: no such option"),
    ("train: override without a key", lambda t: ["train", "=oops"], "Could not override ''"),
    ("train: unknown flag", lambda t: ["train", "--no-such-flag"], "unknown option '--no-such-flag'"),
    ("train: NaN temperature", lambda t: ["train", "rollout.temperature=nan"], "must be a finite number"),
    ("train: infinite learning rate", lambda t: ["train", "optim.lr=inf"], "optim.lr=inf must be a finite"),
    ("train: NaN dual clip", lambda t: ["train", "loss.dual_clip=nan"], "loss.dual_clip=nan must be > 1"),
    ("train: empty groups", lambda t: ["train", "rollout.group_size=0"], "rollout.group_size=0 must be > 0"),
    ("train: floor above cap", lambda t: ["train", "loss.weight_floor=5", "loss.weight_cap=1"], "is above"),
    ("train: segment-wise without recompute",
     lambda t: ["train", "mode=segment_wise", "rollout.recompute=never"], "needs the recompute pass"),
    ("train: port out of range", lambda t: ["train", "engine.port=70000"], "engine.port=70000"),
    ("train: heads do not divide the width", lambda t: ["train", "model.num_heads=3"], "divisible"),
    ("train: interpolation to nowhere", lambda t: ["train", "train.steps=${nope}"], "nope"),
    ("train: hf model without a path", lambda t: ["train", "model=hf"], "model=hf needs model.path"),
    ("train: hf model path missing", lambda t: ["train", "model=hf", f"model.path={t}/none"],
     "is not a directory"),
    ("train: gsm8k file missing", lambda t: ["train", "task=gsm8k", f"task.path={t}/none.jsonl"],
     "none.jsonl: no such file"),
    ("train: API key variable empty",
     lambda t: ["train", "engine=vllm", "engine.urls=[http://127.0.0.1:9]",
                "engine.api_key_env=SDP_NO_SUCH_KEY_VARIABLE"], "environment variable is empty"),
    ("train: resume of a missing directory", lambda t: ["train", f"resume={t}/none"],
     "not an sdp run directory"),
    ("train: resume of a file", lambda t: ["train", f"resume={EXAMPLE}"], "not an sdp run directory"),
    ("train: resume with corrupt overrides.json",
     lambda t: ["train", f"resume={_run_dir(t, '[not json')}"], "cannot be read"),
    ("train: resume with overrides.json not a list",
     lambda t: ["train", "resume=" + str(_run_dir(t, '{"a": 1}'))], "is not a JSON list of overrides"),
    ("inspect-weights: option value not a number",
     lambda t: ["inspect-weights", "--cap", "abc", str(EXAMPLE)], "Invalid value for '--cap'"),
    ("inspect-weights: unknown option", lambda t: ["inspect-weights", "--bogus"], "No such option"),
    ("inspect-weights: negative cap", lambda t: ["inspect-weights", "--cap", "-1", str(EXAMPLE)],
     "--cap -1.0 must be a finite number > 0"),
    ("inspect-weights: unknown action", lambda t: ["inspect-weights", "--action", "bogus", str(EXAMPLE)],
     "--action 'bogus'"),
    ("inspect-weights: missing file", lambda t: ["inspect-weights", f"{t}/none.safetensors"],
     "file not found"),
    ("inspect-weights: empty file", lambda t: ["inspect-weights", str(_empty_file(t / "e.safetensors"))],
     "is truncated"),
    ("inspect-weights: a pickle", lambda t: ["inspect-weights", str(_pickle(t / "p.safetensors"))],
     "is a Python pickle, which sdp never loads"),
    ("inspect-weights: a torch.save archive", lambda t: ["inspect-weights", str(_torch_saved(t / "z"))],
     "is a zip archive"),
    ("inspect-weights: header length 2^62",
     lambda t: ["inspect-weights", str(_with_header(t / "h", b"{}", 2**62))],
     f"exceeds the {MAX_HEADER_BYTES // 2**20} MB limit"),
    ("inspect-weights: header longer than the file",
     lambda t: ["inspect-weights", str(_with_header(t / "h", b"{}", 5000))], "is truncated"),
    ("inspect-weights: header is not JSON",
     lambda t: ["inspect-weights", str(_with_header(t / "h", b"\xff{{"))],
     "header is not valid JSON"),
    ("inspect-weights: header nested 100000 deep",
     lambda t: ["inspect-weights", str(_with_header(t / "h", b"[" * 100_000 + b"]" * 100_000))],
     "header is not valid JSON"),
    ("inspect-weights: a foreign safetensors file",
     lambda t: ["inspect-weights", str(_foreign(t / "f.safetensors"))], "not an sdp batch"),
    ("inspect-weights: NaN logprob, outputs requested",
     lambda t: ["inspect-weights", str(_edited_batch(t / "n.safetensors", _nan_logprob)),
                "--plot", f"{t}/p.png", "--dump-weights", f"{t}/w.safetensors"], "non-finite value"),
    ("inspect-weights: cu_seqlens not increasing",
     lambda t: ["inspect-weights", str(_edited_batch(t / "c.safetensors", _cu_not_increasing))],
     "cu_seqlens is not strictly increasing"),
    ("inspect-weights: newer format version",
     lambda t: ["inspect-weights", str(_edited_batch(t / "v.safetensors", _newer_format))], "upgrade sdp"),
    ("inspect-weights: cu_seqlens wrap int64",
     lambda t: ["inspect-weights", str(_edited_batch(t / "w.safetensors", _cu_wraps_int64))],
     "cu_seqlens[1] = 4611686018427387904 is outside [0, 695]"),
    ("recompute: cu_seqlens wrap int64",
     lambda t: ["recompute", str(_edited_batch(t / "w.safetensors", _cu_wraps_int64)), "-c", str(t)],
     "cu_seqlens[1] = 4611686018427387904 is outside [0, 695]"),
    ("inspect-weights: trainer_version 2^70",
     lambda t: ["inspect-weights", str(_edited_batch(t / "v.safetensors", _trainer_version_2_70))],
     "trainer_version 1180591620717411303424 is outside"),
    ("inspect-weights: log-probs above 0, --json",
     lambda t: ["inspect-weights", "--json", str(_edited_batch(t / "p.safetensors", _positive_logprob))],
     "is 0.5, must be <= 0"),
    ("inspect-weights: log-probs near -3e38, --json",
     lambda t: ["inspect-weights", "--json", str(_edited_batch(t / "p.safetensors", _logprob_near_float_min))],
     "below the floor -100000"),
    ("inspect-weights: temperature 1e-300 in the header",
     lambda t: ["inspect-weights", str(_edited_batch(t / "t.safetensors", _tiny_temperature))],
     "temperature 1e-300 is outside [0.01, 100]"),
    ("recompute: negative token id",
     lambda t: ["recompute", str(_edited_batch(t / "i.safetensors", _token_id_negative)), "-c", str(t)],
     "input_ids[3] = -5 is outside"),
    ("train: temperature 1e-300", lambda t: ["train", "rollout.temperature=1e-300"],
     "rollout.temperature=1e-300 is outside [0.01, 100]"),
    ("inspect-weights: --plot over a FIFO", lambda t: ["inspect-weights", "--example", "--plot", str(_fifo(t / "f"))],
     "is a FIFO, not a regular file"),
    ("inspect-weights: --dump-weights over a training batch, no --force",
     lambda t: ["inspect-weights", "--example", "--dump-weights", str(_existing(t / "step-000013.safetensors"))],
     "already exists; pass --force to replace it"),
    ("inspect-weights: --plot and --dump-weights one file (x and ./x)",
     lambda t: ["inspect-weights", "--example", "--plot", f"{t}/w.out", "--dump-weights", f"{t}/./w.out"],
     "is given for both --plot and --dump-weights"),
    ("inspect-weights: --plot name of 300 characters",
     lambda t: ["inspect-weights", "--example", "--plot", f"{t}/{'p' * 300}.png"], "longer than the 255"),
    ("inspect-weights: one batch twice (a file and its hard link)",
     lambda t: ["inspect-weights", str(_copy_example(t)), str(_hard_link(t))], "is the same file as"),
    ("recompute: -o over an existing file, no --force",
     lambda t: ["recompute", str(_copy_example(t)), "-c", str(t), "-o", str(_existing(t / "kept.safetensors"))],
     "already exists; pass --force"),
    ("recompute: -o a FIFO",
     lambda t: ["recompute", str(_copy_example(t)), "-c", str(t), "-o", str(_fifo(t / "f")), "--force"],
     "is a FIFO, not a regular file"),
    ("recompute: a version's model.safetensors truncated",
     lambda t: ["recompute", str(_copy_example(t)), "-c", str(_versions_with_a_truncated_one(t)), "--dry-run"],
     "v000008: model.safetensors is truncated"),
    ("inspect-weights: batch name of 300 characters",
     lambda t: ["inspect-weights", f"{t}/{'b' * 300}.safetensors"], "File name too long"),
    ("recompute: batch name of 300 characters",
     lambda t: ["recompute", f"{t}/{'b' * 300}.safetensors", "-c", str(t)], "longer than the 255"),
    ("recompute: --checkpoints name of 300 characters",
     lambda t: ["recompute", str(_copy_example(t)), "-c", f"{t}/{'c' * 300}"], "File name too long"),
    ("inspect-weights: directory without batches", lambda t: ["inspect-weights", str(_empty_dir(t))],
     "holds no *.safetensors"),
    ("recompute: no --checkpoints, batch outside a run", lambda t: ["recompute", str(_copy_example(t))],
     "pass --checkpoints RUN_DIR"),
    ("recompute: a run that saved no batches", lambda t: ["recompute", str(_run_without_batches(t))],
     "train.save_batches=true"),
    ("recompute: checkpoints directory missing",
     lambda t: ["recompute", str(_copy_example(t)), "--checkpoints", f"{t}/none", "-o", f"{t}/o.safetensors"],
     "none"),
    ("recompute: corrupt batch",
     lambda t: ["recompute", str(_with_header(t / "b.safetensors", b"{}", 2**40)), "--checkpoints", str(t)],
     "MB limit"),
    ("sdp: unknown command", lambda t: ["no-such-command"], "No such command"),
]  # fmt: skip


def _pickle(path: Path) -> Path:
    import pickle  # only to write the hostile file; sdp never loads one

    path.write_bytes(pickle.dumps({"input_ids": [1, 2, 3]}))
    return path


def _torch_saved(path: Path) -> Path:
    torch.save({"input_ids": torch.arange(3)}, path)
    return path


def _empty_file(path: Path) -> Path:
    path.write_bytes(b"")
    return path


def _foreign(path: Path) -> Path:
    save_file({"weight": torch.zeros(3)}, str(path))
    return path


def _empty_dir(tmp: Path) -> Path:
    (tmp / "empty").mkdir()
    return tmp / "empty"


def _run_without_batches(tmp: Path) -> Path:
    (tmp / "run").mkdir()
    (tmp / "run" / "config.yaml").write_text("{}\n")
    return tmp / "run"


def _copy_example(tmp: Path) -> Path:
    return Path(shutil.copy(EXAMPLE, tmp / "batch.safetensors"))


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def _run_main(argv: list[str], capsys) -> tuple[int, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


@pytest.mark.parametrize("name,build,fragment", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_input_is_one_line_nonzero_and_writes_nothing(
    name, build, fragment, tmp_path, monkeypatch, capsys
):
    inputs = tmp_path / "in"
    inputs.mkdir()
    argv = build(inputs)
    capsys.readouterr()  # what building the input printed is not the command's output
    work = tmp_path / "work"  # the working directory: runs/ would appear here
    work.mkdir()
    monkeypatch.chdir(work)
    before = _tree(tmp_path)
    code, err = _run_main(argv, capsys)
    written = sorted(set(_tree(tmp_path).items()) - set(before.items()))
    one_line = nonzero = False
    try:
        nonzero = code != 0
        line = error_line(err)
        one_line = True
        assert fragment in line, line
    finally:
        report.hostile_input(name, one_line=one_line, nonzero_exit=nonzero, nothing_written=not written)
    assert nonzero and not written, (code, written)


def test_the_console_script_gives_the_same_one_line(tmp_path):
    """The real entry point in a fresh process: a usage error, a config error, a hostile file."""
    for argv in (
        ["inspect-weights", "--cap", "abc", str(EXAMPLE)],
        ["train", "rollout.temperature=nan"],
        ["inspect-weights", str(_pickle(tmp_path / "p.safetensors"))],
    ):
        done = subprocess.run([sys.executable, "-m", "sdp_cli", *argv], capture_output=True, text=True,
                              cwd=tmp_path, timeout=120)  # fmt: skip
        assert done.returncode == 2
        error_line(done.stderr)


def test_at_least_thirty_malformed_inputs():
    assert len(MALFORMED) >= 30


# -------------------------------------------------------------------------------- fuzzing
def _example_bytes() -> bytes:
    return EXAMPLE.read_bytes()


def _json_values():
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
        st.text(max_size=20),
    )  # fmt: skip
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)
        ),
        max_leaves=20,
    )


def _header_variants():
    """Headers shaped like the real one with fields replaced by arbitrary JSON."""
    tensors, meta = _example_tensors()
    real = json.loads(_example_bytes()[8 : 8 + struct.unpack("<Q", _example_bytes()[:8])[0]])
    names = [*real.keys()]

    @st.composite
    def variant(draw):
        header = json.loads(json.dumps(real))
        for _ in range(draw(st.integers(1, 3))):
            name = draw(st.sampled_from(names))
            keys = [*meta, "format"] if name == "__metadata__" else ["dtype", "shape", "data_offsets"]
            key = draw(st.sampled_from([*keys, None]))
            if key is None or not isinstance(header[name], dict):  # replace the whole entry
                header[name] = draw(_json_values())
            else:
                header[name][key] = draw(_json_values())
        return json.dumps(header).encode()

    return variant()


@st.composite
def _mutated_files(draw):
    data = bytearray(_example_bytes())
    how = draw(st.sampled_from(["truncate", "flip", "length", "header", "random"]))
    if how == "truncate":
        return bytes(data[: draw(st.integers(0, len(data) - 1))])
    if how == "flip":
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= draw(st.integers(1, 255))
        return bytes(data)
    if how == "length":
        data[:8] = struct.pack("<Q", draw(st.integers(0, 2**64 - 1)))
        return bytes(data)
    if how == "header":
        header_len = struct.unpack("<Q", data[:8])[0]
        header = draw(_header_variants())
        return struct.pack("<Q", len(header)) + header + bytes(data[8 + header_len :])
    return draw(st.binary(max_size=2048))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=_mutated_files())
def test_fuzzed_batch_files_are_read_or_refused_in_one_line(tmp_path, content):
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(content)
    started = time.perf_counter()
    try:
        batch = read_batch(path)
        assert batch.num_sequences > 0  # accepted: it passed full validation
    except BatchFormatError as err:
        assert "\n" not in str(err) and str(err).startswith(str(path))
    assert time.perf_counter() - started < 2.0, "the reader took too long"


INT64_EDGES = [0, 1, -1, 2**31 - 1, 2**31, 2**53 - 1, 2**53, 2**62, 2**63 - 1, -(2**63), -(2**62)]
_INT64 = st.one_of(st.sampled_from(INT64_EDGES), st.integers(-(2**63), 2**63 - 1), st.integers(-3, 800))
_METADATA_NUMBERS = st.one_of(
    st.sampled_from([*map(str, INT64_EDGES), str(2**64), str(2**70), "1e-300", "1e309", "5e-324", "-0",
                     "nan", "-inf", "1_0", " 1", "+1", "\u0661", "0x10", "", "9" * 5000]),
    st.integers(-(2**80), 2**80).map(str), st.floats().map(repr), st.text(max_size=8),
)  # fmt: skip
_INT_TENSORS = ("cu_seqlens", "prompt_lens", "versions", "proximal_t_versions", "input_ids")
_FLOAT_TENSORS = ("old_logprobs", "proximal_logprobs_t", "proximal_logprobs", "advantages", "rewards")
_INT64_WRAP = 2**64


def _wrap(x: int) -> int:
    return (x + 2**63) % _INT64_WRAP - 2**63


@st.composite
def _wrapping_cu_seqlens(draw, n: int, entries: int):
    """cu_seqlens from 0 to ``n`` whose differences are all positive in int64 arithmetic, with
    values far outside [0, n] (they wrap around)."""
    cu = [0]
    for _ in range(entries - 3):
        cu.append(_wrap(cu[-1] + draw(st.integers(1, 2**63 - 1))))
    # the last two steps: to a value v with v − cu[-1] > 0 and n − v > 0, both wrapped
    v = draw(st.integers(n + 1 - 2**63, n - 1))
    assume(0 < _wrap(v - cu[-1]) and 0 < _wrap(n - v))
    return torch.tensor([*cu, v, n], dtype=torch.int64)


@st.composite
def _hostile_numbers(draw):
    """The example batch with 1–4 numbers replaced: int64 entries by edge values or any int64,
    log-probs and rewards by any float32, metadata numbers by arbitrary strings, or cu_seqlens
    by a sequence whose differences are all positive in wrapping int64 arithmetic."""
    tensors, meta = _example_tensors()
    for _ in range(draw(st.integers(1, 4))):
        what = draw(st.sampled_from(["metadata", "wrapping cu_seqlens", "int", "float"]))
        if what == "int":
            name = draw(st.sampled_from(_INT_TENSORS))
            tensors[name][draw(st.integers(0, tensors[name].numel() - 1))] = draw(_INT64)
        elif what == "float":
            name = draw(st.sampled_from(_FLOAT_TENSORS))
            tensors[name][draw(st.integers(0, tensors[name].numel() - 1))] = draw(st.floats(width=32))
        elif what == "metadata":
            meta[draw(st.sampled_from(["trainer_version", "temperature"]))] = draw(_METADATA_NUMBERS)
        else:
            cu = tensors["cu_seqlens"]
            tensors["cu_seqlens"] = draw(_wrapping_cu_seqlens(int(cu[-1]), cu.numel()))
    return tensors, meta


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_hostile_numbers())
def test_fuzzed_header_and_tensor_numbers_are_read_or_refused_in_one_line(tmp_path, case):
    """Whatever the numbers, the reader accepts the batch or refuses it in one line; an accepted
    batch can be analysed (the layout, padding and every statistic) and its --json report is
    strict JSON. A crash here (SIGSEGV, SIGFPE, OverflowError) fails the whole session."""
    from sdp_cli.analysis.inspect import analyse_batches
    from sdp_cli.fileio import json_document

    tensors, meta = case
    path = tmp_path / "numbers.safetensors"
    save_file(tensors, str(path), metadata=meta)
    try:
        batch = read_batch(path)
    except BatchFormatError as err:
        assert "\n" not in str(err) and str(err).startswith(str(path))
        return
    report = analyse_batches([batch], [str(path)])

    def refuse(name):
        raise AssertionError(f"{name} is not JSON")

    json.loads(json_document(report.to_dict()), parse_constant=refuse)


KEYS = [key for key, _, _ in field_docs()]
GROUPS = ["mode", "is_agg", "staleness", "engine", "model", "task", "+preset", "+ablate"]
ODD_VALUES = [
    "nan", "inf", "-inf", "null", "", "[]", "[1,2]", "{a: 1}", "${nope}", "${oc.env:HOME}",
    "'quoted'", '"x"', "[" * 200, "1e999", "-0", "true", "0x10", "\\", "=", ",", "…", "\x00",
]  # fmt: skip


@st.composite
def _overrides(draw):
    key = draw(st.one_of(st.sampled_from(KEYS), st.sampled_from(GROUPS),
                         st.text(st.characters(codec="utf-8"), max_size=12)))  # fmt: skip
    prefix = draw(st.sampled_from(["", "", "", "+", "++", "~"]))
    value = draw(st.one_of(
        st.sampled_from(ODD_VALUES), st.integers(-(10**20), 10**20).map(str),
        st.floats().map(repr), st.text(max_size=16),
    ))  # fmt: skip
    return f"{prefix}{key}={value}" if draw(st.booleans()) or prefix != "~" else f"~{key}"


@settings(max_examples=150, deadline=None)
@given(overrides=st.lists(_overrides(), min_size=1, max_size=4))
def test_fuzzed_overrides_compose_or_fail_in_one_line(overrides):
    started = time.perf_counter()
    try:
        compose_config(overrides)
    except UserError as err:
        assert "\n" not in str(err)
    assert time.perf_counter() - started < 10.0, "composing took too long"


OPTIONS = ["--cap", "--floor", "--action", "--per-file", "--json", "--batch-normalize", "--example",
           "--checkpoints", "--proximal", "--exact", "--dry-run", "-o", "--bogus", "--help"]  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    command=st.sampled_from(["inspect-weights", "recompute"]),
    words=st.lists(st.one_of(st.sampled_from(OPTIONS), st.sampled_from(ODD_VALUES),
                             st.sampled_from(["EXAMPLE", "MISSING", "-1", "5", "0.2", "mask"])),
                   max_size=6),
)  # fmt: skip
def test_fuzzed_command_lines_exit_cleanly(tmp_path, monkeypatch, capsys, command, words):
    monkeypatch.chdir(tmp_path)
    argv = [command, *(str(EXAMPLE) if w == "EXAMPLE" else str(tmp_path / "missing") if w == "MISSING" else w
                       for w in words)]  # fmt: skip
    code, err = _run_main(argv, capsys)
    assert code in (0, 2), (argv, code, err)
    assert "Traceback" not in err
    if code:
        error_line(err)


# ------------------------------------------------------------------------ headers, pickle
def test_oversized_headers_are_refused_before_they_are_read(tmp_path):
    """A header length of 2^62, or one just over the limit, costs no allocation and no parsing."""
    cases = [
        _with_header(tmp_path / "a", b"{}", 2**62),
        _with_header(tmp_path / "b", b" " * (MAX_HEADER_BYTES + 1)),
    ]
    for path in cases:
        tracemalloc.start()
        started = time.perf_counter()
        with pytest.raises(BatchFormatError, match="MB limit"):
            read_batch(path)
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert elapsed < 0.05 and peak < 1 << 20, (path.name, elapsed, peak)


def test_a_checkpoint_that_matches_its_manifest_but_is_hostile_is_one_line(tmp_path):
    """Files whose manifest was forged to match still go through a parser that refuses them."""
    from sdp_cli.train.session import checkpoint as ckpt

    root = tmp_path / "checkpoints"
    ckpt.write_checkpoint(
        root, 1, save_policy=lambda d: d.mkdir(), optimizer_state={"state": {}, "param_groups": []},
        state={"trainer": {}, "loop": {}},
    )  # fmt: skip
    path = root / "step-000001"
    (path / "optimizer.safetensors").write_bytes(struct.pack("<Q", 2**60) + b"{}")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["optimizer.safetensors"] = {
        "size": (path / "optimizer.safetensors").stat().st_size,
        "sha256": ckpt._sha256(path / "optimizer.safetensors"),
    }
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="checkpoint cannot be read") as err:
        ckpt.read_checkpoint(path)
    assert "\n" not in str(err.value)


def test_no_pickle_anywhere_in_sdp():
    """No module of sdp imports a pickle-based loader or calls one; models load with
    use_safetensors=True. (Writing a pickle is never needed either.)"""
    banned_modules = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
    banned_calls = {("torch", "load"), ("np", "load"), ("numpy", "load"), ("pd", "read_pickle"),
                    ("pandas", "read_pickle")}  # fmt: skip
    problems = []
    root = Path(sdp_cli.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) > 40
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                problems += [
                    f"{path}: import {a.name}"
                    for a in node.names
                    if a.name.split(".")[0] in banned_modules
                ]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in banned_modules:
                problems.append(f"{path}: from {node.module} import")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                if isinstance(owner, ast.Name) and (owner.id, node.func.attr) in banned_calls:
                    problems.append(f"{path}:{node.lineno}: {owner.id}.{node.func.attr}(...)")
                if node.func.attr == "from_pretrained" and "Model" in ast.unparse(owner):
                    keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
                    if keywords.get("use_safetensors") != "True":
                        problems.append(f"{path}:{node.lineno}: from_pretrained without use_safetensors=True")
    assert not problems, problems


def test_a_torch_save_file_is_refused_unread(tmp_path, monkeypatch):
    """Even given a torch.save archive, no code path of the reader calls the unpickler."""
    import pickle

    def trap(*args, **kwargs):
        raise AssertionError("something tried to unpickle")

    monkeypatch.setattr(pickle, "load", trap)
    monkeypatch.setattr(pickle, "loads", trap)
    monkeypatch.setattr(torch, "load", trap)
    for path in (_torch_saved(tmp_path / "z.safetensors"), _pickle(tmp_path / "p.safetensors")):
        with pytest.raises(BatchFormatError):
            read_batch(path)
    assert save({"x": torch.zeros(1)})  # the safetensors writer itself is untouched


def test_truncated_weights_are_one_line_in_every_reader(tmp_path, monkeypatch, capsys):
    """A model.safetensors cut short: the local engine's weight reader, the policy loader behind
    `sdp train model=hf` and recompute's scorers (the MALFORMED case above) each name the file
    and say it is truncated; `sdp train` refuses it before it writes or prints anything."""
    from sdp_cli.engine._local_weights import read_safetensors_dir
    from sdp_cli.engine.base import EngineError

    run = _versions_with_a_truncated_one(tmp_path)
    broken = run / "versions" / "v000008"
    with pytest.raises(EngineError, match="model.safetensors: is truncated: tensor") as err:
        read_safetensors_dir(broken)
    assert "\n" not in str(err.value)
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)
    code, err_text = _run_main(["train", "model=hf", f"model.path={broken}", "train.steps=1"], capsys)
    assert code == 2
    assert "model.safetensors is truncated" in error_line(err_text)
