"""The asynchronous weight push (docs/training.md "The weight push"): with η > 0 and an engine
that stages weights, ``RolloutSide._push`` stages in the caller's thread and loads on a thread of
its own; it is waited for before the next push, before a batch is taken that holds tokens whose
π_prox_t the push owes, and before a snapshot. A fake engine blocks its load on an event, so
each test sees the push while it is still in flight."""

import threading
import types

import pytest

from sdp_cli.config.schema import SdpConfig
from sdp_cli.engine.base import EngineError, WeightUpdate
from sdp_cli.rollout.records import RolloutGroup, RolloutSample
from sdp_cli.train.asyncloop.loop import AsyncLoop
from sdp_cli.train.asyncloop.rollout import RolloutSide

from .test_push_hooks import LoggingEngine
from .test_rewarding import Codec, GatedTask


class StagingEngine(LoggingEngine):
    """Stages a state dict as a path update; each load waits for ``release``."""

    def __init__(self, log):
        super().__init__(log)
        self.release = threading.Event()
        self.loading = threading.Event()
        self.fail: BaseException | None = None
        self.loader_threads: list[str] = []
        self.loader_idents: list[int] = []

    def pause(self):
        self.paused = True

    def resume(self):
        self.paused = False

    def stage_weights(self, update):
        self.log.append(f"stage v{update.version}")
        return WeightUpdate(version=update.version, path=f"/staged/v{update.version}")

    def update_weights(self, update):
        self.loader_threads.append(threading.current_thread().name)
        self.loader_idents.append(threading.get_ident())
        self.loading.set()
        assert self.release.wait(10), "the test never released the load"
        if self.fail is not None:
            raise self.fail
        self.log.append(f"load {update.path or 'state dict'}")


def _loop(*, eta=4, mode="decoupled", steps=10, async_push=True):
    log = []
    cfg = SdpConfig()
    cfg.loss.mode = mode
    cfg.rollout.max_head_offpolicyness = eta
    cfg.rollout.batch_groups = 1
    cfg.rollout.group_size = 1
    cfg.train.steps = steps
    cfg.train.async_push = async_push
    engine = StagingEngine(log)
    trainer = types.SimpleNamespace(version=1)  # the push reads the trainer's version only
    loop = RolloutSide(cfg, engine=engine, task=GatedTask(), codec=Codec(), stop_token_ids=(2,), max_new_tokens=1)
    loop.test_trainer = trainer
    return loop, engine, trainer, log


def push(loop, *, last_step=False):
    """The push of the weights the trainer has now (``RolloutSide._push``)."""
    version = loop.test_trainer.version
    return loop._push(WeightUpdate(version=version, state_dict={}), last_step=last_step)


def take(loop, wait_s=30.0):
    """The next batch for the trainer at its version now (``RolloutSide.take_batch``)."""
    return loop.take_batch(loop.test_trainer.version, 1, stop_requested=False, wait_s=wait_s)


def _group(group_id, version):
    sample = RolloutSample(prompt_ids=[5, 6], group_id=group_id)
    sample.append_tokens([7, 8], [-1.0, -1.0], version)
    sample.finish_reason = "stop"
    sample.reward = 1.0
    return RolloutGroup(group_id=group_id, samples=[sample])


def test_the_push_stages_here_and_loads_on_its_own_thread_while_the_step_goes_on():
    loop, engine, trainer, log = _loop()
    assert push(loop) == {}  # returned with the load still blocked
    assert engine.loading.wait(10) and log == ["stage v1"]
    assert loop._push_in_flight is not None
    engine.release.set()
    trainer.version = 2
    push(loop)  # waits for the first push before staging the second: in order
    assert log[:3] == ["stage v1", "load /staged/v1", "stage v2"]
    assert loop._joined_push_metrics["time/push_async_s"] > 0  # reported with the step that waited
    assert engine.loader_threads[0] == "sdp-weight-push"
    loop.join_push()
    assert log[-1] == "load /staged/v2" and loop._version == 2


def test_the_pushes_load_on_one_thread_that_lives_until_the_side_is_closed():
    loop, engine, trainer, _ = _loop()
    engine.release.set()
    for version in (1, 2, 3):
        trainer.version = version
        push(loop)
        loop.join_push()
    assert len(set(engine.loader_idents)) == 1 and engine.loader_idents[0] != threading.get_ident()
    (pusher,) = [t for t in threading.enumerate() if t.ident == engine.loader_idents[0]]
    assert pusher.daemon  # an abort does not wait for it
    loop.close()
    pusher.join(10)
    assert not pusher.is_alive()
    trainer.version = 4
    push(loop)  # a push after the close starts a thread again
    loop.join_push()
    assert loop._version == 4 and engine.loader_idents[-1] != threading.get_ident()


@pytest.mark.parametrize("release", ["release_push", "join_push", "close"])
def test_a_held_push_waits_for_its_release_and_a_join_or_close_releases_it(release):
    loop, engine, trainer, log = _loop()
    engine.release.set()
    report = loop.finish_step(WeightUpdate(version=1, state_dict={}), last_step=False, hold_push=True)
    assert report.version == 1 and log == ["stage v1"]  # staged here, the step reported
    assert not engine.loading.wait(0.3), "a held push started before its release"
    getattr(loop, release)()
    assert engine.loading.wait(10) and engine.loader_threads == ["sdp-weight-push"]
    loop.join_push()
    assert log == ["stage v1", "load /staged/v1"] and loop._version == 1
    trainer.version = 2
    push(loop)  # a push not held starts at once, after a close too
    loop.join_push()
    assert loop._version == 2


@pytest.mark.parametrize(
    ("eta", "async_push", "steps"),
    [(0, True, 10), (4, False, 10), (4, True, 1)],
    ids=["eta-0", "switched-off", "last-step"],
)
def test_the_push_stays_in_the_callers_thread(eta, async_push, steps):
    loop, engine, _, log = _loop(eta=eta, async_push=async_push, steps=steps)
    engine.release.set()
    metrics = push(loop, last_step=steps == 1)
    assert loop._push_in_flight is None and log[-1] == "load state dict" and loop._version == 1
    assert "staleness/purged_groups" in metrics  # its metrics belong to its own step
    assert engine.loader_threads == [threading.current_thread().name]


def test_an_engine_that_does_not_stage_is_pushed_synchronously():
    loop, engine, _, log = _loop()
    engine.stage_weights = lambda update: None  # the base class's answer
    engine.release.set()
    push(loop)
    assert loop._push_in_flight is None and loop._version == 1


@pytest.mark.parametrize(
    ("lag", "scored_by", "joins"),
    [(1, None, True), (2, None, True), (2, 4, False), (3, None, False)],
    ids=["c-1", "c-2", "c-2-scored-already", "c-3"],
)
def test_a_take_waits_for_the_push_only_for_tokens_whose_proximal_t_it_owes(lag, scored_by, joins):
    # trainer at c = 5 after its step; the push in flight loads version 5
    loop, engine, trainer, _ = _loop(mode="segment_wise")
    trainer.version = 5
    push(loop)
    assert engine.loading.wait(10)
    group = _group(0, 5 - lag)
    if scored_by is not None:  # the producer's pass gave it π_{c−1} already
        for t in range(group.samples[0].output_len):
            group.samples[0].set_proximal_t(t, -0.5, scored_by)
    loop.queue.put(group)
    taken: list = []
    taker = threading.Thread(target=lambda: taken.append(take(loop)))
    taker.start()
    taker.join(1.0)
    assert (not taken) == joins, "the take should wait for the push exactly when it owes π_prox_t"
    engine.release.set()
    taker.join(10)
    assert taken and taken[0][0].group_id == 0
    assert (loop._push_in_flight is None) == joins
    loop.join_push()


def test_a_mode_without_proximal_t_takes_any_batch_during_the_push():
    loop, engine, _, _ = _loop(mode="decoupled")
    push(loop)
    assert engine.loading.wait(10)
    loop.queue.put(_group(0, 0))  # one version stale: decoupled reads no π_prox_t
    assert take(loop)[0].group_id == 0 and loop._push_in_flight is not None
    engine.release.set()
    loop.join_push()


def test_a_snapshot_waits_for_the_push_in_flight():
    loop, engine, _, _ = _loop()
    push(loop)
    assert engine.loading.wait(10)
    threading.Timer(0.3, engine.release.set).start()
    snap = loop.snapshot()
    assert snap["version"] == 1 and loop._push_in_flight is None


def test_a_failed_push_is_raised_by_the_next_wait_once():
    loop, engine, trainer, log = _loop()
    engine.fail = EngineError("server gone")
    push(loop)
    engine.release.set()
    trainer.version = 2
    with pytest.raises(EngineError, match="server gone"):
        push(loop)  # the next push waits for it first, and does not start
    assert log == ["stage v1"] and loop._version == 0 and loop._push_in_flight is None
    loop.join_push()  # already reported


def test_run_step_reports_a_push_that_failed_while_its_step_trained():
    """The step trained, so it is counted: push_failed on its row, the engine's version behind."""
    rollout, engine, trainer, _ = _loop()
    engine.fail = EngineError("server gone")
    push(rollout)  # step 1's push (trainer at version 1), in flight
    engine.release.set()
    records = []
    rollout.take_batch = lambda *args, **kwargs: [_group(0, 0)]

    def step(batch):  # step 2 trains
        trainer.version = 2
        return types.SimpleNamespace(metrics={"loss": 0.0})

    trainer.step = step
    loop = AsyncLoop(
        rollout.cfg,
        rollout=rollout,
        trainer=trainer,
        pad_token_id=0,
        push_weights=lambda version: WeightUpdate(version=version, state_dict={}),
        on_step=records.append,
    )
    loop.step = 1
    with pytest.raises(EngineError, match="server gone"):
        loop.run_step()
    # counted, flagged, and the engine still at version 0: two behind the trainer
    assert loop.step == 2
    assert records[0].metrics["engine/push_failed"] == 1.0 and records[0].version == 0


def test_the_cache_filter_never_runs_while_the_push_owes_a_cached_group_its_pass():
    """A version c − 2 token without π_{c−1} anywhere in the cache (not only in the batch): the
    segment-wise filter would drop its group as past its window while the push's pass, under
    weights c − 1 still loaded, is about to score it."""
    loop, engine, trainer, _ = _loop(mode="segment_wise")
    trainer.version = 5
    push(loop)
    assert engine.loading.wait(10)
    old = _group(0, 2)  # c − 3, its π_{c−2} given long ago
    for t in range(old.samples[0].output_len):
        old.samples[0].set_proximal_t(t, -0.5, 3)
    loop.queue.put(old)
    loop.queue.put(_group(1, 3))  # c − 2, not yet scored: the second group, not in the batch
    filtered_during_push = []
    real_filter = loop.strategy.filter_stale_from_cache

    def watched(cache, version):
        filtered_during_push.append(loop._push_in_flight is not None)
        return real_filter(cache, version)

    loop.strategy.filter_stale_from_cache = watched
    threading.Timer(0.3, engine.release.set).start()
    assert take(loop)[0].group_id == 0
    assert filtered_during_push == [False]
