"""GGUF blocks re-laid for the GPU decode GEMV (``_triton_quant_gpu_layout``),
and the torch reference that reads the layout back.

    with_gpu_layout(packed) -> PackedWeight   the layout built, the blocks dropped (pure torch, any device)
    gpu_layout_rows_into(packed, start, stop, out)   rows start:stop, float32, bit-equal to ``dequantize``
    gpu_layout_dequantize(packed, dtype) -> [N, K]   the whole weight (``dequantize``'s values, cast)
    check_gpu_layout(packed, name)            the layout's tensors have the shapes and dtypes below

Why: Q4_0, Q8_0 and Q6_K blocks are only 2-byte aligned (18, 34, 210 bytes),
so a kernel reading them in place loads 16/32-bit words, each with its own
64-bit address and its block's scale beside it: on an H200 the one-token
GEMV read Q4_0 at ~0.86 TB/s, too few bytes in flight (docs/quantization.md).
Here every row's quant values are one run of 32-bit words, each row starting
16-byte aligned, so a thread loads 4 words (32 4-bit or 16 8-bit weights)
with one 128-bit load, and the scales are arrays of their own.

The values and scales are the file's, unchanged (no re-quantization, no
rounding): only where the bits sit moves. Per row, all tensors [N, ...]
row-major (so ``rows``, ``cat_rows`` and ``to`` are plain row gathers, cats
and copies of each):

    type  tensors (LAYOUT_FIELDS)                                  bits a weight (file)
    Q8_0  q int32 [N, K/4]; d fp16 [N, K/32]                       8.5  (8.5)
    Q4_0  q int32 [N, K/8]; d fp16 [N, K/32]                       4.5  (4.5)
    Q4_K  q int32 [N, K/8]; sc, m uint8 [N, K/32] (the 6-bit       4.625 (4.5)
          scale and min, unpacked); d, dmin fp16 [N, K/256]
    Q6_K  q int32 [N, K/8] (the low 4 bits); qh int16 [N, K/8]     6.5625 (6.5625)
          (the high 2 bits); sc int8 [N, K/16]; d fp16 [N, K/256]

Value order. A "vector" is 4 consecutive words (16 bytes, one 128-bit
load) of a row: 32 weights for the 4-bit kinds, 16 for Q8_0. Within vector
v, word j (0..3) holds

    4-bit kinds: at bits 4p..4p+3 (p = 0..7) weight 32v + 4p + j's value (Q4_0: q, Q4_K: q, Q6_K: q & 15)
    Q8_0:        at bits 8p..8p+7 (p = 0..3) weight 16v + 4p + j's int8

so field p of a vector's 4 words is 4 consecutive weights (their x is one
8-byte load of bf16). A 32-weight vector is one Q4_0 block, one Q4_K
sub-block (its sc, m), two Q6_K scale groups (p < 4 and p >= 4); a Q8_0
block is two vectors. Q6_K's high 2 bits of word j's weights are the int16
qh[j] (same index as the word): weight p < 4 at bits 4p..4p+1, p >= 4 at
bits 4(p - 4) + 2..+3, so one shift puts either half where the kernel joins
it to its low 4 bits. Rows need K a multiple of the type's block (a whole
number of vectors: every row 16-byte aligned).
"""

from __future__ import annotations

import dataclasses

import torch

from kvstrata.kernels._checks import KernelArgumentError
from kvstrata.kernels.quant import PackedWeight, _k_nibbles, _k_scale_bytes, _nibbles, check_packed

# the tensors of each type's layout, in PackedWeight.gpu_layout's order, with their dtype and
# how many weights of a row each element covers
LAYOUT_FIELDS: dict[str, tuple[tuple[str, torch.dtype, int], ...]] = {
    "Q8_0": (("q", torch.int32, 4), ("d", torch.float16, 32)),
    "Q4_0": (("q", torch.int32, 8), ("d", torch.float16, 32)),
    "Q4_K": (("q", torch.int32, 8), ("sc", torch.uint8, 32), ("m", torch.uint8, 32), ("d", torch.float16, 256),
             ("dmin", torch.float16, 256)),
    "Q6_K": (("q", torch.int32, 8), ("qh", torch.int16, 8), ("sc", torch.int8, 16), ("d", torch.float16, 256)),
}
GPU_LAYOUT_TYPES = tuple(LAYOUT_FIELDS)


def with_gpu_layout(packed: PackedWeight) -> PackedWeight:
    """``packed`` re-laid (module docstring): ``gpu_layout`` set, the GGUF
    blocks dropped (``data`` None), on the blocks' device. KernelArgumentError
    for a type without a layout or a weight whose blocks are gone."""
    name = packed.qtype.name
    if name not in LAYOUT_FIELDS:
        raise KernelArgumentError(f"no GPU layout for {name} (types {', '.join(GPU_LAYOUT_TYPES)})")
    if packed.data is None:
        raise KernelArgumentError(f"{name} {packed.shape}: its GGUF blocks are gone (re-laid or dropped for a "
                                  f"CPU path); the GPU layout is built from the blocks")
    n, k = packed.shape
    b = packed.data.view(n, -1, packed.qtype.type_size)
    tensors = _BUILD[name](b, n, k)
    return dataclasses.replace(packed, data=None, cpu_path="dequant", planes=None, gpu_layout=tensors)


def _vector_words(v: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 values [N, G, 32] (0..15) -> int32 [N, G * 4]: weight 4p + j of a group at bits 4p of word j."""
    v = v.reshape(n, -1, 4, 2, 4)  # [.., byte k, nibble h, word j]: p = 2k + h
    byte = v[:, :, :, 0, :] | (v[:, :, :, 1, :] << 4)  # [N, G, k, j]
    return byte.transpose(-1, -2).contiguous().view(torch.int32).reshape(n, -1)


def _build_q8_0(b: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, ...]:
    q = b[..., 2:].contiguous().reshape(n, -1, 4, 4)  # [N, vectors of 16, p, j]
    q = q.transpose(-1, -2).contiguous().view(torch.int32).reshape(n, -1)  # word j: bytes p = 0..3
    return q, _f16_field(b, 0)


def _build_q4_0(b: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, ...]:
    v = torch.empty(n, b.shape[1], 32, dtype=torch.uint8, device=b.device)
    _nibbles(b[..., 2:], v)
    return _vector_words(v, n), _f16_field(b, 0)


def _build_q4_k(b: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, ...]:
    v = torch.empty(n, b.shape[1], 8, 32, dtype=torch.uint8, device=b.device)
    _k_nibbles(b[..., 16:144], v)
    sc, m = _k_scale_bytes(b)
    return (_vector_words(v, n), sc.reshape(n, -1).contiguous(), m.reshape(n, -1).contiguous(), _f16_field(b, 0),
            _f16_field(b, 2))


def _q6_values(b: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [N, nb, 210] -> the 6-bit values uint8 [N, nb, 256] in weight order (``_deq_q6_k``'s)."""
    n, nb = b.shape[:2]
    q = torch.empty(n, nb, 2, 4, 32, dtype=torch.uint8, device=b.device)  # w = 128h + 32r + j
    ql = b[..., 0:128].contiguous().view(n, nb, 2, 2, 32)  # [h, r % 2, j]
    qh = b[..., 128:192].contiguous().view(n, nb, 2, 1, 32)
    q[:, :, :, 0:2] = ql & 15
    q[:, :, :, 2:4] = ql >> 4
    for r in range(4):
        q[:, :, :, r] |= ((qh[:, :, :, 0] >> (2 * r)) & 3) << 4
    return q.view(n, nb, 256)


def _build_q6_k(b: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, ...]:
    q = _q6_values(b).view(n, -1, 8, 4)  # [N, G, p, j]
    high = (q >> 4).to(torch.int16)
    qh = high[:, :, 0:4] | (high[:, :, 4:8] << 2)  # [N, G, p % 4, j]: p < 4 at bits 0-1 of slot p, p >= 4 at 2-3
    qh = sum(qh[:, :, p] << (4 * p) for p in range(4))  # [N, G, j]
    sc = b[..., 192:208].contiguous().view(torch.int8).reshape(n, -1)
    return _vector_words(q & 15, n), qh.reshape(n, -1).contiguous(), sc, _f16_field(b, 208)


def _f16_field(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte ``at`` of each block [N, nb, TS] as float16 [N, nb] (its bits, unconverted)."""
    return b[..., at:at + 2].contiguous().view(torch.float16).squeeze(-1)


_BUILD = {"Q8_0": _build_q8_0, "Q4_0": _build_q4_0, "Q4_K": _build_q4_k, "Q6_K": _build_q6_k}


# ---- the layout read back (the torch reference) ----------------------------------------------


def gpu_layout_dequantize(packed: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [N, K] from its GPU layout: ``dequantize``'s float32 values bit for bit, cast to ``dtype``."""
    check_gpu_layout(packed)
    w = torch.empty(packed.shape, dtype=torch.float32, device=packed.device)
    gpu_layout_rows_into(packed, 0, packed.out_features, w)
    return w if dtype == torch.float32 else w.to(dtype)


def gpu_layout_rows_into(packed: PackedWeight, start: int, stop: int, out: torch.Tensor) -> None:
    """Rows ``start:stop`` into ``out`` (float32 [stop - start, K], contiguous), formed with
    ``dequantize``'s float32 operations in its order (so bit-equal to it)."""
    fields = [t[start:stop] for t in packed.gpu_layout]
    _READ[packed.qtype.name](fields, out.view(stop - start, -1, 32))


def _word_values(q: torch.Tensor) -> torch.Tensor:
    """int32 words [R, W] (4-bit kinds) -> uint8 values [R, W / 4, 32] in weight order."""
    r = q.shape[0]
    byte = q.contiguous().view(torch.uint8).view(r, -1, 4, 4)  # [R, G, j, k]
    v = torch.stack((byte & 15, byte >> 4), -1)  # [R, G, j, k, h]: p = 2k + h
    return v.view(r, -1, 4, 8).transpose(-1, -2).reshape(r, -1, 32)  # [R, G, p, j] -> weight 4p + j


def _read_q8_0(f, o: torch.Tensor) -> None:
    q, d = f
    r = q.shape[0]
    v = q.contiguous().view(torch.int8).view(r, -1, 4, 4).transpose(-1, -2)  # [R, vectors, p, j]
    o.copy_(v.reshape(o.shape))
    o.mul_(d.float().unsqueeze(-1))


def _read_q4_0(f, o: torch.Tensor) -> None:
    q, d = f
    o.copy_(_word_values(q))
    o.sub_(8).mul_(d.float().unsqueeze(-1))


def _read_q4_k(f, o: torch.Tensor) -> None:
    q, sc, m, d, dmin = f
    r = q.shape[0]
    o.copy_(_word_values(q))
    dd = (d.float().unsqueeze(-1) * sc.view(r, -1, 8).float()).view(r, -1, 1)  # gguf's d * sc, per 32
    dm = (dmin.float().unsqueeze(-1) * m.view(r, -1, 8).float()).view(r, -1, 1)
    o.mul_(dd).sub_(dm)


def _read_q6_k(f, o: torch.Tensor) -> None:
    q, qh, sc, d = f
    r = q.shape[0]
    low = _word_values(q).view(r, -1, 8, 4)  # [R, G, p, j]
    h = qh.to(torch.int32).view(r, -1, 1, 4)  # [R, G, 1, j]
    shift = torch.tensor([4 * p + 2 * (p // 4) - 16 * (p // 4) for p in range(8)], dtype=torch.int32,
                         device=q.device).view(1, 1, 8, 1)  # weight p's 2 bits: 4p (p < 4), 4(p - 4) + 2
    high = ((h >> shift) & 3) << 4
    o.copy_((low.to(torch.int32) + high).view(o.shape))  # q, 0..63
    o.sub_(32)
    dd = d.float().unsqueeze(-1) * sc.view(r, -1, 16).float()  # [R, blocks, 16]: per 16 weights
    o.view(r, -1, 16).mul_(dd.view(r, -1, 1))


_READ = {"Q8_0": _read_q8_0, "Q4_0": _read_q4_0, "Q4_K": _read_q4_k, "Q6_K": _read_q6_k}


def check_gpu_layout(packed: PackedWeight, name: str = "packed") -> PackedWeight:
    """``packed.gpu_layout`` holds ``LAYOUT_FIELDS``' tensors for its type and shape, contiguous, on one
    device, and nothing beside it (``check_packed``)."""
    check_packed(packed, name, need_blocks=False)
    qt, (n, k) = packed.qtype, packed.shape
    layout = packed.gpu_layout
    if layout is None:
        raise KernelArgumentError(f"{name} has no GPU layout (with_gpu_layout builds it)")
    fields = LAYOUT_FIELDS.get(qt.name)
    if fields is None or k % qt.block:
        raise KernelArgumentError(f"{name}: no GPU layout for {qt.name} {packed.shape} (types "
                                  f"{', '.join(GPU_LAYOUT_TYPES)}, in_features a multiple of the block)")
    if len(layout) != len(fields):
        raise KernelArgumentError(f"{name}.gpu_layout has {len(layout)} tensors, {qt.name} has {len(fields)}")
    for t, (field, dtype, per) in zip(layout, fields, strict=True):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != (n, k // per):
            got = (t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
            raise KernelArgumentError(f"{name}.gpu_layout {field} must be {dtype} [{n}, {k // per}], got {got}")
        if not t.is_contiguous() or t.device != layout[0].device:
            raise KernelArgumentError(f"{name}.gpu_layout {field} must be contiguous, on {layout[0].device}")
    return packed
