"""Compiled Triton kernels and CUDA streams; skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch

from kernel_builders import make_paged_batch
from kvstrata.kernels import (
    KV_LAYOUTS,
    KVCacheShape,
    KVStreams,
    allocate_kv_caches,
    gather_kv,
    gather_kv_layer,
    paged_attention,
    reshape_and_cache,
    scatter_kv,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _cuda_batch(batch):
    for name in ("query", "key_cache", "value_cache", "block_tables", "query_start_loc", "seq_lens"):
        setattr(batch, name, getattr(batch, name).cuda())
    return batch


def _attend(batch, scale, window=None, impl="auto"):
    return paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                           batch.query_start_loc, batch.seq_lens, scale, window, impl=impl)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_compiled_attention_matches_torch(dtype, group):
    batch = _cuda_batch(make_paged_batch([300, 77, 1, 40], [1, 77, 1, 9], block_size=16, q_heads=2 * group,
                                         kv_heads=2, head_dim=64, dtype=dtype, seed=group))
    torch.testing.assert_close(_attend(batch, 0.125), _attend(batch, 0.125, impl="torch"),
                               atol=TOL[dtype], rtol=TOL[dtype])


def test_compiled_attention_sliding_window_null_blocks():
    batch = _cuda_batch(make_paged_batch([200, 50], [1, 20], block_size=16, q_heads=8, kv_heads=2, head_dim=128,
                                         dtype=torch.float16, sliding_window=33, seed=3))
    got = _attend(batch, 0.1, 33)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, _attend(batch, 0.1, 33, impl="torch"), atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("layout", KV_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compiled_cache_write_and_transfer_match_torch(layout, dtype):
    shape = KVCacheShape(num_layers=3, num_blocks=32, block_size=16, num_kv_heads=4, head_size=64)
    backing, caches = allocate_kv_caches(shape, layout, dtype, "cuda")
    ref_backing = backing.clone()
    ref_caches = _views(ref_backing, layout, 3)
    key = torch.randn((100, 4, 64), device="cuda", dtype=dtype)
    value = torch.randn((100, 4, 64), device="cuda", dtype=dtype)
    slots = torch.randperm(32 * 16, device="cuda")[:100]
    slots[::7] = -1
    for layer in range(3):
        reshape_and_cache(key, value, *caches[layer], slots)
        reshape_and_cache(key, value, *ref_caches[layer], slots, impl="torch")
    assert torch.equal(backing, ref_backing)
    chunk_slots = torch.arange(37, 37 + 250, device="cuda")  # mid-block start and end
    chunk = gather_kv(caches, chunk_slots)
    assert torch.equal(chunk, gather_kv(ref_caches, chunk_slots, impl="torch"))
    before = backing.clone()
    scatter_kv(chunk, caches, chunk_slots)
    assert torch.equal(backing, before)


def _views(backing, layout, num_layers):
    if layout == "per_layer":
        return [(backing[i, 0], backing[i, 1]) for i in range(num_layers)]
    return [(backing[:, i, 0], backing[:, i, 1]) for i in range(num_layers)]


def test_store_waits_for_the_layer_write_and_load_precedes_attention():
    shape = KVCacheShape(num_layers=2, num_blocks=64, block_size=16, num_kv_heads=2, head_size=64)
    backing, caches = allocate_kv_caches(shape, "cross_layer", torch.float16, "cuda")
    streams = KVStreams("cuda", num_layers=2)
    host = streams.alloc_host((2, 512, 2, 64), torch.float16)
    assert host.is_pinned()
    key = torch.randn((512, 2, 64), device="cuda", dtype=torch.float16)
    value = torch.randn_like(key)
    slots = torch.arange(16, 16 + 512, device="cuda")
    big = torch.randn((4096, 4096), device="cuda")
    for _ in range(4):
        big = big @ big / 64  # keep the compute stream busy so a racing store would read zeros
    reshape_and_cache(key, value, *caches[0], slots)
    stored = streams.store_layer(0, *caches[0], slots, host_out=host)
    stored.wait()
    assert torch.equal(host[0].cuda(), key) and torch.equal(host[1].cuda(), value)
    # reload into layer 1 on the load stream; attention on layer 1 must see it
    loaded = streams.load_layer(1, host, *caches[1], slots)
    streams.wait_layer_loaded(1)
    q = torch.randn((1, 2, 64), device="cuda", dtype=torch.float16)
    table = torch.arange(0, 33, device="cuda", dtype=torch.int32).unsqueeze(0)  # positions 0..527
    out = paged_attention(q, *caches[1], table, torch.tensor([0, 1], device="cuda", dtype=torch.int32),
                          torch.tensor([16 + 512], device="cuda", dtype=torch.int32), 0.125)
    torch.cuda.synchronize()
    assert loaded.done()
    ref = paged_attention(q, *caches[0], table, torch.tensor([0, 1], device="cuda", dtype=torch.int32),
                          torch.tensor([16 + 512], device="cuda", dtype=torch.int32), 0.125)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    streams.synchronize()
    assert streams.num_inflight() == 0
    del big, backing


def test_gather_layer_into_preallocated_out_on_side_stream():
    shape = KVCacheShape(num_layers=1, num_blocks=8, block_size=16, num_kv_heads=1, head_size=128)
    backing, caches = allocate_kv_caches(shape, "per_layer", torch.bfloat16, "cuda")
    backing.normal_()
    slots = torch.arange(5, 90, device="cuda")
    out = torch.empty((2, 85, 1, 128), device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gather_kv_layer(*caches[0], slots, out=out)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out, gather_kv_layer(*caches[0], slots, impl="torch"))
