"""Rotary position embeddings (the "rotate half" layout Hugging Face Llama uses).

Frequencies follow transformers' ``ROPE_INIT_FUNCTIONS`` bit for bit (fp32):
"default", "linear" (frequencies divided by ``factor``) and "llama3" (low
frequencies divided by ``factor``, a smooth ramp between ``low_freq_factor``
and ``high_freq_factor`` wavelengths). "dynamic" NTK scaling is refused at
config time: its frequencies depend on the current sequence length, so keys
already in a paged cache would have been rotated with different ones.

cos/sin are computed per forward for the positions in the batch (one small
outer product shared by every layer) instead of a table of
``max_position_embeddings`` rows, which for Llama 3 would be 128 MiB.
"""

from __future__ import annotations

import math

import torch

from kvstrata.worker.model.config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """fp32 [head_dim // 2] inverse frequencies for ``rope``."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    factor = rope.factor
    low, high = rope.low_freq_factor, rope.high_freq_factor
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Owns: the inverse-frequency vector (on the model's device, fp32)."""

    __slots__ = ("inv_freq",)

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device | str = "cpu") -> None:
        self.inv_freq = inv_frequencies(rope, head_dim).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Half-width cos/sin [T, 1, head_dim // 2] for ``positions`` [T], cast to ``dtype``.

        The full-width HF tensors are ``cat(half, half)``; applying the
        rotation on the two halves separately is the same arithmetic.
        """
        freqs = positions.to(torch.float)[:, None] * self.inv_freq
        return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, H, D] by half-width ``cos``/``sin`` [T, 1, D/2].

    Equals HF's ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)``.
    """
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
