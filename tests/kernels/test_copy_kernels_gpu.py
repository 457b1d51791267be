"""Compiled copy kernels (reshape_and_cache, gather/scatter, the store path)
against the torch references at realistic shapes (TinyLlama-like: 22 layers,
Hkv=4, D=64, block size 16, bf16), eagerly and captured in a CUDA graph;
skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch

from kvstrata.kernels import (
    KV_LAYOUTS,
    KVCacheShape,
    KVStreams,
    allocate_kv_caches,
    gather_kv,
    gather_kv_layer,
    reshape_and_cache,
    scatter_kv,
    scatter_kv_layer_ref,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

L, H, D, BS = 22, 4, 64, 16
HQ = 32


def _caches(layout: str, *, num_blocks: int = 600, heads: int = H, head_dim: int = D, num_layers: int = L,
            dtype: torch.dtype = torch.bfloat16):
    shape = KVCacheShape(num_layers=num_layers, num_blocks=num_blocks, block_size=BS, num_kv_heads=heads,
                         head_size=head_dim)
    backing, caches = allocate_kv_caches(shape, layout, dtype, "cuda")
    backing.normal_()
    return backing, caches


def _views(backing: torch.Tensor, layout: str):
    n = backing.shape[0] if layout == "per_layer" else backing.shape[1]
    if layout == "per_layer":
        return [(backing[i, 0], backing[i, 1]) for i in range(n)]
    return [(backing[:, i, 0], backing[:, i, 1]) for i in range(n)]


def _slots(n: int, num_blocks: int, seed: int) -> torch.Tensor:
    """Block-shuffled slots (prefill-like runs of 16) with every 13th token padding."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(num_blocks - 1, generator=g)[: (n + BS - 1) // BS] + 1
    slots = (blocks[:, None] * BS + torch.arange(BS)).reshape(-1)[:n].clone()
    slots[::13] = -1
    return slots.cuda()


def _qkv_views(n: int, heads: int, head_dim: int, dtype: torch.dtype):
    """K and V as slices of one fused projection: a strided token dim."""
    qkv = torch.randn((n, (HQ + 2 * heads) * head_dim), device="cuda", dtype=dtype)
    k = qkv[:, HQ * head_dim:(HQ + heads) * head_dim].view(n, heads, head_dim)
    v = qkv[:, (HQ + heads) * head_dim:].view(n, heads, head_dim)
    return k, v


@pytest.mark.parametrize("n", [1, 63, 4096, 5000])
@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_compiled_reshape_and_cache_matches_torch(layout, n):
    backing, caches = _caches(layout)
    ref = backing.clone()
    key, value = _qkv_views(n, H, D, torch.bfloat16)
    slots = _slots(n, 600, seed=n)
    out_of_range = slots.clone()
    out_of_range[1::17] = 600 * BS + 5  # past the cache: the kernel drops these
    reshape_and_cache(key, value, *caches[7], out_of_range)
    dropped = slots.clone()
    dropped[1::17] = -1
    reshape_and_cache(key, value, *_views(ref, layout)[7], dropped, impl="torch")
    assert torch.equal(backing, ref)


@pytest.mark.parametrize(("heads", "head_dim", "dtype"), [
    (5, 128, torch.bfloat16),  # 640: not a power of two, masked columns
    (32, 256, torch.float16),  # 8192: a row wider than a tile, several column chunks
    (4, 64, torch.float32),
    (1, 8, torch.bfloat16),  # 16-byte rows
])
def test_compiled_copies_other_row_shapes(heads, head_dim, dtype):
    backing, caches = _caches("cross_layer", num_blocks=80, heads=heads, head_dim=head_dim, num_layers=3,
                              dtype=dtype)
    ref = backing.clone()
    key, value = _qkv_views(700, heads, head_dim, dtype)
    slots = _slots(700, 80, seed=heads)
    reshape_and_cache(key, value, *caches[1], slots)
    reshape_and_cache(key, value, *_views(ref, "cross_layer")[1], slots, impl="torch")
    assert torch.equal(backing, ref)
    chunk = gather_kv(caches, slots)
    assert torch.equal(chunk, gather_kv(caches, slots, impl="torch"))
    assert torch.equal(gather_kv(caches, slots, max_programs=3), chunk)
    scatter_kv(chunk * 2, caches, slots)
    scatter_kv(chunk * 2, _views(ref, "cross_layer"), slots, impl="torch")
    assert torch.equal(backing, ref)


@pytest.mark.parametrize("max_programs", [None, 1, 8])
@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_compiled_gather_scatter_match_torch(layout, max_programs):
    backing, caches = _caches(layout)
    slots = _slots(3000, 600, seed=1)
    chunk = torch.full((L, 2, 3000, H, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    gather_kv(caches, slots, out=chunk, max_programs=max_programs)
    assert torch.equal(chunk, gather_kv(caches, slots, impl="torch"))
    assert (chunk[:, :, ::13] == 0).all()
    assert torch.equal(gather_kv_layer(*caches[5], slots, max_programs=max_programs), chunk[5])
    new = torch.randn_like(chunk)
    ref = backing.clone()
    scatter_kv(new, caches, slots)
    scatter_kv(new, _views(ref, layout), slots, impl="torch")
    assert torch.equal(backing, ref)


def test_compiled_gather_drops_out_of_range_slots():
    _, caches = _caches("per_layer", num_blocks=40, num_layers=2)
    slots = torch.tensor([3, 40 * BS, 17, 40 * BS + 100], device="cuda")
    chunk = gather_kv(caches, slots)
    assert (chunk[:, :, [1, 3]] == 0).all()
    assert torch.equal(chunk[:, :, [0, 2]], gather_kv(caches, slots[[0, 2]], impl="torch"))


def test_compiled_transfer_separately_allocated_layers():
    caches = [tuple(torch.randn((50, BS, H, D), device="cuda", dtype=torch.bfloat16) for _ in range(2))
              for _ in range(3)]
    slots = _slots(500, 50, seed=2)
    chunk = gather_kv(caches, slots, max_programs=4)
    assert torch.equal(chunk, gather_kv(caches, slots, impl="torch"))
    fresh = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in caches]
    ref = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in caches]
    scatter_kv(chunk, fresh, slots)
    scatter_kv(chunk, ref, slots, impl="torch")
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(fresh, ref, strict=True))


@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_copy_kernels_captured_in_cuda_graph_and_replayed(layout):
    """The engine's decode graphs capture the cache write; the graph must read
    its static inputs anew on every replay (no value baked in at capture)."""
    n = 256
    backing, caches = _caches(layout, num_blocks=100)
    other_backing, others = _caches(layout, num_blocks=100)
    key = torch.empty((n, H, D), device="cuda", dtype=torch.bfloat16)
    value = torch.empty_like(key)
    slots = torch.empty(n, device="cuda", dtype=torch.int64)
    chunk = torch.empty((L, 2, n, H, D), device="cuda", dtype=torch.bfloat16)

    def step():
        reshape_and_cache(key, value, *caches[3], slots)
        gather_kv(caches, slots, out=chunk)
        scatter_kv(chunk, others, slots)

    key.normal_()
    value.normal_()
    slots.copy_(_slots(n, 100, seed=0))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (1, 2, 3):
        ref, other_ref = backing.clone(), other_backing.clone()
        key.normal_()
        value.normal_()
        slots.copy_(_slots(n, 100, seed=seed))
        graph.replay()
        ref_caches = _views(ref, layout)
        reshape_and_cache(key, value, *ref_caches[3], slots, impl="torch")
        expected_chunk = gather_kv(ref_caches, slots, impl="torch")
        scatter_kv(expected_chunk, _views(other_ref, layout), slots, impl="torch")
        torch.cuda.synchronize()
        assert torch.equal(backing, ref)
        assert torch.equal(chunk, expected_chunk)
        assert torch.equal(other_backing, other_ref)


@pytest.mark.parametrize("store_programs", [None, 2])
def test_store_layer_bounded_gather_with_host_slots_on_busy_stream(store_programs):
    backing, caches = _caches("per_layer", num_blocks=300)
    streams = KVStreams("cuda", num_layers=L, store_programs=store_programs)
    n = 2000
    key, value = _qkv_views(n, H, D, torch.bfloat16)
    slots = _slots(n, 300, seed=4)
    host_slots = slots.cpu()  # pageable, as the connector hands them over
    host = streams.alloc_host((2, n, H, D), torch.bfloat16)
    busy = torch.randn((4096, 4096), device="cuda")
    for _ in range(4):
        busy = busy @ busy / 64  # a racing store would read the cache before the write below
    reshape_and_cache(key, value, *caches[9], slots)
    stored = streams.store_layer(9, *caches[9], host_slots, host_out=host)
    everything = streams.store_all(caches, host_slots)
    stored.wait()
    everything.wait()
    expected = gather_kv_layer(*caches[9], slots, impl="torch").cpu()
    assert torch.equal(host, expected)
    assert torch.equal(everything.result, gather_kv(caches, slots, impl="torch").cpu())
    streams.synchronize()
    assert streams.num_inflight() == 0
    del busy, backing


@pytest.mark.parametrize("device_slots", [False, True])
def test_layer_segments_store_then_load_on_busy_streams(device_slots):
    """S chunks per layer in one launch each way, racing a busy compute
    stream: every chunk's host buffer holds exactly its slots' K/V, and the
    loads land where the per-chunk loads would."""
    backing, caches = _caches("per_layer", num_blocks=300)
    streams = KVStreams("cuda", num_layers=L)
    s, n = 5, 256
    key, value = _qkv_views(s * n, H, D, torch.bfloat16)
    slots = _slots(s * n, 300, seed=5)
    given = slots if device_slots else slots.cpu()
    outs = [streams.alloc_host((2, n, H, D), torch.bfloat16) for _ in range(s)]
    busy = torch.randn((4096, 4096), device="cuda")
    for _ in range(4):
        busy = busy @ busy / 64
    reshape_and_cache(key, value, *caches[3], slots)
    streams.store_layer_segments(3, *caches[3], given, outs)
    streams.synchronize()
    for i, out in enumerate(outs):
        assert torch.equal(out, gather_kv_layer(*caches[3], slots[i * n:(i + 1) * n], impl="torch").cpu())
    target = _slots(s * n, 300, seed=6)
    expected = backing.clone()
    ref = _views(expected, "per_layer")
    for i, out in enumerate(outs):
        scatter_kv_layer_ref(out.cuda(), *ref[7], target[i * n:(i + 1) * n])
    for _ in range(4):
        busy = busy @ busy / 64
    streams.load_layer_segments(7, outs, *caches[7], target if device_slots else target.cpu())
    streams.wait_layer_loaded(7)
    torch.cuda.synchronize()
    assert torch.equal(backing, expected)
    streams.synchronize()
    assert streams.num_inflight() == 0
    del busy


def test_all_layer_segments_store_then_load():
    """Bulk transfers of S chunks in one launch each way: every chunk holds
    its slots' K/V of all layers, and loading them back elsewhere writes
    what the per-chunk loads write."""
    backing, caches = _caches("cross_layer", num_blocks=300)
    streams = KVStreams("cuda", num_layers=L)
    s, n = 3, 200
    slots = _slots(s * n, 300, seed=7)
    outs = [streams.alloc_host((L, 2, n, H, D), torch.bfloat16) for _ in range(s)]
    streams.store_all_segments(caches, slots.cpu(), outs)
    streams.synchronize()
    for i, out in enumerate(outs):
        assert torch.equal(out, gather_kv(caches, slots[i * n:(i + 1) * n], impl="torch").cpu())
    target = _slots(s * n, 300, seed=8)
    expected = backing.clone()
    ref = _views(expected, "cross_layer")
    for i, out in enumerate(outs):
        scatter_kv(out.cuda(), ref, target[i * n:(i + 1) * n], impl="torch")
    streams.load_all_segments(outs, caches, target)
    for layer in range(L):
        streams.wait_layer_loaded(layer)
    torch.cuda.synchronize()
    assert torch.equal(backing, expected)
    streams.synchronize()
    assert streams.num_inflight() == 0
