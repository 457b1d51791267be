"""Quantized linear weights (llama.cpp's GGUF block formats), kept packed in
memory, and their torch reference (``dequantize``).

    PackedWeight(qtype, shape=(out, in), data)   data: uint8 [out, in // QK * TS]
    pack_weight(raw, qtype, shape, device) -> PackedWeight   (GGUF bytes, any uint8 view)
    quant_gpu_layout.with_gpu_layout(packed)                 the GPU decode layout (blocks dropped)
    packed.rows(index), cat_rows([...]), packed.to(device)
    dequantize(packed, dtype) -> [out, in]                == gguf.quants.dequantize, cast

The matmul that reads them is ``quant_linear.quant_matmul`` (Triton on a GPU,
the CPU paths of ``quant_cpu`` on a CPU, chosen per layer by
``quant_cpu.choose_cpu_path``).

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

``dequantize`` does gguf.quants' float32 operations in its order (separate
multiply and add, never fused), so it is bit-equal to
``gguf.quants.dequantize``, then rounded once to the asked dtype.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

import torch

from kvstrata.kernels._checks import KV_DTYPES, KernelArgumentError, check_tensor

# the CPU paths ``quant_cpu`` implements (a PackedWeight names the one it takes)
CPU_PATH_NAMES = ("dequant", "int4", "native")
PLANE_PATHS = ("int4", "native")  # the CPU paths that read repacked planes (the blocks may go)

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
    int4 or native path (``quant_cpu.with_cpu_path(w, "native", keep_blocks=False)``:
    then only that path can run it). ``cpu_path``: the CPU path
    ``quant_matmul`` takes ("dequant", "int4" or "native"), set by
    ``quant_cpu.with_cpu_path`` (or ``choose_cpu_path``).
    ``planes``: what the "int4" path reads (((nibbles, scales_and_zeros),)
    per plane) or the "native" path ((the tensors ``quant_native.LAYOUTS``
    names for the type),), else None.
    ``gpu_layout``: the tensors ``quant_gpu_layout.LAYOUT_FIELDS`` names for
    the type (the GPU decode GEMV's layout, every one [out_features, ...]),
    else None; set by ``quant_gpu_layout.with_gpu_layout``, which drops the
    blocks (``data`` None): the Triton kernels and the torch reference read it.
    """

    qtype: QuantType
    shape: tuple[int, int]
    data: torch.Tensor | None
    cpu_path: str = "dequant"
    planes: tuple[tuple[torch.Tensor, ...], ...] | None = None
    gpu_layout: tuple[torch.Tensor, ...] | None = None

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def device(self) -> torch.device:
        if self.data is not None:
            return self.data.device
        return self.gpu_layout[0].device if self.gpu_layout is not None else self.planes[0][0].device

    @property
    def nbytes(self) -> int:
        """Resident bytes: the blocks (unless dropped) plus any planes or GPU layout."""
        extra = sum(t.numel() * t.element_size() for plane in self.planes or () for t in plane)
        extra += sum(t.numel() * t.element_size() for t in self.gpu_layout or ())
        return (0 if self.data is None else self.data.numel()) + extra

    def to(self, device: torch.device | str) -> PackedWeight:
        """The same weight on ``device``: its blocks, or its GPU layout (the
        CPU planes are not carried)."""
        if self.gpu_layout is not None:
            return dataclasses.replace(self, gpu_layout=tuple(t.to(device) for t in self.gpu_layout))
        return PackedWeight(self.qtype, self.shape, _blocks(self).to(device))

    def rows(self, index: torch.Tensor | slice) -> PackedWeight:
        """The weight's rows ``index`` (a slice or an index tensor), e.g. to undo
        llama.cpp's q/k head permutation before packing; of the blocks, or of
        the GPU layout (a row gather of each of its tensors)."""
        if self.gpu_layout is not None:
            layout = tuple(t[index].contiguous() for t in self.gpu_layout)
            return dataclasses.replace(self, shape=(layout[0].shape[0], self.shape[1]), gpu_layout=layout)
        data = _blocks(self)[index].contiguous()
        return PackedWeight(self.qtype, (data.shape[0], self.shape[1]), data)


def _blocks(packed: PackedWeight, name: str = "packed") -> torch.Tensor:
    if packed.data is None:
        where = "re-laid for the GPU" if packed.gpu_layout is not None else "dropped for a CPU path's planes"
        raise KernelArgumentError(f"{name} has no GGUF blocks left ({where})")
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
    projection): they must share type, in_features and device, and all hold
    their blocks or all a GPU layout (each of its tensors stacked)."""
    if not weights:
        raise KernelArgumentError("weights must be a non-empty list of PackedWeight")
    first = check_packed(weights[0], "weights[0]", need_blocks=False)
    for i, w in enumerate(weights[1:], 1):
        check_packed(w, f"weights[{i}]", need_blocks=False)
        if (w.qtype, w.in_features, w.device) != (first.qtype, first.in_features, first.device):
            raise KernelArgumentError(
                f"weights[{i}] is {w.qtype.name} [{w.out_features}, {w.in_features}] on {w.device}; weights[0] "
                f"is {first.qtype.name} [{first.out_features}, {first.in_features}] on {first.device}")
    relaid = [w.gpu_layout is not None for w in weights]
    if any(relaid):
        if not all(relaid):
            raise KernelArgumentError("weights mix GGUF blocks and GPU layouts: re-lay all or none before cat_rows")
        layout = tuple(torch.cat(ts) for ts in zip(*(w.gpu_layout for w in weights), strict=True))
        return dataclasses.replace(first, shape=(layout[0].shape[0], first.in_features), gpu_layout=layout)
    data = torch.cat([_blocks(w, "weights[]") for w in weights])
    return PackedWeight(first.qtype, (data.shape[0], first.in_features), data)


def check_packed(packed: object, name: str = "packed", *, need_blocks: bool = True) -> PackedWeight:
    """``packed`` is a well-formed PackedWeight (shape, dtype and size of its
    data); its GGUF blocks must be there unless ``need_blocks`` is False."""
    if not isinstance(packed, PackedWeight):
        raise TypeError(f"{name} must be a PackedWeight, got {type(packed).__name__}")
    qt, (out_f, in_f) = packed.qtype, packed.shape
    if packed.cpu_path not in CPU_PATH_NAMES or (packed.planes is not None) != (packed.cpu_path in PLANE_PATHS):
        raise KernelArgumentError(f"{name}.cpu_path {packed.cpu_path!r} does not match its planes "
                                  f"(set it with with_cpu_path)")
    if packed.gpu_layout is not None and (packed.data is not None or packed.planes is not None):
        raise KernelArgumentError(f"{name} has a GPU layout beside its blocks or planes (with_gpu_layout drops them)")
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
    sc, mn = _k_scale_bytes(b)
    return (_f16(b, 0) * sc.float()).unsqueeze(-1), (_f16(b, 2) * mn.float()).unsqueeze(-1)


def _k_scale_bytes(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 6-bit scale and min of each 32-weight sub-block of Q4_K/Q5_K blocks,
    uint8 [..., 8] each (gguf's get_scale_min, before d and dmin multiply them)."""
    s = b[..., 4:16]
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    return torch.cat((d & 63, (md & 15) | ((d >> 2) & 48)), -1), torch.cat((m & 63, (md >> 4) | ((m >> 2) & 48)), -1)


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
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=b.device).view(4, 1)  # made on the device: no host copy
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

