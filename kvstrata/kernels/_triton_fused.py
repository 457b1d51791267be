"""Triton kernels of the fused decoder-layer ops (torch references and
contracts: ``fused.py``). Imported lazily by the dispatcher: imports triton.

Every kernel computes in fp32 and rounds to the model dtype exactly where the
unfused torch code rounds (each torch op on fp16/bf16 tensors computes in
fp32 and rounds its result), so the fused result is that of the torch
sequence up to the fp32 reduction order of the norm and the fp32 ``exp`` of
SiLU. Rounding goes through ``_round``, handed to each kernel as the
constexpr ``ROUND`` (compiled or interpreted to match the kernel: a kernel
run by the interpreter cannot call a ``triton.jit`` function, and a compiled
one cannot call a plain one). The interpreter's fp32 -> bf16 cast truncates,
so there (``BF16_BITS``) bf16 rounding is done on the bits.

Tiles (elements per program) are about 2-4K on CUDA, so a row of a 2K-wide
model is one program with 16-byte loads, and small rows are packed several
to a program; the interpreter takes ~64K, since it pays per program step.
Grids depend on tensor shapes only and per-call counts are not specialised
on, so the launches can be captured in CUDA graphs and warmed up once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# tl.reduce with triton's combine function, not tl.sum: see _triton_attention.py.
from triton.language.standard import _sum_combine

from kvstrata.kernels.dispatch import LazyKernel, is_interpreted

# Memory-bound kernels: fp-contraction would only change the rounding
# (x1*cos - x2*sin must round both products, as torch does).
_LAUNCH_OPTIONS = {"enable_fp_fusion": False}


def _round(x, DT: tl.constexpr, BF16_BITS: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even in ``DT``, returned as fp32."""
    if DT == tl.float32:
        y = x
    elif BF16_BITS:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = bits.to(tl.float32, bitcast=True)
    else:
        y = x.to(DT).to(tl.float32)
    return y


round_fn = LazyKernel(_round)


def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    num_rows,
    x_stride,
    res_stride,
    out_stride,
    res_out_stride,
    eps,
    H: tl.constexpr,
    H_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STORE_RESIDUAL: tl.constexpr,
    ROUND: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    DT: tl.constexpr = x_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, H_PAD)
    col_ok = cols < H
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    rows = rows.to(tl.int64)
    s = tl.load(x_ptr + (rows * x_stride)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + (rows * res_stride)[:, None] + cols[None, :], mask=mask, other=0.0)
        s = ROUND(s + r.to(tl.float32), DT, BF16_BITS)
    if STORE_RESIDUAL:
        tl.store(res_out_ptr + (rows * res_out_stride)[:, None] + cols[None, :], s.to(DT), mask=mask)
    var = tl.reduce(s * s, 1, _sum_combine) / H
    rstd = tl.rsqrt(var + eps)  # approximate on CUDA, like torch's rsqrtf there
    normed = ROUND(s * rstd[:, None], DT, BF16_BITS)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = ROUND(normed * w[None, :], DT, BF16_BITS)
    tl.store(out_ptr + (rows * out_stride)[:, None] + cols[None, :], y.to(DT), mask=mask)


add_rms_norm_kernel = LazyKernel(_add_rms_norm_kernel, do_not_specialize=("num_rows",))


def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    num_rows,
    x_stride,
    out_stride,
    I: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ROUND: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    DT: tl.constexpr = x_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < num_rows)[:, None] & (cols < I)[None, :]
    rows = rows.to(tl.int64)
    gate_ptrs = x_ptr + (rows * x_stride)[:, None] + cols[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + I, mask=mask, other=0.0).to(tl.float32)
    act = ROUND(gate / (1.0 + tl.exp(-gate)), DT, BF16_BITS)
    y = ROUND(act * up, DT, BF16_BITS)
    tl.store(out_ptr + (rows * out_stride)[:, None] + cols[None, :], y.to(DT), mask=mask)


silu_and_mul_kernel = LazyKernel(_silu_and_mul_kernel, do_not_specialize=("num_rows",))


def _rotary_and_cache_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    q_out_ptr,
    num_tokens,
    num_slots,
    q_stride,
    k_stride,
    v_stride,
    cs_stride,
    q_out_stride,
    block_stride,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
    VROW_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ROUND: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    """Program (t, h) rotates HEAD_BLOCK heads of BLOCK_T tokens: q heads
    for h < Q_BLOCKS (into q_out), else k heads (into their cache slots);
    program (t, Q_BLOCKS) also copies the tokens' v rows to the cache.

    Which of q or k a program works on is chosen with scalar selects of base
    pointers and strides (never a select of pointer tensors, which would
    cost the compiler its proof of 16-byte alignment and so the wide loads).
    """
    DT: tl.constexpr = q_ptr.dtype.element_ty
    HALF: tl.constexpr = D // 2
    ROW: tl.constexpr = HKV * D
    Q_BLOCKS: tl.constexpr = (HQ + HEAD_BLOCK - 1) // HEAD_BLOCK
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < num_tokens
    slot = tl.load(slot_ptr + tok, mask=tok_ok, other=-1).to(tl.int64)
    # negative slots are padding; slots past the cache are dropped, not written
    keep = tok_ok & (slot >= 0) & (slot < num_slots)
    tok = tok.to(tl.int64)

    hb = tl.program_id(1)
    is_q = hb < Q_BLOCKS
    src_ptr = tl.where(is_q, q_ptr, k_ptr)
    src_stride = tl.where(is_q, q_stride, k_stride)
    dst_ptr = tl.where(is_q, q_out_ptr, key_cache_ptr)
    # destination row: q_out row t, or the cache row of slot t
    dst_t_stride = tl.where(is_q, q_out_stride, 0)
    dst_block_stride = tl.where(is_q, 0, block_stride)
    dst_row_stride = tl.where(is_q, 0, ROW)
    dst_row = tok * dst_t_stride + slot // BLOCK_SIZE * dst_block_stride + slot % BLOCK_SIZE * dst_row_stride
    row_ok = tl.where(is_q, tok_ok, keep)
    num_heads = tl.where(is_q, HQ, HKV)
    head0 = tl.where(is_q, hb, hb - Q_BLOCKS) * HEAD_BLOCK

    # [BLOCK_T, HEAD_BLOCK, HALF_PAD] tiles of the first and second halves
    head = (head0 + tl.arange(0, HEAD_BLOCK))[None, :, None]
    j = tl.arange(0, HALF_PAD)[None, None, :]
    j_ok = j < HALF
    col = head * D + j
    x_ptrs = src_ptr + (tok * src_stride)[:, None, None] + col
    x_ok = tok_ok[:, None, None] & (head < num_heads) & j_ok
    x1 = tl.load(x_ptrs, mask=x_ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptrs + HALF, mask=x_ok, other=0.0).to(tl.float32)
    cs_off = (tok * cs_stride)[:, None, None] + j
    cs_ok = tok_ok[:, None, None] & j_ok
    cos = tl.load(cos_ptr + cs_off, mask=cs_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + cs_off, mask=cs_ok, other=0.0).to(tl.float32)
    # apply_rotary: cat(x1*cos - x2*sin, x2*cos + x1*sin), every op rounded
    o1 = ROUND(ROUND(x1 * cos, DT, BF16_BITS) - ROUND(x2 * sin, DT, BF16_BITS), DT, BF16_BITS)
    o2 = ROUND(ROUND(x2 * cos, DT, BF16_BITS) + ROUND(x1 * sin, DT, BF16_BITS), DT, BF16_BITS)
    dst_ptrs = dst_ptr + dst_row[:, None, None] + col
    dst_ok = row_ok[:, None, None] & (head < num_heads) & j_ok
    tl.store(dst_ptrs, o1.to(DT), mask=dst_ok)
    tl.store(dst_ptrs + HALF, o2.to(DT), mask=dst_ok)

    if hb == Q_BLOCKS:
        vcol = tl.arange(0, VROW_PAD)
        v_ok = keep[:, None] & (vcol < ROW)[None, :]
        v = tl.load(v_ptr + (tok * v_stride)[:, None] + vcol[None, :], mask=v_ok)
        cache_row = slot // BLOCK_SIZE * block_stride + slot % BLOCK_SIZE * ROW
        tl.store(value_cache_ptr + cache_row[:, None] + vcol[None, :], v, mask=v_ok)


rotary_and_cache_kernel = LazyKernel(_rotary_and_cache_kernel, do_not_specialize=("num_tokens", "slot_ptr"))  # as reshape_and_cache's


def _budget(device: torch.device, cuda: int) -> int:
    """Elements per program: ``cuda`` compiled, 64K in the interpreter."""
    return 65536 if is_interpreted(device) else cuda


def _num_warps(elements: int) -> int:
    """4 warps up to 2K elements, then one more warp per 512, at most 16."""
    return max(4, min(16, elements // 512))


def _statics(t: torch.Tensor) -> dict:
    device = t.device
    return dict(ROUND=round_fn.for_device(device),
                BF16_BITS=is_interpreted(device) and t.dtype == torch.bfloat16)


def add_rms_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual_out: torch.Tensor | None,
) -> None:
    """``out`` = RMSNorm(s), ``residual_out`` = s (if given), s = residual + x (or x)."""
    num_rows, hidden = x.shape
    h_pad = triton.next_power_of_2(hidden)
    block_t = max(1, _budget(x.device, 2048) // h_pad)
    grid = (triton.cdiv(num_rows, block_t),)
    add_rms_norm_kernel.for_device(x.device)[grid](
        x,
        x if residual is None else residual,
        weight,
        out,
        out if residual_out is None else residual_out,
        num_rows,
        x.stride(0),
        0 if residual is None else residual.stride(0),
        out.stride(0),
        0 if residual_out is None else residual_out.stride(0),
        float(eps),
        H=hidden,
        H_PAD=h_pad,
        BLOCK_T=block_t,
        HAS_RESIDUAL=residual is not None,
        STORE_RESIDUAL=residual_out is not None,
        num_warps=_num_warps(block_t * h_pad),
        **_statics(x),
        **_LAUNCH_OPTIONS,
    )


def silu_and_mul_triton(x: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` = silu(x[:, :I]) * x[:, I:]."""
    num_rows, inter = out.shape
    budget = _budget(x.device, 4096)
    # CUDA: 1K-column strips, 4 rows of them; interpreter: whole rows
    block_c = min(triton.next_power_of_2(inter), budget if is_interpreted(x.device) else 1024)
    block_t = max(1, budget // block_c)
    grid = (triton.cdiv(num_rows, block_t), triton.cdiv(inter, block_c))
    silu_and_mul_kernel.for_device(x.device)[grid](
        x,
        out,
        num_rows,
        x.stride(0),
        out.stride(0),
        I=inter,
        BLOCK_T=block_t,
        BLOCK_C=block_c,
        num_warps=_num_warps(block_t * block_c // 2),
        **_statics(x),
        **_LAUNCH_OPTIONS,
    )


def rotary_and_cache_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_out: torch.Tensor,
) -> None:
    """``q_out`` = rotated q; rotated k and v written to the caches' slots."""
    num_tokens, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    num_blocks, block_size = key_cache.shape[:2]
    half_pad = triton.next_power_of_2(head_dim // 2)
    budget = _budget(q.device, 1024)  # (x1, x2) pairs per program
    # q and k blocks of one size, no wider than k's heads: few masked lanes
    head_block = min(triton.next_power_of_2(kv_heads), max(1, budget // half_pad))
    block_t = max(1, budget // (head_block * half_pad))
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(q_heads, head_block) + triton.cdiv(kv_heads, head_block))
    rotary_and_cache_kernel.for_device(q.device)[grid](
        q,
        k,
        v,
        cos,
        sin,
        key_cache,
        value_cache,
        slot_mapping,
        q_out,
        num_tokens,
        num_blocks * block_size,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        cos.stride(0),
        q_out.stride(0),
        key_cache.stride(0),
        HQ=q_heads,
        HKV=kv_heads,
        D=head_dim,
        HALF_PAD=half_pad,
        HEAD_BLOCK=head_block,
        VROW_PAD=triton.next_power_of_2(kv_heads * head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_T=block_t,
        num_warps=_num_warps(2 * block_t * head_block * half_pad),
        **_statics(q),
        **_LAUNCH_OPTIONS,
    )
