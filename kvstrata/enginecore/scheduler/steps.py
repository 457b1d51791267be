"""The steps scheduled and not yet updated: one, or two with async
scheduling (step N+1 is planned before step N's output is applied).

A request that stops running while a step in flight still writes its KV
(finished, aborted, failed, preempted) has its blocks freed at once: steps
run one at a time, in order, so that step is done before any later one can
use the blocks again. Each step notes the blocks it writes for such a
request (``suspect``), uncached if it fails.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstrata.enginecore.request import Request


class _InFlight:
    """A step scheduled and not yet updated. ``starts``: per request, the
    first token whose KV it writes (``StepPlan.write_starts``); ``sampling``:
    the requests it samples a token for (their placeholders); ``suspect``:
    the blocks it writes for requests that stopped running meanwhile."""

    __slots__ = ("starts", "sampling", "suspect")

    def __init__(self, starts: dict[str, int], sampling: list[Request]) -> None:
        self.starts = starts
        self.sampling = sampling
        self.suspect: list[int] = []


class StepsInFlight:
    """Owns: the steps in flight, by ``id()`` of their SchedulerOutput (the
    Scheduler keeps that object alive until the step's update or failure)."""

    __slots__ = ("_steps",)

    def __init__(self) -> None:
        self._steps: dict[int, _InFlight] = {}

    def __bool__(self) -> bool:
        return bool(self._steps)

    def add(self, key: int, starts: dict[str, int], sampling: list[Request]) -> None:
        """A step was scheduled: where it writes, and whom it samples for
        (each of them carries one placeholder for it)."""
        self._steps[key] = _InFlight(starts, sampling)

    def leaving(self, request_id: str, tables: tuple[list[int], ...], block_size: int) -> None:
        """A request stops running (its blocks ``tables`` are about to be
        freed) while steps in flight may still write its KV: each notes the
        blocks it writes for it, to uncache if it fails."""
        for f in self._steps.values():
            pos = f.starts.get(request_id)
            if pos is not None:
                f.suspect.extend(b for group in tables for b in group[pos // block_size:])

    def written(self, key: int, tables: Callable[[str], tuple[list[int], ...]], block_size: int) -> set[int]:
        """The blocks step ``key`` writes: for each of its requests, its
        blocks (``tables``: of a live request, () of one gone) from the first
        it writes on, and those noted for requests that left since."""
        f = self._steps.get(key)
        if f is None:
            return set()
        out = set(f.suspect)
        for rid, pos in f.starts.items():
            out.update(b for group in tables(rid) for b in group[pos // block_size:])
        return out

    def done(self, key: int) -> list[int]:
        """A step came back (its output, or its failure): its requests no
        longer expect its tokens. Returns the blocks it wrote for requests
        that stopped running meanwhile."""
        f = self._steps.pop(key, None)
        if f is None:
            return []
        for req in f.sampling:
            if req.num_output_placeholders > 0:  # 0: preempted (or finished) since
                req.num_output_placeholders -= 1
        return f.suspect
