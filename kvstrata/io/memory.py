"""MemoryObj: one stored object's bytes inside an allocator's buffer.

Reference counting (all on the event loop thread; I/O threads only touch the
bytes, never the counts)::

    allocate()            ref_count = 1   (the caller)
    tier.put(key, obj)    ref_count += 1  (the tier's reference)
    caller.release()      ref_count -= 1
    an I/O job in flight  holds its own reference until it is done
    ref_count == 0        the bytes go back to the allocator

``pin_count`` keeps an object in its tier between a lookup and the retrieve
that follows. A tier may evict an object only when ``pin_count == 0`` and
``ref_count == 1`` (nobody but the tier holds it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import structlog
import torch

if TYPE_CHECKING:
    from collections.abc import Iterable

log = structlog.get_logger(__name__)

ALIGN = 4096


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
        torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
        torch.float8_e4m3fn, torch.float8_e5m2,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(f"dtype {dtype!r} is not supported by the store")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}") from None


def object_nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a tensor of this shape and dtype; rejects bad input by name."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    dtype_name(dtype)
    if not isinstance(shape, (tuple, list)) or not shape:
        raise ValueError(f"shape must be a non-empty tuple of positive ints, got {shape!r}")
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or d < 1:
            raise ValueError(f"shape must be a non-empty tuple of positive ints, got {shape!r}")
    return math.prod(shape) * dtype.itemsize


def host_buffer(nbytes: int, *, pin_memory: bool) -> tuple[torch.Tensor, int]:
    """A uint8 tensor of at least ``nbytes`` whose usable part starts on a
    4 KiB boundary (so O_DIRECT can read into it). Returns (tensor, offset).

    Pinned (``pin_memory`` on a CUDA machine): torch's caching host
    allocator pins the next power of two of the size asked for, on a page
    boundary. So no alignment slack is asked for (a 1 GiB tier pins 1 GiB,
    not 2 GiB), and a size that is not a power of two is logged with what
    it really pins."""
    pin = pin_memory and torch.cuda.is_available()
    if pin:
        raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if raw.data_ptr() % ALIGN == 0:
            pinned = 1 << max(0, (nbytes - 1).bit_length())
            if pinned != nbytes:
                log.warning("host_buffer_pinned_rounded_up", asked_bytes=nbytes, pinned_bytes=pinned,
                            hint="torch pins a power of two: a capacity of one pins exactly that")
            return raw, 0
        del raw  # not on a page (not seen: pinned memory starts on one): with slack, as below
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    offset = (-raw.data_ptr()) % ALIGN
    return raw, offset


class Freeable(Protocol):
    def free(self, obj: MemoryObj) -> None: ...

    def batched_free(self, objs: Sequence[MemoryObj]) -> None: ...


class MemoryObj:
    """Owns: its ref and pin counts. The bytes belong to the allocator's
    buffer; ``address`` is the offset of the object inside it."""

    __slots__ = (
        "address", "alloc_size", "nbytes", "shape", "dtype", "layout",
        "ref_count", "pin_count", "_raw", "_tensor", "_allocator",
    )

    def __init__(
        self,
        allocator: Freeable,
        raw: torch.Tensor,
        address: int,
        alloc_size: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        layout: str,
    ) -> None:
        self._allocator = allocator
        self._raw = raw
        self._tensor: torch.Tensor | None = None
        self.address = address
        self.alloc_size = alloc_size
        self.nbytes = raw.numel()
        self.shape = tuple(shape)
        self.dtype = dtype
        self.layout = layout
        self.ref_count = 1
        self.pin_count = 0

    def __repr__(self) -> str:
        return (
            f"MemoryObj(address={self.address}, nbytes={self.nbytes}, shape={self.shape}, "
            f"dtype={self.dtype}, layout={self.layout!r}, ref={self.ref_count}, pin={self.pin_count})"
        )

    @property
    def tensor(self) -> torch.Tensor:
        """The object as a tensor of its shape and dtype (a view, no copy)."""
        t = self._tensor
        if t is None:
            t = self._tensor = self._raw.view(self.dtype).view(self.shape)
        return t

    @property
    def raw(self) -> torch.Tensor:
        """The object's bytes as a flat uint8 tensor view."""
        return self._raw

    def numpy_bytes(self) -> np.ndarray:
        """The bytes as a flat uint8 numpy view, for file and socket I/O."""
        return self._raw.numpy()

    def ref_up(self) -> None:
        if self.ref_count <= 0:
            raise RuntimeError("MemoryObj.ref_up on a freed object")
        self.ref_count += 1

    def release(self) -> None:
        """Drop one reference; the last one returns the bytes."""
        if self.ref_count <= 0:
            raise RuntimeError("MemoryObj released more times than it was referenced")
        self.ref_count -= 1
        if self.ref_count == 0:
            self._tensor = None
            self._allocator.free(self)

    def pin(self) -> None:
        self.pin_count += 1

    def unpin(self) -> None:
        if self.pin_count <= 0:
            raise RuntimeError("MemoryObj unpinned more times than it was pinned")
        self.pin_count -= 1

    @property
    def can_evict(self) -> bool:
        """Only the tier holds it and nobody pinned it."""
        return self.pin_count == 0 and self.ref_count == 1


def release_all(objs: Iterable[MemoryObj]) -> None:
    """Drop one reference of each object, freeing the ones that reach zero
    in one sorted batch per allocator."""
    dead: dict[int, tuple[Freeable, list[MemoryObj]]] = {}
    for obj in objs:
        if obj.ref_count <= 0:
            raise RuntimeError("MemoryObj released more times than it was referenced")
        obj.ref_count -= 1
        if obj.ref_count == 0:
            obj._tensor = None
            alloc = obj._allocator
            dead.setdefault(id(alloc), (alloc, []))[1].append(obj)
    for alloc, group in dead.values():
        alloc.batched_free(group)
