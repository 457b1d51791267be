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

from typing import Any

from kvstrata.io import ChunkKey, MemoryObj


class Lent:
    """One lent buffer: the object (the lender's reference), its key, what it
    is for ("save" or "load"), the request and, for saves, how to publish it."""

    __slots__ = ("obj", "key", "kind", "req_id", "info")

    def __init__(self, obj: MemoryObj, key: ChunkKey, kind: str, req_id: str, info: Any = None) -> None:
        self.obj = obj
        self.key = key
        self.kind = kind
        self.req_id = req_id
        self.info = info


class Lender:
    """Owns: the entries lent for the step in flight and the tensor views the
    worker reads (``buffers``, shared with the worker side)."""

    __slots__ = ("buffers", "_entries", "_next")

    def __init__(self) -> None:
        self.buffers: dict[int, Any] = {}
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

    def take_all(self) -> list[Lent]:
        entries = list(self._entries.values())
        self._entries.clear()
        self.buffers.clear()
        return entries
