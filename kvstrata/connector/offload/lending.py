"""Host buffers lent by the scheduler side to the worker for one step.

    loop:  build_connector_meta ── lend(obj) -> handle ──┐   (metadata names handles)
    step thread:                      buffers[handle] ◄──┘   gather into / scatter from it
    loop:  update_connector_output ── take(handle) -> put into the store, or release

The loop writes ``buffers`` only before it submits a step and after the step
has returned (the engine runs one step at a time and waits for it), so the
step thread reads a dict nobody is changing; no lock is needed. A request
aborted mid-step leaves its entries alone: they are settled with the step.
"""

from __future__ import annotations

import torch

from kvstrata.connector.events import ChunkInfo
from kvstrata.connector.metadata import WorkerReport
from kvstrata.io import ChunkKey, MemoryObj
from kvstrata.io.memory import release_all


class Lent:
    """One lent buffer: the object (the lender's reference), its key, the
    request, for a save with events on how to publish it, and whether the
    saved chunk goes to the local lower tiers too (``lower``; admission)."""

    __slots__ = ("obj", "key", "req_id", "info", "lower")

    def __init__(self, obj: MemoryObj, key: ChunkKey, req_id: str, info: ChunkInfo | None = None,
                 *, lower: bool = True) -> None:
        self.obj = obj
        self.key = key
        self.req_id = req_id
        self.info = info
        self.lower = lower


class Lender:
    """Owns: the entries lent for the step in flight and the tensor views the
    worker reads (``buffers``, shared with the worker side)."""

    __slots__ = ("buffers", "_entries", "_next")

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}
        self._entries: dict[int, Lent] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lend(self, entry: Lent) -> int:
        self._next += 1
        handle = self._next
        self._entries[handle] = entry
        self.buffers[handle] = entry.obj.tensor
        return handle

    def take(self, handle: int) -> Lent | None:
        self.buffers.pop(handle, None)
        return self._entries.pop(handle, None)

    def settle(self, report: WorkerReport) -> list[Lent]:
        """Take back what the worker reports: returns the entries it saved
        into (for the store); releases those it loaded from or failed."""
        saved = [e for h in report.saved if (e := self.take(h)) is not None]
        release_all([e.obj for h in (*report.loaded, *report.failed) if (e := self.take(h)) is not None])
        return saved

    def release_all(self) -> None:
        """Release whatever is still lent (the worker did not report it, or
        the step failed)."""
        entries = list(self._entries.values())
        self._entries.clear()
        self.buffers.clear()
        release_all([e.obj for e in entries])
