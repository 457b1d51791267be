"""Triton paged attention (torch reference and contract: ``attention.py``).
Imported lazily: imports triton.

Two launch paths, picked from shapes alone (never from lengths on the
device), so both run under CUDA-graph capture with no host sync:

    T != B   prefill / extend / mixed steps: _paged_attention_kernel
             grid (query tiles, KV heads). A program owns BLOCK_Q consecutive
             new tokens of one sequence times the GROUP query heads of one KV
             head (BLOCK_M = BLOCK_Q * GROUP rows), so K/V are read once per
             KV head and GQA costs nothing extra. The tile count is bounded
             on the host without the lengths (T // BLOCK_Q + B); each program
             finds its sequence by binary search over ``query_start_loc`` and
             exits if it has no rows.

    T == B   decode steps (one new token per sequence): split-K
             ("flash decoding") in two kernels

             _paged_decode_kernel            part[T, Hq, S, D]    _combine_splits_kernel
             grid (T, Hkv, S): token t's  ──►  lse[T, Hq, S]   ──►  grid (T, Hq): out[t, h] =
             GROUP heads x split s of its      (fp32)               sum_s w_s part[t, h, s], with
             KV range [lo, hi)                                      w_s ~ 2^lse_s, normalised

             S = split_count(B, Hkv, SMs) is a pure function of shapes: a few
             seqs x KV heads cannot fill 132 SMs, so each program takes 1/S of
             its sequence's KV tiles, computing its own sub-range from
             seq_len in the kernel. Splits past the end of a short sequence
             are empty (lse = -inf, weight 0). S = 1 when the grid is already
             full; the combine is then a cheap copy out of fp32.

Both walk their KV range TILE_N positions at a time, looking each position's
physical block up in the block table (any block size works), and load only
positions in [lo, hi): the earliest row's window start to the last row's
position + 1. So the null block (table padding, blocks slid out of every
row's window) is never read. Softmax is online in fp32, exp2 with the scale
folded in.

Interpreted (UPCAST / INTERPRETED), loop bounds go to range() as Python ints
taken from the tensors: the interpreter of triton <= 3.6 turns a tensor bound
into an int with ``int()`` of a shape-(1,) numpy array, which NumPy >= 2.4
refuses (triton#9171), and it re-wraps every assigned value as a tensor, so
the conversion has to sit inside the range() call. Compiled, the bounds stay
tensors: a ``for`` over them is an scf.for, which triton software-pipelines
(a ``while`` would not be).
"""

from __future__ import annotations

from typing import NamedTuple

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

LOG2E = 1.4426950408889634

# Arguments that change from step to step: never specialised on (value 1,
# divisibility by 16, pointer alignment), so a batch of one sequence, a
# table of 16 columns or step metadata at an odd offset of the packed step
# buffer compiles nothing new.
_STEP_ARGS = ("table_ptr", "qsl_ptr", "seq_lens_ptr", "num_seqs", "window", "table_stride")


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
    left = q_tile * 0  # loop-carried: an i32 tensor from the start (num_seqs may
    right = left + num_seqs  # be a constant where a caller compiles it as one)
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
    kv_begin = (lo // TILE_N) * TILE_N
    kv_end = hi
    # UPCAST is set exactly when interpreted: there range() takes Python ints (module docstring)
    for tile_start in range(kv_begin.handle.data.item() if UPCAST else kv_begin,
                            kv_end.handle.data.item() if UPCAST else kv_end, TILE_N):
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


paged_attention_kernel = LazyKernel(_paged_attention_kernel, do_not_specialize=_STEP_ARGS)


def _paged_decode_kernel(
    part_ptr,
    lse_ptr,
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    table_ptr,
    qsl_ptr,
    seq_lens_ptr,
    scale_log2,
    num_seqs,
    window,
    num_splits,
    q_stride_t,
    q_stride_h,
    block_stride,
    table_stride,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Token t (axis 0) x KV head (axis 1) x split (axis 2). Writes, for the
    GROUP query heads h of the KV head, part[t, h, split, :] (the split's
    softmax-weighted V, normalised) and lse[t, h, split] (log2 of its sum of
    exp2 scores; -inf when the split is empty)."""
    tok = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Decode: token t is sequence t's only new token. Any other layout with
    # T == B (some sequences with none, others with several) searches for
    # the last sequence whose first token is <= t.
    seq = tok
    q_start = tl.load(qsl_ptr + tok)
    q_end = tl.load(qsl_ptr + tok + 1)
    if (q_start != tok) | (q_end != tok + 1):
        left = tok * 0  # loop-carried: an i32 tensor from the start
        right = left + num_seqs
        while left < right:
            mid = (left + right) // 2
            if tl.load(qsl_ptr + mid) <= tok:
                left = mid + 1
            else:
                right = mid
        seq = left - 1
        q_start = tl.load(qsl_ptr + seq)
        q_end = tl.load(qsl_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_pos = seq_len - (q_end - q_start) + (tok - q_start)
    hi = tl.maximum(q_pos + 1, 0)  # never negative: // and cdiv below round differently there
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(q_pos - window + 1, 0)

    # This split's share of the KV tiles [lo // TILE_N, cdiv(hi, TILE_N)).
    # (cdiv by hand: tl.cdiv is a @jit function, see the import of _sum_combine.)
    first_tile = lo // TILE_N
    tiles_per_split = ((hi + TILE_N - 1) // TILE_N - first_tile + num_splits - 1) // num_splits
    kv_begin = (first_tile + split * tiles_per_split) * TILE_N
    kv_end = tl.minimum(hi, kv_begin + tiles_per_split * TILE_N)

    rows = tl.arange(0, BLOCK_M)  # query heads of the group; BLOCK_M >= 16 for tl.dot
    head = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + tok.to(tl.int64) * q_stride_t + (head * q_stride_h)[:, None] + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if INTERPRETED:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0.0, tl.float32)
    table_row = table_ptr + seq.to(tl.int64) * table_stride
    head_off = kv_head * HEAD_DIM
    for tile_start in range(kv_begin.handle.data.item() if INTERPRETED else kv_begin,
                            kv_end.handle.data.item() if INTERPRETED else kv_end, TILE_N):
        kv_pos = tile_start + tl.arange(0, TILE_N)
        kv_ok = (kv_pos >= lo) & (kv_pos < hi)  # every row sees the same positions
        block = tl.load(table_row + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        kv_off = block * block_stride + (kv_pos % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM) + head_off
        k = tl.load(key_cache_ptr + kv_off[None, :] + dims[:, None], mask=kv_ok[None, :] & dim_ok[:, None],
                    other=0.0)  # [D, N]
        v = tl.load(value_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_ok[:, None] & dim_ok[None, :],
                    other=0.0)  # [N, D]
        if INTERPRETED:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if q.dtype == tl.float32:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = tl.where(kv_ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _elementwise_max))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
        if v.dtype == tl.float32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    empty = l_i == 0.0  # an empty split: nothing to weigh
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))
    part_row = (tok.to(tl.int64) * (NUM_KV_HEADS * GROUP) + head) * num_splits + split
    tl.store(part_ptr + part_row[:, None] * HEAD_DIM + dims[None, :], acc / l_safe[:, None],
             mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(lse_ptr + part_row, lse, mask=row_ok)


paged_decode_kernel = LazyKernel(_paged_decode_kernel, do_not_specialize=(*_STEP_ARGS, "num_splits"))


def _combine_splits_kernel(
    out_ptr,
    part_ptr,
    lse_ptr,
    num_splits,
    o_stride_t,
    o_stride_h,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """Token t (axis 0) x query head h (axis 1): out[t, h] = the splits'
    partials weighted by 2^lse (relative to their max), normalised."""
    tok = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    row = (tok.to(tl.int64) * NUM_Q_HEADS + head) * num_splits + splits
    lse = tl.load(lse_ptr + row, mask=split_ok, other=float("-inf"))
    m = tl.reduce(lse, 0, _elementwise_max)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # 0 for empty splits
    total = tl.reduce(w, 0, _sum_combine)
    part = tl.load(part_ptr + row[:, None] * HEAD_DIM + dims[None, :], mask=split_ok[:, None] & dim_ok[None, :],
                   other=0.0)
    o = tl.reduce(part * w[:, None], 0, _sum_combine) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + tok.to(tl.int64) * o_stride_t + head * o_stride_h + dims, o.to(out_ptr.dtype.element_ty),
             mask=dim_ok)


combine_splits_kernel = LazyKernel(_combine_splits_kernel, do_not_specialize=("num_splits",))

# The combine kernel always pads to this many splits (masked), so it compiles
# once per head size whatever the batch size.
MAX_SPLITS = 32
# split_count aims for at least this many decode programs per SM: a few
# resident per SM keep enough K/V loads in flight to stream at full bandwidth.
PROGRAMS_PER_SM = 4


class DecodePlan(NamedTuple):
    """Launch shape of a decode step (see ``decode_plan``)."""

    num_splits: int
    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int


def split_count(num_seqs: int, kv_heads: int, num_sms: int, programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """KV splits per decode token: the smallest power of two (at most
    MAX_SPLITS) that gives ``num_seqs * kv_heads * splits >= programs_per_sm
    * num_sms``. Shapes only, so a graph captured for a batch size is right
    for any lengths; a power of two, so few distinct launches exist."""
    splits = 1
    while splits < MAX_SPLITS and num_seqs * kv_heads * splits < programs_per_sm * num_sms:
        splits *= 2
    return splits


def decode_plan(
    num_seqs: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    num_sms: int | None,
    *,
    num_splits: int | None = None,
    tile_n: int | None = None,
) -> DecodePlan:
    """Splits and tiles of a decode step. ``num_sms`` None means the
    interpreter: no split unless forced, and large KV tiles (it pays per
    program step, not per element). On a GPU the KV tile holds 16 KB of K
    (and of V) per program step: 128 positions at D <= 64, 64 above.
    ``num_splits`` / ``tile_n`` force a value (tests, tuning)."""
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if tile_n is not None and (tile_n < 16 or tile_n & (tile_n - 1)):
        raise ValueError(f"tile_n must be a power of two >= 16, got {tile_n}")
    block_m = max(16, triton.next_power_of_2(q_heads // kv_heads))
    if num_sms is None:
        return DecodePlan(num_splits or 1, block_m, tile_n or 128, num_warps=4, num_stages=1)
    splits = num_splits or split_count(num_seqs, kv_heads, num_sms)
    return DecodePlan(splits, block_m, tile_n or (128 if head_dim <= 64 else 64), num_warps=4, num_stages=3)


def varlen_tiles(group: int, interpreted: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_Q, TILE_N) of prefill/extend steps: 64 rows (at least
    one token's GROUP heads). The interpreter takes larger KV tiles."""
    block_m = max(64, triton.next_power_of_2(group))
    return block_m, block_m // group, 128 if interpreted else 64


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
    *,
    split_decode: bool = False,
    num_splits: int | None = None,
    tile_n: int | None = None,
) -> None:
    """Launch on already checked arguments (``attention.paged_attention``).
    Decode steps run the split-K kernels with ``split_decode`` (or a forced
    ``num_splits`` / ``tile_n``), else the varlen kernel with decode tiles
    (16 rows: one token's GQA group, or a few tokens)."""
    num_tokens, q_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    interpreted = is_interpreted(query.device)
    if num_tokens == num_seqs and not (split_decode or num_splits is not None or tile_n is not None):
        _launch_varlen(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                       sliding_window, out, interpreted, decode=True)
        return
    if num_tokens != num_seqs:
        if num_splits is not None or tile_n is not None:
            raise ValueError("num_splits and tile_n apply to decode steps (as many tokens as sequences) only")
        _launch_varlen(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                       sliding_window, out, interpreted)
        return
    num_sms = None if interpreted else torch.cuda.get_device_properties(query.device).multi_processor_count
    plan = decode_plan(num_seqs, q_heads, key_cache.shape[2], head_dim, num_sms, num_splits=num_splits,
                       tile_n=tile_n)
    launch_decode(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window,
                  out, plan, interpreted)


def launch_decode(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, window, out,
                  plan: DecodePlan, interpreted: bool) -> None:
    """A decode step (T == B) with an explicit plan, on checked arguments
    (``paged_attention_triton`` picks the plan; tuning tools pass their own)."""
    num_tokens, q_heads, head_dim = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    if not 1 <= plan.num_splits <= MAX_SPLITS:  # the combine kernel reads at most MAX_SPLITS
        raise ValueError(f"plan.num_splits must be in [1, {MAX_SPLITS}], got {plan.num_splits}")
    # Scratch per call: under CUDA-graph capture it comes from the graph's pool.
    part = torch.empty((num_tokens, q_heads, plan.num_splits, head_dim), dtype=torch.float32, device=query.device)
    lse = torch.empty((num_tokens, q_heads, plan.num_splits), dtype=torch.float32, device=query.device)
    paged_decode_kernel.for_device(query.device)[(num_tokens, kv_heads, plan.num_splits)](
        part,
        lse,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * LOG2E,
        seq_lens.shape[0],
        window or 0,
        plan.num_splits,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        block_tables.stride(0),
        NUM_KV_HEADS=kv_heads,
        GROUP=q_heads // kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=plan.block_m,
        TILE_N=plan.tile_n,
        HAS_WINDOW=window is not None,
        INTERPRETED=interpreted,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    combine_splits_kernel.for_device(query.device)[(num_tokens, q_heads)](
        out,
        part,
        lse,
        plan.num_splits,
        out.stride(0),
        out.stride(1),
        NUM_Q_HEADS=q_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        SPLITS_PAD=MAX_SPLITS,
        num_warps=4,
    )


def _launch_varlen(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, window, out,
                   interpreted: bool, decode: bool = False) -> None:
    num_tokens, q_heads, head_dim = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    group = q_heads // kv_heads
    block_m, block_q, tile_n = varlen_tiles(group, interpreted)
    if decode:  # one token per sequence: a tile of 16 rows, not 64 mostly masked ones
        block_m = max(16, triton.next_power_of_2(group))
        block_q = block_m // group
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
        window or 0,
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
        HAS_WINDOW=window is not None,
        UPCAST=interpreted,
    )
