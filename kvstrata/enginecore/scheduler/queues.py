"""Waiting queues, one per scheduling policy, picked from ``QUEUES`` by name.

FCFS keeps arrival order in a deque; a preempted request goes back to the
front (it already waited its turn). Priority keeps a heap ordered by
``Request.sort_key`` = (priority, arrival time, admission sequence): lower
priority values first, then earlier arrivals; a preempted request re-enters
at the place its key gives it.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
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


class CacheAwareQueue:
    """``cache-aware``: among waiting requests of the best priority, the one
    with the most cached prompt tokens goes first (``scorer(request)``: the
    device prefix hit, as ``KVCacheManager.get_computed_blocks`` sees it;
    the scheduler sets it), ties by arrival. A starvation bound: each time a
    request is served ahead of an earlier arrival, that earlier request
    counts one skip; one skipped ``max_skips`` times, or waiting longer than
    ``max_wait_s``, is *aged* and served before every non-aged request of
    its priority, aged ones in arrival order. So no request waits more than
    ``max_skips`` admissions (or ``max_wait_s``) past its FCFS turn, and
    priorities still win. Only the first ``window`` requests in arrival
    order are scored (a hit walk each), so a long queue costs a bounded scan.

    Owns: the waiting requests in arrival order, their skip counts and
    enqueue times, the last pick."""

    __slots__ = ("_q", "_skips", "_since", "scorer", "max_skips", "max_wait_s", "window", "_pick",
                 "max_skips_seen", "clock")

    def __init__(self, *, max_skips: int = 64, max_wait_s: float = 30.0, window: int = 64) -> None:
        self._q: list[Request] = []
        self._skips: dict[int, int] = {}
        self._since: dict[int, float] = {}
        self.scorer: Callable[[Request], int] = lambda r: 0
        self.max_skips = max_skips
        self.max_wait_s = max_wait_s
        self.window = window
        self._pick: Request | None = None
        self.max_skips_seen = 0  # the largest skip count any request reached (the bound actually observed)
        self.clock = time.monotonic

    def add(self, request: Request) -> None:
        self._q.append(request)
        self._skips[id(request)] = 0
        self._since[id(request)] = self.clock()
        self._pick = None

    def _choose(self) -> Request:
        now = self.clock()
        best, best_key = None, None
        # FCFS order is the list order (a preempted request goes back to the
        # front): aged requests and ties follow it, as the skip count does.
        for i, r in enumerate(self._q[: self.window]):
            aged = self._skips[id(r)] >= self.max_skips or now - self._since[id(r)] >= self.max_wait_s
            key = (r.priority, 0 if aged else 1, 0 if aged else -self.scorer(r), i)
            if best_key is None or key < best_key:
                best, best_key = r, key
        assert best is not None
        return best

    def peek(self) -> Request:
        if self._pick is None:  # every change of the queue clears it
            self._pick = self._choose()
        return self._pick

    def pop(self) -> Request:
        r = self.peek()
        self._pick = None
        i = self._q.index(r)
        del self._q[i]
        skips = self._skips
        for earlier in self._q[:i]:  # arrived before it, served after it: one skip each
            if r.priority >= earlier.priority:  # passed by a better priority (a lower value): not a skip
                n = skips[id(earlier)] + 1
                skips[id(earlier)] = n
                if n > self.max_skips_seen:
                    self.max_skips_seen = n
        del skips[id(r)]
        del self._since[id(r)]
        return r

    def prepend(self, request: Request) -> None:
        """Back at the front (preempted, or skipped this pass): its arrival
        order and skip count are kept."""
        self._q.insert(0, request)
        self._skips.setdefault(id(request), 0)
        self._since.setdefault(id(request), self.clock())
        self._pick = None

    def prepend_all(self, requests: list[Request]) -> None:
        for r in reversed(requests):
            self.prepend(r)

    def remove(self, request: Request) -> None:
        self._q.remove(request)
        self._skips.pop(id(request), None)
        self._since.pop(id(request), None)
        self._pick = None

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._q))


QUEUES: dict[str, type] = {"fcfs": FCFSQueue, "priority": PriorityQueue, "cache-aware": CacheAwareQueue}


def make_waiting_queue(policy: str) -> WaitingQueue:
    try:
        return QUEUES[policy]()
    except KeyError:
        raise ValueError(f"scheduler.policy must be one of {sorted(QUEUES)}, got {policy!r}") from None


def remove_all(requests: list[Request], gone: Iterable[Request]) -> list[Request]:
    """``requests`` without the members of ``gone``, order kept."""
    gone_ids = {id(r) for r in gone}
    return [r for r in requests if id(r) not in gone_ids]
