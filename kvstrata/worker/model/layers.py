"""Parameter-holding building blocks shared by the decoder: frozen linear
layers allocated uninitialised, and RMSNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """A frozen linear layer allocated uninitialised (the loader fills it):
    ``nn.Linear`` would spend seconds on a random init we overwrite."""

    def __init__(
        self, out_features: int, in_features: int, bias: bool, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device), False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), False) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """A frozen token embedding allocated uninitialised (the loader fills it)."""

    def __init__(self, num: int, dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim, dtype=dtype, device=device), False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """HF Llama's RMSNorm: normalise in fp32, cast back, then scale by the weight."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device), False)
        self.fused = False  # the final norm of a fused decoder (``LlamaForCausalLM.use_fused_kernels``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)
