"""Triton kernel for reshape_and_cache (torch reference and contract: ``cache_write.py``).

Imported lazily by the dispatcher: this module imports triton.

One program copies a tile of BLOCK_T tokens x one whole token row
(Hkv * D elements, contiguous in both the input and the cache) for K and for
V, so the interpreter runs cdiv(T, BLOCK_T) programs and a GPU gets wide,
coalesced row copies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstrata.kernels.dispatch import LazyKernel


def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    num_tokens,
    num_slots,
    key_stride,
    value_stride,
    block_stride,
    BLOCK_SIZE: tl.constexpr,
    ROW: tl.constexpr,
    ROW_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = tok < num_tokens
    slot = tl.load(slot_ptr + tok, mask=in_range, other=-1).to(tl.int64)
    # Negative slots are padding; slots past the cache are dropped rather
    # than written out of bounds (CUDA callers are not range-checked).
    keep = in_range & (slot >= 0) & (slot < num_slots)
    col = tl.arange(0, ROW_PAD)
    mask = keep[:, None] & (col < ROW)[None, :]
    tok64 = tok.to(tl.int64)
    dst = (slot // BLOCK_SIZE * block_stride + slot % BLOCK_SIZE * ROW)[:, None] + col[None, :]
    k = tl.load(key_ptr + (tok64 * key_stride)[:, None] + col[None, :], mask=mask)
    tl.store(key_cache_ptr + dst, k, mask=mask)
    v = tl.load(value_ptr + (tok64 * value_stride)[:, None] + col[None, :], mask=mask)
    tl.store(value_cache_ptr + dst, v, mask=mask)


reshape_and_cache_kernel = LazyKernel(_reshape_and_cache_kernel)


def row_tile(row: int, device: torch.device) -> tuple[int, int]:
    """(ROW_PAD, BLOCK_T) for copying rows of ``row`` elements: ~4K elements per
    program on GPU, ~64K in the interpreter (fewer, larger numpy steps)."""
    row_pad = triton.next_power_of_2(row)
    budget = 4096 if device.type == "cuda" else 65536
    return row_pad, max(1, min(1024, budget // row_pad))


def reshape_and_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens, heads, head_dim = key.shape
    num_blocks, block_size = key_cache.shape[:2]
    row = heads * head_dim
    row_pad, block_t = row_tile(row, key.device)
    grid = (triton.cdiv(num_tokens, block_t),)
    reshape_and_cache_kernel.for_device(key.device)[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_tokens,
        num_blocks * block_size,
        key.stride(0),
        value.stride(0),
        key_cache.stride(0),
        BLOCK_SIZE=block_size,
        ROW=row,
        ROW_PAD=row_pad,
        BLOCK_T=block_t,
    )
