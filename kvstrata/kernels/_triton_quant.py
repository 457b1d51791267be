"""Triton kernel of ``quant_matmul``: out = x @ W.T + bias with W read as GGUF
blocks and dequantized on the fly (torch reference and checks:
``quant.py``). Only the dispatcher imports this module: it imports triton.

A program owns BLOCK_T tokens x BLOCK_N weight rows and walks K in tiles of
BLOCK_K (a multiple of 32). Each tile of weights is rebuilt as
[BLOCK_N, S, 32] (S = BLOCK_K / 32 groups of 32 consecutive weights; every
format's scales are constant over such a group, except Q6_K's per-16
scales): the per-group fields (d, m, the K-quants' 6-bit scales) are loaded
once per group, the quant bits once per weight, then the tile is flattened
to [BLOCK_N, BLOCK_K] in natural K order. The float32 operations and their
order are ``dequantize``'s, with fp-contraction off, so the weights are the
reference's bit for bit; only the accumulation order differs.

    small T (decode, GEMV):   acc[t, n] += sum_k x[t, k] * w[n, k]   broadcast, fp32
    large T (prefill, GEMM):  acc += tl.dot(x, w.T): bf16/fp16 operands on CUDA
                              (w rounded to x's dtype, as ``dequantize(dtype)``),
                              ieee fp32 for fp32 x (no TF32)

The interpreter computes in fp32 throughout and writes a float32 result
(the wrapper rounds it to x's dtype: the interpreter's own fp32 -> bf16 cast
truncates). Grids depend on shapes only; T is not specialised on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# tl.full / tl.reduce with triton's combine function, not tl.zeros / tl.sum:
# those are @jit functions (see _triton_attention.py).
from triton.language.standard import _sum_combine

from kvstrata.kernels.dispatch import LazyKernel, is_interpreted

_LAUNCH_OPTIONS = {"enable_fp_fusion": False}

# format codes (constexpr QT) and their (weights, bytes) per block
QT_CODES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q5_0": 3, "Q5_1": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7}


def _f16(ptr, mask):
    """The little-endian fp16 at byte ``ptr`` (any alignment), as float32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


f16_fn = LazyKernel(_f16)


def _dequant_tile(bp, sub, j, gmask, QT: tl.constexpr, F16: tl.constexpr):
    """float32 weights [BN, S, 32] of groups starting at byte ``bp`` [BN, S, 1]
    (the group's block), ``sub`` [1, S, 1]: the group's index in its block,
    ``j`` [1, 1, 32]: the weight's index in its group."""
    wmask = gmask & (j < 32)
    if QT == 0:  # Q8_0: d | int8 x32
        q = tl.load(bp + 2 + j, mask=wmask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = q * F16(bp, gmask)
    elif QT == 1 or QT == 2:  # Q4_0: d | 16 B;  Q4_1: d m | 16 B
        QS: tl.constexpr = 2 if QT == 1 else 4
        byte = tl.load(bp + QS + (j % 16), mask=wmask, other=0).to(tl.int32)
        q = (byte >> ((j // 16) * 4)) & 15
        if QT == 1:
            w = F16(bp, gmask) * (q - 8).to(tl.float32)
        else:
            w = F16(bp, gmask) * q.to(tl.float32) + F16(bp + 2, gmask)
    elif QT == 3 or QT == 4:  # Q5_0: d | qh | 16 B;  Q5_1: d m | qh | 16 B
        QH: tl.constexpr = 2 if QT == 3 else 4
        byte = tl.load(bp + QH + 4 + (j % 16), mask=wmask, other=0).to(tl.int32)
        hbyte = tl.load(bp + QH + j // 8, mask=wmask, other=0).to(tl.int32)
        q = ((byte >> ((j // 16) * 4)) & 15) | (((hbyte >> (j % 8)) & 1) << 4)
        if QT == 3:
            w = F16(bp, gmask) * (q - 16).to(tl.float32)
        else:
            w = F16(bp, gmask) * q.to(tl.float32) + F16(bp + 2, gmask)
    elif QT == 5 or QT == 6:  # Q4_K / Q5_K: d dmin | 12 B scales | (qh 32 B) | 128 B
        i = sub % 4
        a = tl.load(bp + 4 + i, mask=gmask, other=0).to(tl.int32)  # 6-bit sc (low), sc/sm high bits
        b = tl.load(bp + 8 + i, mask=gmask, other=0).to(tl.int32)  # 6-bit min (low), min high bits
        c = tl.load(bp + 12 + i, mask=gmask, other=0).to(tl.int32)  # the high groups' low nibbles
        sc = tl.where(sub < 4, a & 63, (c & 15) | ((a >> 2) & 48))
        mn = tl.where(sub < 4, b & 63, (c >> 4) | ((b >> 2) & 48))
        dd = F16(bp, gmask) * sc.to(tl.float32)
        dm = F16(bp + 2, gmask) * mn.to(tl.float32)
        QS: tl.constexpr = 16 if QT == 5 else 48
        byte = tl.load(bp + QS + (sub // 2) * 32 + j, mask=wmask, other=0).to(tl.int32)
        q = (byte >> ((sub % 2) * 4)) & 15
        if QT == 6:
            hbyte = tl.load(bp + 16 + j, mask=wmask, other=0).to(tl.int32)
            q = q | (((hbyte >> sub) & 1) << 4)
        w = dd * q.to(tl.float32) - dm
    else:  # Q6_K: ql 128 B | qh 64 B | int8 scales x16 | d;  group sub = 4h + r
        h = sub // 4
        r = sub % 4
        lo = tl.load(bp + 64 * h + 32 * (r % 2) + j, mask=wmask, other=0).to(tl.int32)
        hi = tl.load(bp + 128 + 32 * h + j, mask=wmask, other=0).to(tl.int32)
        q = (((lo >> ((r // 2) * 4)) & 15) | (((hi >> (2 * r)) & 3) << 4)) - 32
        scale = tl.load(bp + 192 + 2 * sub + j // 16, mask=wmask, other=0).to(tl.int8, bitcast=True)
        dd = F16(bp + 208, gmask) * scale.to(tl.float32)
        w = dd * q.to(tl.float32)
    return w


dequant_tile_fn = LazyKernel(_dequant_tile)


def _quant_matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    num_tokens,
    x_stride,
    out_stride,
    N: tl.constexpr,
    K: tl.constexpr,
    QT: tl.constexpr,
    QK: tl.constexpr,
    TS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_DT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    F16: tl.constexpr,
    DEQUANT: tl.constexpr,
):
    S: tl.constexpr = BLOCK_K // 32
    ROW_BYTES: tl.constexpr = K // QK * TS
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    toks = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < N
    tok_ok = toks < num_tokens
    row_base = w_ptr + (rows.to(tl.int64) * ROW_BYTES)[:, None, None]  # [BN, 1, 1]
    x_rows = x_ptr + toks.to(tl.int64)[:, None] * x_stride  # [BT, 1]
    g = tl.arange(0, S)[None, :, None]  # [1, S, 1] group of the tile
    j = tl.arange(0, 32)[None, None, :]  # [1, 1, 32]
    kk = tl.arange(0, BLOCK_K)
    acc = tl.full((BLOCK_T, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_group = k0 + 32 * g  # first weight of each group
        gmask = row_ok[:, None, None] & (k_group < K)
        bp = row_base + (k_group // QK) * TS
        w = DEQUANT(bp, (k_group % QK) // 32, j, gmask, QT, F16)
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))
        k_ok = (k0 + kk) < K
        x = tl.load(x_rows + (k0 + kk)[None, :], mask=tok_ok[:, None] & k_ok[None, :], other=0.0)
        if USE_DOT:
            if DOT_DT == tl.float32:
                acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x.to(DOT_DT), tl.trans(w.to(DOT_DT)))
        else:
            acc += tl.reduce(x.to(tl.float32)[:, None, :] * w[None, :, :], 2, _sum_combine)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + toks.to(tl.int64)[:, None] * out_stride + rows[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=tok_ok[:, None] & row_ok[None, :])


quant_matmul_kernel = LazyKernel(_quant_matmul_kernel, do_not_specialize=("num_tokens",))


def _dequant_rows_kernel(
    w_ptr,
    out_ptr,
    first_row,
    num_rows,
    K: tl.constexpr,
    QK: tl.constexpr,
    QT: tl.constexpr,
    TS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    F16: tl.constexpr,
    DEQUANT: tl.constexpr,
):
    """out [num_rows, K] (out's dtype) = rows first_row.. of the weight: ``dequantize``'s
    float32 values (the same DEQUANT as the matmul's), rounded once to out's dtype."""
    S: tl.constexpr = BLOCK_K // 32
    ROW_BYTES: tl.constexpr = K // QK * TS
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    row_base = w_ptr + ((first_row + rows).to(tl.int64) * ROW_BYTES)[:, None, None]  # [BN, 1, 1]
    k_group = tl.program_id(1) * BLOCK_K + 32 * tl.arange(0, S)[None, :, None]  # [1, S, 1]
    gmask = row_ok[:, None, None] & (k_group < K)
    w = DEQUANT(row_base + (k_group // QK) * TS, (k_group % QK) // 32, tl.arange(0, 32)[None, None, :], gmask, QT,
                F16)
    kk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ptrs = out_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :]
    tl.store(ptrs, tl.reshape(w, (BLOCK_N, BLOCK_K)).to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (kk < K)[None, :])


dequant_rows_kernel = LazyKernel(_dequant_rows_kernel, do_not_specialize=("first_row", "num_rows"))

_DOT_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}

# Tokens up to this count take the GEMV tiles on CUDA (memory-bound decode batches).
GEMV_MAX_TOKENS = 8


def tiles(num_tokens: int, n: int, k: int, interpreted: bool) -> dict:
    """BLOCK_T / BLOCK_N / BLOCK_K / USE_DOT and launch options for one call."""
    k_tile = min(256, triton.next_power_of_2(k))
    if interpreted:  # few, large program steps: the interpreter pays per step
        bt = min(64, triton.next_power_of_2(num_tokens))
        return dict(BLOCK_T=bt, BLOCK_N=64, BLOCK_K=k_tile, USE_DOT=bt >= 16, num_warps=4)
    if num_tokens <= GEMV_MAX_TOKENS:
        bt = triton.next_power_of_2(num_tokens)
        bn = 16 if n <= 8192 else 32
        # the broadcast product is BT x BN x BK fp32: at most 32 per thread of 4 warps
        return dict(BLOCK_T=bt, BLOCK_N=bn, BLOCK_K=max(32, min(k_tile, 4096 // (bt * bn))), USE_DOT=False,
                    num_warps=4)
    bt = 32 if num_tokens <= 32 else 64
    return dict(BLOCK_T=bt, BLOCK_N=64, BLOCK_K=min(k_tile, 64), USE_DOT=True, num_warps=4, num_stages=3)


def launch_args(x, data, bias, out, n: int, qtype: str, type_size: int) -> tuple[tuple, dict]:
    """What this module's kernel and ``_triton_quant_gemv``'s both take: the
    runtime arguments in their order (x, the blocks, bias (``out`` when there
    is none: never read), out, the token count, the row strides) and the
    shared constexprs N, K, QT, TS, HAS_BIAS."""
    args = (x, data, out if bias is None else bias, out, x.shape[0], x.stride(0), out.stride(0))
    return args, dict(N=n, K=x.shape[1], QT=QT_CODES[qtype], TS=type_size, HAS_BIAS=bias is not None)


def quant_matmul_triton(
    x: torch.Tensor,
    data: torch.Tensor,
    qtype: str,
    block: int,
    type_size: int,
    n: int,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    tile_config: dict | None = None,
) -> None:
    """``out`` [T, N] = x [T, K] @ W.T (+ bias), W from GGUF blocks ``data`` [N, bytes].
    ``tile_config``: ``tiles``' answer to use instead (tests run CUDA's tiles interpreted)."""
    num_tokens, k = x.shape
    interpreted = is_interpreted(x.device)
    t = tile_config or tiles(num_tokens, n, k, interpreted)
    grid = (triton.cdiv(n, t["BLOCK_N"]), triton.cdiv(num_tokens, t["BLOCK_T"]))
    args, shared = launch_args(x, data, bias, out, n, qtype, type_size)
    quant_matmul_kernel.for_device(x.device)[grid](
        *args,
        **shared,
        QK=block,
        DOT_DT=tl.float32 if interpreted else _DOT_DTYPES[x.dtype],
        F16=f16_fn.for_device(x.device),
        DEQUANT=dequant_tile_fn.for_device(x.device),
        **t,
        **_LAUNCH_OPTIONS,
    )


def dequantize_rows_triton(data: torch.Tensor, qtype: str, block: int, type_size: int, k: int, first_row: int,
                           out: torch.Tensor, tile_config: dict | None = None) -> None:
    """``out`` [rows, K] (contiguous; float32, bf16 or fp16) = rows ``first_row``.. of the weight
    in GGUF blocks ``data``: ``dequantize(packed, out.dtype)``'s rows, bit for bit (float32 values,
    one rounding). The interpreter's own float32 -> bf16/fp16 cast truncates: there ``out`` must
    be float32 (the caller rounds with torch). ``tile_config``: BLOCK_N, BLOCK_K (a power of two)
    and num_warps instead of 16, min(256, K) and 4 (benchmarks compare them)."""
    rows = out.shape[0]
    t = tile_config or dict(BLOCK_N=16, BLOCK_K=min(256, triton.next_power_of_2(k)), num_warps=4)
    grid = (triton.cdiv(rows, t["BLOCK_N"]), triton.cdiv(k, t["BLOCK_K"]))
    dequant_rows_kernel.for_device(out.device)[grid](
        data, out, first_row, rows, K=k, QK=block, QT=QT_CODES[qtype], TS=type_size,
        F16=f16_fn.for_device(out.device), DEQUANT=dequant_tile_fn.for_device(out.device), **t, **_LAUNCH_OPTIONS)
