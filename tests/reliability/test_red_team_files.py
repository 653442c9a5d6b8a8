"""The red team's files (issue 24): links and special files in a run or sweep directory, damaged
metrics and ledgers, sparse huge batches and huge versions, deep and odd data files.

Each case goes through the real entry point (``sdp_cli.cli.main.main``) in an empty working
directory and must end in one ``error:`` line, exit code 2 and nothing written — not in the run,
not in the file a link points to (the content of a run's ``.lock``, which holds the PID of the
last process that locked it, aside: a refused resume may hold the lock while it checks). On
main each was a traceback, a write through a link, a resume that went on with a ledger that
lost a group, a MemoryError, or a loop over 2⁵³ versions (tests/analysis, tests/rollout,
tests/tasks and tests/train/test_resume_trust.py hold the unit tests that failed on main). Each
case must also be refused within 60 s. The cases are counted as hostile
inputs in the report, named ``red team: <class>: <case>``; docs/reliability.md gives the
counts per class.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch

from sdp_cli.cli.main import main

from ..fast_run import FAST, train_run
from . import report
from .harness import error_line

pytestmark = pytest.mark.reliability


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run of two steps, a checkpoint after each (step 2 consumed groups [4, 5, 6, 7])."""
    return train_run(tmp_path_factory.mktemp("red"), [*FAST, "train.steps=2", "train.checkpoint_every=1"])


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, trained) -> Path:
    """A sweep directory of one finished run, as `sdp ablate` lays it out."""
    root = tmp_path_factory.mktemp("sweep") / "sweep"
    shutil.copytree(trained, root / "runs" / "decoupled-eta0-seed0")
    return root


# ---------------------------------------------------------------------------- builders
def _run(t: Path, trained: Path) -> Path:
    run = t / "run"
    shutil.copytree(trained, run)
    for name in ("metrics.jsonl", "events.jsonl", "ledger.jsonl"):  # what a crash leaves: cut only by a resume that goes on
        with open(run / name, "ab") as fh:
            fh.write(b'{"step": 3, "torn')
    return run


def _outside(t: Path, content: bytes = b"a file of the user's\n") -> Path:
    path = t / "elsewhere" / "notes.txt"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(content)
    return path


def _linked(name: str):
    def build(t, trained):
        run = _run(t, trained)
        (run / name).unlink(missing_ok=True)
        (run / name).symlink_to(_outside(t))
        return ["train", f"resume={run}", "train.steps=3"]

    return build


def _linked_dir(name: str):
    def build(t, trained):
        run = _run(t, trained)
        target = t / "elsewhere" / name
        target.parent.mkdir(exist_ok=True)
        if (run / name).exists():
            shutil.move(run / name, target)
        else:
            target.mkdir()
        (run / name).symlink_to(target, target_is_directory=True)
        return ["train", f"resume={run}", "train.steps=3"]

    return build


def _lock_to_other_ledger(t, trained):
    run, other = _run(t, trained), t / "other"
    shutil.copytree(trained, other)
    (run / ".lock").unlink(missing_ok=True)
    (run / ".lock").symlink_to(other / "ledger.jsonl")
    return ["train", f"resume={run}", "train.steps=3"]


def _fifo(name: str):
    def build(t, trained):
        run = _run(t, trained)
        (run / name).unlink(missing_ok=True)
        os.mkfifo(run / name)
        return ["train", f"resume={run}", "train.steps=3"]

    return build


def _hard_linked_ledger(t, trained):
    run = _run(t, trained)
    (t / "elsewhere").mkdir()
    os.link(run / "ledger.jsonl", t / "elsewhere" / "ledger.jsonl")
    return ["train", f"resume={run}", "train.steps=3"]


def _sweep_file_linked(name: str):
    def build(t, sweep_dir):
        target = t / "sweep"
        shutil.copytree(sweep_dir, target)
        (target / name).symlink_to(_outside(t))
        return ["ablate", "--report", str(target), "--no-plots"]

    return build


def _metrics_line(line: bytes):
    def build(t, trained):
        run = _run(t, trained)
        lines = (run / "metrics.jsonl").read_bytes().split(b"\n")
        (run / "metrics.jsonl").write_bytes(b"\n".join([lines[0], line, *lines[1:]]))
        return ["train", f"resume={run}", "train.steps=3"]

    return build


def _last_event_not_an_event(t, trained):
    run = t / "run"
    shutil.copytree(trained, run)
    with open(run / "events.jsonl", "ab") as fh:
        fh.write(b"5\n")
    return ["train", f"resume={run}", "train.steps=3"]


def _ledger_edited(*, digest: bool):
    def build(t, trained):
        run = _run(t, trained)
        path = run / "ledger.jsonl"
        path.write_bytes(path.read_bytes().replace(b'"groups": [4, 5, 6, 7]', b'"groups": [4, 5, 6, 6]'))
        if not digest:  # checkpoints as an sdp before ledger digests wrote them: the audit decides
            _without_digests(run)
        return ["train", f"resume={run}", "train.steps=3"]

    return build


def _ledger_line_no_event(t, trained):
    run = _run(t, trained)
    _without_digests(run)
    path = run / "ledger.jsonl"
    path.write_bytes(path.read_bytes().replace(b'"event": "consumed"', b'"event": "consumer"', 1))
    return ["train", f"resume={run}", "train.steps=3"]


def _without_digests(run: Path) -> None:
    import hashlib

    for checkpoint in (run / "checkpoints").glob("step-*"):
        state = json.loads((checkpoint / "state.json").read_text())
        state["loop"].pop("ledger_sha256", None)
        (checkpoint / "state.json").write_text(json.dumps(state))
        manifest = json.loads((checkpoint / "manifest.json").read_text())
        data = (checkpoint / "state.json").read_bytes()
        manifest["files"]["state.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def _deep_trackers(t, trained):
    run = _run(t, trained)
    (run / "trackers.json").write_text("[" * 100_000 + "]" * 100_000)
    return ["train", f"resume={run}", "train.steps=3"]


def _sparse(t: Path, tokens: int = 2**31) -> Path:
    """A batch whose header is consistent with ``tokens`` tokens in one sequence and whose data
    is a hole: 64 GiB by its size at 2³¹ tokens, a few kB on disk."""
    entries, offset = {}, 0
    for name, dtype, itemsize in [
        ("input_ids", "I64", 8), ("cu_seqlens", "I64", 8), ("prompt_lens", "I64", 8), ("old_logprobs", "F32", 4),
        ("versions", "I64", 8), ("proximal_logprobs_t", "F32", 4), ("proximal_t_versions", "I64", 8),
    ]:  # fmt: skip
        n = {"cu_seqlens": 2, "prompt_lens": 1}.get(name, tokens)
        entries[name] = {"dtype": dtype, "shape": [n], "data_offsets": [offset, offset + n * itemsize]}
        offset += n * itemsize
    entries["__metadata__"] = {"format": "sdp-batch", "format_version": "1", "trainer_version": "1",
                               "temperature": "1.0", "model": "m", "mode": "decoupled", "sdp_version": "0"}  # fmt: skip
    header = json.dumps(entries).encode()
    path = t / "huge.safetensors"
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
        fh.truncate(8 + len(header) + offset)
    return path


def _lopsided(t: Path, sequences: int = 100_000, longest: int = 100_000) -> Path:
    """A valid 11 MB batch: ``sequences − 1`` sequences of one prompt and one output token and
    one of ``longest`` output tokens; padded to [S, T] it would take 80 GB per int64 tensor."""
    from sdp_cli.rollout.batch_file import SavedBatch, write_batch

    lens = [2] * (sequences - 1) + [1 + longest]
    n = sum(lens)
    cu = torch.tensor([0, *lens]).cumsum(0)
    versions = torch.zeros(n, dtype=torch.int64)
    versions[cu[:-1]] = -1
    old = torch.where(versions >= 0, torch.full((n,), -0.5), torch.zeros(n))
    path = t / "lopsided.safetensors"
    write_batch(path, SavedBatch(
        input_ids=torch.zeros(n, dtype=torch.int64), cu_seqlens=cu, prompt_lens=torch.ones(sequences, dtype=torch.int64),
        old_logprobs=old, versions=versions, proximal_logprobs_t=old.clone(), proximal_t_versions=versions.clone(),
        trainer_version=0, temperature=1.0, model="m", mode="decoupled",
    ))  # fmt: skip
    return path


def _versioned_batch(t: Path, c: int, versions: list[int]) -> Path:
    """A valid batch of trainer version ``c``: one sequence, prompt of 1 token, outputs of
    ``versions``; and ``t/versions`` holding empty directories of the versions the outputs
    carry (the chain between them is missing)."""
    from sdp_cli.rollout.batch_file import SavedBatch, write_batch

    n = 1 + len(versions)
    vers = torch.tensor([-1, *versions], dtype=torch.int64)
    old = torch.where(vers >= 0, torch.full((n,), -0.5), torch.zeros(n))
    batch = SavedBatch(
        input_ids=torch.arange(n), cu_seqlens=torch.tensor([0, n]), prompt_lens=torch.tensor([1]),
        old_logprobs=old, versions=vers, proximal_logprobs_t=old.clone(), proximal_t_versions=vers.clone(),
        trainer_version=c, temperature=1.0, model="m", mode="decoupled",
    )  # fmt: skip
    path = t / "b.safetensors"
    write_batch(path, batch)
    for v in sorted(set(versions)):
        (t / "versions" / f"v{v:06d}").mkdir(parents=True)
    return path


def _data(name: str, text: str, *extra: str):
    def build(t, trained):
        path = t / name
        path.write_text(text, encoding="utf-8")
        return ["train", "task=dataset", f"task.path={path}", "task.reward=final_number", *extra]

    return build


def _deep(depth: int) -> str:
    return '{"prompt": "1+1=", "answer": "2", "x": ' + "[" * depth + "]" * depth + "}"


GOOD = '{"prompt": "1+1=", "answer": "2"}\n'
TOP = 2**53 - 1

# (class, case, builder(tmp, fixture) -> argv, fixture name, fragment of the one error line)
CASES = [
    ("symlinked run files", ".lock linked to a file outside the run", _linked(".lock"), "trained", ".lock is a symbolic link"),
    ("symlinked run files", ".lock linked to another run's ledger", _lock_to_other_ledger, "trained", ".lock is a symbolic link"),
    ("symlinked run files", "metrics.jsonl linked outside", _linked("metrics.jsonl"), "trained", "metrics.jsonl is a symbolic link"),
    ("symlinked run files", "events.jsonl linked outside", _linked("events.jsonl"), "trained", "events.jsonl is a symbolic link"),
    ("symlinked run files", "ledger.jsonl linked outside", _linked("ledger.jsonl"), "trained", "ledger.jsonl is a symbolic link"),
    ("symlinked run files", "trackers.json linked outside", _linked("trackers.json"), "trained", "trackers.json is a symbolic link"),
    ("symlinked run files", "checkpoints/ linked outside", _linked_dir("checkpoints"), "trained", "checkpoints is a symbolic link"),
    ("symlinked run files", "weights/ linked outside", _linked_dir("weights"), "trained", "weights is a symbolic link"),
    ("symlinked run files", "tensorboard/ linked outside", _linked_dir("tensorboard"), "trained", "tensorboard is a symbolic link"),
    ("symlinked run files", "a FIFO named .lock", _fifo(".lock"), "trained", ".lock is a FIFO, not a regular file"),
    ("symlinked run files", "a FIFO named metrics.jsonl", _fifo("metrics.jsonl"), "trained", "metrics.jsonl is a FIFO"),
    ("symlinked run files", "ledger.jsonl hard-linked outside", _hard_linked_ledger, "trained", "ledger.jsonl has 2 hard links"),
    ("symlinked run files", "sweep: summary.md linked outside", _sweep_file_linked("summary.md"), "sweep", "summary.md is a symbolic link"),
    ("symlinked run files", "sweep: plots/ linked outside", _sweep_file_linked("plots"), "sweep", "plots is a symbolic link"),
    ("damaged metrics and ledgers", "metrics: NUL bytes mid-file", _metrics_line(b"\0" * 64), "trained", "line 2 is not JSON"),
    ("damaged metrics and ledgers", "metrics: garbage mid-file", _metrics_line(b"garbage"), "trained", "line 2 is not JSON"),
    ("damaged metrics and ledgers", "metrics: 5 mid-file", _metrics_line(b"5"), "trained", "line 2 is int, not a metrics row"),
    ("damaged metrics and ledgers", 'metrics: {"step":"x"}', _metrics_line(b'{"step":"x"}'), "trained", 'line 2 has step "x"'),
    ("damaged metrics and ledgers", 'metrics: {"step":null}', _metrics_line(b'{"step":null}'), "trained", "line 2 has step null"),
    ("damaged metrics and ledgers", "events: last line 5", _last_event_not_an_event, "trained", "events.jsonl: line"),
    ("damaged metrics and ledgers", "ledger [4,5,6,7] -> [4,5,6,6]", _ledger_edited(digest=True), "trained", "sha256 differs"),
    ("damaged metrics and ledgers", "ledger [4,5,6,7] -> [4,5,6,6], no digest", _ledger_edited(digest=False), "trained",
     "(group 7 lost, group 6 duplicated)"),
    ("damaged metrics and ledgers", "ledger: a line that is no event", _ledger_line_no_event, "trained", 'event "consumer" is not one of'),
    ("damaged metrics and ledgers", "trackers.json nested 100000 deep", _deep_trackers, "trained", "trackers.json is unreadable"),
    ("sparse huge batches", "inspect-weights: sparse 64 GiB batch",
     lambda t, _: ["inspect-weights", str(_sparse(t))], None, "over the 4 GiB limit"),
    ("sparse huge batches", "recompute: sparse 64 GiB batch",
     lambda t, _: ["recompute", str(_sparse(t)), "-c", str(t)], None, "over the 4 GiB limit"),
    ("sparse huge batches", "inspect-weights: 11 MB batch that pads to 10^10 entries",
     lambda t, _: ["inspect-weights", str(_lopsided(t))], None, "= 10000000000 entries per padded tensor"),
    ("sparse huge batches", "recompute --exact: trainer version 2^53-1",
     lambda t, _: ["recompute", str(_versioned_batch(t, TOP, [0, TOP])), "-c", str(t), "--exact", "--dry-run"], None,
     f"version(s) 1–{TOP - 1} are missing"),
    ("sparse huge batches", "recompute --exact: trainer version 200000",
     lambda t, _: ["recompute", str(_versioned_batch(t, 200_000, [1, 200_000])), "-c", str(t), "--exact", "--dry-run"],
     None, "version(s) 2–199999 are missing"),
    ("deep/odd data files", "JSONL nested 100000 deep", _data("d.jsonl", GOOD + _deep(100_000) + "\n"), None,
     "d.jsonl:2: the record is nested deeper than 64 levels"),
    ("deep/odd data files", "JSON array nested 100000 deep", _data("d.json", "[" + GOOD + "," + _deep(100_000) + "]"), None,
     "d.json:2: the record is nested deeper than 64 levels"),
    ("deep/odd data files", "an integer of 5000 digits", _data("d.jsonl", '{"prompt": "q", "answer": ' + "9" * 5000 + "}\n"),
     None, "more than 4300 digits"),
    ("deep/odd data files", "a lone surrogate in a prompt, --show-prompts",
     _data("d.jsonl", GOOD + '{"prompt": "q\\ud83d", "answer": "1"}\n', "--show-prompts", "2"), None,
     "d.jsonl:2: field 'prompt' holds a lone surrogate"),
    ("deep/odd data files", "a lone surrogate in an answer", _data("d.jsonl", GOOD + '{"prompt": "q", "answer": "\\udc00"}\n'),
     None, "d.jsonl:2: field 'answer' holds a lone surrogate"),
    ("deep/odd data files", "a 10 MB prompt", _data("d.jsonl", json.dumps({"prompt": "What is 1+1? " * 800_000, "answer": "2"})),
     None, "characters of text, over the 1000000"),
]  # fmt: skip


def _tree(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``: a link's target, a file's size, time and bytes (a .lock's
    content aside, the bytes of a file over 1 MB too: a sparse 64 GiB batch is not read), a
    directory, a FIFO; read without following links or opening FIFOs."""
    out: dict[str, tuple] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = ("link", os.readlink(path))
        elif path.is_dir():
            out[rel] = ("dir",)
        elif path.is_fifo():
            out[rel] = ("fifo",)
        elif path.name == ".lock":
            out[rel] = ("file",)
        else:
            info = path.stat()
            out[rel] = ("file", info.st_size, info.st_mtime_ns, path.read_bytes() if info.st_size < 2**20 else None)
    return out


@pytest.mark.parametrize("kind, name, build, fixture, fragment", CASES, ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_red_team_file_is_one_line_nonzero_and_writes_nothing(kind, name, build, fixture, fragment, request, tmp_path,
                                                              monkeypatch, capsys):  # fmt: skip
    inputs = tmp_path / "in"
    inputs.mkdir()
    argv = build(inputs, request.getfixturevalue(fixture) if fixture else None)
    capsys.readouterr()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    before = _tree(tmp_path)
    threads = torch.get_num_threads()
    started = time.monotonic()
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    written = sorted(k for k in set(before) | set(_tree(tmp_path)) if before.get(k) != _tree(tmp_path).get(k))
    one_line = False
    try:
        line = error_line(err)
        one_line = True
        assert fragment in line, line
    finally:
        report.hostile_input(f"red team: {kind}: {name}", one_line=one_line, nonzero_exit=code == 2,
                             nothing_written=not written)  # fmt: skip
    assert code == 2 and not written, (code, written)
    assert time.monotonic() - started < 60, "a hostile file must be refused at once, not worked through"


def test_the_red_team_classes_and_their_counts():
    """The counts docs/reliability.md gives, per class."""
    counts: dict[str, int] = {}
    for kind, *_ in CASES:
        counts[kind] = counts.get(kind, 0) + 1
    assert counts == {
        "symlinked run files": 14,
        "damaged metrics and ledgers": 10,
        "sparse huge batches": 5,
        "deep/odd data files": 6,
    }


def test_line_separators_inside_strings_are_read_and_keep_the_line_numbers(tmp_path, monkeypatch, capsys):
    """Valid JSONL with U+2028 and U+0085 inside strings: on main refused (str.splitlines broke
    the line there) with the later line numbers shifted; now read, the prompts shown whole."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1=\u2028", "answer": "2"}\n{"prompt": "2+2=\u0085", "answer": "4"}\n', encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as done:
        main(["train", "task=dataset", f"task.path={path}", "task.reward=final_number", "--show-prompts", "2"])
    out = capsys.readouterr().out
    assert done.value.code == 0, out
    assert "record 0 (" in out and f"{path}:1))" in out and "record 1 (" in out and f"{path}:2))" in out, out
