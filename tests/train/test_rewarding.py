"""Rewards run off the generation path (issue 14): the producer starts its next generate call
while a group's reward is still being computed, errors in reward code stop the run in one line,
and extra reward keys become reward/<key> means. A fake engine and task keep it deterministic."""

import functools
import random
import threading
import time

import pytest

from sdp_cli.config.schema import SdpConfig
from sdp_cli.engine.base import InferenceEngine
from sdp_cli.tasks.base import Task, TaskItem
from sdp_cli.tasks.plugins import RewardError, call_reward, load_reward
from sdp_cli.train.asyncloop.rollout import RolloutSide
from sdp_cli.train.asyncloop.rewarding import RewardPool, extra_means


class CountingEngine(InferenceEngine):
    """Answers every sample with one token; counts generate calls."""

    temperature = 1.0

    def __init__(self):
        self.calls = 0
        self.called = threading.Condition()

    def get_version(self):
        return 0

    def set_version(self, version):
        pass

    def generate(self, samples, params):
        for sample in samples:
            sample.append_tokens([7], [-0.5], 0)
            sample.finish_reason = "stop"
        with self.called:
            self.calls += 1
            self.called.notify_all()

    def pause(self):
        pass

    def resume(self):
        pass

    def is_paused(self):
        return False

    def update_weights(self, update):
        pass

    def score(self, sequences, starts):
        return [[0.0] * (len(s) - k) for s, k in zip(sequences, starts)]

    def inflight_samples(self):
        return []


class GatedTask(Task):
    """Each reward waits until ``gate`` opens, then returns ``value``."""

    name = "gated"
    charset = "arith"
    max_new_tokens = 1

    def __init__(self, value=1.0):
        self.gate = threading.Event()
        self.value = value

    def sample(self, rng, n):
        return [TaskItem(prompt=f"{rng.randint(0, 9)}=", answer="1") for _ in range(n)]

    def eval_items(self, n, seed):
        return []

    def reward(self, completion, item, *, stopped):
        assert self.gate.wait(timeout=30), "the test never opened the gate"
        return self.value

    def params(self):
        return {}


class Codec:
    def encode_prompt(self, text):
        return [1, 2]

    def decode_completion(self, token_ids):
        return "x"


def _producing_loop(cfg, engine, task):
    """A ``RolloutSide`` whose producer runs against ``engine`` (no trainer, nothing pushed)."""
    return RolloutSide(cfg, engine=engine, task=task, codec=Codec(), stop_token_ids=(2,), max_new_tokens=1)


def _loop(task, **task_keys):
    cfg = SdpConfig()
    cfg.rollout.batch_groups = 1
    cfg.rollout.group_size = 2
    cfg.rollout.groups_per_request = 1
    for key, value in task_keys.items():
        setattr(cfg.task, key, value)
    engine = CountingEngine()
    return _producing_loop(cfg, engine, task), engine


def test_generation_goes_on_while_a_reward_is_computed():
    task = GatedTask()
    loop, engine = _loop(task)
    loop.start()
    try:
        # Every reward blocks until the gate opens. Scored inline, the producer would be stuck
        # in the first group's reward and never call generate a second time.
        with engine.called:
            assert engine.called.wait_for(lambda: engine.calls >= 2, timeout=10), (
                f"generate was called {engine.calls} time(s) while the first reward was running"
            )
        assert loop.queue.qsize() == 0  # nothing is handed over before it is scored
        in_hand = len(loop.producer.in_hand)
        assert in_hand >= 2  # the groups being scored are still the producer's
        task.gate.set()
        deadline = time.monotonic() + 10
        while loop.queue.qsize() < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        scored = loop.queue.snapshot()
        assert len(scored) >= 2 and all(s.reward == 1.0 for g in scored for s in g.samples)
    finally:
        task.gate.set()
        loop.stop()


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_failing_reward_stops_the_loop_with_its_one_line(kind, tmp_path):
    # The user's path: a reward function in a file, handed to the pool as plain data
    # (call_reward + RewardSpec). A spawned worker imports the file itself; a function defined
    # in this test module could not be imported there.
    (tmp_path / "judge.py").write_text("def judge(prompt, completion, record):\n    raise ValueError('no such number')\n")
    spec = load_reward(f"{tmp_path}/judge.py:judge", {}, answer_key="answer")

    class Failing(GatedTask):
        def reward_call(self, completion, item, *, stopped):
            return functools.partial(call_reward, spec, item.prompt, completion, {}, "record 0")

    task = Failing()
    loop, engine = _loop(task, reward_pool=kind)
    loop.start()
    try:
        deadline = time.monotonic() + 60
        while loop.producer.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert isinstance(loop.producer.error, RewardError), loop.producer.error
        assert str(loop.producer.error) == "reward function judge.py:judge failed on record 0: ValueError: no such number"
        assert loop.queue.qsize() == 0
    finally:
        loop.stop()


def _nan():
    return float("nan")


def test_a_non_finite_reward_is_an_error():
    results = []
    pool = RewardPool(name="of task gated")
    pool.submit([_nan], ["record 3"], lambda r, e: results.append((r, e)))
    deadline = time.monotonic() + 10
    while not results and time.monotonic() < deadline:
        time.sleep(0.01)
    pool.close()
    (result, error), = results
    assert result is None and isinstance(error, RewardError)
    assert str(error) == "reward function of task gated returned nan as its score for record 3; rewards must be finite"


def _with_mean():
    return {"score": 1.0, "mean": 2.0}


def test_an_extra_key_sdp_logs_itself_is_refused():
    results = []
    pool = RewardPool(name="f")
    pool.submit([_with_mean], ["record 0"], lambda r, e: results.append(e))
    deadline = time.monotonic() + 10
    while not results and time.monotonic() < deadline:
        time.sleep(0.01)
    pool.close()
    assert "returned the key 'mean', which sdp logs itself as reward/mean" in str(results[0])


def test_extra_means_average_over_the_samples_that_report_a_key():
    # format: (1 + 0 + 1) / 3 = 0.667; length: only two samples report it, (4 + 6) / 2 = 5
    means = extra_means([{"format": 1.0, "length": 4.0}, {"format": 0.0}, None, {"format": 1.0, "length": 6.0}])
    assert means == pytest.approx({"reward/format": 2 / 3, "reward/length": 5.0})
    assert extra_means([None, {}]) == {}


def test_one_worker_hands_groups_over_in_generation_order():
    order = []
    pool = RewardPool(workers=1)
    done = threading.Event()

    def record(i):
        def callback(results, error):
            order.append(i)
            if len(order) == 20:
                done.set()

        return callback

    for i in range(20):
        pool.submit([lambda: random.random()], ["r"], record(i))
    assert done.wait(10)
    pool.close()
    assert order == list(range(20))


def test_work_submitted_after_close_is_dropped_silently():
    # the producer may finish a generate call after the loop stopped: its groups stay in hand
    pool = RewardPool()
    pool.close()
    reported = []
    pool.submit([lambda: 1.0], ["r"], lambda r, e: reported.append((r, e)))
    time.sleep(0.1)
    assert reported == []


@pytest.mark.parametrize("workers", [1, 3])
def test_groups_submitted_together_go_as_one_job_per_worker_each_with_its_own_results(workers):
    # 7 groups of 1..7 calls; call j of group g scores 10·g + j, run on the thread that scored it
    threads: dict[int, set[int]] = {}
    lock = threading.Lock()

    def call(g, j):
        with lock:
            threads.setdefault(g, set()).add(threading.get_ident())
        return 10.0 * g + j

    reported: dict[int, list[float]] = {}
    all_done = threading.Event()

    def done(g, results, error):
        assert error is None
        with lock:
            reported[g] = [score for score, _ in results]
            if len(reported) == 7:
                all_done.set()

    pool = RewardPool(workers=workers)
    submitted = []
    original_submit = pool.submit
    pool.submit = lambda calls, wheres, cb: (submitted.append(len(calls)), original_submit(calls, wheres, cb))
    pool.submit_groups(
        [([functools.partial(call, g, j) for j in range(g)], [f"g{g}"] * g, functools.partial(done, g)) for g in range(1, 8)]
    )
    assert all_done.wait(10)
    pool.close()
    assert reported == {g: [10.0 * g + j for j in range(g)] for g in range(1, 8)}
    assert len(submitted) == workers and sum(submitted) == 28  # one job per worker, every call once
    assert all(len(t) == 1 for t in threads.values())  # a group is never split across jobs


def test_an_error_in_a_job_of_several_groups_reaches_every_group_of_it():
    errors: list[tuple[int, str]] = []
    reported = threading.Event()

    def done(g, results, error):
        assert results is None
        errors.append((g, str(error)))
        if len(errors) == 3:
            reported.set()

    def broken():
        raise ValueError("bad answer format")

    pool = RewardPool(workers=1, name="r")
    pool.submit_groups([([lambda: 1.0], ["a"], functools.partial(done, 0)), ([broken], ["b"], functools.partial(done, 1)), ([lambda: 2.0], ["c"], functools.partial(done, 2))])
    assert reported.wait(10)
    pool.close()
    assert [g for g, _ in errors] == [0, 1, 2]
    assert all("bad answer format" in text for _, text in errors)


class SizeLoggingEngine(CountingEngine):
    """Also records how many samples each generate call held."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def generate(self, samples, params):
        with self.called:  # read by the test's thread
            self.sizes.append(len(samples))
        super().generate(samples, params)


@pytest.mark.parametrize(
    "mode,eta,first_call", [("decoupled", 0, 10), ("decoupled", 1, 8), ("segment_wise", 1, 10)]
)
def test_by_default_the_producer_asks_for_the_whole_batch_at_eta_0_or_with_recompute_passes(mode, eta, first_call):
    # rollout.groups_per_request=null: at η = 0 the batch is generated whole before a step can
    # train, so it goes in one call; at η > 0 in calls of 8 groups (B = 10 tells the two apart),
    # unless the engine also runs the recompute passes (segment-wise): then one call per batch
    cfg = SdpConfig()
    cfg.loss.mode = mode
    cfg.rollout.batch_groups, cfg.rollout.group_size = 10, 1
    cfg.rollout.max_head_offpolicyness = eta
    assert cfg.rollout.groups_per_request is None
    engine = SizeLoggingEngine()
    task = GatedTask()
    task.gate.set()
    loop = _producing_loop(cfg, engine, task)
    loop.start()
    try:
        with engine.called:
            assert engine.called.wait_for(lambda: sum(engine.sizes) >= 10, timeout=10)
        assert engine.sizes[0] == first_call
    finally:
        loop.stop()
