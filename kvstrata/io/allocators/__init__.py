"""Host-memory allocators for L1: first-fit over one buffer (coalescing,
4 KiB aligned, batched) or fixed-size slots (O(1)). Both return None when an
allocation does not fit, and change nothing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvstrata.io.allocators.first_fit import FirstFitAllocator
from kvstrata.io.allocators.slots import SlotAllocator
from kvstrata.io.config import CPUConfig
from kvstrata.io.memory import MemoryObj


class Allocator(Protocol):
    capacity: int

    @property
    def used_bytes(self) -> int: ...

    @property
    def num_live(self) -> int: ...

    def live_objects(self) -> list[MemoryObj]: ...

    def can_ever_fit(self, nbytes: int) -> bool: ...

    def allocate(self, shape: Sequence[int], dtype: torch.dtype, layout: str = "raw") -> MemoryObj | None: ...

    def batched_allocate(
        self, n: int, shape: Sequence[int], dtype: torch.dtype, layout: str = "raw"
    ) -> list[MemoryObj] | None: ...

    def free(self, obj: MemoryObj) -> None: ...

    def batched_free(self, objs: Sequence[MemoryObj]) -> None: ...


def make_allocator(cfg: CPUConfig) -> Allocator:
    pin = torch.cuda.is_available() if cfg.pin_memory is None else cfg.pin_memory
    if cfg.allocator == "slots":
        assert cfg.slot_bytes is not None  # CPUConfig.validate checked it
        return SlotAllocator(cfg.capacity_bytes, cfg.slot_bytes, pin_memory=pin)
    return FirstFitAllocator(cfg.capacity_bytes, pin_memory=pin)


__all__ = ["Allocator", "FirstFitAllocator", "SlotAllocator", "make_allocator"]
