"""Triton kernel of ``_triton_quant_gemv`` for decode batches of 1-2 tokens
(``_gemv_few_kernel``): why it exists, its figures and the formats' word
geometry are in that module's docstring, which also dispatches to it and
picks its tiles (``gemv_few_tiles``), tile order (``C_LAST``) and geometry
(``FEW_GEOMETRY``). Helpers (K_SCALE, FIFTH, Q6_SCALES) come as constexpr
functions, as ``_gemv_kernel`` takes them.
"""

from __future__ import annotations

import triton.language as tl
from triton.language.standard import _sum_combine

from kvstrata.kernels.dispatch import LazyKernel


def _gemv_few_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    num_tokens,
    x_stride,
    out_stride,
    one,
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
    FIFTH: tl.constexpr,
    Q6_SCALES: tl.constexpr,
    C_LAST: tl.constexpr,
):
    """``_gemv_kernel`` for 1-2 tokens (same words, geometry and result within the
    same bound): a [BN, NC, U] or [BN, U, NC] tile for one token, [BN, NC, U, BT] or
    [BT, BN, U, NC] for more (C_LAST), an element per word (and token), so no value
    moves between threads.

    - Layout: every tensor, x's pointers and a chunk's fields included, has the tile's
      shape (broadcast over rows, words or tokens), so triton gives every load the
      layout the arithmetic uses (no shared-memory round trips), and what is broadcast
      (a chunk's scales and Q5 high bits over its words, a word and its conversion
      over the tokens) is one value per thread, loaded and computed once. The word
      offsets are multiplied by ``one`` (a runtime 1) so the compiler sees no
      contiguity: every load then gets the same layout. Triton 3.7 turned the order it
      gives such loads around (first dimension fastest before, last after): C_LAST
      puts the chunks on the side that spreads them over threads, and the tokens on
      the side that keeps them in one.
    - Exact integers: with the exponent bits of 2^(23 - P) (``e150 - (P << 23)``, a
      runtime value, so mask-and-exponent is one LOP3 with it in a register) the
      value's bits at P count units: one FADD leaves q - OFF exactly.
    - The scale waits: x . (q - OFF) of a word is summed first (one FMA a weight and
      token), then times d (dd) once, plus x's sum times m (minus dm): on one-hot x
      that is ``dequantize``'s rounding, bit for bit. bf16 x comes two values a 32-bit
      load.
    """
    NC: tl.constexpr = BLOCK_K // CH  # chunks of a row per step
    HS: tl.constexpr = 64 if QT == 7 else CH // 2  # Q6_K: FEW_GEOMETRY's chunks
    QK: tl.constexpr = 256 if QT >= 5 else 32
    ROW_BYTES: tl.constexpr = K // QK * TS
    rows1 = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    toks1 = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_base1 = w_ptr + tl.where(rows1 < N, rows1, 0).to(tl.int64) * ROW_BYTES
    # rows and tokens past the end read row / token 0 and are not stored
    if BLOCK_T == 1:  # one token: [BN, U, NC] or [BN, NC, U]; x's row from the program id (from
        # the masked token index: ~1 instruction more a weight)
        row_base = row_base1[:, None, None]
        x_base = x_ptr + tl.program_id(1).to(tl.int64) * x_stride
        if C_LAST:
            SHAPE: tl.constexpr = (BLOCK_N, U, NC)
            u = tl.arange(0, U)[None, :, None]  # the word of the chunk
            c = tl.arange(0, NC)[None, None, :]  # the chunk of the step
        else:
            SHAPE: tl.constexpr = (BLOCK_N, NC, U)
            c = tl.arange(0, NC)[None, :, None]
            u = tl.arange(0, U)[None, None, :]
    else:  # [BT, BN, U, NC] or [BN, NC, U, BT]
        x_base1 = x_ptr + tl.where(toks1 < num_tokens, toks1, 0).to(tl.int64) * x_stride
        u = tl.arange(0, U)[None, None, :, None]
        if C_LAST:
            SHAPE: tl.constexpr = (BLOCK_T, BLOCK_N, U, NC)
            row_base = row_base1[None, :, None, None]
            x_base = x_base1[:, None, None, None]
            c = tl.arange(0, NC)[None, None, None, :]
        else:
            SHAPE: tl.constexpr = (BLOCK_N, NC, U, BLOCK_T)
            row_base = row_base1[:, None, None, None]
            x_base = x_base1[None, None, None, :]
            c = tl.arange(0, NC)[None, :, None, None]
    uw = u * one  # the same, with no contiguity the compiler can see (see the docstring)
    e150 = one * 1258291200  # 150 << 23 at run time: kept in a register
    if QT == 7:  # chunk c: group g (c % 4) of half n ((c // 4) % 2) of block c // 8 (FEW_GEOMETRY)
        x_unit = 256 * (c // 8) + 128 * ((c // 4) % 2) + 32 * (c % 4 // 2) + 16 * (c % 2) + 2 * u
    else:
        x_unit = CH * c + W * u
    x_ptrs = tl.broadcast_to(x_base + x_unit, SHAPE)  # the word's first weight's x
    if QT == 5 or QT == 6:
        block = row_base + (c // 4) * TS
        cp = block + 32 * (c % 4)
    elif QT == 7:
        block = row_base + (c // 8) * TS
        cp = block + 64 * ((c // 4) % 2) + 16 * (c % 4)  # the group's 16 low-bit bytes
    else:
        block = row_base + c * TS
        cp = block
    # a chunk's fields: one pointer broadcast over its words (the same value: loaded once)
    if QT == 7:
        d_ptrs = tl.broadcast_to((block + 208).to(tl.pointer_type(tl.float16)), SHAPE)
    elif QT == 5 or QT == 6:
        d_ptrs = tl.broadcast_to(block.to(tl.pointer_type(tl.float16)), SHAPE)
    else:
        d_ptrs = tl.broadcast_to(cp.to(tl.pointer_type(tl.float16)), SHAPE)
    # a word's pointers: broadcast over the tokens (the same value: loaded and converted once)
    if QT == 0 or QT == 1:
        w_ptrs = tl.broadcast_to((cp + 2).to(tl.pointer_type(tl.uint16)) + uw, SHAPE)
    elif QT == 2:
        w_ptrs = tl.broadcast_to((cp + 4).to(tl.pointer_type(tl.uint32)) + uw, SHAPE)
    elif QT == 3:
        w_ptrs = tl.broadcast_to((cp + 6).to(tl.pointer_type(tl.uint16)) + uw, SHAPE)
        h_ptrs = tl.broadcast_to((cp + 2).to(tl.pointer_type(tl.uint16)), SHAPE)
    elif QT == 4:
        w_ptrs = tl.broadcast_to((cp + 8).to(tl.pointer_type(tl.uint32)) + uw, SHAPE)
        h_ptrs = tl.broadcast_to((cp + 4).to(tl.pointer_type(tl.uint32)), SHAPE)
    elif QT == 5:
        w_ptrs = tl.broadcast_to((cp + 16).to(tl.pointer_type(tl.uint32)) + uw, SHAPE)
        g_ptrs = tl.broadcast_to(block, SHAPE)  # K_SCALE's blocks
    elif QT == 6:
        w_ptrs = tl.broadcast_to((cp + 48).to(tl.pointer_type(tl.uint32)) + uw, SHAPE)
        h_ptrs = tl.broadcast_to((block + 16).to(tl.pointer_type(tl.uint32)) + uw, SHAPE)
        g_ptrs = tl.broadcast_to(block, SHAPE)
    else:  # Q6_K: the high bits of weights l, l + 1 at bits 2 (c % 4 // 2) of bytes 128 + 32 n + l, l + 1
        half = (c // 4) % 2
        w_ptrs = tl.broadcast_to(cp.to(tl.pointer_type(tl.uint16)) + uw, SHAPE)
        h_ptrs = tl.broadcast_to((block + 128 + 32 * half + 16 * (c % 2)).to(tl.pointer_type(tl.uint16)) + uw, SHAPE)
        s_ptrs = tl.broadcast_to(block + 192 + 8 * half + 2 * (c % 4 // 2) + c % 2, SHAPE)  # the scale of nibble 0
    acc = tl.full(SHAPE, 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        done = k0 // QK * TS
        if QT == 0 or QT == 1 or QT == 3 or QT == 7:
            units = tl.load(w_ptrs + done // 2).to(tl.uint32)
        else:
            units = tl.load(w_ptrs + done // 4)
        if QT == 0:
            units = units ^ 0x8080  # each byte q + 128
        high = units >> 16  # 32-bit words: their values at bits 16-31 (16-bit words: unused)
        d = tl.load(d_ptrs + done // 2).to(tl.float32)
        if QT == 3:  # as _gemv_kernel
            qh_lo = tl.load(h_ptrs + done // 2).to(tl.uint32) >> (2 * u)
            qh_hi = tl.load(h_ptrs + done // 2 + 1).to(tl.uint32) >> (2 * u)
        elif QT == 4:
            qh_lo = tl.load(h_ptrs + done // 4) >> (4 * u)
            qh_hi = qh_lo
        elif QT == 6:
            qh_lo = tl.load(h_ptrs + done // 4) >> (2 * (c % 4))
            qh_hi = qh_lo
        elif QT == 7:
            qh = (tl.load(h_ptrs + done // 2).to(tl.uint32) >> (2 * (c % 4 // 2))) << 4
        p0 = tl.full(SHAPE, 0.0, tl.float32)  # x . (q - OFF) of the word (Q4_K/Q5_K, Q6_K: nibble 0)
        p1 = p0  # nibble 1
        s0 = p0  # x sums, for the formats with a min
        s1 = p0
        for s in tl.static_range(H * W):  # weight W*u + w + HS*h of the chunk at bit 8w + 4h
            BIT = 8 * (s % W) + 4 * (s // W)
            P = BIT % 16
            if BIT < 16:
                src = units
            else:
                src = high
            MASK = (255 if QT == 0 else 15) << P
            OFF = 128.0 if QT == 0 else (8.0 if QT == 1 else (16.0 if QT == 3 else (32.0 if QT == 7 else 0.0)))
            bits = src & MASK
            if QT == 3 or QT == 4 or QT == 6:
                bits = bits | (FIFTH(qh_lo, qh_hi, s % W, s // W, QT) & (16 << P))
            elif QT == 7:
                bits = bits | (qh & (48 << P))
            # with the exponent 150 - P the value's bits count units: 2^(23 - P) + q, exactly
            qf = (bits | (e150 - (P << 23))).to(tl.float32, bitcast=True) - ((1 << (23 - P)) + OFF)
            if x_ptr.dtype.element_ty == tl.bfloat16:  # x of weights w and w + 1: one 32-bit load
                if s % 2 == 0:
                    pair = tl.load((x_ptrs + (k0 + s % W + HS * (s // W))).to(tl.pointer_type(tl.uint32)))
                    x = (pair << 16).to(tl.float32, bitcast=True)
                else:
                    x = (pair & 0xFFFF0000).to(tl.float32, bitcast=True)
            else:
                x = tl.load(x_ptrs + (k0 + s % W + HS * (s // W))).to(tl.float32)
            if (QT == 5 or QT == 6 or QT == 7) and s // W == 1:
                p1 = tl.fma(x, qf, p1)
                if QT != 7:
                    s1 += x
            else:
                p0 = tl.fma(x, qf, p0)
                if QT == 2 or QT == 4 or QT == 5 or QT == 6:
                    s0 += x
        if QT == 2 or QT == 4:
            m = tl.load(d_ptrs + done // 2 + 1).to(tl.float32)
            acc = tl.fma(s0, m, tl.fma(p0, d, acc))
        elif QT == 5 or QT == 6:
            dmin = tl.load(d_ptrs + done // 2 + 1).to(tl.float32)
            dd0, dm0 = K_SCALE(g_ptrs + done, 2 * (c % 4), d, dmin)
            dd1, dm1 = K_SCALE(g_ptrs + done, 2 * (c % 4) + 1, d, dmin)
            acc = tl.fma(s0, -dm0, tl.fma(p0, dd0, acc))
            acc = tl.fma(s1, -dm1, tl.fma(p1, dd1, acc))
        elif QT == 7:
            dd0, dd1 = Q6_SCALES(s_ptrs + done, d)
            acc = tl.fma(p1, dd1, tl.fma(p0, dd0, acc))
        else:
            acc = tl.fma(p0, d, acc)
    if BLOCK_T == 1:
        total = tl.reduce(tl.reduce(acc, 2, _sum_combine), 1, _sum_combine)[:, None]  # [BN, 1]
        rows = rows1[:, None]
        toks = toks1[None, :]
    elif C_LAST:
        total = tl.reduce(tl.reduce(acc, 3, _sum_combine), 2, _sum_combine)  # [BT, BN]
        rows = rows1[None, :]
        toks = toks1[:, None]
    else:
        total = tl.reduce(tl.reduce(acc, 2, _sum_combine), 1, _sum_combine)  # [BN, BT]
        rows = rows1[:, None]
        toks = toks1[None, :]
    if HAS_BIAS:
        total += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + toks.to(tl.int64) * out_stride + rows, total.to(out_ptr.dtype.element_ty),
             mask=(rows < N) & (toks < num_tokens))


gemv_few_kernel = LazyKernel(_gemv_few_kernel, do_not_specialize=("num_tokens", "one"))
