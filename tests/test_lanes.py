"""The real executor's Python lanes (moelab.hybrid.lanes.Lane): one task at a time in priority order,
every task an event, and with ``helping`` a waiting thread runs the task the idle lane would run next."""

from __future__ import annotations

import threading
import time

import pytest

from moelab.hybrid.events import EventLog
from moelab.hybrid.lanes import Lane


@pytest.fixture
def lane(request):
    lanes = []

    def make(helping: bool = True) -> Lane:
        lanes.append(Lane("device", EventLog("t"), helping=helping))
        return lanes[-1]

    yield make
    for ln in lanes:
        ln.close()


def _blocker(lane: Lane, started: threading.Event, release: threading.Event, ran: list):
    """A task that holds the lane's worker until ``release`` is set."""
    def fn():
        ran.append(("A", threading.get_ident()))
        started.set()
        assert release.wait(10)
    return lane.submit(fn, step=0, layer=0, kind="x")


def _task(name: str, ran: list):
    return lambda: ran.append((name, threading.get_ident())) or name


@pytest.mark.parametrize("helping", [True, False])
def test_an_idle_lanes_task_runs_on_the_waiting_thread_only_when_helping(lane, helping):
    ln = lane(helping)
    ran: list = []
    # the lane's lock (reentrant) held: its idle worker cannot take the task before the waiter asks
    with ln._cond:
        fut = ln.submit(_task("B", ran), step=1, layer=2, kind="expert-device", tokens=3, cause="hit")
        if helping:
            assert fut.result() == "B"
    if not helping:
        assert fut.result(timeout=10) == "B"
    me = threading.get_ident()
    assert (ran[0][1] == me) is helping
    (ev,) = ln.log.events
    assert (ev.lane, ev.kind, ev.step, ev.layer, ev.tokens, ev.cause) == ("device", "expert-device", 1, 2, 3, "hit")
    assert ev.t_end_us >= ev.t_start_us


def test_a_busy_lanes_task_is_left_to_its_worker_after_the_running_one(lane):
    ln = lane()
    ran: list = []
    started, release = threading.Event(), threading.Event()
    a = _blocker(ln, started, release, ran)
    assert started.wait(10)
    b = ln.submit(_task("B", ran), step=0, layer=0, kind="x")
    threading.Timer(0.2, release.set).start()
    assert b.result(timeout=10) == "B"
    a.result(timeout=10)
    assert [n for n, _ in ran] == ["A", "B"]
    assert ran[1][1] == ran[0][1] != threading.get_ident()  # both on the worker, not on the waiter


def test_a_waiter_does_not_jump_the_lanes_priority_order(lane):
    """The waited task (priority 1) is behind a priority-0 task: the lane runs them in priority
    order, on its worker, whoever waits."""
    ln = lane()
    ran: list = []
    started, release = threading.Event(), threading.Event()
    _blocker(ln, started, release, ran)
    assert started.wait(10)
    low = ln.submit(_task("low", ran), priority=1, step=0, layer=0, kind="x")
    high = ln.submit(_task("high", ran), priority=0, step=0, layer=0, kind="x")
    threading.Timer(0.2, release.set).start()
    assert low.result(timeout=10) == "low"
    assert high.result(timeout=10) == "high"
    assert [n for n, _ in ran] == ["A", "high", "low"]


def test_a_helping_lane_runs_one_task_at_a_time_under_many_waiters(lane):
    ln = lane()
    running, peak, lock = [0], [0], threading.Lock()

    def work():
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.001)
        with lock:
            running[0] -= 1
        return 1

    futs = [ln.submit(work, priority=i % 3, step=0, layer=i, kind="x") for i in range(60)]
    results = []

    def waiter(fs):
        results.extend(f.result(timeout=30) for f in fs)

    threads = [threading.Thread(target=waiter, args=(futs[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sum(results) == 60 and peak[0] == 1
    assert len(ln.log.events) == 60


def test_a_helped_task_waits_for_its_copies_and_its_error_reaches_the_waiter(lane):
    ln, copy = lane(), lane()
    order: list = []
    started, release = threading.Event(), threading.Event()
    _blocker(copy, started, release, [])
    assert started.wait(10)
    done = copy.submit(lambda: order.append("copy"), step=0, layer=0, kind="transfer-demand")
    fut = ln.submit(lambda: order.append("compute") or "ok", step=0, layer=0, kind="expert-device", after=[done])
    threading.Timer(0.2, release.set).start()
    assert fut.result(timeout=10) == "ok"
    assert order == ["copy", "compute"]
    assert [e.kind for e in ln.log.events] == ["wait", "expert-device"]

    def boom():
        raise ValueError("expert 3 failed")

    with pytest.raises(ValueError, match="expert 3"):
        ln.submit(boom, step=0, layer=0, kind="x").result(timeout=10)
    assert ln.submit(lambda: 7, step=0, layer=0, kind="x").result(timeout=10) == 7  # the lane goes on


def test_a_waiter_on_an_idle_lane_takes_only_the_task_at_its_head(lane):
    """Idle lane, the waited task behind a more urgent one: the waiter leaves both to the lane."""
    ln = lane()
    ran: list = []
    with ln._cond:  # the idle worker cannot take anything yet
        low = ln.submit(_task("low", ran), priority=1, step=0, layer=0, kind="x")
        high = ln.submit(_task("high", ran), priority=0, step=0, layer=0, kind="x")
        ln._help(low._item)  # what low.result() offers first
        assert ran == []
    assert low.result(timeout=10) == "low" and high.result(timeout=10) == "high"
    assert [n for n, _ in ran] == ["high", "low"]


def test_an_interrupt_on_the_helping_thread_frees_the_lane_and_settles_the_task(lane, monkeypatch):
    """A KeyboardInterrupt (the main thread's) landing where the waiter has taken the task but not
    started it: the lane is free for the next task and the taken one is cancelled, not pending."""
    import concurrent.futures

    ln = lane()
    real_run = ln._run
    calls = []

    def interrupted(fut, fn, meta):
        if not calls:
            calls.append(1)
            raise KeyboardInterrupt
        return real_run(fut, fn, meta)

    monkeypatch.setattr(ln, "_run", interrupted)
    with ln._cond:
        fut = ln.submit(lambda: 1, step=0, layer=0, kind="x")
        with pytest.raises((KeyboardInterrupt, concurrent.futures.CancelledError)):
            fut.result()
    assert fut.cancelled() and not ln._busy
    assert ln.submit(lambda: 2, step=0, layer=0, kind="x").result(timeout=10) == 2


def test_a_bounded_wait_does_not_run_the_task_and_a_closed_lane_refuses_work(lane):
    import concurrent.futures

    ln = lane()
    with ln._cond:  # the worker cannot take the task: only a helping waiter could run it
        fut = ln.submit(lambda: 1, step=0, layer=0, kind="x")
        with pytest.raises(concurrent.futures.TimeoutError):
            fut.result(timeout=0.05)
    assert fut.result(timeout=10) == 1 and fut._item is None  # ran on the worker; no queue-entry cycle
    ln.close()
    with pytest.raises(RuntimeError, match="submit after close"):
        ln.submit(lambda: 3, step=0, layer=0, kind="x")
