"""Triton paged attention, varlen prefill/extend and decode in one kernel
(torch reference and contract: ``attention.py``). Imported lazily: imports triton.

Grid: (query tiles, KV heads). A program owns BLOCK_Q consecutive new tokens
of one sequence times the GROUP query heads that share one KV head, i.e.
BLOCK_M = BLOCK_Q * GROUP rows, so K/V are read once per KV head and GQA
costs nothing extra. The number of tiles is bounded on the host without
reading the lengths (T // BLOCK_Q + B, no device sync); each program finds
its sequence by binary search over ``query_start_loc`` and exits if it has
no rows. The KV loop walks TILE_N positions at a time, looking each
position's physical block up in the block table, so any block size works.

Only positions in [lo, hi) are ever loaded, where lo is the earliest row's
window start and hi the last row's position + 1: the null block (which
stands for blocks that slid out of every row's window, or pads the table) is
never read. Softmax is online in fp32 (exp2 with the scale folded in).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Reductions go through tl.reduce with triton's own combine functions rather
# than tl.max/tl.sum: those are @jit functions, fixed as compiled or
# interpreted when triton is first imported, while tl.reduce is a builtin
# that both modes handle (the interpreter maps these two to numpy). This is
# what lets one kernel source run compiled on CUDA and interpreted on CPU in
# the same process, whatever TRITON_INTERPRET was at import time.
from triton.language.standard import _elementwise_max, _sum_combine

from kvstrata.kernels.dispatch import LazyKernel, is_interpreted


def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    table_ptr,
    qsl_ptr,
    seq_lens_ptr,
    scale_log2,
    num_seqs,
    window,
    q_stride_t,
    q_stride_h,
    o_stride_t,
    o_stride_h,
    block_stride,
    table_stride,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
):
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Sequence b's tiles start at qsl[b] // BLOCK_Q + b (an over-allocation
    # that needs no host-side lengths); find the last b whose start <= q_tile.
    left = q_tile * 0  # loop-carried: an i32 tensor from the start, even when
    right = left + num_seqs  # num_seqs == 1 is specialised to a constant
    while left < right:
        mid = (left + right) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if start <= q_tile:
            left = mid + 1
        else:
            right = mid
    seq = left - 1
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    tile_in_seq = q_tile - (q_start // BLOCK_Q + seq)
    if tile_in_seq * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    tok = tile_in_seq * BLOCK_Q + rows // GROUP  # token index within the seq's new tokens
    head = kv_head * GROUP + rows % GROUP
    # BLOCK_M is a power of two; when GROUP is not, the last rows would spill
    # into the next tile's first token (and see too short a KV range): mask them.
    row_ok = (tok < q_len) & (rows < BLOCK_Q * GROUP)
    q_pos = seq_len - q_len + tok
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM

    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + (q_rows * q_stride_t + head * q_stride_h)[:, None] + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    first_pos = seq_len - q_len + tile_in_seq * BLOCK_Q
    hi = tl.minimum(seq_len, first_pos + BLOCK_Q)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, first_pos - window + 1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0.0, tl.float32)
    table_row = table_ptr + seq.to(tl.int64) * table_stride
    head_off = kv_head * HEAD_DIM
    for tile_start in range((lo // TILE_N) * TILE_N, hi, TILE_N):
        kv_pos = tile_start + tl.arange(0, TILE_N)
        kv_ok = (kv_pos >= lo) & (kv_pos < hi)
        block = tl.load(table_row + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        kv_off = block * block_stride + (kv_pos % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM) + head_off
        k = tl.load(key_cache_ptr + kv_off[None, :] + dims[:, None], mask=kv_ok[None, :] & dim_ok[:, None],
                    other=0.0)  # [D, N]
        v = tl.load(value_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_ok[:, None] & dim_ok[None, :],
                    other=0.0)  # [N, D]
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if q.dtype == tl.float32:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        visible = row_ok[:, None] & kv_ok[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (kv_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _elementwise_max))
        # rows with nothing visible yet keep m = -inf; shift them by 0 instead
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
        if v.dtype == tl.float32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_i[:, None]
    tl.store(
        out_ptr + (q_rows * o_stride_t + head * o_stride_h)[:, None] + dims[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


paged_attention_kernel = LazyKernel(_paged_attention_kernel)

LOG2E = 1.4426950408889634


def attention_tiles(num_tokens: int, num_seqs: int, group: int, interpreted: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_Q, TILE_N). Decode (T == B, one token per seq) packs
    the GQA group into 16 rows; prefill/extend uses 64 rows. The interpreter
    takes larger KV tiles: it pays per program step, not per element."""
    decode = num_tokens == num_seqs
    block_m = max(16 if decode else 64, triton.next_power_of_2(group))
    tile_n = 128 if interpreted else 64
    return block_m, block_m // group, tile_n


def paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
) -> None:
    num_tokens, q_heads, head_dim = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    group = q_heads // kv_heads
    interpreted = is_interpreted(query.device)
    block_m, block_q, tile_n = attention_tiles(num_tokens, num_seqs, group, interpreted)
    grid = (num_tokens // block_q + num_seqs, kv_heads)
    paged_attention_kernel.for_device(query.device)[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * LOG2E,
        num_seqs,
        sliding_window or 0,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        block_tables.stride(0),
        NUM_KV_HEADS=kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        HAS_WINDOW=sliding_window is not None,
        UPCAST=interpreted,
    )
