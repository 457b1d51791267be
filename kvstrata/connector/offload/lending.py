"""Host buffers lent by the scheduler side to the worker, each for one step.

    loop:  build_connector_meta(step k) ── begin(k); lend(obj) -> handle ──┐   (metadata names handles)
    step thread:                               buffers[handle] ◄───────────┘   gather into / scatter from it
    loop:  update_connector_output ── settle(report of step k) -> put into the store, or release

Every entry belongs to the step whose metadata named it. With async
scheduling two steps are lent at once: the loop lends step k+1's buffers
while step k runs, and takes back step k's (after k returned) while k+1
runs. Neither touches an entry the running step reads, and each change of
``buffers`` is one dict operation (atomic under the GIL; free-threaded
builds lock dicts), so the step thread needs no lock. Steps come back in
order; a request aborted mid-step leaves its entries alone: they are
settled with their step.

A step that fails may have written wrong KV that the step queued behind it
reads: ``discard_saves`` makes every save still lent to a later step come
back released instead of stored (a save is a cache: dropping one is always
safe; storing a wrong chunk is not).
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from kvstrata.connector.events import ChunkInfo
from kvstrata.connector.metadata import WorkerReport
from kvstrata.io import ChunkKey, MemoryObj
from kvstrata.io.memory import release_all


class Lent:
    """One lent buffer: the object (the lender's reference), its key, the
    request, for a save with events on how to publish it, whether the
    saved chunk goes to the local lower tiers too (``lower``; admission),
    and whether a save into it is to be dropped (``discarded``)."""

    __slots__ = ("obj", "key", "req_id", "info", "lower", "discarded")

    def __init__(self, obj: MemoryObj, key: ChunkKey, req_id: str, info: ChunkInfo | None = None,
                 *, lower: bool = True) -> None:
        self.obj = obj
        self.key = key
        self.req_id = req_id
        self.info = info
        self.lower = lower
        self.discarded = False


class Lender:
    """Owns: the entries lent to the steps in flight, by step, and the tensor
    views the worker reads (``buffers``, shared with the worker side)."""

    __slots__ = ("buffers", "_steps", "_step", "_next")

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}
        self._steps: dict[int, dict[int, Lent]] = {}
        self._step = 0  # the step being lent to
        self._next = 0

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._steps.values())

    def begin(self, step: int) -> None:
        """Lend to ``step`` from now on (its metadata is being built)."""
        self._step = step

    def lend(self, entry: Lent) -> int:
        self._next += 1
        handle = self._next
        self._steps.setdefault(self._step, {})[handle] = entry
        self.buffers[handle] = entry.obj.tensor
        return handle

    def settle(self, report: WorkerReport) -> list[Lent]:
        """Take back ``report.step``'s entries: returns those the worker saved
        into (for the store) and releases the rest (loaded from, failed, not
        reported, or discarded saves). Entries of earlier steps are released
        too: steps come back in order, so theirs were settled or failed."""
        saved = set(report.saved)
        keep: list[Lent] = []
        drop: list[Lent] = []
        for step in [s for s in self._steps if s <= report.step]:
            for handle, e in self._take(step).items():
                (keep if step == report.step and handle in saved and not e.discarded else drop).append(e)
        release_all([e.obj for e in drop])
        return keep

    def release_step(self, step: int) -> None:
        """Release everything lent to ``step`` (it failed)."""
        release_all([e.obj for e in self._take(step).values()])

    def discard_saves(self, req_ids: Collection[str] | None = None) -> None:
        """Drop whatever the steps still lent save (for ``req_ids`` only, if
        given): a step failed, or a load into those requests' blocks did, and
        these saves may read KV that is not there."""
        for entries in self._steps.values():
            for e in entries.values():
                if req_ids is None or e.req_id in req_ids:
                    e.discarded = True

    def release_all(self) -> None:
        """Release whatever is still lent (closing)."""
        entries = [e for step in list(self._steps) for e in self._take(step).values()]
        self.buffers.clear()
        release_all([e.obj for e in entries])

    def _take(self, step: int) -> dict[int, Lent]:
        entries = self._steps.pop(step, {})
        for handle in entries:
            self.buffers.pop(handle, None)
        return entries
