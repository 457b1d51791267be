"""Layers whose weights stay quantized (a GGUF's blocks, ``kvstrata.kernels.
PackedWeight``): the loader puts them in place of ``Linear`` / ``Embedding``
when ``model.quantized_weights`` resolves to "packed" (``gguf_packed.py``;
"auto" does on a CPU where the native kernels run).

    PackedLinear(parts, bias, dtype, device, scratch)   y = x @ W.T + b, W = the parts' rows stacked
    PackedEmbedding(packed, dtype)                       rows of W, dequantized per lookup

A fused projection (qkv, gate_up) is one module over several parts, each
writing its columns of the output: a ``PackedWeight`` (one per run of
parts of one type, stacked with ``cat_rows``) or a dense tensor (a part of
a type that does not pack, dequantized at load)::

    out [T, q | k | v]  <-  quant_matmul_unchecked(x, q+k: Q4_K, out[:, :q+k]);  F.linear(x, v: dense) -> out[:, q+k:]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.kernels import PackedWeight, QuantScratch, packed_embedding, quant_matmul_unchecked

Part = PackedWeight | torch.Tensor


def part_bytes(part: Part) -> int:
    return part.nbytes if isinstance(part, PackedWeight) else part.numel() * part.element_size()


class PackedLinear(nn.Module):
    """A frozen linear layer over packed (and possibly dense) row parts.

    Owns: its parts and its bias. ``scratch``: the model's one buffer for
    the CPU "dequant" path (layers run one at a time), shared, not owned.
    """

    def __init__(self, parts: list[Part], bias: bool, dtype: torch.dtype, device: torch.device | str,
                 scratch: QuantScratch) -> None:
        super().__init__()
        if not parts:
            raise ValueError("PackedLinear needs at least one part")
        widths = {p.in_features if isinstance(p, PackedWeight) else p.shape[1] for p in parts}
        if len(widths) != 1:
            raise ValueError(f"PackedLinear parts must share in_features, got {sorted(widths)}")
        self.parts = list(parts)  # not parameters: a PackedWeight is not a tensor
        self.in_features = widths.pop()
        self.out_features = sum(self._rows(p) for p in parts)
        self.scratch = scratch
        self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype, device=device), False) if bias else None

    @staticmethod
    def _rows(part: Part) -> int:
        return part.out_features if isinstance(part, PackedWeight) else part.shape[0]

    @property
    def nbytes(self) -> int:
        """Resident bytes of the weight parts (the bias is a parameter)."""
        return sum(part_bytes(p) for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The parts were checked against each other at construction, and x's width by the reshape;
        # out and the bias are in x's dtype on its device: the matmuls skip the per-call checks.
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()
        out = torch.empty(x2.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        if len(self.parts) == 1 and isinstance(self.parts[0], PackedWeight):
            quant_matmul_unchecked(x2, self.parts[0], self.bias, out, self.scratch)
            return out.view(*lead, self.out_features)
        lo = 0
        for part in self.parts:
            hi = lo + self._rows(part)
            bias = None if self.bias is None else self.bias[lo:hi]
            if isinstance(part, PackedWeight):
                quant_matmul_unchecked(x2, part, bias, out[:, lo:hi], self.scratch)
            else:
                out[:, lo:hi] = F.linear(x2, part, bias)
            lo = hi
        return out.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        kinds = [f"{p.qtype.name}/{p.cpu_path}" if isinstance(p, PackedWeight) else str(p.dtype) for p in self.parts]
        return f"in={self.in_features}, out={self.out_features}, parts={kinds}, bias={self.bias is not None}"


class PackedEmbedding(nn.Module):
    """A token embedding kept packed: a lookup dequantizes only the rows it
    reads (``packed_embedding``). With tied embeddings the lm_head
    (a ``PackedLinear``) holds the same ``PackedWeight``.

    Owns: nothing of its own when tied (the loader hands both the same weight)."""

    def __init__(self, packed: PackedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.packed = packed
        self.dtype = dtype

    @property
    def weight(self) -> torch.Tensor:
        """The packed storage (uint8 blocks, or the first tensor of its GPU
        layout or planes): here for code that asks an embedding for its
        device; not a dense weight."""
        packed = self.packed
        return packed.data if packed.data is not None else (packed.gpu_layout or packed.planes[0])[0]

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = packed_embedding(ids.reshape(-1), self.packed, self.dtype)
        return rows.view(*ids.shape, self.packed.in_features)

    def extra_repr(self) -> str:
        p = self.packed
        return f"{p.out_features}, {p.in_features}, {p.qtype.name}/{p.cpu_path}"
