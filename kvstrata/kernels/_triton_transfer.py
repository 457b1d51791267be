"""Triton kernel for gather/scatter between the paged cache and chunk buffers
(torch reference and contract: ``transfer.py``). Imported lazily: imports triton.

One kernel does both directions. Program (t, 2*layer + kv) copies BLOCK_T
token rows of one layer's K or V. Layers are addressed as element offsets
from layer 0's key cache: when every layer sits at a uniform distance
(both layouts of ``layout.py`` do) all layers go in one launch; otherwise
one launch per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstrata.kernels._triton_cache_write import row_tile
from kvstrata.kernels.dispatch import LazyKernel


def _transfer_kernel(
    cache_ptr,
    chunk_ptr,
    slot_ptr,
    num_tokens,
    num_slots,
    layer_stride,
    kv_stride,
    block_stride,
    BLOCK_SIZE: tl.constexpr,
    ROW: tl.constexpr,
    ROW_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    TO_CACHE: tl.constexpr,
):
    lkv = tl.program_id(1)
    layer = (lkv // 2).to(tl.int64)
    kv = (lkv % 2).to(tl.int64)
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = tok < num_tokens
    slot = tl.load(slot_ptr + tok, mask=in_range, other=-1).to(tl.int64)
    keep = in_range & (slot >= 0) & (slot < num_slots)
    col = tl.arange(0, ROW_PAD)
    col_ok = (col < ROW)[None, :]
    cache_off = layer * layer_stride + kv * kv_stride + (slot // BLOCK_SIZE * block_stride + slot % BLOCK_SIZE * ROW)
    chunk_off = (layer * 2 + kv) * num_tokens * ROW + tok.to(tl.int64) * ROW
    cache_ptrs = cache_ptr + cache_off[:, None] + col[None, :]
    chunk_ptrs = chunk_ptr + chunk_off[:, None] + col[None, :]
    if TO_CACHE:
        x = tl.load(chunk_ptrs, mask=keep[:, None] & col_ok)
        tl.store(cache_ptrs, x, mask=keep[:, None] & col_ok)
    else:
        # padding slots read as zeros, so the chunk is fully defined
        x = tl.load(cache_ptrs, mask=keep[:, None] & col_ok, other=0.0)
        tl.store(chunk_ptrs, x, mask=in_range[:, None] & col_ok)


transfer_kernel = LazyKernel(_transfer_kernel)


def transfer_triton(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    chunk: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    to_cache: bool,
) -> None:
    """Copy between ``chunk`` [L, 2, n, Hkv, D] (contiguous) and the caches' slots."""
    key0 = kv_caches[0][0]
    elem = key0.element_size()
    base = key0.data_ptr()
    # element-aligned pointers of one dtype: every difference is whole elements
    assert all((t.data_ptr() - base) % elem == 0 for pair in kv_caches for t in pair)
    offsets = [((k.data_ptr() - base) // elem, (v.data_ptr() - base) // elem) for k, v in kv_caches]
    layer_stride = offsets[1][0] if len(offsets) > 1 else 0
    kv_stride = offsets[0][1]
    uniform = all(k_off == i * layer_stride and v_off - k_off == kv_stride for i, (k_off, v_off) in enumerate(offsets))
    if uniform:
        _launch(key0, chunk, slot_mapping, len(kv_caches), layer_stride, kv_stride, to_cache)
    else:
        for layer, (k, v) in enumerate(kv_caches):
            _launch(k, chunk[layer], slot_mapping, 1, 0, (v.data_ptr() - k.data_ptr()) // elem, to_cache)


def _launch(cache, chunk, slot_mapping, num_layers, layer_stride, kv_stride, to_cache) -> None:
    num_blocks, block_size, heads, head_dim = cache.shape
    num_tokens = slot_mapping.shape[0]
    row = heads * head_dim
    row_pad, block_t = row_tile(row, cache.device)
    grid = (triton.cdiv(num_tokens, block_t), 2 * num_layers)
    transfer_kernel.for_device(cache.device)[grid](
        cache,
        chunk,
        slot_mapping,
        num_tokens,
        num_blocks * block_size,
        layer_stride,
        kv_stride,
        cache.stride(0),
        BLOCK_SIZE=block_size,
        ROW=row,
        ROW_PAD=row_pad,
        BLOCK_T=block_t,
        TO_CACHE=to_cache,
    )
