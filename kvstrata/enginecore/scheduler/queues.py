"""Waiting queues, one per scheduling policy, picked from ``QUEUES`` by name.

FCFS keeps arrival order in a deque; a preempted request goes back to the
front (it already waited its turn). Priority keeps a heap ordered by
``Request.sort_key`` = (priority, arrival time, admission sequence): lower
priority values first, then earlier arrivals; a preempted request re-enters
at the place its key gives it.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Protocol

from kvstrata.enginecore.request import Request


class WaitingQueue(Protocol):
    def add(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def prepend(self, request: Request) -> None: ...
    def prepend_all(self, requests: list[Request]) -> None: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __bool__(self) -> bool: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    """Owns: the deque of waiting requests in service order."""

    __slots__ = ("_q",)

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def prepend(self, request: Request) -> None:
        self._q.appendleft(request)

    def prepend_all(self, requests: list[Request]) -> None:
        """Put ``requests`` back at the front, keeping their relative order."""
        self._q.extendleft(reversed(requests))

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Owns: a heap of (sort_key, request); the smallest key is served first."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[tuple, Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.sort_key, request))

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def prepend(self, request: Request) -> None:
        self.add(request)

    def prepend_all(self, requests: list[Request]) -> None:
        for r in requests:
            self.add(r)

    def remove(self, request: Request) -> None:
        heap = self._heap
        for i, (_, r) in enumerate(heap):
            if r is request:
                heap[i] = heap[-1]
                heap.pop()
                heapq.heapify(heap)
                return
        raise ValueError(f"request {request.request_id!r} is not waiting")

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter([r for _, r in sorted(self._heap, key=lambda e: e[0])])


QUEUES: dict[str, type] = {"fcfs": FCFSQueue, "priority": PriorityQueue}


def make_waiting_queue(policy: str) -> WaitingQueue:
    try:
        return QUEUES[policy]()
    except KeyError:
        raise ValueError(f"scheduler.policy must be one of {sorted(QUEUES)}, got {policy!r}") from None


def remove_all(requests: list[Request], gone: Iterable[Request]) -> list[Request]:
    """``requests`` without the members of ``gone``, order kept."""
    gone_ids = {id(r) for r in gone}
    return [r for r in requests if id(r) not in gone_ids]
