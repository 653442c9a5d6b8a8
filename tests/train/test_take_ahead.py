"""The next step's batch taken ahead (``RolloutSide.reserve_batch``, ``RolloutLink.take_ahead``):
with η > 0 the rollout process sets the batch of step k + 1 aside while the trainer trains step k,
and the take of step k + 1 then claims it. It must be the batch that take would have chosen, and
every path that does not claim it (a stop, a snapshot, a take for another step) must put it back
where it was, so that nothing is lost, duplicated or reordered."""

from __future__ import annotations

import contextlib
import copy
import select
import socket
import threading
import time
import types
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdp_cli.config.schema import SdpConfig
from sdp_cli.engine.base import WeightUpdate
from sdp_cli.rollout.records import RolloutGroup, RolloutSample
from sdp_cli.train.asyncloop import rollout_link
from sdp_cli.train.asyncloop.loop import AsyncLoop
from sdp_cli.train.asyncloop.loop_state import LoopInterrupted
from sdp_cli.train.asyncloop.rollout import RolloutSide
from sdp_cli.train.asyncloop.rollout_link import RolloutLink, serve

from .test_async_push import StagingEngine
from .test_rewarding import Codec, GatedTask

ETA = 4


def _side(*, mode: str, batch_groups: int, eta: int = ETA) -> RolloutSide:
    cfg = SdpConfig()
    cfg.loss.mode = mode
    cfg.staleness.strategy = "segment_wise" if mode == "segment_wise" else "standard"  # as the presets
    cfg.rollout.max_head_offpolicyness = eta
    cfg.rollout.batch_groups = batch_groups
    cfg.rollout.group_size = 2
    cfg.train.steps = 100
    return RolloutSide(cfg, engine=StagingEngine([]), task=GatedTask(), codec=Codec(), stop_token_ids=(2,), max_new_tokens=1)


def _sample(group_id: int, tokens: list[tuple[int, bool]]) -> RolloutSample:
    """A sample whose tokens are (version, holds π_{v+1}) each."""
    sample = RolloutSample(prompt_ids=[5, 6], group_id=group_id)
    for version, scored in tokens:
        sample.append_tokens([7], [-1.0], version)
        if scored:
            sample.set_proximal_t(sample.output_len - 1, -0.5, version + 1)
    sample.finish_reason = "stop"
    sample.reward = 1.0
    return sample


def _group(group_id: int, samples: list[list[tuple[int, bool]]]) -> RolloutGroup:
    return RolloutGroup(group_id=group_id, samples=[_sample(group_id, tokens) for tokens in samples])


def _ids(groups) -> list[int]:
    return [g.group_id for g in groups]


def _content(group: RolloutGroup) -> dict:
    """A group as data, without its samples' ids (a counter of the process)."""
    data = group.to_dict()
    for sample in data["samples"]:
        del sample["sample_id"]
    return data


def _never() -> bool:
    return False


def _at_once() -> bool:
    return True


# versions in generation order (a token's version never falls), each at most c = 8
C = 8
token_lists = st.lists(
    st.tuples(st.integers(C - 6, C), st.booleans()), min_size=1, max_size=4
).map(lambda tokens: sorted(tokens, key=lambda t: t[0]))
group_specs = st.lists(st.lists(token_lists, min_size=2, max_size=2), min_size=0, max_size=7)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=group_specs, mode=st.sampled_from(["segment_wise", "decoupled"]), batch_groups=st.integers(1, 3))
def test_a_batch_set_aside_is_the_batch_the_take_would_choose(specs, mode, batch_groups):
    """Two sides holding the same groups: one sets the batch of trainer version c aside and then
    takes it, the other takes at c as before. When one was set aside, both train the same groups
    and, once the first has caught up with the filter it left for later (at its snapshot), both
    hold the same groups in the same order; when none could be, nothing moved."""
    ahead, plain = _side(mode=mode, batch_groups=batch_groups), _side(mode=mode, batch_groups=batch_groups)
    for side in (ahead, plain):
        for gid, spec in enumerate(specs):
            side.manager.on_rollout_enqueued()  # as the producer counts each (a drop gives its slot back)
            side.manager.on_rollout_submitted()
            side.manager.on_rollout_accepted()
            side.queue.put(_group(gid, copy.deepcopy(spec)))
    reserved = ahead.reserve_batch(C, 5, give_up=_at_once)
    if reserved is None:
        assert ahead.reserved_batch() is None
        assert _ids(ahead.cache.get_all()) == list(range(len(specs)))  # only moved from the queue
        return
    taken = ahead.take_batch(C, 5, stop_requested=False, wait_s=0)
    assert taken is reserved
    expected = plain.take_batch(C, 5, stop_requested=False, wait_s=0)
    assert expected is not None and _ids(taken) == _ids(expected)
    assert [_content(g) for g in taken] == [_content(g) for g in expected]
    snap_ahead, snap_plain = ahead.snapshot(), plain.snapshot()
    assert [g["group_id"] for g in snap_ahead["cache"]] == [g["group_id"] for g in snap_plain["cache"]]
    assert snap_ahead["strategy"] == snap_plain["strategy"]  # the same drops, counted at c


@pytest.mark.parametrize(
    ("tokens", "fixed"),
    [
        ([(C - 2, True)], True),  # older than c − 1 with π_{v+1}: settled
        ([(C - 1, True)], False),  # version c − 1: the take-time pass at c scores it
        ([(C - 2, False)], False),  # π_{c−1} still owed by the push that loads c − 1 … or never
        ([(C - 5, True)], False),  # head lags 5 > η at c: dropped, not taken
    ],
    ids=["settled", "c-1", "owed", "too-stale"],
)
def test_segment_wise_sets_aside_only_groups_nothing_can_change(tokens, fixed):
    side = _side(mode="segment_wise", batch_groups=1)
    side.queue.put(_group(0, [tokens, tokens]))
    assert (side.reserve_batch(C, 5, give_up=_at_once) is not None) is fixed


def test_a_stop_at_the_take_puts_the_batch_back_at_the_head_of_the_cache():
    side = _side(mode="decoupled", batch_groups=2)
    for gid in range(4):
        side.queue.put(_group(gid, [[(C - 2, True)], [(C - 2, True)]]))
    assert _ids(side.reserve_batch(C, 5, give_up=_at_once)) == [0, 1]
    side.queue.put(_group(9, [[(C, False)], [(C, False)]]))  # arrived meanwhile
    with pytest.raises(LoopInterrupted):
        side.take_batch(C, 5, stop_requested=True, wait_s=0)
    side._drain_queue()
    assert _ids(side.cache.get_all()) == [0, 1, 2, 3, 9]
    assert side.reserved_batch() is None


def test_a_snapshot_holds_the_batch_set_aside_and_the_take_after_it_chooses_anew():
    side = _side(mode="decoupled", batch_groups=2)
    for gid in range(3):
        side.queue.put(_group(gid, [[(C - 2, True)], [(C - 2, True)]]))
    side.reserve_batch(C, 5, give_up=_at_once)
    snap = side.snapshot()
    assert [g["group_id"] for g in snap["cache"]] == [0, 1, 2]
    assert side.reserved_batch() is None
    assert _ids(side.take_batch(C, 5, stop_requested=False, wait_s=0)) == [0, 1]


@pytest.mark.parametrize("other", [(C + 1, 5), (C, 6)], ids=["another-version", "another-step"])
def test_a_take_for_another_step_or_version_puts_the_batch_back_first(other):
    side = _side(mode="decoupled", batch_groups=2)
    for gid in range(3):
        side.queue.put(_group(gid, [[(C - 2, True)], [(C - 2, True)]]))
    reserved = side.reserve_batch(C, 5, give_up=_at_once)
    taken = side.take_batch(*other, stop_requested=False, wait_s=0)
    assert _ids(taken) == [0, 1] and taken is not reserved  # taken from the cache, as before
    assert _ids(side.cache.get_all()) == [2]


def test_it_waits_for_groups_until_the_trainer_asks_for_something_else():
    side = _side(mode="decoupled", batch_groups=2)
    side.queue.put(_group(0, [[(C - 1, False)], [(C - 1, False)]]))
    threading.Timer(0.05, lambda: side.queue.put(_group(1, [[(C, False)], [(C, False)]]))).start()
    assert _ids(side.reserve_batch(C, 5, give_up=_never)) == [0, 1]  # came while it waited
    assert side.reserved_batch() is not None

    lonely = _side(mode="decoupled", batch_groups=2)
    lonely.queue.put(_group(0, [[(C - 1, False)], [(C - 1, False)]]))
    asked = time.monotonic() + 0.05
    assert lonely.reserve_batch(C, 5, give_up=lambda: time.monotonic() > asked) is None
    assert _ids(lonely.cache.get_all()) == [0] and lonely.reserved_batch() is None


SETTLED = [[(C - 2, True)], [(C - 3, True), (C - 2, True)]]


def _settle_by_a_pass(side: RolloutSide, monkeypatch) -> None:
    """A recompute pass under weights c − 1 over the cache, as the producer's: it gives the
    version c − 2 tokens that lack it their π_{c−1} (the engine's score: 0.0)."""
    monkeypatch.setattr(side.engine, "get_version", lambda: C - 1)
    with side._handoff_lock:
        plan = side.recomputer.plan(cache=side.cache, inflight=[])
        assert plan.jobs, "the pass has a token to score"
        side.recomputer.write(plan, side.recomputer.score(plan))


def test_each_look_judges_only_a_group_that_may_have_changed(monkeypatch):
    """Group 0 is fixed, group 1 owes π_{c−1}: each look is woken by a new group (or the pass),
    but a group found fixed is not judged again, and one found not fixed only after a pass wrote.
    The pass settles group 1 and the next look sets the batch aside."""
    side = _side(mode="segment_wise", batch_groups=2)
    judged: list[int] = []
    real_fixed = side._fixed
    monkeypatch.setattr(side, "_fixed", lambda group, c: judged.append(group.group_id) or real_fixed(group, c))
    side.queue.put(_group(0, SETTLED))
    side.queue.put(_group(1, [[(C - 2, False)], [(C - 2, True)]]))
    looks = 0

    def look() -> bool:  # give_up, once a look: a new group for the first three, then the pass
        nonlocal looks
        looks += 1
        if looks <= 3:
            side.queue.put(_group(1 + looks, SETTLED))
        elif looks == 4:
            _settle_by_a_pass(side, monkeypatch)
        return looks > 6

    assert _ids(side.reserve_batch(C, 5, give_up=look)) == [0, 1]
    assert looks == 4 and judged == [0, 1, 1]


@pytest.mark.parametrize("wake", ["group", "pass", "trainer"])
def test_with_the_link_watched_each_change_wakes_it_without_polling(wake, monkeypatch):
    """With ``watch`` the wait has no short poll: a queued group, a pass's write and the trainer's
    next request each end it at once, though the idle wait here is a minute."""
    import sdp_cli.train.asyncloop.rollout as rollout_module

    monkeypatch.setattr(rollout_module, "RESERVE_IDLE_S", 60.0)
    side = _side(mode="segment_wise", batch_groups=2)
    side.queue.put(_group(0, SETTLED))
    if wake == "pass":
        side.queue.put(_group(1, [[(C - 2, False)], [(C - 2, True)]]))
    ours, theirs = socket.socketpair()

    def change() -> None:
        while side.cache.size() < (2 if wake == "pass" else 1):  # the first look moved them
            time.sleep(0.01)
        time.sleep(0.05)  # the reserve waits by now
        if wake == "group":
            side.queue.put(_group(1, SETTLED))
        elif wake == "pass":
            _settle_by_a_pass(side, monkeypatch)
        else:
            ours.send(b"next request")

    threading.Thread(target=change, daemon=True).start()
    start = time.monotonic()
    try:
        got = side.reserve_batch(
            C, 5, give_up=lambda: bool(select.select([theirs], [], [], 0)[0]), watch=theirs.fileno()
        )
    finally:
        ours.close()
        theirs.close()
    assert time.monotonic() - start < 10.0
    assert (got is None) if wake == "trainer" else (_ids(got) == [0, 1])


# ------------------------------------------------------------------ over the link


@contextlib.contextmanager
def _served(side: RolloutSide, tmp_path, *, settled_groups: int = 0) -> Iterator[RolloutLink]:
    """A link to ``side`` served on a thread over a socket pair, with ``settled_groups`` groups
    (ids 0, 1, …) queued first; the link is shut down and the server joined after."""
    for gid in range(settled_groups):
        side.queue.put(_group(gid, SETTLED))
    ours, theirs = socket.socketpair()
    server = threading.Thread(target=serve, args=(side, theirs), daemon=True)
    server.start()
    process = types.SimpleNamespace(poll=lambda: None, wait=lambda timeout=None: 0)
    link = RolloutLink(process, ours, log_path=tmp_path / "rollout.log", weight_dtype=None)
    try:
        yield link
    finally:
        link.shutdown(grace_s=0.1)
        server.join(5)


def test_over_the_link_the_batch_taken_ahead_is_sent_and_decoded_once_and_claimed_with_a_short_answer(tmp_path, monkeypatch):
    side = _side(mode="segment_wise", batch_groups=2)
    encoded: list[list[int]] = []
    real_encode = rollout_link.encode_groups
    monkeypatch.setattr(rollout_link, "encode_groups", lambda groups: encoded.append(_ids(groups)) or real_encode(groups))
    decoded: list[list[int]] = []
    real_decode = rollout_link.decode_groups
    monkeypatch.setattr(rollout_link, "decode_groups", lambda data: decoded.append(_ids(g := real_decode(data))) or g)
    with _served(side, tmp_path, settled_groups=4) as link:
        link.take_ahead(C, 5)
        assert link.filtered_groups() == 0  # another call: the answer of the one posted is read first
        assert decoded == [[0, 1]]  # decoded then, while that call waited for its answer
        taken = link.take_batch(C, 5, stop_requested=False, wait_s=0)
        assert encoded == [[0, 1]] and decoded == [[0, 1]]  # sent and decoded once, as take_ahead's answer
        assert [_content(g) for g in taken] == [_content(_group(gid, SETTLED)) for gid in (0, 1)]
        assert _ids(side.cache.get_all()) == [2, 3] and side.reserved_batch() is None
        # the next take is an ordinary one: encoded and sent
        assert _ids(link.take_batch(C + 1, 6, stop_requested=False, wait_s=0)) == [2, 3] and encoded[-1] == [2, 3]


def test_over_the_link_a_snapshot_between_puts_the_batch_back_and_the_take_gets_it_anew(tmp_path):
    side = _side(mode="decoupled", batch_groups=2)
    with _served(side, tmp_path, settled_groups=3) as link:
        link.take_ahead(C, 5)
        assert [g["group_id"] for g in link.snapshot()["cache"]] == [0, 1, 2]
        taken = link.take_batch(C, 5, stop_requested=False, wait_s=0)
        assert _ids(taken) == [0, 1] and _ids(side.cache.get_all()) == [2]


def test_over_the_link_a_stop_at_the_take_leaves_the_batch_for_the_take_after_it(tmp_path):
    side = _side(mode="decoupled", batch_groups=2)
    with _served(side, tmp_path, settled_groups=3) as link:
        link.take_ahead(C, 5)
        link.filtered_groups()
        with pytest.raises(LoopInterrupted):
            link.take_batch(C, 5, stop_requested=True, wait_s=0)
        assert _ids(side.cache.get_all()) == [0, 1, 2]  # back at the head, nothing taken
        taken = link.take_batch(C, 5, stop_requested=False, wait_s=0)  # a resumed loop's take, anew
        assert _ids(taken) == [0, 1] and _ids(side.cache.get_all()) == [2]


def test_an_error_of_the_take_ahead_is_raised_by_the_next_take_not_by_the_calls_between(tmp_path):
    side = _side(mode="decoupled", batch_groups=1)

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device", "/runs/x/groups.jsonl")

    side.reserve_batch = broken
    with _served(side, tmp_path) as link:
        link.take_ahead(C, 5)
        assert link.filtered_groups() == 0  # the posted call's error waits for the take
        with pytest.raises(OSError, match="No space left"):
            link.take_batch(C, 5, stop_requested=False, wait_s=0)


def test_over_the_link_the_push_starts_once_the_trainer_has_the_steps_answer(tmp_path, monkeypatch):
    # the push's first work would take the rollout process's interpreter and core from the
    # answer the trainer waits for: it starts only once that answer is sent
    side = _side(mode="segment_wise", batch_groups=1)
    side.engine.release.set()
    events: list[str] = []
    real_pause = side.engine.pause
    side.engine.pause = lambda: events.append("push started") or real_pause()
    real_send = rollout_link.send_frame

    def slow_send(sock, frame):
        finish_answer = isinstance(frame.get("ok"), dict) and "push_error" in frame["ok"]
        if finish_answer:
            time.sleep(0.3)  # time enough for a push started at once to begin
        real_send(sock, frame)
        if finish_answer:
            events.append("answer sent")

    monkeypatch.setattr(rollout_link, "send_frame", slow_send)
    with _served(side, tmp_path) as link:
        report = link.finish_step(WeightUpdate(version=C + 1, path=tmp_path), last_step=False)
        assert report.version == C + 1
        assert side.engine.loading.wait(10), "the push waited for a join: nothing released it"
        link.join_push()
    assert events == ["answer sent", "push started"]
    assert side.engine.log == [f"stage v{C + 1}", f"load /staged/v{C + 1}"]


# ------------------------------------------------------------------ the loop asks
class _Recording:
    """A rollout side that hands out one-group batches and records ``take_ahead``."""

    def __init__(self):
        self.ahead: list[tuple[int, int]] = []

    def take_batch(self, trainer_version, step, *, stop_requested, wait_s):
        return [_group(step, [[(trainer_version, False)]])]

    def take_ahead(self, trainer_version, step):
        self.ahead.append((trainer_version, step))

    def finish_step(self, update, *, last_step):
        from sdp_cli.train.asyncloop.rollout import StepReport

        return StepReport(version=update.version, metrics={})


@pytest.mark.parametrize("eta", [0, 4])
def test_the_loop_asks_for_the_next_batch_ahead_at_eta_above_zero_except_at_the_last_step(eta):
    cfg = SdpConfig()
    cfg.rollout.max_head_offpolicyness = eta
    cfg.train.steps = 3
    trainer = types.SimpleNamespace(version=0)

    def step(batch):
        trainer.version += 1
        return types.SimpleNamespace(metrics={})

    trainer.step = step
    rollout = _Recording()
    loop = AsyncLoop(cfg, rollout=rollout, trainer=trainer, pad_token_id=0, push_weights=lambda v: types.SimpleNamespace(version=v, state_dict=None, path=None))
    for _ in range(3):
        loop.run_step()
    # step k (trainer at version k − 1) asks for step k + 1's batch, at version k
    assert rollout.ahead == ([] if eta == 0 else [(1, 2), (2, 3)])
