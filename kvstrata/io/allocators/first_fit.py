"""First-fit allocator over one large host buffer.

Free space is an explicit list of regions sorted by address and always
coalesced (no two free regions touch)::

    buffer  |used|free......|used|used|free..|
    free     (start, size)         (start, size)     sorted by start

Every allocation is rounded up to 4 KiB, so every object starts on a 4 KiB
boundary of a 4 KiB aligned buffer (O_DIRECT can read straight into it).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

import torch

from kvstrata.io.memory import ALIGN, MemoryObj, align_up, host_buffer, object_nbytes


class FirstFitAllocator:
    """Owns: the buffer, the sorted free-region lists and the live objects.

    An allocation that does not fit returns None and changes nothing.
    """

    __slots__ = ("capacity", "_raw", "_buf", "_starts", "_sizes", "_free_bytes", "_live")

    def __init__(self, capacity: int, *, pin_memory: bool = False) -> None:
        if not isinstance(capacity, int) or capacity < ALIGN:
            raise ValueError(f"capacity must be an integer >= {ALIGN}, got {capacity!r}")
        capacity -= capacity % ALIGN
        self.capacity = capacity
        self._raw, offset = host_buffer(capacity, pin_memory=pin_memory)
        self._buf = self._raw[offset : offset + capacity]
        self._starts: list[int] = [0]
        self._sizes: list[int] = [capacity]
        self._free_bytes = capacity
        self._live: dict[int, MemoryObj] = {}

    # --- queries -------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self.capacity - self._free_bytes

    @property
    def num_live(self) -> int:
        return len(self._live)

    def live_objects(self) -> list[MemoryObj]:
        return list(self._live.values())

    def free_regions(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._sizes))

    def can_ever_fit(self, nbytes: int) -> bool:
        return align_up(nbytes) <= self.capacity

    # --- allocation ----------------------------------------------------
    def allocate(self, shape: Sequence[int], dtype: torch.dtype, layout: str = "raw") -> MemoryObj | None:
        nbytes = object_nbytes(shape, dtype)
        size = align_up(nbytes)
        start = self._take(size)
        if start is None:
            return None
        return self._make(start, size, nbytes, shape, dtype, layout)

    def batched_allocate(
        self, n: int, shape: Sequence[int], dtype: torch.dtype, layout: str = "raw"
    ) -> list[MemoryObj] | None:
        """n objects carved from one region (less fragmentation than n calls)."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        nbytes = object_nbytes(shape, dtype)
        size = align_up(nbytes)
        start = self._take(size * n)
        if start is None:
            return None
        return [self._make(start + i * size, size, nbytes, shape, dtype, layout) for i in range(n)]

    def free(self, obj: MemoryObj) -> None:
        self._forget(obj)
        self._give(obj.address, obj.alloc_size)

    def batched_free(self, objs: Sequence[MemoryObj]) -> None:
        """Free in address order, merging adjacent objects first so each run
        costs one insertion into the free list."""
        run_start = run_end = -1
        for obj in sorted(objs, key=lambda o: o.address):
            self._forget(obj)
            if obj.address == run_end:
                run_end += obj.alloc_size
                continue
            if run_start >= 0:
                self._give(run_start, run_end - run_start)
            run_start, run_end = obj.address, obj.address + obj.alloc_size
        if run_start >= 0:
            self._give(run_start, run_end - run_start)

    # --- internals -----------------------------------------------------
    def _make(
        self, start: int, size: int, nbytes: int, shape: Sequence[int], dtype: torch.dtype, layout: str
    ) -> MemoryObj:
        obj = MemoryObj(self, self._buf[start : start + nbytes], start, size, tuple(shape), dtype, layout)
        self._live[start] = obj
        return obj

    def _forget(self, obj: MemoryObj) -> None:
        if self._live.get(obj.address) is not obj:
            raise RuntimeError(f"free of an object this allocator does not hold: {obj!r}")
        del self._live[obj.address]

    def _take(self, size: int) -> int | None:
        sizes = self._sizes
        for i in range(len(sizes)):
            if sizes[i] >= size:
                start = self._starts[i]
                if sizes[i] == size:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += size
                    sizes[i] -= size
                self._free_bytes -= size
                return start
        return None

    def _give(self, start: int, size: int) -> None:
        starts, sizes = self._starts, self._sizes
        i = bisect_left(starts, start)
        assert i == len(starts) or start + size <= starts[i], "free region overlaps its successor"
        assert i == 0 or starts[i - 1] + sizes[i - 1] <= start, "free region overlaps its predecessor"
        self._free_bytes += size
        joins_prev = i > 0 and starts[i - 1] + sizes[i - 1] == start
        joins_next = i < len(starts) and start + size == starts[i]
        if joins_prev and joins_next:
            sizes[i - 1] += size + sizes[i]
            del starts[i], sizes[i]
        elif joins_prev:
            sizes[i - 1] += size
        elif joins_next:
            starts[i] = start
            sizes[i] += size
        else:
            starts.insert(i, start)
            sizes.insert(i, size)
