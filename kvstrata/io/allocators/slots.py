"""Fixed-slot allocator: the buffer is cut into equal slots, each object
takes one. O(1) allocate and free (a deque of free slot indices); no
fragmentation, at the price of rounding every object up to the slot size."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from kvstrata.io.memory import MemoryObj, align_up, host_buffer, object_nbytes


class SlotAllocator:
    """Owns: the buffer, the free-slot deque and the live objects.

    An object larger than a slot, or no free slot, returns None.
    """

    __slots__ = ("capacity", "slot_bytes", "num_slots", "_raw", "_buf", "_free", "_live")

    def __init__(self, capacity: int, slot_bytes: int, *, pin_memory: bool = False) -> None:
        if not isinstance(slot_bytes, int) or slot_bytes < 1:
            raise ValueError(f"slot_bytes must be an integer >= 1, got {slot_bytes!r}")
        slot_bytes = align_up(slot_bytes)
        if not isinstance(capacity, int) or capacity < slot_bytes:
            raise ValueError(f"capacity must be an integer >= slot_bytes ({slot_bytes}), got {capacity!r}")
        self.slot_bytes = slot_bytes
        self.num_slots = capacity // slot_bytes
        self.capacity = self.num_slots * slot_bytes
        self._raw, offset = host_buffer(self.capacity, pin_memory=pin_memory)
        self._buf = self._raw[offset : offset + self.capacity]
        self._free: deque[int] = deque(range(self.num_slots))
        self._live: dict[int, MemoryObj] = {}

    @property
    def used_bytes(self) -> int:
        return len(self._live) * self.slot_bytes

    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def live_objects(self) -> list[MemoryObj]:
        return list(self._live.values())

    def can_ever_fit(self, nbytes: int) -> bool:
        return nbytes <= self.slot_bytes

    def allocate(self, shape: Sequence[int], dtype: torch.dtype, layout: str = "raw") -> MemoryObj | None:
        nbytes = object_nbytes(shape, dtype)
        if nbytes > self.slot_bytes or not self._free:
            return None
        return self._make(self._free.popleft(), nbytes, shape, dtype, layout)

    def batched_allocate(
        self, n: int, shape: Sequence[int], dtype: torch.dtype, layout: str = "raw"
    ) -> list[MemoryObj] | None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        nbytes = object_nbytes(shape, dtype)
        if nbytes > self.slot_bytes or len(self._free) < n:
            return None
        pop = self._free.popleft
        return [self._make(pop(), nbytes, shape, dtype, layout) for _ in range(n)]

    def free(self, obj: MemoryObj) -> None:
        self._free.append(self._forget(obj))

    def batched_free(self, objs: Sequence[MemoryObj]) -> None:
        """Return slots in address order, so reuse order stays predictable."""
        for obj in sorted(objs, key=lambda o: o.address):
            self._free.append(self._forget(obj))

    def _make(self, slot: int, nbytes: int, shape: Sequence[int], dtype: torch.dtype, layout: str) -> MemoryObj:
        start = slot * self.slot_bytes
        obj = MemoryObj(self, self._buf[start : start + nbytes], start, self.slot_bytes, tuple(shape), dtype, layout)
        self._live[slot] = obj
        return obj

    def _forget(self, obj: MemoryObj) -> int:
        slot = obj.address // self.slot_bytes
        if self._live.get(slot) is not obj:
            raise RuntimeError(f"free of an object this allocator does not hold: {obj!r}")
        del self._live[slot]
        return slot

