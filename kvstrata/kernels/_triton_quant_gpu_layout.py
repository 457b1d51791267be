"""Triton kernels over the GPU layout of packed weights (``quant_gpu_layout``):
the decode GEMV for 1-8 tokens, and a dequantize into a scratch buffer for
larger batches (then F.linear, as ``quant_linear._dequantize_then_mm``).
Within kvstrata only the dispatcher (``quant_linear``) imports this module:
it imports triton.

    layout_gemv_triton(x, packed, bias, out, tile_config=None)      out [T, N] = x @ W.T (+ bias), T <= 8
    layout_dequantize_rows_triton(packed, first_row, out)           out [R, K] = rows of W, bit-equal to dequantize

GEMV (``_layout_gemv_kernel``). A program owns BLOCK_N rows and walks K in
steps of NV vectors (``quant_gpu_layout``: a vector is 4 words, 16 bytes, 32
4-bit or 16 8-bit weights). Every tensor of a step has the one tile's shape
[BT, BN, NV, 4] (tokens, rows, vectors, words), loads included (pointers
broadcast over the tokens, or over the rows for x and the tokens for the
words): the word dimension is contiguous, so a thread's 4 words are one
128-bit load (LDG.E.128), x's 4 bf16 values of a field one 64-bit load, and
every load gets the layout the arithmetic uses (no shared-memory moves in
the loop). The tokens sit in one thread's registers: a word, its fields'
conversion and its scales are loaded and computed once for all tokens.

- Exact integers: a field at bit P of its 16-bit half (the words' bits
  16-31 moved down once a word) with the exponent bits of 2^(23 - P) OR-ed
  in (one LOP3: the exponent is a runtime value, ``one * 150 << 23``, in a
  register) is the float 2^(23 - P) + q; one FADD leaves q - OFF exactly
  (Q6_K first ORs its 2 high bits in: a second LOP3).
- The scale waits: per vector and token, x . (q - OFF) over its weights is
  summed first (one FMA a weight and token), then times the vector's scale
  once (Q4_K: plus x's sum times -dm; Q6_K: two sums, one per 16-weight
  scale). On one-hot x that is ``dequantize``'s rounding bit for bit; the
  fp32 bound is ``quant_linear``'s (Q4_K, with a min: S').
- fp32 accumulators per (token, row, vector) of the tile, summed across
  threads once after the K loop: the order depends on the tile alone, not
  on the batch, so a row's result is deterministic.

Instructions per weight in the K loop (sm_90 SASS, ``tools/quant_gemv_sass.py
--layout``) are in docs/quantization.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.standard import _sum_combine

from kvstrata.kernels._triton_quant import _LAUNCH_OPTIONS, QT_CODES
from kvstrata.kernels.dispatch import LazyKernel, is_interpreted

LAYOUT_GEMV_MAX_TOKENS = 8  # the batches the layout GEMV takes (larger: dequantize, then F.linear)
VECTOR_WEIGHTS = {"Q8_0": 16, "Q4_0": 32, "Q4_K": 32, "Q6_K": 32}  # weights of one 4-word vector
_VECTORS_PER_PROGRAM = 512  # a step's vectors (BN x NV): 4 per thread of 4 warps, 64 bytes in flight each
_MIN_PROGRAMS = 1024  # row blocks wanted for a weight (as ``_triton_quant_gemv``)


def _layout_gemv_kernel(
    x_ptr,
    q_ptr,
    f1_ptr,
    f2_ptr,
    f3_ptr,
    f4_ptr,
    bias_ptr,
    out_ptr,
    num_tokens,
    x_stride,
    out_stride,
    one,
    N: tl.constexpr,
    K: tl.constexpr,
    QT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NV: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """out[t, n] = sum_k x[t, k] W[n, k] (+ bias[n]) over the GPU layout (module docstring).
    f1..f4: the layout's tensors after q (``LAYOUT_FIELDS``; unused ones are q again)."""
    VW: tl.constexpr = 16 if QT == 0 else 32  # weights of a vector
    NF: tl.constexpr = 4 if QT == 0 else 8  # fields of a word
    ROW_WORDS: tl.constexpr = K // VW * 4
    SHAPE: tl.constexpr = (BLOCK_T, BLOCK_N, NV, 4)
    rows1 = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    toks1 = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    # rows and tokens past the end read row / token 0 and are not stored: no masks in the loop
    row = tl.where(rows1 < N, rows1, 0).to(tl.int64)[None, :, None, None]
    tok = tl.where(toks1 < num_tokens, toks1, 0).to(tl.int64)[:, None, None, None]
    v = tl.arange(0, NV)[None, None, :, None]
    j = tl.arange(0, 4)[None, None, None, :]
    w_ptrs = tl.broadcast_to(q_ptr + row * ROW_WORDS + 4 * v + j, SHAPE)
    x_ptrs = tl.broadcast_to(x_ptr + tok * x_stride + VW * v + j, SHAPE)  # field p: + 4p
    e150 = one * 1258291200  # 150 << 23 at run time: mask and exponent in one LOP3
    # scale offsets times a runtime 1: no contiguity along the vectors the compiler could vectorize
    # on, so their loads take the tile's layout (one value a thread, broadcast over its words)
    vs = v * one
    # the scales of vector v (broadcast over its words and the tokens)
    if QT == 0:  # Q8_0: d per 32 weights = 2 vectors
        d_ptrs = tl.broadcast_to(f1_ptr + row * (K // 32) + vs // 2, SHAPE)
    elif QT == 1:  # Q4_0: d per vector
        d_ptrs = tl.broadcast_to(f1_ptr + row * (K // 32) + vs, SHAPE)
    elif QT == 5:  # Q4_K: sc, m per vector, d, dmin per 8
        sc_ptrs = tl.broadcast_to(f1_ptr + row * (K // 32) + vs, SHAPE)
        m_ptrs = tl.broadcast_to(f2_ptr + row * (K // 32) + vs, SHAPE)
        d_ptrs = tl.broadcast_to(f3_ptr + row * (K // 256) + vs // 8, SHAPE)
        dmin_ptrs = tl.broadcast_to(f4_ptr + row * (K // 256) + vs // 8, SHAPE)
    else:  # Q6_K: the high-bit halfwords beside the words; sc per 16 weights, d per 8 vectors
        h_ptrs = tl.broadcast_to(f1_ptr + row * ROW_WORDS + 4 * v + j, SHAPE)
        sc_ptrs = tl.broadcast_to(f2_ptr + row * (K // 16) + 2 * vs, SHAPE)
        d_ptrs = tl.broadcast_to(f3_ptr + row * (K // 256) + vs // 8, SHAPE)
    acc = tl.full(SHAPE, 0.0, tl.float32)
    for k0 in range(0, K, NV * VW):
        kv = k0 // VW  # vectors before this step
        words = tl.load(w_ptrs + 4 * kv).to(tl.uint32, bitcast=True)
        if QT == 0:
            words = words ^ 0x80808080  # each byte q + 128
        high = words >> 16  # bits 16-31 moved down (fields at bit P < 16 of either half)
        if QT == 7:
            hw = tl.load(h_ptrs + 4 * kv).to(tl.uint16, bitcast=True).to(tl.int32)
            h_lo = hw << 4  # fields 0-3's 2 high bits at 4p + 4 (their low 4 at 4p)
            h_hi = hw << 2  # fields 4-7's at 4(p - 4) + 4
        p0 = tl.full(SHAPE, 0.0, tl.float32)  # x . (q - OFF) of the vector (Q6_K: fields 0-3)
        p1 = p0  # Q6_K: fields 4-7
        xs = p0  # Q4_K: x's sum
        for p in tl.static_range(NF):
            P = (p % (NF // 2)) * (32 // NF)  # the field's bit in its half
            MASK = (255 if QT == 0 else 15) << P
            OFF = 128.0 if QT == 0 else (8.0 if QT == 1 else (32.0 if QT == 7 else 0.0))
            if p < NF // 2:
                bits = words & MASK
            else:
                bits = high & MASK
            if QT == 7:
                if p < NF // 2:
                    bits = bits | (h_lo & (48 << P))
                else:
                    bits = bits | (h_hi & (48 << P))
            qf = (bits | (e150 - (P << 23))).to(tl.float32, bitcast=True) - ((1 << (23 - P)) + OFF)
            x = tl.load(x_ptrs + (k0 + 4 * p)).to(tl.float32)
            if QT == 7 and p >= NF // 2:
                p1 = tl.fma(x, qf, p1)
            else:
                p0 = tl.fma(x, qf, p0)
            if QT == 5:
                xs += x
        if QT == 0 or QT == 1:
            d = tl.load(d_ptrs + (kv // 2 if QT == 0 else kv)).to(tl.float32)
            acc = tl.fma(p0, d, acc)
        elif QT == 5:
            d = tl.load(d_ptrs + kv // 8).to(tl.float32)
            dmin = tl.load(dmin_ptrs + kv // 8).to(tl.float32)
            dd = d * tl.load(sc_ptrs + kv).to(tl.float32)  # gguf's d * sc, exact in fp32
            dm = dmin * tl.load(m_ptrs + kv).to(tl.float32)
            acc = tl.fma(xs, -dm, tl.fma(p0, dd, acc))
        else:
            d = tl.load(d_ptrs + kv // 8).to(tl.float32)
            dd0 = d * tl.load(sc_ptrs + 2 * kv).to(tl.float32)
            dd1 = d * tl.load(sc_ptrs + 2 * kv + 1).to(tl.float32)
            acc = tl.fma(p1, dd1, tl.fma(p0, dd0, acc))
    total = tl.reduce(tl.reduce(acc, 3, _sum_combine), 2, _sum_combine)  # [BT, BN] (tl.sum's own combine
    # function is jit-wrapped when triton is imported: the interpreter cannot call it)
    rows = rows1[None, :]
    toks = toks1[:, None]
    if HAS_BIAS:
        total += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + toks.to(tl.int64) * out_stride + rows, total.to(out_ptr.dtype.element_ty),
             mask=(rows < N) & (toks < num_tokens))


layout_gemv_kernel = LazyKernel(_layout_gemv_kernel, do_not_specialize=("num_tokens", "one"))


def layout_gemv_tiles(num_tokens: int, n: int, k: int, qtype: str, interpreted: bool = False) -> dict:
    """BLOCK_T (the tokens, a power of two), BLOCK_N (rows: as few as keep ~1024
    programs, at most 16) and NV (vectors a step: the largest power of two
    dividing K's vectors within ``_VECTORS_PER_PROGRAM`` for the tile).
    ``interpreted``: 64 rows and up to 64x the vectors (the interpreter runs
    programs one after another: fewer, larger ones)."""
    vectors = k // VECTOR_WEIGHTS[qtype]
    bt = triton.next_power_of_2(max(1, num_tokens))
    bn = 64 if interpreted else max(1, min(16, triton.next_power_of_2(max(1, n // _MIN_PROGRAMS))))
    budget = _VECTORS_PER_PROGRAM * (64 if interpreted else 1)
    nv = 1
    while vectors % (2 * nv) == 0 and 2 * nv * bn <= budget:
        nv *= 2
    return dict(BLOCK_T=bt, BLOCK_N=bn, NV=nv, num_warps=4)


def _layout_dequant_kernel(
    q_ptr,
    f1_ptr,
    f2_ptr,
    f3_ptr,
    f4_ptr,
    out_ptr,
    first_row,
    num_rows,
    K: tl.constexpr,
    QT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NV: tl.constexpr,
):
    """out[r, :] = row first_row + r of W, [BLOCK_N, NV vectors] a program: each weight
    formed with ``dequantize``'s float32 operations in its order (fp-contraction off), so
    bit-equal to it, then cast once to out's dtype."""
    VW: tl.constexpr = 16 if QT == 0 else 32
    NF: tl.constexpr = 4 if QT == 0 else 8
    ROW_WORDS: tl.constexpr = K // VW * 4
    SHAPE: tl.constexpr = (BLOCK_N, NV, 4)
    r1 = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (r1 < num_rows)[:, None, None]
    row = (first_row + tl.where(r1 < num_rows, r1, 0)).to(tl.int64)[:, None, None]
    v = (tl.program_id(1) * NV + tl.arange(0, NV))[None, :, None]
    j = tl.arange(0, 4)[None, None, :]
    words = tl.load(q_ptr + row * ROW_WORDS + 4 * v + j).to(tl.uint32, bitcast=True)
    if QT == 0:
        d = tl.broadcast_to(tl.load(f1_ptr + row * (K // 32) + v // 2).to(tl.float32), SHAPE)
    elif QT == 1:
        d = tl.broadcast_to(tl.load(f1_ptr + row * (K // 32) + v).to(tl.float32), SHAPE)
    elif QT == 5:
        sc = tl.load(f1_ptr + row * (K // 32) + v).to(tl.float32)
        mn = tl.load(f2_ptr + row * (K // 32) + v).to(tl.float32)
        dd = tl.broadcast_to(tl.load(f3_ptr + row * (K // 256) + v // 8).to(tl.float32) * sc, SHAPE)
        dm = tl.broadcast_to(tl.load(f4_ptr + row * (K // 256) + v // 8).to(tl.float32) * mn, SHAPE)
    else:
        hw = tl.load(f1_ptr + row * ROW_WORDS + 4 * v + j).to(tl.uint16, bitcast=True).to(tl.uint32)
        d = tl.load(f3_ptr + row * (K // 256) + v // 8).to(tl.float32)
        dd0 = tl.broadcast_to(d * tl.load(f2_ptr + row * (K // 16) + 2 * v).to(tl.float32), SHAPE)
        dd1 = tl.broadcast_to(d * tl.load(f2_ptr + row * (K // 16) + 2 * v + 1).to(tl.float32), SHAPE)
    out_row = out_ptr + r1.to(tl.int64)[:, None, None] * K + VW * v + j
    for p in tl.static_range(NF):
        WIDTH = 8 if QT == 0 else 4
        q = (words >> (WIDTH * p)) & ((1 << WIDTH) - 1)
        if QT == 0:
            w = (q ^ 128).to(tl.int32) - 128  # the int8
            w = w.to(tl.float32) * d
        elif QT == 1:
            w = (q.to(tl.float32) - 8.0) * d
        elif QT == 5:
            w = q.to(tl.float32) * dd - dm
        else:
            HIGH = 4 * p if p < 4 else 4 * (p - 4) + 2  # the 2 high bits in the halfword
            q = q | (((hw >> HIGH) & 3) << 4)
            if p < 4:
                w = (q.to(tl.float32) - 32.0) * dd0
            else:
                w = (q.to(tl.float32) - 32.0) * dd1
        tl.store(out_row + 4 * p, w.to(out_ptr.dtype.element_ty), mask=ok)


layout_dequant_kernel = LazyKernel(_layout_dequant_kernel, do_not_specialize=("first_row", "num_rows"))


def _launch_fields(packed) -> tuple:
    """The layout's q and its four other tensors (``LAYOUT_FIELDS`` order; q again for those a type lacks)."""
    q, *rest = packed.gpu_layout
    return (q, *rest, *(q,) * (4 - len(rest)))


def check_layout_tiles(qtype: str, k: int, t: dict) -> None:
    """The kernels' step walks whole vectors and whole scale groups: NV a power of two dividing
    K's vectors, and a multiple of the vectors a scale spans (Q8_0: 2; the K-quants' d: 8)."""
    vectors, nv = k // VECTOR_WEIGHTS[qtype], t["NV"]
    span = {"Q8_0": 2, "Q4_0": 1, "Q4_K": 8, "Q6_K": 8}[qtype]
    if nv & (nv - 1) or vectors % nv or nv % span:
        raise ValueError(f"NV {nv} must be a power of two dividing {qtype}'s {vectors} vectors (K={k}) and a "
                         f"multiple of {span}")


def layout_gemv_triton(x: torch.Tensor, packed, bias, out: torch.Tensor, tile_config: dict | None = None) -> None:
    """``out`` [T, N] = x [T, K] @ W.T (+ bias) for T <= LAYOUT_GEMV_MAX_TOKENS, W a
    PackedWeight with a GPU layout; ``tile_config``: ``layout_gemv_tiles``' keys, to
    use instead (benchmarks and tests)."""
    (n, k), qtype = packed.shape, packed.qtype.name
    t = dict(tile_config or layout_gemv_tiles(x.shape[0], n, k, qtype, is_interpreted(x.device)))
    check_layout_tiles(qtype, k, t)
    if x.shape[0] > LAYOUT_GEMV_MAX_TOKENS:
        raise ValueError(f"the layout GEMV takes up to {LAYOUT_GEMV_MAX_TOKENS} tokens, got {x.shape[0]}")
    grid = (triton.cdiv(n, t["BLOCK_N"]), triton.cdiv(x.shape[0], t["BLOCK_T"]))
    layout_gemv_kernel.for_device(x.device)[grid](
        x, *_launch_fields(packed), out if bias is None else bias, out, x.shape[0], x.stride(0), out.stride(0), 1,
        N=n, K=k, QT=QT_CODES[qtype], HAS_BIAS=bias is not None, **t, **_LAUNCH_OPTIONS)


def layout_dequantize_rows_triton(packed, first_row: int, out: torch.Tensor, tile_config: dict | None = None) -> None:
    """``out`` [R, K] (contiguous; float32, bf16 or fp16) = rows ``first_row``.. of W from its GPU
    layout: ``dequantize(packed, out.dtype)``'s rows bit for bit. The interpreter's float32 ->
    bf16/fp16 cast truncates: there ``out`` must be float32 (the caller rounds with torch).
    ``tile_config``: BLOCK_N, NV, num_warps instead of 16, up to 16 vectors (interpreted: 1024), 4."""
    (_, k), qtype = packed.shape, packed.qtype.name
    vectors = k // VECTOR_WEIGHTS[qtype]
    most = 1024 if is_interpreted(out.device) else 16  # the interpreter: fewer, larger programs
    t = dict(tile_config or dict(BLOCK_N=16, NV=min(most, vectors & -vectors), num_warps=4))
    if t["NV"] & (t["NV"] - 1) or vectors % t["NV"]:
        raise ValueError(f"NV {t['NV']} must be a power of two dividing {qtype}'s {vectors} vectors (K={k})")
    rows = out.shape[0]
    grid = (triton.cdiv(rows, t["BLOCK_N"]), vectors // t["NV"])
    layout_dequant_kernel.for_device(out.device)[grid](
        *_launch_fields(packed), out, first_row, rows, K=k, QT=QT_CODES[qtype], **t, **_LAUNCH_OPTIONS)
