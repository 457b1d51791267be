"""The torch reference kernels against plain dense computations."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvstrata.kernels.attention as attention_module
from kvstrata.kernels import (
    KernelArgumentError,
    KVCacheShape,
    allocate_kv_caches,
    gather_kv,
    gather_kv_layer,
    paged_attention,
    reshape_and_cache,
    scatter_kv,
    scatter_kv_layer,
)
from kernel_builders import dense_attention, make_paged_batch

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (4, 2), (8, 2), (8, 1)])
def test_paged_attention_matches_dense_causal_mixed_batch(q_heads, kv_heads):
    # prefill from scratch, extend over a cached prefix, two decodes, a length-1 seq
    seq_lens, q_lens = [9, 13, 6, 17, 1], [9, 5, 1, 1, 1]
    batch = make_paged_batch(seq_lens, q_lens, q_heads=q_heads, kv_heads=kv_heads, seed=q_heads * 10 + kv_heads)
    out = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                          batch.query_start_loc, batch.seq_lens, scale=0.25, impl="torch")
    torch.testing.assert_close(out.double(), dense_attention(batch, 0.25), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 3, 6])
def test_paged_attention_sliding_window_with_null_blocks_matches_dense(window):
    seq_lens, q_lens = [15, 18, 11], [1, 6, 1]
    batch = make_paged_batch(seq_lens, q_lens, sliding_window=window, seed=window)
    assert (batch.block_tables[:, 0] == 0).any(), "the window must have replaced a block by the null block"
    out = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                          batch.query_start_loc, batch.seq_lens, scale=0.3, sliding_window=window, impl="torch")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), dense_attention(batch, 0.3, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seq_lens", [[3, 31, 9, 1, 17, 30, 12, 5, 10, 2], [8, 8, 8]])
@pytest.mark.parametrize("chunk_bytes", [1, 4096, 1 << 20])
@pytest.mark.parametrize("window", [None, 3, 6])
def test_paged_attention_decode_chunks_ignore_nan_null_block_and_tails(monkeypatch, seq_lens, chunk_bytes, window):
    # The decode path groups sequences by length into chunks of about
    # chunk_bytes of K: 1 -> one sequence per call (exact rows, no mask);
    # 4096 (8 blocks here) -> a mix of single and padded multi-sequence chunks;
    # 1 MiB -> the whole batch in one call ([8, 8, 8] without a window: full
    # equal blocks, the chunk needs no mask).
    monkeypatch.setattr(attention_module, "_DECODE_CHUNK_BYTES", chunk_bytes)
    batch = make_paged_batch(seq_lens, [1] * len(seq_lens), sliding_window=window, extra_table_cols=2, seed=7)
    block_size = batch.key_cache.shape[1]
    for b, n in enumerate(seq_lens):  # unwritten tail of each last block: NaN garbage
        last = int(batch.block_tables[b, (n - 1) // block_size])
        batch.key_cache[last, (n - 1) % block_size + 1 :] = float("nan")
        batch.value_cache[last, (n - 1) % block_size + 1 :] = float("nan")
    out = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                          batch.query_start_loc, batch.seq_lens, scale=0.3, sliding_window=window, impl="torch")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), dense_attention(batch, 0.3, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_bytes", [1, 4096, 1 << 20])
def test_paged_attention_plans_are_reused_across_layers_and_kept_apart_by_window(monkeypatch, chunk_bytes):
    # One step's metadata, several layers: the first layer's plan (host
    # lengths, decode chunks, gather indices and masks, the gather buffer)
    # serves the others with their own caches and queries, bit-equal to
    # planning each layer afresh; another window gets its own plan.
    monkeypatch.setattr(attention_module, "_DECODE_CHUNK_BYTES", chunk_bytes)
    seq_lens, q_lens = [3, 31, 9, 1, 17, 30, 12, 5], [1, 1, 4, 1, 1, 6, 1, 1]
    first = make_paged_batch(seq_lens, q_lens, extra_table_cols=2, seed=11)
    layers = [dataclasses.replace(first, query=first.query * -a, key_cache=first.key_cache * a,
                                  value_cache=first.value_cache + a, keys=[k * a for k in first.keys],
                                  values=[v + a for v in first.values]) for a in (1.0, 2.0, 0.5)]
    tables = first.block_tables
    plans: dict = {}
    for window in (None, 5, None, 5):
        for b in layers:
            args = (b.query, b.key_cache, b.value_cache, tables, b.query_start_loc, b.seq_lens)
            fresh = paged_attention(*args, scale=0.3, sliding_window=window, impl="torch")
            reused = paged_attention(*args, scale=0.3, sliding_window=window, impl="torch", plans=plans)
            assert torch.equal(fresh, reused)
            torch.testing.assert_close(reused.double(), dense_attention(b, 0.3, window), atol=1e-5, rtol=1e-5)
    assert len(plans) == 2  # one per window: both reused by every later layer


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_low_precision_returns_query_dtype(dtype):
    batch = make_paged_batch([7, 12], [7, 1], dtype=dtype, seed=3)
    out = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                          batch.query_start_loc, batch.seq_lens, scale=0.25, impl="torch")
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), dense_attention(batch, 0.25), atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4)


def test_paged_attention_writes_into_out():
    batch = make_paged_batch([5, 3], [2, 1], seed=4)
    out = torch.full_like(batch.query, 7.0)
    res = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                          batch.query_start_loc, batch.seq_lens, 0.5, out=out, impl="torch")
    assert res is out
    torch.testing.assert_close(out.double(), dense_attention(batch, 0.5), atol=1e-5, rtol=1e-5)


def test_reshape_and_cache_writes_slots_and_skips_negative():
    kc = torch.zeros((4, 4, 2, 8))
    vc = torch.zeros((4, 4, 2, 8))
    key = torch.randn((5, 2, 8))
    value = torch.randn((5, 2, 8))
    slots = torch.tensor([5, -1, 15, 4, -7])
    reshape_and_cache(key, value, kc, vc, slots, impl="torch")
    torch.testing.assert_close(kc[1, 1], key[0], rtol=0, atol=0)
    torch.testing.assert_close(kc[3, 3], key[2], rtol=0, atol=0)
    torch.testing.assert_close(vc[1, 0], value[3], rtol=0, atol=0)
    written = torch.zeros((4, 4), dtype=torch.bool)
    written[1, 1] = written[3, 3] = written[1, 0] = True
    assert (kc[~written] == 0).all() and (vc[~written] == 0).all()


@pytest.mark.parametrize("layout", ["per_layer", "cross_layer"])
def test_gather_then_scatter_is_identity_and_leaves_other_blocks(layout):
    shape = KVCacheShape(num_layers=3, num_blocks=6, block_size=4, num_kv_heads=2, head_size=8)
    backing, caches = allocate_kv_caches(shape, layout, torch.float32, "cpu")
    backing.copy_(torch.randn(backing.shape))
    before = backing.clone()
    # a chunk that starts inside block 2 and ends inside block 5, plus a padding slot
    slots = torch.tensor([10, 11, 20, 21, 22, -1, 13], dtype=torch.int64)
    chunk = gather_kv(caches, slots, impl="torch")
    assert chunk.shape == (3, 2, 7, 2, 8) and chunk.is_contiguous()
    assert (chunk[:, :, 5] == 0).all()
    for layer, (k, v) in enumerate(caches):
        torch.testing.assert_close(chunk[layer, 0, 0], k[2, 2], rtol=0, atol=0)
        torch.testing.assert_close(chunk[layer, 1, 4], v[5, 2], rtol=0, atol=0)
    # scatter into other slots, then back: only those slots change
    dst = torch.tensor([4, 5, 6, 7, 8, -1, 9])
    scatter_kv(chunk, caches, dst, impl="torch")
    again = gather_kv(caches, dst, impl="torch")
    torch.testing.assert_close(again[:, :, [0, 1, 2, 3, 4, 6]], chunk[:, :, [0, 1, 2, 3, 4, 6]], rtol=0, atol=0)
    changed = (backing != before).reshape(-1).nonzero().numel()
    assert 0 < changed <= 3 * 2 * 6 * 2 * 8
    for layer, (k, v) in enumerate(caches):
        kb = before_view(before, layout, layer)
        untouched = torch.ones((6, 4), dtype=torch.bool)
        for s in [4, 5, 6, 7, 8, 9]:
            untouched[s // 4, s % 4] = False
        torch.testing.assert_close(k[untouched], kb[0][untouched], rtol=0, atol=0)
        torch.testing.assert_close(v[untouched], kb[1][untouched], rtol=0, atol=0)


def before_view(before: torch.Tensor, layout: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if layout == "per_layer":
        return before[layer, 0], before[layer, 1]
    return before[:, layer, 0], before[:, layer, 1]


def test_single_layer_gather_scatter_roundtrip():
    kc, vc = torch.randn((5, 4, 2, 8)), torch.randn((5, 4, 2, 8))
    k0, v0 = kc.clone(), vc.clone()
    slots = torch.tensor([3, 4, 5, 6, 7, 8], dtype=torch.int32)
    chunk = gather_kv_layer(kc, vc, slots, impl="torch")
    scatter_kv_layer(chunk, kc, vc, slots, impl="torch")
    assert torch.equal(kc, k0) and torch.equal(vc, v0)


def test_bad_arguments_raise_naming_the_field():
    kc = torch.zeros((4, 4, 2, 8))
    with pytest.raises(KernelArgumentError, match="slot_mapping"):
        reshape_and_cache(torch.zeros((2, 2, 8)), torch.zeros((2, 2, 8)), kc, kc.clone(), torch.tensor([1, 2, 3]))
    with pytest.raises(KernelArgumentError, match="slot_mapping has slot 16"):
        reshape_and_cache(torch.zeros((1, 2, 8)), torch.zeros((1, 2, 8)), kc, kc.clone(), torch.tensor([16]))
    with pytest.raises(KernelArgumentError, match="key_cache dtype"):
        reshape_and_cache(torch.zeros((1, 2, 8), dtype=torch.float16), torch.zeros((1, 2, 8), dtype=torch.float16),
                          kc, kc.clone(), torch.tensor([1]))
    batch = make_paged_batch([5], [1], q_heads=3, kv_heads=3)
    with pytest.raises(KernelArgumentError, match="multiple"):
        paged_attention(batch.query[:, :2], batch.key_cache, batch.value_cache, batch.block_tables,
                        batch.query_start_loc, batch.seq_lens, 0.5)
    with pytest.raises(KernelArgumentError, match="seq_lens"):
        paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                        batch.query_start_loc, torch.tensor([13], dtype=torch.int32), 0.5)
    with pytest.raises(KernelArgumentError, match="scale"):
        paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                        batch.query_start_loc, batch.seq_lens, -1.0)
