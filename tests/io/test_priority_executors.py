"""Priority executors: prefetch before delete before put, bounded work,
dropped puts when saturated, close, failures, thread cancellation."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvstrata.io import Priority, PriorityExecutor
from kvstrata.io.executors import run_in_thread


async def test_waiting_jobs_run_prefetch_then_delete_then_put(tracker):
    ex = tracker.add(PriorityExecutor("t", max_in_flight=1, max_queued_puts=8))
    gate = asyncio.Event()
    order: list[str] = []

    async def job(name):
        if name == "blocker":
            await gate.wait()
        order.append(name)

    ex.submit(Priority.PUT, job, "blocker")
    for prio, name in [(Priority.PUT, "put1"), (Priority.DELETE, "del1"), (Priority.PREFETCH, "pre1"),
                       (Priority.PUT, "put2"), (Priority.PREFETCH, "pre2"), (Priority.DELETE, "del2")]:
        ex.submit(prio, job, name)
    assert ex.pending == 7
    gate.set()
    await ex.drain()
    assert order == ["blocker", "pre1", "pre2", "del1", "del2", "put1", "put2"]
    assert ex.pending == 0


async def test_a_saturated_executor_drops_puts_and_counts_them(tracker):
    ex = tracker.add(PriorityExecutor("t", max_in_flight=2, max_queued_puts=1))
    gate = asyncio.Event()
    dropped: list[int] = []

    async def job(i):
        await gate.wait()
        return i

    futs = [ex.submit(Priority.PUT, job, i, on_drop=lambda i=i: dropped.append(i)) for i in range(5)]
    assert [f is None for f in futs] == [False, False, False, True, True]
    assert dropped == [3, 4] and ex.dropped_puts == 2 and ex.saturated()
    pre = ex.submit(Priority.PREFETCH, job, 99)  # reads are never dropped
    assert pre is not None
    gate.set()
    assert await asyncio.gather(*futs[:3], pre) == [0, 1, 2, 99]
    assert not ex.saturated()


async def test_at_most_max_in_flight_jobs_run(tracker):
    ex = tracker.add(PriorityExecutor("t", max_in_flight=3, max_queued_puts=100))
    running = peak = 0

    async def job():
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.001)
        running -= 1

    for _ in range(20):
        ex.submit(Priority.PUT, job)
    await ex.drain()
    assert peak == 3


async def test_close_drops_waiting_jobs_and_waits_for_running_ones(tracker):
    ex = tracker.add(PriorityExecutor("t", max_in_flight=1, max_queued_puts=8))
    gate = asyncio.Event()
    dropped: list[str] = []
    done: list[str] = []

    async def job(name):
        await gate.wait()
        done.append(name)

    first = ex.submit(Priority.PUT, job, "running")
    queued = ex.submit(Priority.PUT, job, "queued", on_drop=lambda: dropped.append("queued"))
    asyncio.get_running_loop().call_later(0.01, gate.set)
    await ex.aclose()
    assert done == ["running"] and dropped == ["queued"]
    assert first.done() and queued.cancelled() and ex.dropped_puts == 1
    assert ex.submit(Priority.PREFETCH, job, "late") is None
    await ex.aclose()  # idempotent


async def test_a_failing_job_hands_its_exception_to_the_awaiter(tracker):
    ex = tracker.add(PriorityExecutor("t"))

    async def boom():
        raise KeyError("x")

    fut = ex.submit(Priority.PREFETCH, boom)
    with pytest.raises(KeyError):
        await fut
    unawaited = ex.submit(Priority.PUT, boom)  # nobody awaits: no "never retrieved" noise
    await ex.drain()
    assert unawaited.done()


async def test_cancelling_a_thread_job_waits_for_the_thread():
    pool = ThreadPoolExecutor(1)
    started, release = threading.Event(), threading.Event()
    finished: list[bool] = []

    def blocking():
        started.set()
        release.wait(5)
        finished.append(True)

    task = asyncio.create_task(run_in_thread(pool, blocking))
    await asyncio.to_thread(started.wait, 5)
    task.cancel()
    await asyncio.sleep(0.01)
    assert not task.done()  # still waiting for the thread
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished == [True]
    pool.shutdown()


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="max_in_flight"):
        PriorityExecutor("t", max_in_flight=0)
    with pytest.raises(ValueError, match="max_queued_puts"):
        PriorityExecutor("t", max_queued_puts=-1)
