"""MemoryObj: reference and pin counting, views, evictability."""

from __future__ import annotations

import pytest
import torch

from kvstrata.io import FirstFitAllocator
from kvstrata.io.memory import dtype_from_name, dtype_name, release_all


def test_last_release_returns_the_bytes(tracker):
    a = tracker.add(FirstFitAllocator(4 * 4096))
    obj = a.allocate((2, 3), torch.float16, "kv")
    assert (obj.ref_count, obj.pin_count, obj.shape, obj.dtype, obj.layout) == (1, 0, (2, 3), torch.float16, "kv")
    obj.ref_up()
    obj.release()
    assert a.num_live == 1
    obj.release()
    assert a.num_live == 0 and a.used_bytes == 0
    with pytest.raises(RuntimeError):
        obj.ref_up()


def test_evictable_only_when_unpinned_and_held_by_one(tracker):
    a = tracker.add(FirstFitAllocator(4096))
    obj = a.allocate((4,), torch.float32)
    assert obj.can_evict
    obj.pin()
    assert not obj.can_evict
    obj.unpin()
    obj.ref_up()
    assert not obj.can_evict
    obj.release()
    with pytest.raises(RuntimeError, match="unpinned more"):
        obj.unpin()
    obj.release()


def test_tensor_is_a_view_of_the_raw_bytes(tracker):
    a = tracker.add(FirstFitAllocator(4096))
    obj = a.allocate((2, 2), torch.float32)
    obj.tensor.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert obj.raw.numel() == 16 and obj.numpy_bytes().nbytes == 16
    assert torch.equal(obj.raw.view(torch.float32), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    obj.release()


def test_release_all_frees_in_one_batch(tracker):
    a = tracker.add(FirstFitAllocator(8 * 4096))
    objs = a.batched_allocate(4, (4096,), torch.uint8)
    objs[0].ref_up()
    release_all(objs)
    assert a.num_live == 1 and a.free_regions() == [(4096, 7 * 4096)]
    objs[0].release()


def test_dtype_names_round_trip():
    for d in (torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn):
        assert dtype_from_name(dtype_name(d)) is d
    with pytest.raises(ValueError, match="dtype name"):
        dtype_from_name("complex64")


def test_a_pinned_host_buffer_asks_for_no_slack(monkeypatch):
    """torch's caching host allocator pins the next power of two of what it
    is asked for, on a page: asking for the capacity plus 4 KiB of alignment
    slack pinned twice a power-of-two capacity (a 1 GiB tier held 2 GiB of
    pinned memory). Pinned buffers ask for the capacity alone; one that is
    not a power of two is logged with what it pins. (No CUDA here: the
    allocator stands in, page-aligned as cudaHostAlloc's memory is.)"""
    import structlog.testing
    import torch

    from kvstrata.io import memory

    asked: list[tuple[int, bool]] = []
    real_empty = torch.empty

    def pinned_empty(n, dtype, pin_memory=False):
        asked.append((n, pin_memory))
        backing = real_empty(n + memory.ALIGN, dtype=dtype)
        start = (-backing.data_ptr()) % memory.ALIGN
        return backing[start:start + n]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "empty", pinned_empty)
    with structlog.testing.capture_logs() as logs:
        raw, offset = memory.host_buffer(1 << 20, pin_memory=True)
        assert (asked, offset, raw.numel()) == ([(1 << 20, True)], 0, 1 << 20) and not logs
        memory.host_buffer(3 << 20, pin_memory=True)
    assert asked[1] == (3 << 20, True)
    assert [(e["event"], e["pinned_bytes"]) for e in logs] == [("host_buffer_pinned_rounded_up", 4 << 20)]
    raw, offset = memory.host_buffer(1 << 20, pin_memory=False)  # pageable: the slack, for O_DIRECT
    assert asked[2] == ((1 << 20) + memory.ALIGN, False) and (raw.data_ptr() + offset) % memory.ALIGN == 0
