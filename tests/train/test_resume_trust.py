"""A resume trusts nothing it finds (issue 13 item 3): checkpoints carry the run's identity and
config hash; a checkpoint of another run, of another config or of another model, structural
overrides, and a ledger that is gone, cut short or damaged are refused in one line; and a
refused resume leaves every file of the run byte for byte as it was."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys

import pytest

from sdp_cli.errors import UserError
from sdp_cli.models import load_policy, save_policy
from sdp_cli.rundir import RunDir
from sdp_cli.train.session import checkpoint as ckpt
from sdp_cli.train.asyncloop.ledger import audit

from ..fast_run import FAST, resume_run as resume, train_run

#: a run of two steps with a checkpoint after each (step-000001, step-000002)
RUN = [*FAST, "train.steps=2", "train.checkpoint_every=1"]
GROUP_SIZE = 4  # rollout.group_size of +debug=fast


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_run(tmp_path_factory.mktemp("a"), RUN)


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    """A second run of the very same config and seed: the same weights, another identity."""
    return train_run(tmp_path_factory.mktemp("b"), RUN)


def _copy(run, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(run, target)
    return target


def snapshot(run_dir):
    """Every file of the run (the lock file aside) and its bytes."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != ".lock"}


def crash_tails(run_dir):
    """What a crash leaves: a torn last line in metrics, events and ledger (a resume that goes on
    cuts them; a refused one must leave them)."""
    for name in ("metrics.jsonl", "events.jsonl", "ledger.jsonl"):
        with open(run_dir / name, "ab") as fh:
            fh.write(b'{"step": 3, "torn')


def refused(run_dir, *extra, match):
    """Resume must raise one UserError line matching ``match`` and rewrite nothing."""
    before = snapshot(run_dir)
    with pytest.raises(UserError) as err:
        resume(run_dir, *extra)
    message = str(err.value)
    assert "\n" not in message, message
    assert match in message, message
    assert snapshot(run_dir) == before, "a refused resume changed the run directory"
    return message


def resign(checkpoint):
    """Rewrite a checkpoint's manifest for its current files (sizes and sha256 of each file, as
    sdp_cli/train/session/checkpoint.py writes it), so a test can change a file and keep it 'complete'."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file() and p.name != "manifest.json")
    manifest["files"] = {
        str(p.relative_to(checkpoint)): {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in files
    }
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


# --------------------------------------------------------------- structural overrides
@pytest.mark.parametrize(
    "override, key",
    [
        ("rollout.group_size=2", "rollout.group_size"),
        ("model.hidden_size=128", "model.hidden_size"),
        ("task=arith2", "task.name"),
        ("mode=segment_wise", "loss.mode"),
        ("loss.kl_coef=0.5", "loss.kl_coef"),
        ("optim.lr=0.5", "optim.lr"),
        ("seed=7", "seed"),
        ("train.dtype=bfloat16", "train.dtype"),
    ],
)
def test_structural_overrides_at_resume_are_refused_naming_the_key(trained, tmp_path, override, key):
    run_dir = _copy(trained, tmp_path)
    crash_tails(run_dir)
    message = refused(run_dir, "train.steps=3", override, match=f"a resume cannot change {key} (")
    assert "start a new run instead" in message


def test_a_structural_override_is_one_line_on_the_command_line(trained, tmp_path):
    run_dir = _copy(trained, tmp_path)
    before = snapshot(run_dir)
    done = subprocess.run(
        [sys.executable, "-m", "sdp_cli", "train", f"resume={run_dir}", "rollout.group_size=2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert "rollout.group_size (4 -> 2)" in lines[0], lines[0]  # +debug=fast's group size is 4
    assert snapshot(run_dir) == before


def test_allowed_overrides_at_resume_are_taken_and_the_identity_is_kept(trained, tmp_path):
    run_dir = _copy(trained, tmp_path)
    identity = (run_dir / "identity.json").read_text()
    allowed = [
        "train.steps=3",
        "train.checkpoint_every=3",
        "train.keep_checkpoints=3",
        "train.eval_every=5",
        "run.progress=false",
        "run.trackers=[]",
        "engine.request_timeout_s=60",
        "engine.reconnect_timeout_s=60",
    ]
    assert resume(run_dir, *allowed)["steps"] == 3
    assert json.loads((run_dir / "overrides.json").read_text())[-len(allowed):] == allowed
    assert (run_dir / "identity.json").read_text() == identity
    state = json.loads((run_dir / "checkpoints" / "step-000003" / "state.json").read_text())
    assert state["run"]["run_id"] == json.loads(identity)["run_id"]
    # the checkpoints of both sessions were trained with one structural config: one hash
    first = json.loads((run_dir / "checkpoints" / "step-000002" / "state.json").read_text())
    assert state["run"]["config_hash"] == first["run"]["config_hash"]


def test_a_changed_overrides_file_no_longer_matches_the_checkpoint(trained, tmp_path):
    """overrides.json edited by hand: the config a resume composes is not the one the checkpoint
    was trained with (its hash differs)."""
    run_dir = _copy(trained, tmp_path)
    path = run_dir / "overrides.json"
    path.write_text(json.dumps([*json.loads(path.read_text()), "rollout.group_size=2"]))
    refused(run_dir, "train.steps=3", match="config hash differs")


# ------------------------------------------------------------------ foreign checkpoints
def test_a_checkpoint_copied_from_another_run_is_refused(trained, twin, tmp_path):
    run_dir = _copy(trained, tmp_path)
    # the twin's step 2 as this run's newest checkpoint: same config, same weights, another run
    shutil.copytree(twin / "checkpoints" / "step-000002", run_dir / "checkpoints" / "step-000003")
    crash_tails(run_dir)
    refused(run_dir, "train.steps=4", match="step-000003: this checkpoint belongs to another run")


def test_a_checkpoint_without_identity_in_a_run_with_one_is_refused(trained, tmp_path):
    run_dir = _copy(trained, tmp_path)
    newest = run_dir / "checkpoints" / "step-000002"
    state = json.loads((newest / "state.json").read_text())
    state.pop("run", None)  # (main wrote none)
    (newest / "state.json").write_text(json.dumps(state))
    resign(newest)
    refused(run_dir, "train.steps=3", match="belongs to another run")


def test_a_run_made_by_an_older_sdp_resumes_with_a_warning(trained, tmp_path, capsys):
    """No identity.json and checkpoints without a run stamp (an sdp before identities): resumed,
    with a warning that they cannot be checked (docs/reliability.md)."""
    run_dir = _copy(trained, tmp_path)
    (run_dir / "identity.json").unlink(missing_ok=True)  # (main had none)
    for checkpoint in (run_dir / "checkpoints").glob("step-*"):
        state = json.loads((checkpoint / "state.json").read_text())
        state.pop("run", None)  # (main wrote none)
        (checkpoint / "state.json").write_text(json.dumps(state))
        resign(checkpoint)
    capsys.readouterr()
    assert resume(run_dir, "train.steps=3")["steps"] == 3
    assert "was made by an older sdp: its checkpoints carry no run identity" in capsys.readouterr().err


def test_an_unreadable_checkpoint_is_refused_before_any_repair(trained, tmp_path):
    """A refusal that main already had (state.json that matches its manifest but is no sdp state)
    now comes before the crash repair: the torn tails stay, no `crashed` event is written."""
    run_dir = _copy(trained, tmp_path)
    newest = run_dir / "checkpoints" / "step-000002"
    (newest / "state.json").write_text('{"format": "something else"}')
    resign(newest)
    crash_tails(run_dir)
    refused(run_dir, "train.steps=3", match="checkpoint cannot be read")


# ------------------------------------------------------------------- the model's shape
SMALL = dict(num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128)


def test_a_checkpoint_whose_model_differs_from_the_configs_is_refused(tmp_path):
    """model.path now holds another model (32 wide instead of 64): the checkpoint's policy is not
    the model the config builds, and is refused before it is loaded."""
    model = tmp_path / "model"
    save_policy(load_policy("tiny", task="arith1", warm_start_steps=0, seed=1, hidden_size=64, **SMALL), model)
    run_dir = train_run(tmp_path / "hf", [*RUN, "model=hf", f"model.path={model}"])
    save_policy(load_policy("tiny", task="arith1", warm_start_steps=0, seed=1, hidden_size=32, **SMALL), model)
    crash_tails(run_dir)
    message = refused(run_dir, "train.steps=3", match="its model is not the one the config builds (")
    # the first tensor by name is the embedding, [vocabulary, hidden]: 64 wide saved, 32 now
    vocabulary = load_policy("hf", path=str(model)).model.config.vocab_size
    expected = f"model.embed_tokens.weight has shape [{vocabulary}, 64], the config's model [{vocabulary}, 32]"
    assert expected in message, message


# ----------------------------------------------------------------------------- the ledger
def _ledger_offset(run_dir):
    state = json.loads((run_dir / "checkpoints" / "step-000002" / "state.json").read_text())
    return state["loop"]["ledger_offset"]


def test_a_deleted_ledger_is_refused(trained, tmp_path):
    run_dir = _copy(trained, tmp_path)
    (run_dir / "ledger.jsonl").unlink()
    refused(run_dir, "train.steps=3", match="ledger.jsonl is missing, but step-000002 records")


def test_a_ledger_shorter_than_its_checkpoint_offset_is_refused(trained, tmp_path):
    run_dir = _copy(trained, tmp_path)
    offset = _ledger_offset(run_dir)
    with open(run_dir / "ledger.jsonl", "r+b") as fh:
        fh.truncate(offset // 2)
    refused(run_dir, "train.steps=3", match=f"holds {offset // 2} bytes, fewer than the {offset} that step-000002 records")


def test_a_ledger_damaged_before_its_checkpoint_offset_is_refused(trained, tmp_path):
    """A lost page: the first line's bytes became zeros (the length is unchanged)."""
    run_dir = _copy(trained, tmp_path)
    path = run_dir / "ledger.jsonl"
    data = path.read_bytes()
    first = data.index(b"\n")
    path.write_bytes(b"\0" * first + data[first:])
    refused(run_dir, "train.steps=3", match="ledger.jsonl: line 1, before the end step-000002 records, is not JSON")


def test_a_torn_ledger_tail_is_repaired_at_resume(trained, tmp_path):
    """A crash tore the ledger's last line (past the checkpoint's offset): the resume cuts it, as
    it cuts metrics and events, and the ledger of the finished run audits clean."""
    run_dir = _copy(trained, tmp_path)
    crash_tails(run_dir)
    assert resume(run_dir, "train.steps=3")["steps"] == 3
    lines = (run_dir / "ledger.jsonl").read_bytes().splitlines()
    assert all(json.loads(line) for line in lines)  # every line is whole JSON again
    final = ckpt.read_checkpoint(ckpt.find_latest(RunDir(run_dir).checkpoints))
    result = audit(RunDir(run_dir).ledger, final.state["loop"], GROUP_SIZE)
    assert result.ok, result


# ------------------------------------------------- links and special files in the run (issue 24)
def _outside(tmp_path, name, content=b"a file of the user's, outside the run\n"):
    path = tmp_path / "elsewhere" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(content)
    return path


def _entries(run_dir):
    """Every entry of the run as (kind, bytes of a regular file), read without following links
    or opening special files (a FIFO would block a reader)."""
    import os
    import stat as st

    out = {}
    for path in sorted(run_dir.rglob("*")):
        info = os.lstat(path)
        kind = "link" if st.S_ISLNK(info.st_mode) else "dir" if st.S_ISDIR(info.st_mode) else "file" if st.S_ISREG(info.st_mode) else "special"
        out[str(path.relative_to(run_dir))] = (kind, path.read_bytes() if kind == "file" and path.name != ".lock" else None)
    return out


def refused_unchanged(run_dir, *extra, match, outside=()):
    """Resume is refused in one line matching ``match``; the run and the files ``outside`` it
    are as they were."""
    before, around = _entries(run_dir), {p: p.read_bytes() for p in outside}
    with pytest.raises(UserError) as err:
        resume(run_dir, *extra)
    message = str(err.value)
    assert "\n" not in message and match in message, message
    assert _entries(run_dir) == before, "a refused resume changed the run directory"
    assert {p: p.read_bytes() for p in outside} == around, "a refused resume wrote outside the run"
    return message


def test_a_lock_file_linked_outside_the_run_is_never_written_through(trained, tmp_path):
    """On main the lock was opened through the link: the file outside was truncated and got
    the PID, even though the resume was then refused (here by a structural override)."""
    run_dir = _copy(trained, tmp_path)
    target = _outside(tmp_path, "notes.txt")
    (run_dir / ".lock").unlink(missing_ok=True)
    (run_dir / ".lock").symlink_to(target)
    message = refused_unchanged(run_dir, "rollout.group_size=2", match=".lock is a symbolic link", outside=[target])
    assert message.startswith(f"{run_dir}/.lock is a symbolic link"), message


def test_a_lock_file_linked_to_another_runs_ledger_leaves_that_run_resumable(trained, twin, tmp_path):
    run_dir = _copy(trained, tmp_path)
    other = _copy(twin, tmp_path / "other")
    (run_dir / ".lock").unlink(missing_ok=True)
    (run_dir / ".lock").symlink_to(other / "ledger.jsonl")
    refused_unchanged(run_dir, "train.steps=3", match="is a symbolic link", outside=[other / "ledger.jsonl"])
    assert resume(other, "train.steps=3")["steps"] == 3  # on main: its ledger held a PID


@pytest.mark.parametrize("name", ["metrics.jsonl", "events.jsonl", "ledger.jsonl"])
def test_a_log_linked_outside_the_run_is_refused_and_its_target_kept(trained, tmp_path, name):
    """On main an accepted resume rewrote metrics.jsonl's target (and appended to the targets
    of events and ledger)."""
    run_dir = _copy(trained, tmp_path)
    crash_tails(run_dir)  # a resume that went on would cut them: refused, they stay
    target = _outside(tmp_path, name, (run_dir / name).read_bytes())
    (run_dir / name).unlink()
    (run_dir / name).symlink_to(target)
    refused_unchanged(run_dir, "train.steps=3", match=f"{name} is a symbolic link", outside=[target])


@pytest.mark.parametrize("name", ["checkpoints", "weights", "tensorboard"])
def test_a_directory_linked_outside_the_run_is_refused(trained, tmp_path, name):
    run_dir = _copy(trained, tmp_path)
    crash_tails(run_dir)
    target = tmp_path / "elsewhere" / name
    if (run_dir / name).is_dir():
        shutil.move(run_dir / name, target)
    else:
        target.mkdir(parents=True)
    (run_dir / name).symlink_to(target, target_is_directory=True)
    refused_unchanged(run_dir, "train.steps=3", match=f"{name} is a symbolic link")


@pytest.mark.parametrize("name", [".lock", "metrics.jsonl", "events.jsonl"])
def test_a_fifo_in_place_of_a_run_file_is_one_line(trained, tmp_path, name):
    """On main a FIFO named .lock was a traceback, and a FIFO metrics.jsonl or events.jsonl
    blocked the resume for ever (reading a FIFO waits for a writer): 20 s fail the test."""
    import os
    import signal

    def blocked(*_):
        raise TimeoutError(f"the resume waited on the FIFO {name}")

    run_dir = _copy(trained, tmp_path)
    crash_tails(run_dir)
    (run_dir / name).unlink(missing_ok=True)
    os.mkfifo(run_dir / name)
    previous = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(20)
    try:
        refused_unchanged(run_dir, "train.steps=3", match=f"{name} is a FIFO, not a regular file")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_hard_linked_ledger_is_refused(trained, tmp_path):
    """A hard link is a second name of one file: appending would change the other run's too."""
    import os

    run_dir = _copy(trained, tmp_path)
    crash_tails(run_dir)
    other = tmp_path / "elsewhere"
    other.mkdir()
    os.link(run_dir / "ledger.jsonl", other / "ledger.jsonl")
    refused_unchanged(run_dir, "train.steps=3", match="ledger.jsonl has 2 hard links", outside=[other / "ledger.jsonl"])


# ----------------------------------------------------------- damaged logs (issue 24 item 17)
def _damage(path, line):
    """``line`` inserted as the second line of ``path`` (before the end: not a torn tail)."""
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + line + b"\n" + b"".join(lines[1:]))


DAMAGED_METRICS = [
    (b"\0" * 40, "line 2 is not JSON"),
    (b"garbage", "line 2 is not JSON"),
    (b"5", "line 2 is int, not a metrics row"),
    (b'{"step": "x"}', 'line 2 has step "x", not a step number'),
    (b'{"step": null}', "line 2 has step null, not a step number"),
    (b'{"loss": 1.0}', "line 2 has step null, not a step number"),
    (b"[" * 100_000, "line 2 is not JSON"),
]


@pytest.mark.parametrize("line, fragment", DAMAGED_METRICS, ids=[f[:20] for _, f in DAMAGED_METRICS])
def test_a_damaged_metrics_line_is_refused_before_anything_is_written(trained, tmp_path, line, fragment):
    """On main each was a traceback after the resume had written (a `resumed` event, an
    `abandoned` ledger line); now one line, and every file as it was (torn tails included)."""
    run_dir = _copy(trained, tmp_path)
    _damage(run_dir / "metrics.jsonl", line)
    crash_tails(run_dir)
    message = refused_unchanged(run_dir, "train.steps=3", match=fragment)
    assert message.startswith(f"{run_dir}/metrics.jsonl: {fragment} (damaged); fix or delete that line"), message


@pytest.mark.parametrize("line, fragment", [(b"\0" * 40, "line 2 is not JSON"), (b"[1, 2]", "line 2 is list, not an event")])
def test_a_damaged_events_line_is_refused_before_anything_is_written(trained, tmp_path, line, fragment):
    run_dir = _copy(trained, tmp_path)
    _damage(run_dir / "events.jsonl", line)
    refused_unchanged(run_dir, "train.steps=3", match=f"events.jsonl: {fragment} (damaged)")


def test_a_last_event_that_is_json_but_no_event_is_refused(trained, tmp_path):
    """On main `5` as the last line of events.jsonl was an AttributeError after the resume had
    cut the other logs' torn tails."""
    run_dir = _copy(trained, tmp_path)
    with open(run_dir / "events.jsonl", "ab") as fh:
        fh.write(b"5\n")
    refused_unchanged(run_dir, "train.steps=3", match="events.jsonl: line")


def test_a_deeply_nested_trackers_file_is_refused_before_anything_is_written(trained, tmp_path):
    """trackers.json was read only once the resume had written; 100000 levels of nesting were a
    RecursionError traceback."""
    run_dir = _copy(trained, tmp_path)
    (run_dir / "trackers.json").write_text("[" * 100_000 + "]" * 100_000)
    crash_tails(run_dir)
    refused_unchanged(run_dir, "train.steps=3", match="trackers.json is unreadable")


def test_a_torn_metrics_tail_is_still_repaired(trained, tmp_path):
    """What a crash leaves (a torn last line, zeros of a lost page at the end) is cut, as
    documented (docs/reliability.md, "Crash recovery"), and the resume goes on."""
    run_dir = _copy(trained, tmp_path)
    with open(run_dir / "metrics.jsonl", "ab") as fh:
        fh.write(b'{"step": 2, "lo' + b"\n" + b"\0" * 64)
    assert resume(run_dir, "train.steps=3")["steps"] == 3
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "version" in r] == [1, 2, 3]


# ------------------------------------ a ledger edited into another valid one (issue 24 item 18)
def _edit_ledger(run_dir, old: bytes, new: bytes):
    """Replace ``old`` by ``new`` (the same length) in the ledger: the offset check passes."""
    assert len(old) == len(new)
    path = run_dir / "ledger.jsonl"
    data = path.read_bytes()
    assert data.count(old) == 1, data
    path.write_bytes(data.replace(old, new))


def _drop_digests(run_dir):
    """Checkpoints as an sdp before ledger digests wrote them (no ``ledger_sha256``)."""
    for checkpoint in (run_dir / "checkpoints").glob("step-*"):
        state = json.loads((checkpoint / "state.json").read_text())
        state["loop"].pop("ledger_sha256", None)  # (main wrote none)
        (checkpoint / "state.json").write_text(json.dumps(state))
        resign(checkpoint)


def test_a_ledger_edited_into_another_valid_ledger_is_refused(trained, tmp_path):
    """Step 2 consumed groups [4, 5, 6, 7]; edited to [4, 5, 6, 6] (same length, whole JSON) the
    ledger loses group 7 and counts 6 twice. On main the resume exited 0 and the audit of the
    finished run showed the loss."""
    run_dir = _copy(trained, tmp_path)
    _edit_ledger(run_dir, b'"groups": [4, 5, 6, 7]', b'"groups": [4, 5, 6, 6]')
    crash_tails(run_dir)
    message = refused_unchanged(run_dir, "train.steps=3", match="ledger.jsonl: its first")
    assert "sha256 differs from the one step-000002 records" in message, message


def test_without_a_digest_the_audit_finds_the_lost_and_duplicated_group(trained, tmp_path):
    """A checkpoint of an sdp before ledger digests: the ledger is audited against the
    checkpoint's own record (next_group_id 8, queue, cache, in-flight ids, counters): group 7
    has no fate, group 6 has two."""
    run_dir = _copy(trained, tmp_path)
    _drop_digests(run_dir)
    _edit_ledger(run_dir, b'"groups": [4, 5, 6, 7]', b'"groups": [4, 5, 6, 6]')
    message = refused_unchanged(run_dir, "train.steps=3", match="does not account for the groups step-000002 records")
    assert "group 7 lost, group 6 duplicated" in message, message


def test_a_ledger_whose_steps_were_swapped_is_refused(trained, tmp_path):
    """Both lines consistent, fates exactly one per group, but step 2's groups said to be step
    1's and the other way round: the digest notices, and without it the audit's step order does
    not (the groups' fates are still one each), so the digest is what refuses it."""
    run_dir = _copy(trained, tmp_path)
    _edit_ledger(run_dir, b'"groups": [0, 1, 2, 3], "step": 1', b'"groups": [0, 1, 2, 3], "step": 2')
    _edit_ledger(run_dir, b'"groups": [4, 5, 6, 7], "step": 2', b'"groups": [4, 5, 6, 7], "step": 1')
    refused_unchanged(run_dir, "train.steps=3", match="sha256 differs")


@pytest.mark.parametrize(
    "old, new, fragment",
    [
        (b'"event": "consumed"', b'"event": "consumer"', 'line 1: event "consumer" is not one of'),
        (b'"samples": [4, 4, 4, 4]}', b'"samples": [4, 4, 4]}   ', "line 1: 3 sample counts for 4 groups"),
        (b'"groups": [0, 1, 2, 3]', b'"groups": [0,1,2,"x"] ', "line 1: groups is not a list of group ids"),
    ],
)
def test_a_ledger_line_sdp_never_writes_is_refused_in_one_line(trained, tmp_path, old, new, fragment):
    """Whole JSON of the recorded length, but not a ledger event: one line (on main accepted,
    and a KeyError or TypeError traceback where the audit read it), checked without a digest."""
    assert len(old) == len(new)
    run_dir = _copy(trained, tmp_path)
    _drop_digests(run_dir)
    data = (run_dir / "ledger.jsonl").read_bytes()
    first = data.index(b"\n")
    (run_dir / "ledger.jsonl").write_bytes(data[:first].replace(old, new) + data[first:])
    refused_unchanged(run_dir, "train.steps=3", match=fragment)


def test_the_ledger_mark_is_the_sha256_of_the_bytes_before_it(tmp_path):
    """mark() = (length, sha256 of exactly those bytes), also after a resume reopened the ledger
    truncated to a checkpoint's length and appended to it."""
    import hashlib

    from sdp_cli.train.asyncloop.ledger import LedgerLog

    log = LedgerLog(tmp_path / "ledger.jsonl")
    log.write("consumed", [0, 1], step=1, samples=[4, 4])
    first = log.mark()
    log.write("dropped", [2], version=1, where="queue")
    log.close()
    data = (tmp_path / "ledger.jsonl").read_bytes()
    assert first["ledger_offset"] == data.index(b"\n") + 1
    assert first["ledger_sha256"] == hashlib.sha256(data[: first["ledger_offset"]]).hexdigest()
    resumed = LedgerLog(tmp_path / "ledger.jsonl", truncate_to=first["ledger_offset"])
    assert resumed.mark() == first  # the crashed session's line is gone, the digest continues
    resumed.write("abandoned", [2], checkpoint_step=1)
    mark = resumed.mark()
    resumed.close()
    data = (tmp_path / "ledger.jsonl").read_bytes()
    assert mark == {"ledger_offset": len(data), "ledger_sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize("name, content", [
    ("identity.json", "[" * 100_000 + "]" * 100_000),
    ("config_source.json", "[" * 100_000 + "]" * 100_000),
    ("checkpoints/step-000002/manifest.json", "[" * 100_000 + "]" * 100_000),
    ("checkpoints/step-000002/manifest.json", "[]"),
])  # fmt: skip
def test_files_a_resume_reads_first_are_one_line_when_odd(trained, tmp_path, name, content):
    """On main a RecursionError (100000 levels) or an AttributeError (a manifest that is a JSON
    list) was a traceback. A manifest that is no manifest makes its checkpoint incomplete: the
    resume goes back to the older one, with the warning; identity.json is refused."""
    run_dir = _copy(trained, tmp_path)
    (run_dir / name).write_text(content)
    if name.endswith("config_source.json"):
        refused_unchanged(run_dir, "train.steps=3", match="config_source.json is not what sdp wrote there")
    elif name == "identity.json":
        refused_unchanged(run_dir, "train.steps=3", match="identity.json is not what sdp wrote there")
    else:
        assert resume(run_dir, "train.steps=3")["steps"] == 3  # from step-000001


# ------------------------------------------------------------- a run another process holds
def _hold(run_dir):
    """The run's lock, held here as a live `sdp train` holds it (a second open of the lock file
    conflicts with it even in this process: flock belongs to the open file)."""
    from sdp_cli.dirlock import DirectoryLock

    return DirectoryLock.acquire(run_dir, "run directory")


def _mid_metrics_damage(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "metrics.jsonl").write_text("".join([lines[0], "not json\n", *lines[1:]]))


def _no_valid_checkpoint(run_dir):
    for checkpoint in (run_dir / "checkpoints").glob("step-*"):
        (checkpoint / "manifest.json").write_text("{}")


def _fifo_in_a_temporary_checkpoint(run_dir):
    import os

    tmp = run_dir / "checkpoints" / ".tmp-step-000003-abcd"
    tmp.mkdir()
    os.mkfifo(tmp / "state.json")


@pytest.mark.parametrize("damage", [_mid_metrics_damage, _no_valid_checkpoint, _fifo_in_a_temporary_checkpoint])
def test_a_run_in_use_is_refused_as_in_use_before_its_files_are_read(trained, tmp_path, damage):
    """The lock is taken before the run's files are read: what the holder has half written is
    its own business, and the answer is that the run is in use. On main the files were checked
    first, so a live run's half state was reported as damage (or, below, was a traceback)."""
    import os

    run_dir = _copy(trained, tmp_path)
    damage(run_dir)
    with _hold(run_dir):
        message = refused_unchanged(run_dir, "train.steps=3", match="is in use by another sdp process")
    assert message == (
        f"run directory {run_dir} is in use by another sdp process (pid {os.getpid()}); "
        "wait for it to end or stop it, then try again"
    )


def test_a_resume_racing_a_live_checkpoint_writer_is_refused_in_one_line(trained, tmp_path):
    """The reliability suite's race, made likely: while the holder writes and removes temporary
    checkpoint directories, resumes of its run are refused as in use, every time. On main the
    resume walked the run's tree before locking: a directory removed under the walk was a
    FileNotFoundError traceback (exit 1) or "cannot be listed"."""
    import threading

    run_dir = _copy(trained, tmp_path)
    stop = threading.Event()

    def checkpoint_churn():
        n = 0
        while not stop.is_set():
            tmp = run_dir / "checkpoints" / f".tmp-step-{n:06d}-x"
            (tmp / "policy" / "deep").mkdir(parents=True)
            for i in range(20):
                (tmp / "policy" / "deep" / f"f{i}").write_bytes(b"x")
            shutil.rmtree(tmp)
            n += 1

    writer = threading.Thread(target=checkpoint_churn, daemon=True)
    with _hold(run_dir):
        writer.start()
        try:
            for _ in range(15):
                with pytest.raises(UserError, match="is in use by another sdp process"):
                    resume(run_dir, "train.steps=3")
        finally:
            stop.set()
            writer.join()
