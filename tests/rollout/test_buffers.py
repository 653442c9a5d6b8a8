"""RolloutQueue / RolloutCache: FIFO semantics, timeouts, inspection, thread safety."""

import queue
import socket
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdp_cli.rollout.buffers import Doorbell, RolloutCache, RolloutQueue


def test_queue_is_fifo_and_snapshot_does_not_consume():
    q: RolloutQueue[int] = RolloutQueue()
    for i in range(5):
        q.put(i)
    assert q.snapshot() == [0, 1, 2, 3, 4]
    assert q.qsize() == 5  # snapshot removed nothing
    assert [q.get(), q.get()] == [0, 1]
    assert q.drain() == [2, 3, 4]
    assert q.empty() and q.qsize() == 0


def test_queue_timeouts_and_nowait_raise_standard_exceptions():
    q: RolloutQueue[str] = RolloutQueue(maxsize=1)
    with pytest.raises(queue.Empty):
        q.get_nowait()
    start = time.monotonic()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    assert time.monotonic() - start >= 0.04  # it did wait for (about) the timeout
    q.put_nowait("a")
    with pytest.raises(queue.Full):
        q.put_nowait("b")
    with pytest.raises(queue.Full):
        q.put("b", timeout=0.02)
    assert q.snapshot() == ["a"]
    with pytest.raises(ValueError):
        q.get(timeout=-1)


def test_blocked_put_is_released_by_get_drain_and_filter():
    for release in ("get", "drain", "filter"):
        q: RolloutQueue[int] = RolloutQueue(maxsize=2)
        q.put(1)
        q.put(2)
        done = threading.Event()

        def producer(q=q, done=done):
            q.put(3, timeout=5)
            done.set()

        t = threading.Thread(target=producer)
        t.start()
        time.sleep(0.02)
        assert not done.is_set(), "put must block while the queue is full"
        if release == "get":
            assert q.get() == 1
        elif release == "drain":
            assert q.drain() == [1, 2]
        else:
            assert q.filter_inplace(lambda x: x != 1) == 1
        # the producer's own timeout is 5 s: being woken within 1 s proves a notification
        t.join(timeout=1)
        assert done.is_set(), f"{release} did not wake the blocked producer"
        assert q.snapshot()[-1] == 3


def test_blocked_get_is_released_by_put():
    q: RolloutQueue[int] = RolloutQueue()
    got = []
    t = threading.Thread(target=lambda: got.append(q.get(timeout=5)))
    t.start()
    time.sleep(0.02)
    q.put(42)
    t.join(timeout=5)
    assert got == [42]


def test_queue_filter_keeps_order():
    q: RolloutQueue[int] = RolloutQueue()
    for i in range(10):
        q.put(i)
    assert q.filter_inplace(lambda x: x % 3 != 0) == 4  # removes 0, 3, 6, 9
    assert q.snapshot() == [1, 2, 4, 5, 7, 8]


def test_cache_operations():
    c: RolloutCache[str] = RolloutCache()
    for x in "abcde":
        c.add(x)
    all_items = c.get_all()
    all_items.append("zzz")  # a copy: mutating it does not touch the cache
    assert c.size() == 5
    assert c.take_first_n(2) == ["a", "b"]
    assert c.filter_inplace(lambda x: x != "d") == 1
    assert c.get_all() == ["c", "e"]
    assert c.take_first_n(10) == ["c", "e"]
    assert c.take_first_n(1) == []
    c.add("f")
    c.clear()
    assert c.size() == 0
    with pytest.raises(ValueError):
        c.take_first_n(-1)


@given(
    st.lists(st.tuples(st.sampled_from(["add", "take", "take_and_put_back", "filter"]), st.integers(0, 5)), max_size=40)
)
def test_cache_matches_a_list_model(ops):
    """Random operation sequences give the same result as the obvious list implementation."""
    c: RolloutCache[int] = RolloutCache()
    model: list[int] = []
    counter = 0
    for op, n in ops:
        if op == "add":
            c.add(counter)
            model.append(counter)
            counter += 1
        elif op == "take":
            assert c.take_first_n(n) == model[:n]
            model = model[n:]
        elif op == "take_and_put_back":
            taken = c.take_first_n(n)
            c.add(counter)  # an arrival while they are out goes behind them once they are back
            model.append(counter)
            counter += 1
            c.put_back(taken)
        else:
            removed = c.filter_inplace(lambda x, n=n: x % (n + 2) != 0)
            kept = [x for x in model if x % (n + 2) != 0]
            assert removed == len(model) - len(kept)
            model = kept
        assert c.get_all() == model


def test_concurrent_producers_and_consumers_lose_nothing():
    q: RolloutQueue[int] = RolloutQueue(maxsize=8)
    n_producers, per_producer = 4, 500
    received: list[int] = []
    lock = threading.Lock()

    def producer(k):
        for i in range(per_producer):
            q.put(k * per_producer + i, timeout=10)

    def consumer():
        while True:
            try:
                x = q.get(timeout=0.5)
            except queue.Empty:
                return
            with lock:
                received.append(x)

    threads = [threading.Thread(target=producer, args=(k,)) for k in range(n_producers)]
    threads += [threading.Thread(target=consumer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    # every id exactly once: no loss, no duplication
    assert sorted(received) == list(range(n_producers * per_producer))


def test_queue_calls_on_put_once_per_item_after_it_is_in_the_queue():
    seen: list[int] = []
    q: RolloutQueue[int] = RolloutQueue(on_put=lambda: seen.append(q.qsize()))
    for i in range(3):
        q.put(i)
    assert seen == [1, 2, 3]  # each call sees its item already queued
    q.get()
    assert seen == [1, 2, 3]  # a get is no put


def _waits(bell: Doorbell, timeout: float, sockets: list[int] | None = None) -> float:
    start = time.monotonic()
    bell.wait(sockets or [], timeout)
    return time.monotonic() - start


def test_doorbell_wait_returns_at_a_ring_since_the_last_clear_and_not_before():
    bell = Doorbell()
    try:
        bell.ring()
        assert _waits(bell, 30.0) < 5.0  # rung before the wait: no wait
        bell.clear()
        assert _waits(bell, 0.2) >= 0.15  # cleared: only the timeout ends it
        threading.Timer(0.05, bell.ring).start()
        assert _waits(bell, 30.0) < 5.0  # a ring from another thread wakes it
    finally:
        bell.close()


def test_doorbell_wakes_for_a_readable_socket_and_rings_never_block():
    bell, (ours, theirs) = Doorbell(), socket.socketpair()
    try:
        threading.Timer(0.05, lambda: theirs.send(b"x")).start()
        assert _waits(bell, 30.0, [ours.fileno()]) < 5.0
        for _ in range(100_000):  # far more than a socket buffer holds: the extra rings are dropped
            bell.ring()
        bell.clear()
        assert _waits(bell, 0.2) >= 0.15  # one clear forgets them all
    finally:
        bell.close()
        ours.close()
        theirs.close()
    bell.ring()  # after close: ignored, nobody waits any more
