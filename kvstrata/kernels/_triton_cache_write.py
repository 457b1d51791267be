"""Triton kernel for reshape_and_cache (torch reference and contract: ``cache_write.py``).

Imported lazily by the dispatcher: this module imports triton. It also holds
the tile planner that the transfer kernels share (:func:`copy_tile`).

A program copies tiles of BLOCK_T tokens x COLS elements of the token row
(Hkv * D elements, contiguous in the input and in the cache) for K and V:

    token rows  ──►  tile t: tokens [t*BLOCK_T, (t+1)*BLOCK_T), columns chunk c
    per token:  one int64 cache row offset, computed once and shared by K and V
    per tile:   4 wide loads/stores ([BLOCK_T, COLS], 16-byte vectors)

The copy is memcpy-shaped on a GPU: 4 KiB tiles in 16-byte vectors, row
offsets hinted as multiples of the row alignment, and no column mask when
COLS divides the row (EVEN). Programs loop over tiles with a stride of the grid size, so one
kernel serves the ordinary grid (one tile per program) and a bounded grid.
The grid is a function of the shapes only and nothing is read back to the
host, so launches can be captured in CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from kvstrata.kernels.dispatch import LazyKernel, is_interpreted

# Bytes of one [BLOCK_T, COLS] tile of one tensor. Compiled, small tiles
# win at the engine's sizes (measured on an H100, TinyLlama shapes, 64..4096
# tokens: 4 KiB tiles gave 0.80-0.99 of a device copy, 8 KiB 0.70-0.98,
# 32 KiB 0.41-0.98): an indexed copy is latency-bound (slot load, then row
# load), so more programs in flight beat more bytes per program. A bounded
# grid wants the opposite: few programs, each moving much per step. The
# interpreter pays per program, so it gets tiles of 64K elements.
GPU_TILE_BYTES = 4096
BOUNDED_TILE_BYTES = 32768
INTERPRET_TILE_ELEMS = 65536
MAX_BLOCK_T = 1024


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
    COLS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    EVEN: tl.constexpr,
    SRC_ALIGN: tl.constexpr,
    DST_ALIGN: tl.constexpr,
):
    NCOL: tl.constexpr = (ROW + COLS - 1) // COLS
    num_tiles = (num_tokens + BLOCK_T - 1) // BLOCK_T * NCOL  # not tl.cdiv: a @jit helper (see dispatch.py)
    tile = tl.program_id(0)
    while tile < num_tiles:  # not range(): the interpreter can't index with its 1-element tensors
        tok = (tile // NCOL) * BLOCK_T + tl.arange(0, BLOCK_T)
        col = (tile % NCOL) * COLS + tl.max_contiguous(tl.multiple_of(tl.arange(0, COLS), COLS), COLS)
        slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
        # Negative slots are padding; slots past the cache are dropped rather
        # than written out of bounds (CUDA callers are not range-checked).
        keep = (slot >= 0) & (slot < num_slots)
        if EVEN:
            mask = keep[:, None]
        else:
            mask = keep[:, None] & (col < ROW)[None, :]
        # One int64 row offset per token. The block stride is a whole number
        # of rows (check_cache_pair), so every cache row starts at a multiple
        # of ROW; every input row at a multiple of the token strides.
        dst = tl.multiple_of((slot // BLOCK_SIZE) * block_stride + (slot % BLOCK_SIZE) * ROW, DST_ALIGN)
        tok64 = tok.to(tl.int64)
        k_src = tl.multiple_of(tok64 * key_stride, SRC_ALIGN)
        v_src = tl.multiple_of(tok64 * value_stride, SRC_ALIGN)
        k = tl.load(key_ptr + k_src[:, None] + col[None, :], mask=mask)
        v = tl.load(value_ptr + v_src[:, None] + col[None, :], mask=mask)
        tl.store(key_cache_ptr + dst[:, None] + col[None, :], k, mask=mask)
        tl.store(value_cache_ptr + dst[:, None] + col[None, :], v, mask=mask)
        tile += tl.num_programs(0)


# slot_ptr: a view into the step's packed input buffer, its alignment the step's counts' (a second
# KV cache group's mapping sits after the first's): never a compile of its own
reshape_and_cache_kernel = LazyKernel(_reshape_and_cache_kernel, do_not_specialize=("num_tokens", "slot_ptr"))


@dataclasses.dataclass(frozen=True)
class CopyTile:
    """How a row copy is tiled: BLOCK_T tokens x COLS columns per tile."""

    cols: int  # power of two
    block_t: int  # power of two
    even: bool  # cols divides the row: no column mask
    num_warps: int

    def num_tiles(self, num_tokens: int, row: int) -> int:
        return triton.cdiv(num_tokens, self.block_t) * triton.cdiv(row, self.cols)


def copy_tile(row: int, elem_size: int, device: torch.device, tile_bytes: int | None = None) -> CopyTile:
    """The tile for copying token rows of ``row`` elements of ``elem_size`` bytes.

    Compiled (or whenever ``tile_bytes`` is given): ``tile_bytes`` per tensor
    per tile (default GPU_TILE_BYTES), a whole power-of-two row per tile while
    it fits (so rows of 2^k elements need no column mask), 4 warps (8 for
    tiles over 16 KiB). Interpreted by default: one tile of up to 64K elements."""
    return _copy_tile(row, elem_size, is_interpreted(device), tile_bytes)


@functools.lru_cache(maxsize=256)  # on every launch's host path
def _copy_tile(row: int, elem_size: int, interpreted: bool, tile_bytes: int | None) -> CopyTile:
    row_pad = triton.next_power_of_2(row)
    if tile_bytes is None and interpreted:
        cols = min(row_pad, INTERPRET_TILE_ELEMS)
        block_t = max(1, min(MAX_BLOCK_T, INTERPRET_TILE_ELEMS // cols))
        return CopyTile(cols, block_t, row % cols == 0, 4)
    tile_bytes = GPU_TILE_BYTES if tile_bytes is None else tile_bytes
    elems = triton.next_power_of_2(max(1, tile_bytes // elem_size))
    cols = min(row_pad, elems)
    block_t = max(1, min(MAX_BLOCK_T, elems // cols))
    return CopyTile(cols, block_t, row % cols == 0, 8 if tile_bytes > 16384 else 4)


def pow2_alignment(*values: int, cap: int = 16) -> int:
    """The largest power of two (at most ``cap``) dividing every value: a true
    ``tl.multiple_of`` hint for any integer combination of them."""
    g = 0
    for v in values:
        g = math.gcd(g, abs(int(v)))
    if g == 0:
        return cap
    return min(cap, g & -g)


def reshape_and_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    tile_bytes: int | None = None,
) -> None:
    num_tokens, heads, head_dim = key.shape
    num_blocks, block_size = key_cache.shape[:2]
    row = heads * head_dim
    tile = copy_tile(row, key.element_size(), key.device, tile_bytes)
    grid = (tile.num_tiles(num_tokens, row),)
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
        COLS=tile.cols,
        BLOCK_T=tile.block_t,
        EVEN=tile.even,
        SRC_ALIGN=pow2_alignment(key.stride(0), value.stride(0)),
        DST_ALIGN=pow2_alignment(row),
        num_warps=tile.num_warps,
        num_stages=1,
    )
