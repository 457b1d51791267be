"""GGUF blocks re-laid for the native CPU kernels, and rows read back.

    native_planes(packed) -> tuple of tensors     the layout ``quant_native.LAYOUTS[qtype]`` names
    native_rows(packed, ids, dtype) -> [T, in]    rows from the planes, bit-equal to ``dequantize``
    int4_nibbles(w, n, k, ids) -> uint8 [T, K]    the 4-bit values of rows in torch's CPU int4 layout

The planes hold the file's integers and scales unchanged (no rounding): the
4-bit low parts of every weight as 64-row blocks of nibbles (torch's CPU
int4 layout), the bits above them (Q5 kinds 1, Q6_K 2) in bit planes,
Q8_0's int8 values as column pairs, and the scales as [groups, N] tensors
in the file's own types (fp16 d and m; the K-quants' 6-bit sc and min as
uint8, their d and dmin as fp16). ``native_rows`` forms each weight with
``dequantize``'s float32 operations, so a tied embedding read from the
lm_head's planes is exact. Pure torch: no native code runs here.
"""

from __future__ import annotations

import torch

from kvstrata.kernels._checks import KernelArgumentError
from kvstrata.kernels.quant import PackedWeight, _bits, _k_nibbles, _k_scale_bytes, _nibbles, _q5_high
from kvstrata.kernels.quant_native import LAYOUTS


def native_planes(packed: PackedWeight) -> tuple[torch.Tensor, ...]:
    """The tensors ``LAYOUTS[packed.qtype.name]`` names, from the blocks."""
    name, (n, k) = packed.qtype.name, packed.shape
    if name not in LAYOUTS or n % 64 or packed.data is None:
        raise KernelArgumentError(f"no native layout for {name} {packed.shape} (types {', '.join(LAYOUTS)}, "
                                  f"out_features % 64 == 0, the blocks kept)")
    b = packed.data.view(n, -1, packed.qtype.type_size)
    if name == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).reshape(n // 64, 64, k // 2, 2).transpose(1, 2).contiguous()
        return q, _groups(_f16_bits(b, 0), n)
    q, scales = _values_and_scales(name, b)
    q = q.view(n // 64, 64, k)
    out = [((q[:, :32] & 15) | ((q[:, 32:] & 15) << 4)).transpose(1, 2).contiguous()]  # lo [N/64, K, 32]
    if name in ("Q5_0", "Q5_1", "Q5_K"):  # byte i of a column: rows i + 8j at bit j
        h = ((q >> 4) & 1).view(n // 64, 8, 8, k)
        out.append(sum(h[:, j] << j for j in range(8)).transpose(1, 2).contiguous())
    elif name == "Q6_K":  # byte i of a column: rows i + 16j at bits 2j, 2j+1
        h = (q >> 4).view(n // 64, 4, 16, k)
        out.append(sum(h[:, j] << (2 * j) for j in range(4)).transpose(1, 2).contiguous())
    return tuple(out) + scales


def _f16_bits(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte ``at`` of each block, as float16 [N, S] (the bits, unconverted)."""
    return b[..., at:at + 2].contiguous().view(torch.float16).squeeze(-1)


def _groups(t: torch.Tensor, n: int) -> torch.Tensor:
    """[N, ..groups..] -> [groups, N] contiguous (a group's 64-row block reads 16 of N at once)."""
    return t.reshape(n, -1).T.contiguous()


def _values_and_scales(name: str, b: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """uint8 [N, K] of each weight's integer (0..15, 0..31 or 0..63) and the type's scale tensors."""
    n, nb = b.shape[:2]
    if name == "Q6_K":
        return _q6_values(b), (_groups(b[..., 192:208].contiguous().view(torch.int8), n), _groups(_f16_bits(b, 208), n))
    if name in ("Q4_K", "Q5_K"):
        q = torch.empty(n, nb, 8, 32, dtype=torch.uint8)
        _k_nibbles(b[..., 16:144] if name == "Q4_K" else b[..., 48:176], q)
        if name == "Q5_K":
            q += _bits(b[..., 16:48], 8) << 4
        sc, mn = _k_scale_bytes(b)
        return q.view(n, -1), (_groups(sc, n), _groups(mn, n), _groups(_f16_bits(b, 0), n), _groups(_f16_bits(b, 2), n))
    qs_at = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[name]
    q = torch.empty(n, nb, 32, dtype=torch.uint8)
    _nibbles(b[..., qs_at:qs_at + 16], q)
    if name in ("Q5_0", "Q5_1"):
        q += _q5_high(b[..., qs_at - 4:qs_at])
    scales = (_groups(_f16_bits(b, 0), n),)
    if name in ("Q4_1", "Q5_1"):
        scales += (_groups(_f16_bits(b, 2), n),)
    return q.view(n, -1), scales


def _q6_values(b: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [N, S, 210] -> uint8 [N, S * 256]: each weight's 6-bit q (0..63; w = d * sc * (q - 32))."""
    n, nsb = b.shape[:2]
    ql = b[..., 0:128].contiguous().unflatten(-1, (2, 2, 32))  # weight 128h + 32r + j: [h, r % 2, j]
    qh = b[..., 128:192].contiguous().unflatten(-1, (2, 1, 32))
    q = torch.empty(n, nsb, 2, 4, 32, dtype=torch.uint8, device=b.device)
    q[..., 0:2, :] = ql & 15
    q[..., 2:4, :] = ql >> 4
    q += ((qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(4, 1)) & 3) << 4
    return q.view(n, -1)


def int4_nibbles(w: torch.Tensor, n: int, k: int, ids: torch.Tensor) -> torch.Tensor:
    """uint8 [T, K]: the 4-bit values of rows ``ids`` in torch's CPU int4 layout
    (``_convert_weight_to_int4pack_for_cpu`` of an [n, k] weight; the native
    planes' low nibbles are its whole 64-row blocks)."""
    full = n // 64 * 64  # rows in whole 64-row blocks; the rest form one last block
    in_full = ids < full
    r = torch.where(in_full, ids % 64, ids - full)
    base = torch.where(in_full, ids // 64 * 64 * k // 2 + r % 32, full * k // 2 + r // 2)
    stride = torch.where(in_full, 32, (n - full) // 2)
    shift = torch.where(in_full, 4 * (r // 32), 4 * (r % 2)).to(torch.uint8)
    cols = torch.arange(k, dtype=torch.int64)
    raw = w.reshape(-1)[base.unsqueeze(1) + cols * stride.unsqueeze(1)]
    return (raw >> shift.unsqueeze(1)) & 15


# ---- rows back ---------------------------------------------------------------------------------


def native_rows(packed: PackedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` [T] of a "native"-path weight, each weight formed with
    ``dequantize``'s float32 operations (so bit-equal to it), in ``dtype``."""
    if packed.cpu_path != "native" or packed.planes is None:
        raise KernelArgumentError(f"packed has no native planes (its CPU path is {packed.cpu_path!r})")
    name, k = packed.qtype.name, packed.in_features
    planes = dict(zip((f[0] for f in LAYOUTS[name][2]), packed.planes[0]))
    ids = ids.to(torch.int64)
    t = ids.shape[0]
    cols = torch.arange(k, dtype=torch.int64)
    if name == "Q8_0":
        q = planes["q"][ids // 64, :, ids % 64, :].reshape(t, -1).float()
        return q.view(t, -1, 32).mul_(_rows_of(planes["d"], ids).unsqueeze(-1)).view(t, k).to(dtype)
    q = int4_nibbles(planes["lo"], packed.out_features, k, ids)
    r = ids % 64
    if "hi" in planes:
        bits = 1 if name != "Q6_K" else 2
        per = 8 * bits  # bytes per column of a block; byte r % per, bit field r // per
        raw = planes["hi"].reshape(-1)[(ids // 64 * k * per + r % per).unsqueeze(1) + cols * per]
        q = q | (((raw >> (bits * (r // per)).to(torch.uint8).unsqueeze(1)) & (2**bits - 1)) << 4)
    o = q.float()
    if name == "Q6_K":  # (q - 32) * (d * sc), d per 256 columns, sc per 16
        dd = _rows_of(planes["d"], ids).repeat_interleave(16, 1) * _rows_of(planes["sc"], ids)
        return o.sub_(32).view(t, -1, 16).mul_(dd.unsqueeze(-1)).view(t, k).to(dtype)
    o = o.view(t, -1, 32)
    if name in ("Q4_K", "Q5_K"):  # q * (d * sc) - dmin * mn
        dd = _rows_of(planes["d"], ids).repeat_interleave(8, 1) * _rows_of(planes["sc"], ids)
        dm = _rows_of(planes["dmin"], ids).repeat_interleave(8, 1) * _rows_of(planes["mn"], ids)
        return o.mul_(dd.unsqueeze(-1)).sub_(dm.unsqueeze(-1)).view(t, k).to(dtype)
    if name in ("Q4_0", "Q5_0"):  # (q - off) * d
        o.sub_(LAYOUTS[name][1])
    o.mul_(_rows_of(planes["d"], ids).unsqueeze(-1))
    if "m" in planes:
        o.add_(_rows_of(planes["m"], ids).unsqueeze(-1))
    return o.view(t, k).to(dtype)


def _rows_of(scale: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A [groups, N] scale tensor's columns ``ids`` as float32 [T, groups]."""
    return scale[:, ids].T.float()

