"""KVStreams on CPU: the same API as on CUDA, running inline."""

from __future__ import annotations

import pytest
import torch

from kvstrata.kernels import KVCacheShape, KVStreams, allocate_kv_caches, gather_kv


def _caches(layout: str = "cross_layer"):
    shape = KVCacheShape(num_layers=2, num_blocks=5, block_size=4, num_kv_heads=2, head_size=8)
    backing, caches = allocate_kv_caches(shape, layout, torch.float32, "cpu")
    backing.copy_(torch.randn(backing.shape, generator=torch.Generator().manual_seed(0)))
    return backing, caches


def test_store_layer_returns_done_transfer_with_host_chunk():
    _, caches = _caches()
    streams = KVStreams("cpu", num_layers=2)
    slots = torch.tensor([3, 4, 5])
    t = streams.store_layer(1, *caches[1], slots)
    assert t.done()
    assert t.result.shape == (2, 3, 2, 8)
    assert torch.equal(t.result[0], caches[1][0].reshape(-1, 2, 8)[3:6])
    assert torch.equal(t.result[1], caches[1][1].reshape(-1, 2, 8)[3:6])
    assert streams.num_inflight() == 0


def test_store_into_caller_buffer_and_load_back_elsewhere():
    backing, caches = _caches("per_layer")
    streams = KVStreams("cpu", num_layers=2)
    host = streams.alloc_host((2, 4, 2, 8), torch.float32)
    t = streams.store_layer(0, *caches[0], torch.tensor([8, 9, 10, 11]), host_out=host)
    assert t.result is host
    before = backing.clone()
    load = streams.load_layer(1, host, *caches[1], torch.tensor([0, 1, 2, 3]))
    streams.wait_layer_loaded(1)
    assert load.done()
    assert torch.equal(caches[1][0][0], caches[0][0][2])
    assert torch.equal(caches[1][1][0], caches[0][1][2])
    changed = (backing != before).any(dim=(-1, -2, -3))  # [L, 2, blocks]
    assert changed.nonzero().tolist() == [[1, 0, 0], [1, 1, 0]]


@pytest.mark.parametrize("layout", ["per_layer", "cross_layer"])
def test_store_all_then_load_all_roundtrip(layout):
    backing, caches = _caches(layout)
    streams = KVStreams("cpu", num_layers=2)
    slots = torch.tensor([2, 3, 4, 5, 6])
    stored = streams.store_all(caches, slots)
    assert torch.equal(stored.result, gather_kv(caches, slots, impl="torch"))
    backing.zero_()
    streams.load_all(stored.result, caches, slots)
    for layer in range(2):
        streams.wait_layer_loaded(layer)
    got = gather_kv(caches, slots, impl="torch")
    assert torch.equal(got, stored.result)
    streams.synchronize()
    assert streams.num_inflight() == 0


@pytest.mark.parametrize("num_chunks", [1, 3])
def test_layer_segments_are_the_per_chunk_calls(num_chunks):
    """S chunks in one call each way equal S calls of store_layer / load_layer."""
    backing, caches = _caches("per_layer")
    streams = KVStreams("cpu", num_layers=2)
    slots = torch.tensor([7, 2, -1, 9, 0, 1, 17, 18, 19][:3 * num_chunks])
    outs = [streams.alloc_host((2, 3, 2, 8), torch.float32) for _ in range(num_chunks)]
    t = streams.store_layer_segments(1, *caches[1], slots, outs)
    assert t.done()
    for i, out in enumerate(outs):
        assert torch.equal(out, streams.store_layer(1, *caches[1], slots[3 * i:3 * i + 3]).result)
    expected = backing.clone()
    ref = [(expected[i, 0], expected[i, 1]) for i in range(2)]
    target = torch.tensor([19, 4, 5, -1, 12, 13, 10, 11, 3][:3 * num_chunks])
    for i, out in enumerate(outs):
        streams.load_layer(0, out + 1, *ref[0], target[3 * i:3 * i + 3])
    load = streams.load_layer_segments(0, [out + 1 for out in outs], *caches[0], target)
    streams.wait_layer_loaded(0)
    assert load.done()
    assert torch.equal(backing, expected)


@pytest.mark.parametrize("layout", ["per_layer", "cross_layer"])
def test_all_layer_segments_are_the_per_chunk_calls(layout):
    backing, caches = _caches(layout)
    streams = KVStreams("cpu", num_layers=2)
    slots = torch.tensor([7, 2, -1, 9, 0, 1])
    outs = [streams.alloc_host((2, 2, 3, 2, 8), torch.float32) for _ in range(2)]
    assert streams.store_all_segments(caches, slots, outs).done()
    for i, out in enumerate(outs):
        assert torch.equal(out, gather_kv(caches, slots[3 * i:3 * i + 3], impl="torch"))
    expected = backing.clone()
    target = torch.tensor([19, 4, 5, -1, 12, 13])
    views = ([(expected[i, 0], expected[i, 1]) for i in range(2)] if layout == "per_layer"
             else [(expected[:, i, 0], expected[:, i, 1]) for i in range(2)])
    for i, out in enumerate(outs):
        streams.load_all(out + 1, views, target[3 * i:3 * i + 3])
    streams.load_all_segments([out + 1 for out in outs], caches, target)
    assert torch.equal(backing, expected)
    with pytest.raises(ValueError, match="host chunk must have shape"):
        streams.store_all_segments(caches, slots, [outs[0], torch.empty((2, 2, 2, 2, 8))])


def test_layer_segment_arguments_raise():
    _, caches = _caches()
    streams = KVStreams("cpu", num_layers=2)
    two = [torch.empty((2, 2, 2, 8)), torch.empty((2, 2, 2, 8))]
    with pytest.raises(ValueError, match="slot_mapping has 3 slots, 2 chunks of 2 tokens need 4"):
        streams.store_layer_segments(0, *caches[0], torch.tensor([0, 1, 2]), two)
    with pytest.raises(ValueError, match="at least one"):
        streams.load_layer_segments(0, [], *caches[0], torch.tensor([], dtype=torch.int64))
    with pytest.raises(ValueError, match="host chunk must have shape"):
        streams.load_layer_segments(0, [two[0], torch.empty((2, 3, 2, 8))], *caches[0], torch.arange(4))
    with pytest.raises(ValueError, match="host chunk dtype"):
        streams.store_layer_segments(0, *caches[0], torch.arange(2), [torch.empty((2, 2, 2, 8), dtype=torch.half)])
    with pytest.raises(ValueError, match="layer must be"):
        streams.load_layer_segments(2, two, *caches[0], torch.arange(4))


def test_bad_layer_and_arguments_raise():
    _, caches = _caches()
    streams = KVStreams("cpu", num_layers=2)
    with pytest.raises(ValueError, match="layer must be"):
        streams.store_layer(2, *caches[0], torch.tensor([0]))
    with pytest.raises(ValueError, match="layer must be"):
        streams.wait_layer_loaded(-1)
    with pytest.raises(ValueError, match="kv_caches must have 2 layers"):
        streams.store_all(caches[:1], torch.tensor([0]))
    with pytest.raises(ValueError, match="num_layers"):
        KVStreams("cpu", num_layers=0)
    with pytest.raises(ValueError, match="device"):
        KVStreams("meta", num_layers=1)
    with pytest.raises(ValueError, match="host_out must have shape"):
        streams.store_layer(0, *caches[0], torch.tensor([0, 1]), host_out=torch.empty((2, 3, 2, 8)))
    with pytest.raises(ValueError, match="host_out dtype"):
        streams.store_layer(0, *caches[0], torch.tensor([0]), host_out=torch.empty((2, 1, 2, 8), dtype=torch.float16))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only host")
def test_cuda_streams_without_cuda_raise_clearly():
    with pytest.raises(ValueError, match="CUDA is not available"):
        KVStreams("cuda", num_layers=1)
