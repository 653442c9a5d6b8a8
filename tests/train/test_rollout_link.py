"""The link between the trainer's process and the rollout process (sdp_cli/train/asyncloop/rollout_link.py):
what crosses it comes out as it went in (groups, errors, frames), the rollout process's end
answers calls in order and forwards its warnings, and the trainer's end turns a lost or cut-off
rollout process into ``RolloutProcessLost`` without hanging or raising from a stop."""

from __future__ import annotations

import errno
import json
import logging
import math
import socket
import subprocess
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdp_cli.engine.base import EngineError, EngineUnavailable
from sdp_cli.errors import UserError
from sdp_cli.faults import InjectedFault
from sdp_cli.rollout.records import RolloutGroup, RolloutSample
from sdp_cli.tasks.plugins import RewardError
from sdp_cli.train.asyncloop.loop_state import LoopCounters, LoopInterrupted, LoopStopped
from sdp_cli.train.asyncloop.rollout_link import (
    RolloutLink,
    RolloutProcessError,
    RolloutProcessLost,
    decode_groups,
    encode_groups,
    error_from_json,
    error_to_json,
    receive_frame,
    send_frame,
    serve,
)

# ------------------------------------------------------------------ groups
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
logprobs = st.floats(min_value=-50.0, max_value=0.0, allow_nan=False)  # -0.0 included


@st.composite
def samples(draw, group_id: int, shared_meta: dict) -> RolloutSample:
    sample = RolloutSample(
        prompt_ids=draw(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=6)),
        group_id=group_id,
        meta=shared_meta if draw(st.booleans()) else draw(st.dictionaries(st.text(max_size=5), json_values, max_size=3)),
    )
    n = draw(st.integers(0, 5))
    sample.append_tokens(
        draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)),
        draw(st.lists(logprobs, min_size=n, max_size=n)),
        draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n)),
    )
    for t in range(n):  # π_prox_t of some tokens from the next version, as a recompute pass writes it
        if draw(st.booleans()):
            sample.set_proximal_t(t, draw(logprobs), sample.versions[t] + 1)
    sample.reward = draw(st.none() | st.floats(-5, 5, allow_nan=False))
    sample.finish_reason = draw(st.sampled_from([None, "stop", "length"]))
    return sample


@st.composite
def groups(draw) -> list[RolloutGroup]:
    out = []
    for group_id in draw(st.lists(st.integers(0, 10**6), max_size=4, unique=True)):
        shared = draw(st.dictionaries(st.text(max_size=5), json_values, max_size=3))
        members = draw(st.lists(samples(group_id, shared), min_size=1, max_size=4))
        out.append(RolloutGroup(group_id=group_id, samples=members))
    return out


@settings(max_examples=150, deadline=None)
@given(groups())
def test_groups_cross_the_link_as_they_were(batch):
    wire = json.loads(json.dumps(encode_groups(batch)))  # through the frame's JSON
    back = decode_groups(wire)
    assert [g.to_dict() for g in back] == [g.to_dict() for g in batch]
    for before, after in zip((s for g in batch for s in g.samples), (s for g in back for s in g.samples), strict=True):
        # bit for bit, the sign of a zero logprob included
        assert [math.copysign(1, x) for x in after.old_logprobs] == [math.copysign(1, x) for x in before.old_logprobs]
        assert after.sample_id == before.sample_id
    metas = [s.meta for g in back for s in g.samples]
    assert len({id(m) for m in metas}) == len(metas), "every sample has a meta of its own"


def test_a_meta_left_out_as_the_one_before_is_a_copy():
    first = RolloutSample(prompt_ids=[1], group_id=3, meta={"prompt": "1+1=", "answer": "2"})
    second = RolloutSample(prompt_ids=[1], group_id=3, meta={"prompt": "1+1=", "answer": "2"})
    wire = encode_groups([RolloutGroup(3, [first, second])])
    assert wire["samples"][1][-1] is None  # the second sample's meta is not sent again
    a, b = decode_groups(json.loads(json.dumps(wire)))[0].samples
    b.meta["extra"] = 1.0
    assert a.meta == {"prompt": "1+1=", "answer": "2"}


# ------------------------------------------------------------------ errors
def _roundtrip(exc: BaseException) -> BaseException:
    return error_from_json(json.loads(json.dumps(error_to_json(exc))))


@pytest.mark.parametrize(
    "exc",
    [
        LoopInterrupted("a stop was requested"),
        LoopStopped("stopped"),
        EngineUnavailable("sdp's engine process stopped answering"),
        EngineError("server gone"),
        UserError("bad value; fix it"),
        InjectedFault("raise:loop.batch_taken"),
        RolloutProcessLost("the rollout process stopped answering: gone"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_an_error_comes_back_as_its_own_class_and_message(exc):
    back = _roundtrip(exc)
    assert type(back) is type(exc) and str(back) == str(exc)


def test_a_reward_error_keeps_its_details_and_key():
    back = _roundtrip(RewardError("reward function f failed on record 2: ValueError: x", "Traceback ...", key="ValueError at r.py:3"))
    assert isinstance(back, RewardError)
    assert (str(back), back.details, back.key) == ("reward function f failed on record 2: ValueError: x", "Traceback ...", "ValueError at r.py:3")


def test_an_os_error_keeps_its_errno_and_file():
    back = _roundtrip(OSError(errno.ENOSPC, "No space left on device", "/runs/x/metrics.jsonl"))
    assert isinstance(back, OSError) and back.errno == errno.ENOSPC
    assert (back.strerror, back.filename) == ("No space left on device", "/runs/x/metrics.jsonl")


def test_the_cause_crosses_too():
    try:
        try:
            raise RewardError("reward function f failed", "Traceback (f)")
        except RewardError as cause:
            raise LoopStopped("rollout producer failed: reward function f failed") from cause
    except LoopStopped as exc:
        back = _roundtrip(exc)
    assert isinstance(back, LoopStopped) and isinstance(back.__cause__, RewardError)
    assert back.__cause__.details == "Traceback (f)"


def test_a_bug_is_a_rollout_process_error_with_its_traceback_as_a_note():
    def buggy():
        return {}["missing"]

    try:
        buggy()
    except KeyError as exc:
        back = _roundtrip(exc)
    assert isinstance(back, RolloutProcessError) and str(back) == "KeyError: 'missing'"
    (note,) = back.__notes__
    assert "in the rollout process" in note and "in buggy" in note


# ------------------------------------------------------------------ frames
def test_frames_in_order_and_the_end_of_the_stream():
    a, b = socket.socketpair()
    send_frame(a, {"call": "x", "args": {"n": 1}})
    send_frame(a, [1.5, "é", None])
    a.close()
    assert receive_frame(b) == {"call": "x", "args": {"n": 1}}
    assert receive_frame(b) == [1.5, "é", None]
    assert receive_frame(b) is None  # closed between frames


def test_a_stream_cut_within_a_frame_is_an_error():
    a, b = socket.socketpair()
    a.sendall((100).to_bytes(4, "big") + b'{"call"')
    a.close()
    with pytest.raises(ConnectionError, match="within a frame"):
        receive_frame(b)


def test_the_wait_callback_runs_while_nothing_arrives_and_may_give_up(monkeypatch):
    import sdp_cli.train.asyncloop.rollout_link as link

    monkeypatch.setattr(link, "_POLL_S", 0.01)
    _, b = socket.socketpair()
    calls = []

    def wait():
        calls.append(1)
        if len(calls) == 3:
            raise RolloutProcessLost("gone")

    with pytest.raises(RolloutProcessLost):
        receive_frame(b, wait)
    assert len(calls) == 3


# ------------------------------------------------------------------ the two ends
class FakeSide:
    """A rollout side that logs its calls; ``counters`` warns, ``snapshot`` fails."""

    def __init__(self):
        self.calls: list[str] = []
        self.shut = threading.Event()

    def start(self):
        self.calls.append("start")

    def filtered_groups(self):
        self.calls.append("filtered_groups")
        return 7

    def counters(self):
        logging.getLogger("sdp_cli.train.asyncloop.producer").warning("engine fault 1 in a row: %s", "gone")
        return LoopCounters(engine_faults=1)

    def snapshot(self):
        raise EngineError("the snapshot's push failed")

    def stop(self, *, wait):
        self.calls.append(f"stop {wait}")
        return RewardError("reward function f failed", "tb")

    def settle_push(self):
        self.calls.append("settle_push")

    def close(self):
        self.calls.append("close")

    def shutdown(self):
        self.calls.append("shutdown")
        self.shut.set()


class FakeProcess:
    """A rollout process that runs until ``code`` is set; a ``stubborn`` one ends only when killed."""

    def __init__(self, *, stubborn: bool = False):
        self.code: int | None = None
        self.stubborn = stubborn
        self.signals: list[str] = []

    def poll(self):
        return self.code

    def wait(self, timeout=None):
        if self.stubborn and "KILL" not in self.signals:
            raise subprocess.TimeoutExpired("rollout process", timeout)
        return self.code

    def terminate(self):
        self.signals.append("TERM")

    def kill(self):
        self.signals.append("KILL")


def _linked(tmp_path: Path, side: FakeSide | None = None) -> tuple[RolloutLink, FakeSide, FakeProcess, threading.Thread]:
    side = side or FakeSide()
    ours, theirs = socket.socketpair()
    server = threading.Thread(target=serve, args=(side, theirs), daemon=True)
    server.start()
    process = FakeProcess()
    log = tmp_path / "rollout.log"
    log.write_text("sdp rollout process: pid 1\nTraceback: the last line\n")
    link = RolloutLink(process, ours, log_path=log, weight_dtype=None)
    return link, side, process, server


def test_calls_are_answered_in_order_and_warnings_come_back_with_them(tmp_path, caplog):
    link, side, _, server = _linked(tmp_path)
    link.start()
    assert link.filtered_groups() == 7
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert link.counters().engine_faults == 1
    # logged again on this side of the link, under the logger that logged it there
    (forwarded,) = [r for r in caplog.records if Path(r.pathname).name == "rollout_link.py"]
    caplog.clear()
    assert (forwarded.name, forwarded.levelno, forwarded.getMessage()) == (
        "sdp_cli.train.asyncloop.producer", logging.WARNING, "engine fault 1 in a row: gone"
    )
    with pytest.raises(EngineError, match="the snapshot's push failed"):
        link.snapshot()  # an error of the call is raised here, and the link goes on
    failure = link.stop(wait=True)
    assert isinstance(failure, RewardError) and failure.details == "tb"
    link.shutdown(grace_s=1)
    server.join(5)
    assert side.calls == ["start", "filtered_groups", "stop True", "shutdown"]


def test_a_rollout_process_that_exited_is_lost_with_its_log(tmp_path, monkeypatch):
    import sdp_cli.train.asyncloop.rollout_link as link_module

    monkeypatch.setattr(link_module, "_POLL_S", 0.01)
    ours, theirs = socket.socketpair()  # nothing serves it: the call waits for an answer
    process = FakeProcess()
    log = tmp_path / "rollout.log"
    log.write_text("a\nb\nMemoryError\n")
    link = RolloutLink(process, ours, log_path=log, weight_dtype=None)
    threading.Timer(0.1, lambda: setattr(process, "code", -9)).start()
    with pytest.raises(RolloutProcessLost) as lost:
        link.filtered_groups()
    assert str(lost.value) == (
        f"the rollout process stopped answering: it was killed by SIGKILL; see {log} (last line: MemoryError)"
    )
    with pytest.raises(RolloutProcessLost, match="^the rollout process has stopped$"):
        link.start()  # every later call says so at once, in short
    # the stop paths do not raise: the run already knows why it stops
    assert link.stop(wait=True) is None
    link.settle_push()
    link.close()
    link.shutdown(grace_s=0.1)
    theirs.close()


def test_the_other_end_closing_is_a_lost_process(tmp_path):
    ours, theirs = socket.socketpair()
    theirs.close()
    link = RolloutLink(FakeProcess(), ours, log_path=tmp_path / "rollout.log", weight_dtype=None)
    with pytest.raises(RolloutProcessLost, match="closed the link|link to it failed"):
        link.filtered_groups()


def test_a_call_cut_off_leaves_the_link_unusable_and_the_shutdown_signals(tmp_path, monkeypatch):
    import sdp_cli.train.asyncloop.rollout_link as link_module

    monkeypatch.setattr(link_module, "_POLL_S", 0.01)
    ours, theirs = socket.socketpair()
    process = FakeProcess(stubborn=True)
    link = RolloutLink(process, ours, log_path=tmp_path / "rollout.log", weight_dtype=None)

    def second_ctrl_c():
        raise KeyboardInterrupt

    monkeypatch.setattr(link, "_check_alive", second_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        link.filtered_groups()
    with pytest.raises(RolloutProcessLost, match="cut off"):
        link.start()
    link.shutdown(grace_s=0.01)  # it cannot be asked to stop: it is signalled, then killed
    assert process.signals == ["TERM", "KILL"]
    theirs.close()


def test_the_end_of_the_link_shuts_the_side_down(tmp_path):
    side = FakeSide()
    ours, theirs = socket.socketpair()
    server = threading.Thread(target=serve, args=(side, theirs), daemon=True)
    server.start()
    ours.close()  # sdp has gone
    assert side.shut.wait(5)
    server.join(5)
    assert not server.is_alive()
