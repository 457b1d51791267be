"""Quantized linear weights (llama.cpp's GGUF block formats), kept packed in
memory, and the matmul that dequantizes them on the fly.

    PackedWeight(qtype, shape=(out, in), data)   data: uint8 [out, in // QK * TS]
    pack_weight(raw, qtype, shape, device) -> PackedWeight   (GGUF bytes, any uint8 view)
    packed.rows(index), cat_rows([...]), packed.with_cpu_path(path), packed.to(device)
    dequantize(packed, dtype) -> [out, in]                == gguf.quants.dequantize, cast
    quant_matmul(x [T, in], packed, bias=None, *, out=None, scratch=None, impl="auto") -> [T, out]
    choose_cpu_path(packed, sample_tokens=(1, 16)) -> CpuChoice   (one-time benchmark)

Layout: ``data`` is the tensor's GGUF bytes unchanged, one weight row per
row (GGUF blocks never straddle rows), so the resident size is the file's
and any row subset or permutation (llama.cpp's q/k head permutation, a
fused qkv of one type) is a row gather of ``data``. Per block of QK weights
(TS bytes; d, dmin: fp16; multi-byte fields little-endian):

    type  QK  TS   block                                      weight
    Q8_0  32  34   d | q:int8 x32                             d*q
    Q4_0  32  18   d | 16 B: nibbles, low = w0..15            d*(q-8)
    Q4_1  32  20   d m | 16 B                                 d*q + m
    Q5_0  32  22   d | qh:u32 (bit j = w_j's 5th bit) | 16 B  d*(q-16)
    Q5_1  32  24   d m | qh | 16 B                            d*q + m
    Q4_K 256 144   d dmin | 12 B: 8 x (6-bit sc, 6-bit m) | 128 B nibbles
                   sub-block s (32 w) = nibble s%2 of bytes 32*(s//2)..   (d*sc_s)*q - dmin*m_s
    Q5_K 256 176   as Q4_K, then qh 32 B (bit s of byte j = w_{32s+j}'s 5th bit) before the nibbles
    Q6_K 256 210   ql 128 B | qh 64 B | 16 x int8 scale | d    (d*scale_{w/16})*(q-32)
                   w = 128h + 32r + j: low 4 bits nibble r//2 of ql[64h + 32(r%2) + j],
                   high 2 bits (qh[32h + j] >> 2r) & 3

Exactness and tolerance (S = |x| @ |W|.T + |bias|, the scale of the sum's terms):

    dequantize                 bit-equal to gguf.quants.dequantize, then one rounding to dtype
    CPU "dequant" path         bit-equal to quant_matmul_ref = F.linear(x, dequantize(W, x.dtype), bias)
    Triton kernel              fp32 x: |err| <= K * 2^-24 * S (any order of a K-term fp32 sum)
                               bf16 x: <= 2^-7 * S (weights and sum rounded to bf16, 2^-9 each)
    CPU "int4" path            <= 2^-7 * S (bf16 x, scales and plane sums; measured <= 2^-8 * S)

``dequantize`` does gguf.quants' float32 operations in its order (separate
multiply and add, never fused). The Triton kernel rebuilds each weight with
the same operations (fp-contraction off), so it multiplies by the very same
fp32 weights and differs from the reference by accumulation order only (and
for bf16 x by when the weights and the sum round to bf16).

CPU paths (``quant_matmul`` with impl "auto"/"torch" on CPU; ``packed.cpu_path``):

    "dequant"  dequantize 2^20-weight row chunks into ``scratch`` (reused,
               one per model) and F.linear each: exact, any type, resident
               memory = the blocks. Slow: ~10 torch ops per chunk, 3-6x
               dense fp32 on the bench machine.
    "int4"     torch's ``_weight_int4pack_mm_for_cpu`` (bf16) on repacked
               planes, w = sum_p (q_p - 8) * s_p + z_p per 32 weights: one plane
               for Q4_0/Q4_1/Q4_K, two (low nibble, high bits) for
               Q5_0/Q5_1/Q5_K/Q8_0. Needs out_features % 16 == 0. Each plane
               adds 0.625 B/weight on top of the blocks. Q6_K has no int4 form
               (its scales cover 16 weights; the kernel's groups are 32..256).
               Its fp32 variant is the op's slow reference (~10x dense): unused.
               ``with_cpu_path("int4", keep_blocks=False)`` drops the blocks:
               resident = planes only (Q4_*: 1.0-1.1x the file's bytes).

Not candidates: ``_weight_int8pack_mm`` (one scale per output row: Q8_0's
per-32 scales would have to be requantized, off by up to half a step of the
row's largest block), and a torch.compile'd dequantize (75 s to compile one
shape here, and still ~6x slower than the dense matmul it would feed).

``choose_cpu_path`` times the candidates (and "dense", the dequantize-at-load
baseline) on the layer at load and returns the fastest; "int4" is offered
for bf16 activations only and must beat "dequant" by 10 %. Measured with
``tools/bench_quant.py --quick`` (1 thread of a shared, heavily loaded 2-core
AMD EPYC with AVX512-bf16; two runs; ms for the SmolLM2 layer set
qkv+o+gate_up+down in Q4_1, and for one 8B gate [14336, 4096] in Q4_K):

                      int4 (bf16)   dense fp32   dense bf16   dequant fp32
    SmolLM2 Q4_1 T=1     0.30          0.8-1.0      0.9          3.1-4.0
    SmolLM2 Q4_1 T=16    1.5           2.5          1.4          4.5-5.9
    8B Q4_K      T=1     3.7-7.4      16-23        24-30        69-107
    8B Q4_K      T=16     40-57      124-140       36-40       137-190

So on a CPU: bf16 activations with "int4" where the type has it (2.7-4.3x
dense fp32 at decode; at 16 tokens 1.7-2.5x dense fp32, 0.7-1x dense bf16),
dense weights where memory allows otherwise; "dequant" is the exact
low-memory fallback.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvstrata.kernels._checks import (
    KV_DTYPES,
    KernelArgumentError,
    check_inner_contiguous,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
)
from kvstrata.kernels.dispatch import is_interpreted, use_triton


class QuantType(NamedTuple):
    """One GGUF block format: ggml type id, weights per block, bytes per block."""

    name: str
    ggml_id: int
    block: int
    type_size: int


QUANT_TYPES: dict[str, QuantType] = {
    t.name: t
    for t in (
        QuantType("Q4_0", 2, 32, 18),
        QuantType("Q4_1", 3, 32, 20),
        QuantType("Q5_0", 6, 32, 22),
        QuantType("Q5_1", 7, 32, 24),
        QuantType("Q8_0", 8, 32, 34),
        QuantType("Q4_K", 12, 256, 144),
        QuantType("Q5_K", 13, 256, 176),
        QuantType("Q6_K", 14, 256, 210),
    )
}
_BY_ID = {t.ggml_id: t for t in QUANT_TYPES.values()}


def quant_type(qtype: object) -> QuantType:
    """The block format named by ``qtype``: a name ("Q4_K"), a ggml type id
    (12) or ``gguf.GGMLQuantizationType.Q4_K``. KernelArgumentError naming the
    type when it is not one this module packs (the caller dequantizes those)."""
    if isinstance(qtype, QuantType):
        return qtype
    if isinstance(qtype, enum.Enum):  # before int: GGMLQuantizationType is an IntEnum
        found = QUANT_TYPES.get(qtype.name)
    elif isinstance(qtype, str):
        found = QUANT_TYPES.get(qtype)
    elif isinstance(qtype, int) and not isinstance(qtype, bool):
        found = _BY_ID.get(qtype)
    else:
        found = None
    if found is None:
        raise KernelArgumentError(
            f"qtype {qtype!r} is not a packed quant type (supported: {', '.join(QUANT_TYPES)})"
        )
    return found


@dataclasses.dataclass(frozen=True, eq=False)
class PackedWeight:
    """A linear weight [out_features, in_features] kept in GGUF blocks.

    ``data``: uint8 [out_features, in_features // block * type_size], the
    GGUF bytes of each weight row (contiguous); None once dropped for the
    int4 path (``with_cpu_path("int4", keep_blocks=False)``: then only that
    path can run it). ``cpu_path``: the CPU path ``quant_matmul`` takes
    ("dequant" or "int4"), set by ``with_cpu_path`` (or ``choose_cpu_path``).
    ``int4``: the planes the "int4" path reads, else None.
    """

    qtype: QuantType
    shape: tuple[int, int]
    data: torch.Tensor | None
    cpu_path: str = "dequant"
    int4: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None  # (nibbles, scales_and_zeros) per plane

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def device(self) -> torch.device:
        return self.data.device if self.data is not None else self.int4[0][0].device

    @property
    def nbytes(self) -> int:
        """Resident bytes: the blocks (unless dropped) plus any int4 planes."""
        extra = sum(t.numel() * t.element_size() for plane in self.int4 or () for t in plane)
        return (0 if self.data is None else self.data.numel()) + extra

    def with_cpu_path(self, path: str, *, keep_blocks: bool = True) -> PackedWeight:
        """This weight with ``path`` ("dequant" or "int4") as its CPU path,
        repacked for it (KernelArgumentError if the path cannot take it).
        ``keep_blocks=False`` (int4 only) drops the GGUF blocks: resident
        memory is then the planes alone, but ``dequantize``, the Triton
        kernel and ``rows`` / ``to`` / the other path no longer work."""
        if path not in CPU_PATHS:
            raise KernelArgumentError(f"path must be one of {', '.join(CPU_PATHS)}, got {path!r}")
        if not keep_blocks and path != "int4":
            raise KernelArgumentError(f"keep_blocks=False needs path 'int4' (the {path!r} path reads the blocks)")
        if self.data is None:
            if path == "int4" and not keep_blocks:
                return self
            raise KernelArgumentError("packed has no GGUF blocks left (dropped for the int4 path)")
        weight = self if path == self.cpu_path == "int4" else CPU_PATHS[path].prepare(self)
        return weight if keep_blocks else dataclasses.replace(weight, data=None)

    def to(self, device: torch.device | str) -> PackedWeight:
        """The same weight on ``device`` (the int4 planes, CPU only, are not carried)."""
        return PackedWeight(self.qtype, self.shape, _blocks(self).to(device))

    def rows(self, index: torch.Tensor | slice) -> PackedWeight:
        """The weight's rows ``index`` (a slice or an index tensor), e.g. to undo
        llama.cpp's q/k head permutation before packing."""
        data = _blocks(self)[index].contiguous()
        return PackedWeight(self.qtype, (data.shape[0], self.shape[1]), data)


def _blocks(packed: PackedWeight, name: str = "packed") -> torch.Tensor:
    if packed.data is None:
        raise KernelArgumentError(f"{name} has no GGUF blocks left (dropped for the int4 CPU path)")
    return packed.data


def pack_weight(
    raw: torch.Tensor, qtype: object, shape: tuple[int, int] | torch.Size, device: torch.device | str | None = None
) -> PackedWeight:
    """A ``PackedWeight`` of ``shape`` [out, in] from its GGUF bytes ``raw``
    (uint8, any shape holding ``out * in // block * type_size`` bytes, e.g. a
    view of the file's mmap), copied once to ``device`` (default: raw's), so
    the result owns its memory."""
    qt = quant_type(qtype)
    if not isinstance(raw, torch.Tensor):
        raise TypeError(f"raw must be a torch.Tensor, got {type(raw).__name__}")
    if raw.dtype != torch.uint8:
        raise KernelArgumentError(f"raw dtype must be uint8 (the GGUF bytes), got {raw.dtype}")
    if len(shape) != 2 or any(not isinstance(n, int) or n <= 0 for n in shape):
        raise KernelArgumentError(f"shape must be (out_features, in_features) > 0, got {tuple(shape)}")
    out_f, in_f = int(shape[0]), int(shape[1])
    if in_f % qt.block:
        raise KernelArgumentError(
            f"shape {(out_f, in_f)}: in_features must be a multiple of {qt.name}'s block of {qt.block}"
        )
    row_bytes = in_f // qt.block * qt.type_size
    if raw.numel() != out_f * row_bytes:
        raise KernelArgumentError(
            f"raw has {raw.numel()} bytes, {qt.name} {(out_f, in_f)} needs {out_f * row_bytes}"
        )
    data = raw.reshape(out_f, row_bytes)
    device = raw.device if device is None else torch.device(device)
    data = data.clone(memory_format=torch.contiguous_format) if device == raw.device else data.to(device)
    return PackedWeight(qt, (out_f, in_f), data.contiguous())


def cat_rows(weights: list[PackedWeight] | tuple[PackedWeight, ...]) -> PackedWeight:
    """One weight of the rows of ``weights`` stacked (a fused qkv or gate/up
    projection): they must share type, in_features and device."""
    if not weights:
        raise KernelArgumentError("weights must be a non-empty list of PackedWeight")
    first = check_packed(weights[0], "weights[0]")
    for i, w in enumerate(weights[1:], 1):
        check_packed(w, f"weights[{i}]")
        if (w.qtype, w.in_features, w.device) != (first.qtype, first.in_features, first.device):
            raise KernelArgumentError(
                f"weights[{i}] is {w.qtype.name} [{w.out_features}, {w.in_features}] on {w.device}; weights[0] "
                f"is {first.qtype.name} [{first.out_features}, {first.in_features}] on {first.device}")
    data = torch.cat([w.data for w in weights])
    return PackedWeight(first.qtype, (data.shape[0], first.in_features), data)


def check_packed(packed: object, name: str = "packed", *, need_blocks: bool = True) -> PackedWeight:
    """``packed`` is a well-formed PackedWeight (shape, dtype and size of its
    data); its GGUF blocks must be there unless ``need_blocks`` is False."""
    if not isinstance(packed, PackedWeight):
        raise TypeError(f"{name} must be a PackedWeight, got {type(packed).__name__}")
    qt, (out_f, in_f) = packed.qtype, packed.shape
    if packed.cpu_path not in CPU_PATHS or (packed.int4 is not None) != (packed.cpu_path == "int4"):
        raise KernelArgumentError(f"{name}.cpu_path {packed.cpu_path!r} does not match its int4 planes "
                                  f"(set it with with_cpu_path)")
    if packed.data is None and not need_blocks:
        return packed
    check_tensor(f"{name}.data", _blocks(packed, name), 2, (torch.uint8,))
    if in_f % qt.block or tuple(packed.data.shape) != (out_f, in_f // qt.block * qt.type_size):
        raise KernelArgumentError(
            f"{name}.data must be [{out_f}, {in_f} // {qt.block} * {qt.type_size}] for {qt.name} "
            f"{(out_f, in_f)}, got shape {tuple(packed.data.shape)}"
        )
    if not packed.data.is_contiguous():
        raise KernelArgumentError(f"{name}.data must be contiguous")
    return packed


# ---- dequantize (the torch reference) ---------------------------------------------------


def dequantize(packed: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [out, in] in ``dtype``: gguf.quants.dequantize's float32 values, cast."""
    check_packed(packed)
    if dtype not in KV_DTYPES:
        raise KernelArgumentError(f"dtype must be one of float32, float16, bfloat16, got {dtype}")
    w = torch.empty(packed.shape, dtype=torch.float32, device=packed.device)
    dequantize_rows_into(packed, 0, packed.out_features, w)
    return w if dtype == torch.float32 else w.to(dtype)


def dequantize_rows_into(packed: PackedWeight, start: int, stop: int, out: torch.Tensor) -> None:
    """Rows ``start:stop`` of the weight into ``out`` (float32, contiguous, [stop-start, in])."""
    qt = packed.qtype
    blocks = packed.data[start:stop].view(stop - start, -1, qt.type_size)
    _DEQUANT[qt.name](blocks, out.view(stop - start, -1, qt.block))


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte ``at`` of each block, as float32 [..., 1]."""
    return b[..., at:at + 2].view(torch.float16).float()


# Byte fields are copied out of the blocks (contiguous) before any bit
# arithmetic: torch's elementwise ops on the strided field views run several
# times slower than a copy plus the same ops on contiguous bytes.


def _nibbles(qs: torch.Tensor, o: torch.Tensor) -> None:
    """Low nibbles of ``qs`` [..., n] into o[..., :n], high nibbles into o[..., n:]."""
    n = qs.shape[-1]
    qs = qs.contiguous()
    o[..., :n].copy_(qs & 15)
    o[..., n:].copy_(qs >> 4)


def _bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """uint8 [..., count, n]: bit i of every byte of ``qh`` [..., n] at [..., i, :]."""
    shifts = torch.arange(count, dtype=torch.uint8, device=qh.device).view(count, 1)
    return (qh.contiguous().unsqueeze(-2) >> shifts) & 1


def _deq_q8_0(b: torch.Tensor, o: torch.Tensor) -> None:
    o.copy_(b[..., 2:].view(torch.int8))
    o.mul_(_f16(b, 0))


def _deq_q4_0(b: torch.Tensor, o: torch.Tensor) -> None:
    _nibbles(b[..., 2:], o)
    o.sub_(8).mul_(_f16(b, 0))


def _deq_q4_1(b: torch.Tensor, o: torch.Tensor) -> None:
    _nibbles(b[..., 4:], o)
    o.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """16 * (5th bit) of each of a block's 32 weights, from its 4 qh bytes: uint8 [..., 32]
    (weight j's bit is bit j % 8 of byte j // 8)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return (((qh.contiguous().unsqueeze(-1) >> shifts) & 1) << 4).flatten(-2)


def _deq_q5_0(b: torch.Tensor, o: torch.Tensor) -> None:
    _nibbles(b[..., 6:], o)
    o.add_(_q5_high(b[..., 2:6])).sub_(16).mul_(_f16(b, 0))


def _deq_q5_1(b: torch.Tensor, o: torch.Tensor) -> None:
    _nibbles(b[..., 8:], o)
    o.add_(_q5_high(b[..., 4:8])).mul_(_f16(b, 0)).add_(_f16(b, 2))


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d * sc, dmin * m), float32 [..., 8, 1], of Q4_K/Q5_K blocks (gguf's get_scale_min)."""
    s = b[..., 4:16]
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((d & 63, (md & 15) | ((d >> 2) & 48)), -1)
    mn = torch.cat((m & 63, (md >> 4) | ((m >> 2) & 48)), -1)
    return (_f16(b, 0) * sc.float()).unsqueeze(-1), (_f16(b, 2) * mn.float()).unsqueeze(-1)


def _k_nibbles(qs: torch.Tensor, o: torch.Tensor) -> None:
    """Q4_K/Q5_K's 128 nibble bytes into o [..., 8, 32]: sub-block s = nibble s%2 of bytes 32*(s//2)."""
    pairs = o.unflatten(-2, (4, 2))
    chunks = qs.contiguous().unflatten(-1, (4, 32))
    pairs[..., 0, :].copy_(chunks & 15)
    pairs[..., 1, :].copy_(chunks >> 4)


def _deq_q4_k(b: torch.Tensor, o: torch.Tensor) -> None:
    o = o.unflatten(-1, (8, 32))
    _k_nibbles(b[..., 16:144], o)
    dd, dm = _k_scales(b)
    o.mul_(dd).sub_(dm)


def _deq_q5_k(b: torch.Tensor, o: torch.Tensor) -> None:
    o = o.unflatten(-1, (8, 32))
    _k_nibbles(b[..., 48:176], o)
    o.add_(_bits(b[..., 16:48], 8) << 4)
    dd, dm = _k_scales(b)
    o.mul_(dd).sub_(dm)


def _deq_q6_k(b: torch.Tensor, o: torch.Tensor) -> None:
    o4 = o.unflatten(-1, (2, 4, 32))  # w = 128h + 32r + j
    ql = b[..., 0:128].contiguous().unflatten(-1, (2, 2, 32))  # [h, r%2, j]
    qh = b[..., 128:192].contiguous().unflatten(-1, (2, 1, 32))  # [h, 1, j]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(4, 1)
    high = ((qh >> shifts) & 3) << 4  # [h, r, j]
    o4[..., 0:2, :].copy_(ql & 15)
    o4[..., 2:4, :].copy_(ql >> 4)
    o.add_(high.flatten(-3)).sub_(32)
    dd = _f16(b, 208) * b[..., 192:208].view(torch.int8).float()  # [..., 16]
    o.unflatten(-1, (16, 16)).mul_(dd.unsqueeze(-1))


_DEQUANT = {
    "Q8_0": _deq_q8_0,
    "Q4_0": _deq_q4_0,
    "Q4_1": _deq_q4_1,
    "Q5_0": _deq_q5_0,
    "Q5_1": _deq_q5_1,
    "Q4_K": _deq_q4_k,
    "Q5_K": _deq_q5_k,
    "Q6_K": _deq_q6_k,
}


# ---- quant_matmul ------------------------------------------------------------------------


def quant_matmul(
    x: torch.Tensor,
    packed: PackedWeight,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    scratch: QuantScratch | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """``x @ W.T + bias`` [T, out_features] for x [T, in_features] (last dim
    contiguous) and W = the packed weight, never materialised whole.

    ``out``: a [T, out_features] buffer in x's dtype, any row stride (e.g. a
    column slice of a fused qkv output). ``scratch``: the buffers the CPU
    "dequant" path reuses (one per model); without it each call allocates.
    CUDA: the Triton kernel (impl "auto"/"triton") or ``quant_matmul_ref``
    ("torch"). CPU: ``packed.cpu_path`` ("auto"/"torch"), or the kernel in
    the Triton interpreter ("triton", or "auto" under TRITON_INTERPRET).
    """
    triton = use_triton(impl, x.device)
    _check_matmul_args(x, packed, bias, out, scratch, need_blocks=triton or x.device.type != "cpu")
    if out is None:
        out = torch.empty((x.shape[0], packed.out_features), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    if triton:
        _matmul_triton(x, packed, bias, out)
    elif x.device.type == "cpu":
        CPU_PATHS[packed.cpu_path].matmul(x, packed, bias, out, scratch)
    else:
        out.copy_(quant_matmul_ref(x, packed, bias))
    return out


def quant_matmul_ref(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference: F.linear with the weight dequantized to x's dtype (no checks)."""
    return F.linear(x, dequantize(packed, x.dtype), bias)


def _matmul_triton(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    from kvstrata.kernels._triton_quant import quant_matmul_triton

    qt = packed.qtype
    # the interpreter's fp32 -> bf16/fp16 casts truncate: it writes fp32, torch rounds
    direct = out.dtype == torch.float32 or not is_interpreted(x.device)
    dest = out if direct else torch.empty(out.shape, dtype=torch.float32, device=out.device)
    quant_matmul_triton(x, packed.data, qt.name, qt.block, qt.type_size, packed.out_features, bias, dest)
    if not direct:
        out.copy_(dest)


def _check_matmul_args(x, packed, bias, out, scratch, need_blocks: bool) -> None:
    check_packed(packed, need_blocks=need_blocks)
    check_tensor("x", x, 2, KV_DTYPES)
    check_inner_contiguous("x", x, 1)
    if x.shape[1] != packed.in_features:
        raise KernelArgumentError(
            f"x must have {packed.in_features} columns (the weight's in_features), got shape {tuple(x.shape)}"
        )
    tensors = {"x": x, "packed": packed.data if packed.data is not None else packed.int4[0][0]}
    if bias is not None:
        check_tensor("bias", bias, 1, KV_DTYPES)
        check_shape("bias", bias, (packed.out_features,))
        check_same_dtype("x", x, bias=bias)
        check_inner_contiguous("bias", bias, 1)
        tensors["bias"] = bias
    if out is not None:
        check_tensor("out", out, 2, KV_DTYPES)
        check_shape("out", out, (x.shape[0], packed.out_features))
        check_same_dtype("x", x, out=out)
        check_inner_contiguous("out", out, 1)
        tensors["out"] = out
    check_same_device(**tensors)
    if scratch is not None and not isinstance(scratch, QuantScratch):
        raise TypeError(f"scratch must be a QuantScratch or None, got {type(scratch).__name__}")


# ---- CPU paths ---------------------------------------------------------------------------

# weights dequantized per chunk of the "dequant" path: 4 MB of float32, still
# in the last-level cache when F.linear reads it, and few enough chunks that
# the ~15 torch ops per chunk (each a parallel region) stay cheap
_CHUNK_WEIGHTS = 1 << 20


class QuantScratch:
    """Reusable buffers of the CPU "dequant" path, grown to the largest chunk.

    Owns: one flat float32 buffer (the dequantized chunk) and one per other
    activation dtype (the chunk rounded to it). One per model: its layers
    run one at a time, so one chunk-sized buffer serves them all.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer of at least ``numel`` elements (contents undefined)."""
        buf = self._buffers.get((dtype, device))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[(dtype, device)] = buf
        return buf[:numel]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class DequantPath:
    """Dequantize row chunks into the scratch buffer, F.linear each chunk.
    Exact: each chunk is ``dequantize``'s rows, in x's dtype."""

    name = "dequant"
    exact = True

    @staticmethod
    def available(packed: PackedWeight) -> bool:
        return True

    @staticmethod
    def prepare(packed: PackedWeight) -> PackedWeight:
        return dataclasses.replace(packed, cpu_path="dequant", int4=None)

    @staticmethod
    def matmul(x, packed, bias, out, scratch) -> None:
        n, k = packed.shape
        rows = max(1, min(n, _CHUNK_WEIGHTS // k))
        scratch = scratch if scratch is not None else QuantScratch()
        f32 = scratch.get(rows * k, torch.float32, x.device)
        low = None if x.dtype == torch.float32 else scratch.get(rows * k, x.dtype, x.device)
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            w = f32[: (stop - start) * k].view(stop - start, k)
            dequantize_rows_into(packed, start, stop, w)
            if low is not None:
                w = low[: w.numel()].view(w.shape).copy_(w)
            b = None if bias is None else bias[start:stop]
            out[:, start:stop].copy_(F.linear(x, w, b))


# Q types as int4 planes: w = sum over planes of (q_p - 8) * s_p + z_p, per 32
# weights. Every z is 0 or a power-of-two multiple of its s where the format
# has no free offset, so rounding s to bf16 scales the group, never shifts it.
def _int4_planes(packed: PackedWeight) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """[(q uint8 [N, K] in 0..15, s float32 [N, K/32], z float32 [N, K/32])]."""
    name, (n, k) = packed.qtype.name, packed.shape
    b = packed.data.view(n, -1, packed.qtype.type_size)
    if name in ("Q4_K", "Q5_K"):
        q = torch.empty(n, b.shape[1], 8, 32, dtype=torch.uint8)
        _k_nibbles(b[..., 16:144] if name == "Q4_K" else b[..., 48:176], q)
        dd, dm = (t.squeeze(-1) for t in _k_scales(b))
        if name == "Q4_K":
            return [(q.view(n, k), dd.view(n, -1), (8 * dd - dm).view(n, -1))]
        high = _bits(b[..., 16:48], 8)
        return [(q.view(n, k), dd.view(n, -1), (8 * dd - dm).view(n, -1)),
                (high.reshape(n, k), (16 * dd).view(n, -1), (128 * dd).view(n, -1))]
    d = _f16(b, 0).squeeze(-1)
    q = torch.empty(n, b.shape[1], 32, dtype=torch.uint8)
    if name == "Q8_0":
        u = b[..., 2:] ^ 128  # int8 q + 128 = lo + 16 * hi
        return [((u & 15).reshape(n, k), d, 8 * d), ((u >> 4).reshape(n, k), 16 * d, torch.zeros_like(d))]
    qs_at = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[name]
    _nibbles(b[..., qs_at:qs_at + 16], q)
    m = _f16(b, 2).squeeze(-1) if name in ("Q4_1", "Q5_1") else None
    if name == "Q4_0":
        return [(q.view(n, k), d, torch.zeros_like(d))]
    if name == "Q4_1":
        return [(q.view(n, k), d, m + 8 * d)]
    high = (_q5_high(b[..., qs_at - 4:qs_at]) >> 4).reshape(n, k)
    low_z = -8 * d if name == "Q5_0" else m + 8 * d
    return [(q.view(n, k), d, low_z), (high, 16 * d, 128 * d)]


_INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q8_0")


class Int4Path:
    """torch's CPU weight-only int4 matmul (bf16) on repacked planes: one for
    the Q4 types, two (low nibble, high bits) for Q5 and Q8_0. Not exact:
    scales and offsets round to bf16, x runs in bf16."""

    name = "int4"
    exact = False

    @staticmethod
    def available(packed: PackedWeight) -> bool:
        return (packed.device.type == "cpu" and packed.qtype.name in _INT4_TYPES
                and packed.out_features % 16 == 0 and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"))

    @staticmethod
    def prepare(packed: PackedWeight) -> PackedWeight:
        if not Int4Path.available(packed):
            raise KernelArgumentError(
                f"packed: the int4 CPU path needs a CPU weight of type {', '.join(_INT4_TYPES)} with "
                f"out_features % 16 == 0, got {packed.qtype.name} {packed.shape} on {packed.device}")
        planes = []
        for q, s, z in _int4_planes(packed):
            w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            sz = torch.stack((s, z), -1).transpose(0, 1).to(torch.bfloat16).contiguous()
            planes.append((w, sz))
        return dataclasses.replace(packed, cpu_path="int4", int4=tuple(planes))

    @staticmethod
    def matmul(x, packed, bias, out, scratch) -> None:
        xb = x.to(torch.bfloat16).contiguous()
        y = None
        for w, sz in packed.int4:
            part = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w, 32, sz).float()
            y = part if y is None else y.add_(part)
        if bias is not None:
            y.add_(bias)
        out.copy_(y)


CPU_PATHS: dict[str, type] = {"dequant": DequantPath, "int4": Int4Path}


# ---- choosing a CPU path at load ----------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class CpuChoice:
    """What ``choose_cpu_path`` measured. ``times_ms[path][tokens]``: the best
    of its runs, for every candidate and for "dense" (F.linear on the weight
    dequantized to ``dtype``: what dequantize-at-load would cost, for the
    loader to weigh against memory). ``weight``: the packed weight prepared
    for ``path`` (repacked when "int4")."""

    path: str
    dtype: torch.dtype
    times_ms: dict[str, dict[int, float]]
    weight: PackedWeight


def choose_cpu_path(
    packed: PackedWeight,
    sample_tokens: tuple[int, ...] = (1, 16),
    *,
    dtype: torch.dtype = torch.float32,
    reps: int = 5,
    ring_bytes: int = 64 << 20,
    margin: float = 0.1,
) -> CpuChoice:
    """Time each CPU path that can run ``packed`` for activations of ``dtype``
    at each token count, and pick the fastest by summed time.

    The inexact "int4" path (bf16 compute) is a candidate for bf16
    activations only, and must beat "dequant" by ``margin``. Each candidate
    cycles through copies of the weight totalling ``ring_bytes`` (a cold
    cache, as in a forward pass whose weights exceed the last-level cache),
    and candidates take turns, so a burst of load from other processes
    lands on all of them; the best of ``reps`` runs counts (a candidate 3x
    behind the leader after two runs gets no more). The result
    depends only on (qtype, shape, dtype): a loader measures each distinct
    one once and reuses the answer for the other layers.
    """
    check_packed(packed)
    if packed.device.type != "cpu":
        raise KernelArgumentError(f"packed must be on the CPU to choose a CPU path, got {packed.device}")
    if dtype not in KV_DTYPES:
        raise KernelArgumentError(f"dtype must be one of float32, float16, bfloat16, got {dtype}")
    if not sample_tokens or any(not isinstance(t, int) or t <= 0 for t in sample_tokens):
        raise KernelArgumentError(f"sample_tokens must be positive token counts, got {sample_tokens!r}")
    weights = {name: path.prepare(packed) for name, path in CPU_PATHS.items()
               if path.available(packed) and (path.exact or dtype == torch.bfloat16)}
    runners = {name: _ring_runner(w, ring_bytes) for name, w in weights.items()}
    runners["dense"] = _dense_runner(packed, dtype, ring_bytes)
    times: dict[str, dict[int, float]] = {name: {} for name in runners}
    gen = torch.Generator().manual_seed(0)
    for tokens in sample_tokens:
        x = torch.randn(tokens, packed.in_features, generator=gen).to(dtype)
        best = {name: float("inf") for name in runners}
        for rep in range(reps + 1):  # the first turn warms up
            leader = min(best[name] for name in weights)
            for name, run in runners.items():
                # a path 3x behind after two runs is out of the race: no more of its (slow) runs
                if rep < 2 or best[name] <= 3 * leader:
                    best[name] = min(best[name], run(x))
        for name in runners:
            times[name][tokens] = round(best[name] * 1e3, 4)
    total = {name: sum(times[name].values()) for name in weights}
    path = min(total, key=total.__getitem__)
    if not CPU_PATHS[path].exact and total[path] > (1 - margin) * total["dequant"]:
        path = "dequant"
    return CpuChoice(path, dtype, times, weights[path])


def _ring_runner(weight: PackedWeight, ring_bytes: int):
    copies = [weight] + [_clone(weight) for _ in range(max(0, min(64, ring_bytes // weight.nbytes) - 1))]
    scratch = QuantScratch()
    turn = itertools.count()

    def run(x: torch.Tensor) -> float:
        w = copies[next(turn) % len(copies)]
        out = torch.empty(x.shape[0], w.out_features, dtype=x.dtype)
        start = time.perf_counter()
        CPU_PATHS[w.cpu_path].matmul(x, w, None, out, scratch)
        return time.perf_counter() - start

    return run


def _dense_runner(packed: PackedWeight, dtype: torch.dtype, ring_bytes: int):
    first = dequantize(packed, dtype)
    copies = [first] + [first.clone() for _ in range(max(0, min(64, ring_bytes // first.nbytes) - 1))]
    turn = itertools.count()

    def run(x: torch.Tensor) -> float:
        w = copies[next(turn) % len(copies)]
        start = time.perf_counter()
        F.linear(x, w)
        return time.perf_counter() - start

    return run


def _clone(w: PackedWeight) -> PackedWeight:
    int4 = None if w.int4 is None else tuple((a.clone(), b.clone()) for a, b in w.int4)
    return dataclasses.replace(w, data=w.data.clone(), int4=int4)
