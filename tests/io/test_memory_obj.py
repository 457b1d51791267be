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
