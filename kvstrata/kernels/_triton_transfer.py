"""Triton kernel for gather/scatter between the paged cache and chunk buffers
(torch reference and contract: ``transfer.py``). Imported lazily: imports triton.

One kernel does both directions. The work is a flat list of tiles,

    tile = (layer * 2 + kv, token tile, column chunk)      layer*2+kv outermost

each tile BLOCK_T token rows x COLS columns of one layer's K or V (the tiling
of ``copy_tile``: 4 KiB, 32 KiB in a bounded grid, 16-byte vectors, no column
mask for rows of 2^k elements). The chunk [L, 2, n, row] is contiguous in exactly that order, so
consecutive programs stream through it. Several chunks at once (segments,
``transfer.gather_kv_segments``): [S, L, 2, n, row], token t of the slot
mapping in segment t // n; a segment's rows sit ``seg_stride`` elements
after the previous one's. Layers are addressed as element
offsets from layer 0's key cache: when every layer sits at a uniform distance
(both layouts of ``layout.py`` do) all layers go in one launch; otherwise one
launch per layer.

Programs stride over the tiles by the grid size: the ordinary grid has one
program per tile; ``max_programs`` bounds the grid to a few programs that
loop (a "persistent" copy on a few SMs; ``streams.py`` says how it fares
beside a forward pass).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstrata.kernels._triton_cache_write import BOUNDED_TILE_BYTES, copy_tile, pow2_alignment
from kvstrata.kernels.dispatch import LazyKernel, is_interpreted


def _transfer_kernel(
    cache_ptr,
    chunk_ptr,
    slot_ptr,
    num_tokens,
    num_slots,
    seg_tokens,
    seg_stride,
    layer_stride,
    kv_stride,
    block_stride,
    BLOCK_SIZE: tl.constexpr,
    ROW: tl.constexpr,
    COLS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    EVEN: tl.constexpr,
    NUM_LKV: tl.constexpr,
    ALIGN: tl.constexpr,
    TO_CACHE: tl.constexpr,
    SEGMENTED: tl.constexpr,
):
    NCOL: tl.constexpr = (ROW + COLS - 1) // COLS
    per_lkv = (num_tokens + BLOCK_T - 1) // BLOCK_T * NCOL  # tiles of one layer's K (or V)
    tile = tl.program_id(0)
    while tile < per_lkv * NUM_LKV:  # not range(): the interpreter can't index with its 1-element tensors
        lkv = tile // per_lkv
        rest = tile - lkv * per_lkv
        tok = (rest // NCOL) * BLOCK_T + tl.arange(0, BLOCK_T)
        col = (rest % NCOL) * COLS + tl.max_contiguous(tl.multiple_of(tl.arange(0, COLS), COLS), COLS)
        in_range = tok < num_tokens
        slot = tl.load(slot_ptr + tok, mask=in_range, other=-1).to(tl.int64)
        keep = (slot >= 0) & (slot < num_slots)
        # One int64 row offset per token on each side. Cache rows start at
        # multiples of ROW (the block stride is a whole number of rows), chunk
        # rows trivially so; ALIGN divides ROW and both layer offsets.
        lkv64 = lkv.to(tl.int64)
        cache_row = tl.multiple_of((slot // BLOCK_SIZE) * block_stride + (slot % BLOCK_SIZE) * ROW, ALIGN)
        if SEGMENTED:
            seg = tok // seg_tokens
            pos = (tok - seg * seg_tokens).to(tl.int64)
            chunk_row = tl.multiple_of(seg.to(tl.int64) * seg_stride + (lkv64 * seg_tokens + pos) * ROW, ALIGN)
        else:  # one chunk (seg_tokens == num_tokens): no division
            chunk_row = tl.multiple_of((lkv64 * num_tokens + tok) * ROW, ALIGN)
        cache_base = cache_ptr + tl.multiple_of((lkv64 // 2) * layer_stride + (lkv64 % 2) * kv_stride, ALIGN)
        cache_ptrs = cache_base + cache_row[:, None] + col[None, :]
        chunk_ptrs = chunk_ptr + chunk_row[:, None] + col[None, :]
        if EVEN:
            keep_mask = keep[:, None]
            row_mask = in_range[:, None]
        else:
            col_ok = (col < ROW)[None, :]
            keep_mask = keep[:, None] & col_ok
            row_mask = in_range[:, None] & col_ok
        if TO_CACHE:
            x = tl.load(chunk_ptrs, mask=keep_mask)
            tl.store(cache_ptrs, x, mask=keep_mask)
        else:
            # padding slots read as zeros, so the chunk is fully defined
            x = tl.load(cache_ptrs, mask=keep_mask, other=0.0)
            tl.store(chunk_ptrs, x, mask=row_mask)
        tile += tl.num_programs(0)


transfer_kernel = LazyKernel(_transfer_kernel, do_not_specialize=("num_tokens", "seg_tokens", "seg_stride"))


def transfer_triton(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    chunk: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    to_cache: bool,
    max_programs: int | None = None,
    tile_bytes: int | None = None,
) -> None:
    """Copy between ``chunk`` [S, L, 2, n, Hkv, D] (contiguous; S * n slots)
    and the caches' slots, with at most ``max_programs`` programs when given
    (None: one per tile). ``tile_bytes`` overrides the tile size (:func:`copy_tile`)."""
    key0 = kv_caches[0][0]
    elem = key0.element_size()
    base = key0.data_ptr()
    # element-aligned pointers of one dtype: every difference is whole elements
    assert all((t.data_ptr() - base) % elem == 0 for pair in kv_caches for t in pair)
    offsets = [((k.data_ptr() - base) // elem, (v.data_ptr() - base) // elem) for k, v in kv_caches]
    layer_stride = offsets[1][0] if len(offsets) > 1 else 0
    kv_stride = offsets[0][1]
    uniform = all(k_off == i * layer_stride and v_off - k_off == kv_stride for i, (k_off, v_off) in enumerate(offsets))
    seg_tokens = chunk.shape[3]
    seg_stride = chunk.stride(0)  # elements: a whole [L, 2, n, row] segment
    launch = dict(to_cache=to_cache, max_programs=max_programs, tile_bytes=tile_bytes)
    if uniform:
        _launch(key0, chunk, slot_mapping, len(kv_caches), layer_stride, kv_stride, seg_tokens, seg_stride, **launch)
    else:
        for layer, (k, v) in enumerate(kv_caches):
            _launch(k, chunk[:, layer], slot_mapping, 1, 0, (v.data_ptr() - k.data_ptr()) // elem, seg_tokens,
                    seg_stride, **launch)


def _launch(cache, chunk, slot_mapping, num_layers, layer_stride, kv_stride, seg_tokens, seg_stride, *, to_cache,
            max_programs, tile_bytes) -> None:
    num_blocks, block_size, heads, head_dim = cache.shape
    num_tokens = slot_mapping.shape[0]
    row = heads * head_dim
    if tile_bytes is None and max_programs is not None and not is_interpreted(cache.device):
        tile_bytes = BOUNDED_TILE_BYTES  # few programs: each must move much per step
    tile = copy_tile(row, cache.element_size(), cache.device, tile_bytes)
    num_tiles = tile.num_tiles(num_tokens, row) * 2 * num_layers
    grid = (num_tiles if max_programs is None else max(1, min(num_tiles, max_programs)),)
    transfer_kernel.for_device(cache.device)[grid](
        cache,
        chunk,
        slot_mapping,
        num_tokens,
        num_blocks * block_size,
        max(1, seg_tokens),
        seg_stride,
        layer_stride,
        kv_stride,
        cache.stride(0),
        BLOCK_SIZE=block_size,
        ROW=row,
        COLS=tile.cols,
        BLOCK_T=tile.block_t,
        EVEN=tile.even,
        NUM_LKV=2 * num_layers,
        ALIGN=pow2_alignment(row, layer_stride, kv_stride, seg_stride),
        TO_CACHE=to_cache,
        SEGMENTED=chunk.shape[0] > 1,
        num_warps=tile.num_warps,
        num_stages=1,
    )
