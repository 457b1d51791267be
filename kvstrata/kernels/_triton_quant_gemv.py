"""Triton GEMVs of ``quant_matmul`` for decode batches (1-8 tokens), on the
GGUF blocks as they are, for every packed type: out = x @ W.T + bias (torch
reference and checks: ``quant.py``; the general kernel: ``_triton_quant``).
Within kvstrata only the dispatcher (``quant_linear``) imports this module:
it imports triton.

Why not the general kernel: ``_triton_quant``'s tile rebuilds each weight
from single bytes (its fp16 scales from two), converts each integer with I2F
and sums the tile across threads every K step: compiled for sm_90, 15-35
instructions per weight in its K loop. A decode GEMV over ~4.5-bit weights
has to issue fewer than ~8 per weight to keep up with an H200's HBM, so
instruction issue, not memory, was its limit. Two kernels here
(``tools/quant_gemv_sass.py`` counts them; 1 token, [4096, 4096], bf16 x):

- ``_gemv_kernel`` (3-8 tokens; 1-2 where x's rows are not 4-byte
  aligned): the quant bits come as 16/32-bit words, one load for 4-8
  weights, and a weight's value is masked where it lies in the word: with
  the exponent bits of 2^23 OR-ed into the word once, ``bits & (mask |
  exponent)`` is the float 2^23 + q * 2^P, and one FADD leaves (q - offset) *
  2^P exactly; times scale * 2^-P (exact) it is ``dequantize``'s product,
  rounded once: the weights are the reference's bit for bit (fp-contraction
  off); one explicit FMA per weight and token into a per-thread accumulator,
  summed across threads once, after the K loop. Converting a weight once for
  every token of the batch is what it is for; at 1-2 tokens triton moves its
  words, scales and x between the layouts of its [BN, C, U] and [BT, BN, C,
  U] tensors through shared memory (on triton 3.6 12-38 barriers a step,
  Q4_1 148; on 3.9 up to 32): at one token 7.2-16.7 (triton 3.9) or 9.0-13.7
  (3.6) instructions per weight.
- ``_gemv_few_kernel`` (``_triton_quant_gemv_few``; 1-2 tokens): every
  tensor has the one tile's shape, so nothing moves between threads; the exponent of 2^(23 - P) makes the
  value's bits count units (q - offset exactly, one LOP3 and one FADD); a
  word's weights are summed against x before its scale multiplies them
  once; bf16 x comes two values a load: at one token 5.3-12.7 (3.9) or
  6.3-10.6 (3.6) per weight, 1.1-1.5x fewer than ``_gemv_kernel`` there but
  for Q8_0, Q5_0 and Q5_K on 3.9 (0.86-0.97x: 5.5-8.5 bits a weight wait on
  memory sooner); at two tokens 1.0-1.4x fewer per weight and token (Q8_0
  on 3.9: 0.83x; docs/quantization.md has the tables). From 4 tokens on
  ``_gemv_kernel``, which converts a weight once for all its tokens, is as
  good or better on 3.9: FEW_MAX_TOKENS is 2.

Both run ~1024 row blocks per weight (1-16 rows each), so every SM has loads
in flight.

A chunk is CH consecutive weights of one row whose quant bits sit in U
aligned words; word u holds, at bit 8*w + 4*h, the weight W*u + w + HS*h of
the chunk (GGUF's own nibble order, so nothing is re-laid: x is read in
that order instead):

    Q8_0  CH 32 = the block   U 16 x 2 B  H 1 W 2          bytes xor 128 = q + 128
    Q4_0  CH 32 = the block   U  8 x 2 B  H 2 W 2  HS 16   (18-byte blocks: 2-aligned)
    Q4_1  CH 32 = the block   U  4 x 4 B  H 2 W 4  HS 16
    Q4_K  CH 64 = 2 groups    U  8 x 4 B  H 2 W 4  HS 32   group 2i + h has its own dd, dm
    Q5_0  as Q4_0, words from byte 6; the 5th bit of weight j: bit j of the 4 bytes at 2
    Q5_1  as Q4_1, words from byte 8; the 5th bits at byte 4
    Q5_K  as Q4_K, words from byte 48 + 32i; the 5th bits: bit 2i + h of the byte at 16 + j
    Q6_K  CH 128 = half h     U 32 x 2 B  H 2 W 2  HS 64   of the 64 low-bit bytes at 64h; word
                                                         u's weights 32 (2h' + u // 16) + 2 (u % 16)
                                                         + w, their 2 high bits in the 2 bytes at
                                                         128 + 32h + 2 (u % 16), scales per 16

Grids depend on shapes only; T is not specialised on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.standard import _sum_combine

from kvstrata.kernels._triton_quant import _LAUNCH_OPTIONS, launch_args
from kvstrata.kernels._triton_quant_gemv_few import gemv_few_kernel
from kvstrata.kernels.dispatch import LazyKernel
from kvstrata.kernels.quant import quant_type

# the formats this kernel reads (every packed type), with their chunk geometry (CH, U, H, W:
# the module docstring)
GEOMETRY = {"Q8_0": (32, 16, 1, 2), "Q4_0": (32, 8, 2, 2), "Q4_1": (32, 4, 2, 4), "Q5_0": (32, 8, 2, 2),
            "Q5_1": (32, 4, 2, 4), "Q4_K": (64, 8, 2, 4), "Q5_K": (64, 8, 2, 4), "Q6_K": (128, 32, 2, 2)}
# the few-token kernel's: Q6_K in chunks of the 8 words one scale (per nibble) covers (weights
# 32 (2h' + g // 2) + 16 (g % 2) + 2u + w of half n for group g; x read as ``_gemv_few_kernel`` says)
FEW_GEOMETRY = {**GEOMETRY, "Q6_K": (32, 8, 2, 2)}
GEMV_TYPES = tuple(GEOMETRY)

_MAGIC = tl.constexpr(0x4B000000)  # float32 bits of 2^23: with value bits v below bit 23 it is 2^23 + v
_TWO23 = tl.constexpr(8388608.0)


def _k_scale(block, grp, d, dmin):
    """(d * sc, dmin * mn) of group ``grp`` (0..7, broadcastable to ``block``) of the Q4_K
    blocks at ``block``, shaped as ``block``: gguf's get_scale_min, then ``dequantize``'s
    products."""
    bp = block + grp % 4
    a = tl.load(bp + 4).to(tl.int32)
    b = tl.load(bp + 8).to(tl.int32)
    hi = tl.load(bp + 12).to(tl.int32)
    low = grp < 4
    sc = tl.where(low, a & 63, (hi & 15) | ((a >> 2) & 48))
    mn = tl.where(low, b & 63, (hi >> 4) | ((b >> 2) & 48))
    return d * sc.to(tl.float32), dmin * mn.to(tl.float32)


def _value(units, high, BIT: tl.constexpr, QT: tl.constexpr, scale, shift, fifth):
    """The weights [BN, C, U] at bit BIT of the words (``units``: bits 0-15, ``high``: bits
    16-31 moved down; both with 2^23's exponent bits OR-ed in), dequantized as ``dequantize``
    does: (q - 8) * d (Q4_0), (q - 128) * d (Q8_0: ``units`` holds q + 128), q * d + m (Q4_1),
    q * dd - dm (Q4_K), (q - 16) * d (Q5_0), q * d + m (Q5_1), q * dd - dm (Q5_K): the Q5 kinds'
    5th bit at bit P + 4 of ``fifth``; ``scale``, ``shift``: d or dd, m or dm. The value stays at
    bit P of its
    16 bits: the float 2^23 + q * 2^P, minus 2^23 + OFF * 2^P, is (q - OFF) * 2^P exactly, and
    times scale * 2^-P (exact: every scale here is >= 2^-24, far from fp32's subnormals) it is
    (q - OFF) * scale rounded once: the reference's product bit for bit, for one mask, one add
    and one multiply."""
    P: tl.constexpr = BIT % 16
    if BIT < 16:
        src = units
    else:
        src = high
    MASK: tl.constexpr = (255 if QT == 0 else 15) << P
    OFF: tl.constexpr = 128.0 if QT == 0 else (8.0 if QT == 1 else (16.0 if QT == 3 else 0.0))
    UNIT: tl.constexpr = 1.0 / (1 << P)
    KEEP: tl.constexpr = MASK | 0x4B000000  # the value bits and the exponent bits
    if QT == 3 or QT == 4 or QT == 6:
        bits = (src & KEEP) | (fifth & (16 << P))
    else:
        bits = src & KEEP
    qf = bits.to(tl.float32, bitcast=True) - (_TWO23 + OFF * (1 << P))
    if QT == 0 or QT == 1 or QT == 3:
        return qf * (scale * UNIT)
    elif QT == 2 or QT == 4:
        return qf * (scale * UNIT) + shift
    else:
        return qf * (scale * UNIT) - shift


def _fifth(qh_lo, qh_hi, W_: tl.constexpr, H_: tl.constexpr, QT: tl.constexpr):
    """The Q5 kinds: the 5th bit of the value at byte W_, nibble H_ of a word, moved to bit P + 4
    (P: the value's bit in its 16-bit half, as VALUE takes it). Q5_0: bit W_ of ``qh_lo`` (H_ = 0)
    or ``qh_hi`` (H_ = 1); Q5_1: bit W_ + 16 H_ of ``qh_lo``; Q5_K: bit 8 W_ + H_ of ``qh_lo``."""
    if QT == 3:
        SRC: tl.constexpr = W_
    elif QT == 4:
        SRC: tl.constexpr = W_ + 16 * H_
    else:
        SRC: tl.constexpr = 8 * W_ + H_
    DST: tl.constexpr = (8 * W_ + 4 * H_) % 16 + 4
    if QT == 3 and H_ == 1:
        src = qh_hi
    else:
        src = qh_lo
    if DST >= SRC:
        return src << (DST - SRC)
    else:
        return src >> (SRC - DST)


def _q6_scales(sp, d):
    """Q6_K's dd of nibble 0 and 1 (int8 scales at ``sp`` and ``sp`` + 4, times d) as
    ``dequantize`` forms them: the int8 made a float exactly, bits(2^23 | (s ^ 128)) - 2^23 -
    128 = s."""
    sc0 = ((tl.load(sp).to(tl.uint32) ^ 128) | _MAGIC).to(tl.float32, bitcast=True)
    sc1 = ((tl.load(sp + 4).to(tl.uint32) ^ 128) | _MAGIC).to(tl.float32, bitcast=True)
    return d * (sc0 - (_TWO23 + 128.0)), d * (sc1 - (_TWO23 + 128.0))


def _q6_value(units, qh, BIT: tl.constexpr, dd):
    """Q6_K's weights [BN, C, U] at bit BIT of the low-bit words ``units``, whose 2 high bits sit
    at BIT + 4 of ``qh`` (moved there by the caller): (q - 32) * dd as ``dequantize`` forms it,
    the 6-bit q made a float by the magic-number trick."""
    q = ((units >> BIT) & 15) | ((qh >> BIT) & 48)
    return ((q | _MAGIC).to(tl.float32, bitcast=True) - (_TWO23 + 32.0)) * dd


def _gemv_kernel(
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
    TS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CH: tl.constexpr,
    U: tl.constexpr,
    H: tl.constexpr,
    W: tl.constexpr,
    K_SCALE: tl.constexpr,
    VALUE: tl.constexpr,
    Q6_VALUE: tl.constexpr,
    FIFTH: tl.constexpr,
    Q6_SCALES: tl.constexpr,
):
    C: tl.constexpr = BLOCK_K // CH
    HS: tl.constexpr = CH // 2
    ROW_BYTES: tl.constexpr = K // (256 if QT >= 5 else 32) * TS
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    toks = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < N
    tok_ok = toks < num_tokens
    # rows and tokens past the end read row / token 0 and are not stored: no masks in the loop
    row_base = w_ptr + (tl.where(row_ok, rows, 0).to(tl.int64) * ROW_BYTES)[:, None]  # [BN, 1]
    x_rows = x_ptr + (tl.where(tok_ok, toks, 0).to(tl.int64) * x_stride)[:, None, None]  # [BT, 1, 1]
    c = tl.arange(0, C)
    u = tl.arange(0, U)[None, None, :]  # [1, 1, U]: a chunk's words
    uu = tl.arange(0, U)[None, :]
    if QT == 7:
        x_unit = CH * c[:, None] + 32 * (uu // 16) + 2 * (uu % 16)  # [C, U]: the x index of each word's first weight
    else:
        x_unit = CH * c[:, None] + W * uu
    # every pointer of the first K step, made once: a step moves them all by its blocks' bytes
    # (BLOCK_K is a multiple of the block: ``gemv_tiles``), so the loop adds one offset a load
    QK: tl.constexpr = 256 if QT >= 5 else 32
    if QT == 5 or QT == 6:  # chunk i of block b: the block's bytes 16 + 32i on (Q5_K: 48 + 32i)
        block = row_base + ((c // 4) * TS)[None, :]  # [BN, C]
        cp = block + (32 * (c % 4))[None, :]
    elif QT == 7:  # half h of block b: its low bits from byte 64h on
        block = row_base + ((c // 2) * TS)[None, :]
        cp = block + (64 * (c % 2))[None, :]
    else:
        block = row_base + (c * TS)[None, :]
        cp = block  # [BN, C]: the chunk's first byte
    if QT == 0 or QT == 1:
        w_ptrs = (cp + 2).to(tl.pointer_type(tl.uint16))[:, :, None] + u
        d_ptrs = cp.to(tl.pointer_type(tl.float16))
    elif QT == 2:
        w_ptrs = (cp + 4).to(tl.pointer_type(tl.uint32))[:, :, None] + u
        d_ptrs = cp.to(tl.pointer_type(tl.float16))
    elif QT == 3:  # Q5_0: d | qh (4 B) | qs: 2-aligned, qh as two 16-bit halves
        w_ptrs = (cp + 6).to(tl.pointer_type(tl.uint16))[:, :, None] + u
        h_ptrs = (cp + 2).to(tl.pointer_type(tl.uint16))
        d_ptrs = cp.to(tl.pointer_type(tl.float16))
    elif QT == 4:  # Q5_1: d m | qh | qs: 8-aligned
        w_ptrs = (cp + 8).to(tl.pointer_type(tl.uint32))[:, :, None] + u
        h_ptrs = (cp + 4).to(tl.pointer_type(tl.uint32))
        d_ptrs = cp.to(tl.pointer_type(tl.float16))
    elif QT == 5:
        w_ptrs = (cp + 16).to(tl.pointer_type(tl.uint32))[:, :, None] + u
        d_ptrs = block.to(tl.pointer_type(tl.float16))
    elif QT == 6:  # Q5_K: the words and the 5th bits of the chunk's weights (byte j: weight j of each group)
        w_ptrs = (cp + 48).to(tl.pointer_type(tl.uint32))[:, :, None] + u
        h_ptrs = (block + 16).to(tl.pointer_type(tl.uint32))[:, :, None] + u
        d_ptrs = block.to(tl.pointer_type(tl.float16))
    else:  # Q6_K: the low-bit words, their 2 high-bit bytes, the scales of n = 0 (+4: n = 1)
        half = (c % 2)[None, :, None]
        w_ptrs = cp.to(tl.pointer_type(tl.uint16))[:, :, None] + u
        h_ptrs = (block[:, :, None] + 128 + 32 * half + 2 * (u % 16)).to(tl.pointer_type(tl.uint16))
        s_ptrs = block[:, :, None] + 192 + 8 * half + 2 * (u // 16) + (u % 16) // 8
        d_ptrs = (block + 208).to(tl.pointer_type(tl.float16))
    acc = tl.full((BLOCK_T, BLOCK_N, C, U), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        done = k0 // QK * TS  # bytes of each row's blocks before this step
        # the quant words [BN, C, U] and the chunk's scales [BN, C, 1] (Q4_K: one pair per half h)
        if QT == 0 or QT == 1:
            units = tl.load(w_ptrs + done // 2).to(tl.uint32)
            d = tl.load(d_ptrs + done // 2).to(tl.float32)[:, :, None]
        elif QT == 2:
            units = tl.load(w_ptrs + done // 4)
            d = tl.load(d_ptrs + done // 2).to(tl.float32)[:, :, None]
            m = tl.load(d_ptrs + done // 2 + 1).to(tl.float32)[:, :, None]
        elif QT == 3:
            # weight j's 5th bit is bit j of the 32-bit qh; word u's weights are 2u + w (+ 16h):
            # each half moved down by 2u, so weight (u, w, h)'s bit is bit w of half h
            units = tl.load(w_ptrs + done // 2).to(tl.uint32)
            qh_lo = tl.load(h_ptrs + done // 2).to(tl.uint32)[:, :, None] >> (2 * u)
            qh_hi = tl.load(h_ptrs + done // 2 + 1).to(tl.uint32)[:, :, None] >> (2 * u)
            d = tl.load(d_ptrs + done // 2).to(tl.float32)[:, :, None]
        elif QT == 4:
            # word u's weights are 4u + w + 16h: qh moved down by 4u puts their 5th bits at w + 16h
            units = tl.load(w_ptrs + done // 4)
            qh_lo = tl.load(h_ptrs + done // 4)[:, :, None] >> (4 * u)
            qh_hi = qh_lo
            d = tl.load(d_ptrs + done // 2).to(tl.float32)[:, :, None]
            m = tl.load(d_ptrs + done // 2 + 1).to(tl.float32)[:, :, None]
        elif QT == 5 or QT == 6:
            units = tl.load(w_ptrs + done // 4)
            d = tl.load(d_ptrs + done // 2).to(tl.float32)
            dmin = tl.load(d_ptrs + done // 2 + 1).to(tl.float32)
            dd0, dm0 = K_SCALE(block + done, (2 * (c % 4))[None, :], d, dmin)
            dd1, dm1 = K_SCALE(block + done, (2 * (c % 4) + 1)[None, :], d, dmin)
            dd0, dm0, dd1, dm1 = dd0[:, :, None], dm0[:, :, None], dd1[:, :, None], dm1[:, :, None]
        else:  # Q6_K (module docstring)
            units = tl.load(w_ptrs + done // 2).to(tl.uint32)
            # the 2-bit fields of weight r (= 2n + u // 16) sit at bit 2r of the byte: shifted down
            # by 2 (u // 16) here, and up by 4 to where they join the low 4 bits
            qh = (tl.load(h_ptrs + done // 2).to(tl.uint32) >> (2 * (u // 16))) << 4
            d = tl.load(d_ptrs + done // 2).to(tl.float32)[:, :, None]
            dd0, dd1 = Q6_SCALES(s_ptrs + done, d)
        if QT == 6:
            # the 5th bit of group 2i + h is bit 2i + h of the byte: moved down by 2i, bit 8w + h
            # of the word for weight (w, h) (FIFTH)
            qh_lo = tl.load(h_ptrs + done // 4) >> (2 * (c % 4))[None, :, None]
            qh_hi = qh_lo
        if QT == 0:
            units = units ^ 0x8080  # each byte q + 128
        if QT != 7:
            # a float's exponent bits over the value bits (see VALUE): bits 0-15 and (32-bit words) 16-31
            high = (units >> 16) | _MAGIC
            units = units | _MAGIC
        for s in tl.static_range(H * W):  # the word's values: weight W*u + w + HS*h at bit 8w + 4h
            if QT == 7:  # byte w of the word, nibble h: weight 32 (2h + u // 16) + 2 (u % 16) + w
                if s // W == 0:
                    wt = Q6_VALUE(units, qh, 8 * (s % W), dd0)
                else:
                    wt = Q6_VALUE(units, qh, 8 * (s % W) + 4, dd1)
            else:
                if QT == 3 or QT == 4 or QT == 6:
                    fifth = FIFTH(qh_lo, qh_hi, s % W, s // W, QT)
                else:
                    fifth = units  # no 5th bit: VALUE does not read it
                if QT == 5 or QT == 6:  # nibble h: group 2i + h, its own dd and dm
                    if s // W == 0:
                        wt = VALUE(units, high, 8 * (s % W), QT, dd0, dm0, fifth)
                    else:
                        wt = VALUE(units, high, 8 * (s % W) + 4, QT, dd1, dm1, fifth)
                elif QT == 2 or QT == 4:
                    wt = VALUE(units, high, 8 * (s % W) + 4 * (s // W), QT, d, m, fifth)
                else:
                    wt = VALUE(units, high, 8 * (s % W) + 4 * (s // W), QT, d, d, fifth)
            x = tl.load(x_rows + (k0 + x_unit + (s % W + HS * (s // W)))[None]).to(tl.float32)  # [BT, C, U]
            acc = tl.fma(x[:, None], wt[None], acc)
    total = tl.reduce(tl.reduce(acc, 3, _sum_combine), 2, _sum_combine)  # [BT, BN]
    if HAS_BIAS:
        total += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + toks.to(tl.int64)[:, None] * out_stride + rows[None, :]
    tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=tok_ok[:, None] & row_ok[None, :])


k_scale_fn = LazyKernel(_k_scale)
value_fn = LazyKernel(_value)
q6_value_fn = LazyKernel(_q6_value)
fifth_fn = LazyKernel(_fifth)
q6_scales_fn = LazyKernel(_q6_scales)
gemv_kernel = LazyKernel(_gemv_kernel, do_not_specialize=("num_tokens",))

_PER_PROGRAM = 4096  # accumulator elements per program: 32 per thread of 4 warps
_MIN_PROGRAMS = 1024  # row blocks wanted for a weight (8 resident programs on each of ~132 SMs)


def gemv_tiles(num_tokens: int, n: int, k: int, qtype: str) -> dict:
    """BLOCK_T / BLOCK_N / BLOCK_K and launch options: rows per program as
    few as keep ~1024 programs in the grid (a memory-bound GEMV wants many
    loads in flight on every SM; fewer where one block of K would not fit
    the accumulator's budget), K per step the largest power-of-two multiple
    of the format's block that divides K within that budget (the loop has no
    K mask, and moves every pointer by whole blocks)."""
    block = quant_type(qtype).block if qtype in GEMV_TYPES else 0
    if not block or k % block:
        raise ValueError(f"the GEMV reads {', '.join(GEMV_TYPES)} with K a multiple of their block, "
                         f"got {qtype} K={k}")
    bt = triton.next_power_of_2(max(1, num_tokens))
    bn = max(1, min(16, triton.next_power_of_2(max(1, n // _MIN_PROGRAMS)), _PER_PROGRAM // (bt * block)))
    bk = block
    while k % (2 * bk) == 0 and 2 * bk * bt * bn <= _PER_PROGRAM:
        bk *= 2
    return dict(BLOCK_T=bt, BLOCK_N=bn, BLOCK_K=bk, num_warps=4)


FEW_MAX_TOKENS = 2  # batches _gemv_few_kernel takes (3-8 tokens: _gemv_kernel; see the module docstring)
_WORDS_PER_PROGRAM = 1024  # the few-token kernel's words x tokens per step: 8 per thread of 4 warps
# where the few-token tile puts its chunks (``_gemv_few_kernel``): measured with
# tools/quant_gemv_sass.py on triton 3.5-3.9, the order triton gives loads without
# contiguity flipped in 3.7
C_LAST = tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 7)


def gemv_few_tiles(num_tokens: int, n: int, k: int, qtype: str) -> dict:
    """``_gemv_few_kernel``'s BLOCK_T / BLOCK_N / BLOCK_K: tokens and rows per
    program as ``gemv_tiles`` picks them, K per step the largest power-of-two
    multiple of the block dividing K with at most ``_WORDS_PER_PROGRAM``
    words times tokens in the step's tile."""
    t = gemv_tiles(num_tokens, n, k, qtype)
    ch, u = FEW_GEOMETRY[qtype][:2]
    bt, bn, bk = t["BLOCK_T"], t["BLOCK_N"], quant_type(qtype).block
    while k % (2 * bk) == 0 and 2 * bk // ch * u * bn * bt <= _WORDS_PER_PROGRAM:
        bk *= 2
    return dict(BLOCK_T=bt, BLOCK_N=bn, BLOCK_K=bk, num_warps=4)


def few_token_kernel_reads(x) -> bool:
    """Whether ``quant_gemv_triton`` gives ``x`` [T, K] to ``_gemv_few_kernel``: up
    to FEW_MAX_TOKENS tokens in rows that (bf16: it reads x two values a 32-bit
    load) are 4-byte aligned."""
    return x.shape[0] <= FEW_MAX_TOKENS and _rows_aligned(x)


def _rows_aligned(x) -> bool:
    """Whether the few-token kernel can read x's rows: bf16 two values a
    32-bit load, so its rows 4-byte aligned (other dtypes: any)."""
    return x.dtype != torch.bfloat16 or (x.data_ptr() % 4 == 0 and (x.shape[0] == 1 or x.stride(0) % 2 == 0))


def quant_gemv_triton(x, data, qtype: str, type_size: int, n: int, bias, out, tile_config: dict | None = None,
                      many: bool = False, few: bool = False) -> None:
    """``out`` [T, N] = x [T, K] @ W.T (+ bias) for a decode batch (T <=
    ``_triton_quant.GEMV_MAX_TOKENS``), W from GGUF blocks ``data`` [N, bytes]
    of a ``GEMV_TYPES`` format: 1-2 tokens by ``_gemv_few_kernel`` (see
    ``few_token_kernel_reads``), more by ``_gemv_kernel`` (``many``: that one
    for 1-2 tokens too, as benchmarks compare them; ``few``: the few-token
    kernel for more tokens too, x's rows 4-byte aligned). ``tile_config``:
    ``gemv_few_tiles``' or ``gemv_tiles``' answer (for the kernel that runs) to
    use instead (its BLOCK_K must divide K)."""
    num_tokens, k = x.shape
    if few and not _rows_aligned(x):
        raise ValueError("few=True reads bf16 x two values a 32-bit load: its rows must be 4-byte aligned")
    few = not many and (few or few_token_kernel_reads(x))
    t = tile_config or (gemv_few_tiles(num_tokens, n, k, qtype) if few else gemv_tiles(num_tokens, n, k, qtype))
    block = quant_type(qtype).block
    if t["BLOCK_K"] % block or k % t["BLOCK_K"]:
        raise ValueError(f"BLOCK_K {t['BLOCK_K']} must be a multiple of {qtype}'s block ({block}) dividing K={k}")
    ch, u, h, w = (FEW_GEOMETRY if few else GEOMETRY)[qtype]
    args, shared = launch_args(x, data, bias, out, n, qtype, type_size)
    shared.update(CH=ch, U=u, H=h, W=w, K_SCALE=k_scale_fn.for_device(x.device), FIFTH=fifth_fn.for_device(x.device),
                  Q6_SCALES=q6_scales_fn.for_device(x.device))
    grid = (triton.cdiv(n, t["BLOCK_N"]), triton.cdiv(num_tokens, t["BLOCK_T"]))
    if few:
        gemv_few_kernel.for_device(x.device)[grid](*args, 1, **shared, **t, C_LAST=C_LAST, **_LAUNCH_OPTIONS)
        return
    gemv_kernel.for_device(x.device)[grid](
        *args,
        **shared,
        VALUE=value_fn.for_device(x.device),
        Q6_VALUE=q6_value_fn.for_device(x.device),
        **t,
        **_LAUNCH_OPTIONS,
    )
