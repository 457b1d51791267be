"""Priority executors for tier I/O.

Every disk or remote operation of a tier runs through one executor::

    submit(priority, job) ──> heap ordered by (priority, arrival) ──> at most
                              max_in_flight jobs running as tasks

    PREFETCH (0)  reads somebody is waiting for
    DELETE   (1)  evictions, corrupt objects
    PUT      (2)  writes; the store is a cache, so a put that finds
                  ``max_queued_puts`` puts already waiting is dropped and
                  counted instead of making anybody wait

``submit`` never blocks and never raises for lack of room. A job's
``on_drop`` runs when it is dropped (saturation or close) so the job can give
back the references it holds. A job that fails unexpectedly is logged and its
exception handed to whoever awaits its future.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import structlog

log = structlog.get_logger(__name__)
T = TypeVar("T")


class Priority(enum.IntEnum):
    PREFETCH = 0
    DELETE = 1
    PUT = 2


class _Job:
    __slots__ = ("priority", "fn", "args", "fut", "on_drop")

    def __init__(self, priority: Priority, fn: Callable[..., Awaitable[object]], args: tuple,
                 fut: asyncio.Future, on_drop: Callable[[], None] | None) -> None:
        self.priority = priority
        self.fn = fn
        self.args = args
        self.fut = fut
        self.on_drop = on_drop

    def drop(self) -> None:
        if not self.fut.done():
            self.fut.cancel()
        if self.on_drop is not None:
            self.on_drop()


class PriorityExecutor:
    """Owns: the heap of waiting jobs, the set of running job tasks, and the
    dropped-put counter. Loop-owned; no locks."""

    __slots__ = ("name", "max_in_flight", "max_queued_puts", "dropped_puts",
                 "_heap", "_seq", "_running", "_queued_puts", "_closed")

    def __init__(self, name: str, *, max_in_flight: int = 4, max_queued_puts: int = 64) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if max_queued_puts < 0:
            raise ValueError(f"max_queued_puts must be >= 0, got {max_queued_puts}")
        self.name = name
        self.max_in_flight = max_in_flight
        self.max_queued_puts = max_queued_puts
        self.dropped_puts = 0
        self._heap: list[tuple[int, int, _Job]] = []
        self._seq = itertools.count()
        self._running: set[asyncio.Task] = set()
        self._queued_puts = 0
        self._closed = False

    @property
    def pending(self) -> int:
        """Jobs waiting plus jobs running."""
        return len(self._heap) + len(self._running)

    @property
    def closed(self) -> bool:
        return self._closed

    def saturated(self) -> bool:
        """True when a put submitted now would be dropped."""
        return self._closed or (
            len(self._running) >= self.max_in_flight and self._queued_puts >= self.max_queued_puts
        )

    def submit(
        self,
        priority: Priority,
        fn: Callable[..., Awaitable[T]],
        *args: object,
        on_drop: Callable[[], None] | None = None,
    ) -> asyncio.Future[T] | None:
        """Queue ``fn(*args)``; returns its future, or None when dropped
        (closed, or a put while saturated; ``on_drop`` has run)."""
        if self._closed or (priority == Priority.PUT and self.saturated()):
            if priority == Priority.PUT:
                self.dropped_puts += 1
            if on_drop is not None:
                on_drop()
            return None
        job = _Job(priority, fn, args, asyncio.get_running_loop().create_future(), on_drop)
        if len(self._running) < self.max_in_flight and not self._heap:
            self._start(job)
        else:
            if priority == Priority.PUT:
                self._queued_puts += 1
            heapq.heappush(self._heap, (int(priority), next(self._seq), job))
        return job.fut

    async def drain(self) -> None:
        """Wait until nothing is queued or running."""
        while self._running:
            await asyncio.wait(set(self._running))

    async def aclose(self, timeout: float = 30.0) -> None:
        """Drop waiting jobs, wait for running ones (they may be in a thread
        that cannot be interrupted), cancel what is still running after
        ``timeout``. Idempotent."""
        self._closed = True
        heap, self._heap = self._heap, []
        self._queued_puts = 0
        for _, _, job in heap:
            if job.priority == Priority.PUT:
                self.dropped_puts += 1
            job.drop()
        if self._running:
            _, late = await asyncio.wait(set(self._running), timeout=timeout)
            for task in late:
                task.cancel()
            if late:
                log.warning("executor_close_timeout", executor=self.name, cancelled=len(late))
                await asyncio.wait(late)

    def _start(self, job: _Job) -> None:
        task = asyncio.get_running_loop().create_task(self._run(job))
        self._running.add(task)

    async def _run(self, job: _Job) -> None:
        fut = job.fut
        try:
            result = await job.fn(*job.args)
        except asyncio.CancelledError:
            if not fut.done():
                fut.cancel()
            raise
        except Exception as e:
            log.exception("io_job_failed", executor=self.name, priority=job.priority.name)
            if not fut.done():
                fut.set_exception(e)
                fut.exception()  # logged above; do not warn again if nobody awaits
        else:
            if not fut.done():
                fut.set_result(result)
        finally:
            self._running.discard(asyncio.current_task())  # type: ignore[arg-type]
            self._pump()

    def _pump(self) -> None:
        heap = self._heap
        while heap and len(self._running) < self.max_in_flight and not self._closed:
            _, _, job = heapq.heappop(heap)
            if job.priority == Priority.PUT:
                self._queued_puts -= 1
            self._start(job)


async def run_in_thread(pool: ThreadPoolExecutor, fn: Callable[..., T], *args: object) -> T:
    """Run blocking ``fn`` on ``pool``. If the caller is cancelled, wait for
    the thread to finish first (it cannot be stopped and may still be using
    buffers the caller's cleanup would free), then propagate the cancel."""
    fut = asyncio.get_running_loop().run_in_executor(pool, fn, *args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            try:
                await asyncio.wait({fut})
            except asyncio.CancelledError:
                continue  # still re-raised below, once the thread is done
        raise
