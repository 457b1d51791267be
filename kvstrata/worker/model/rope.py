"""Rotary position embeddings (the "rotate half" layout Hugging Face Llama uses).

Frequencies follow transformers' ``ROPE_INIT_FUNCTIONS`` (fp32):
"default", "linear" (frequencies divided by ``factor``), "llama3" (low
frequencies divided by ``factor``, a smooth ramp between ``low_freq_factor``
and ``high_freq_factor`` wavelengths) and "yarn" (interpolate the slow
dimensions, keep the fast ones, ramp between; cos/sin scaled by the
attention factor); then per-dimension divisors where a GGUF gives them
(its ``rope_freqs`` tensor: llama.cpp's form of Llama 3's scaling). "dynamic" NTK scaling is refused at
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
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = _llama3(inv_freq, rope)
    elif rope.rope_type == "yarn":
        inv_freq = _yarn(inv_freq, rope, head_dim)
    if rope.freq_factors is not None:
        if len(rope.freq_factors) != head_dim // 2:
            raise ValueError(f"rope: {len(rope.freq_factors)} frequency factors for a head of {head_dim} "
                             f"(it rotates {head_dim // 2} pairs)")
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float)
    return inv_freq


def attention_scaling(rope: RopeConfig) -> float:
    """What cos and sin are multiplied by: 1, except for yarn, whose
    attention factor defaults to ``0.1 * ln(factor) + 1`` (or the ratio of
    two such terms with ``mscale`` / ``mscale_all_dim``)."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor

    def m(scale: float, k: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return m(rope.factor, rope.mscale) / m(rope.factor, rope.mscale_all_dim)
    return m(rope.factor)


def _yarn(inv_freq: torch.Tensor, rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN: dimensions that rotate fast (more than ``beta_fast`` turns over the
    original context) keep their frequency, slow ones (under ``beta_slow``)
    are interpolated by ``factor``, a linear ramp in between."""
    base, orig = rope.theta, rope.original_max_position_embeddings

    def dim_for(turns: float) -> float:  # the dimension that makes ``turns`` rotations over ``orig``
        return dim * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_for(rope.beta_fast), dim_for(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return (inv_freq / rope.factor) * (1 - keep) + inv_freq * keep


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

    __slots__ = ("inv_freq", "scale")

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device | str = "cpu") -> None:
        self.inv_freq = inv_frequencies(rope, head_dim).to(device)
        self.scale = attention_scaling(rope)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Half-width cos/sin [T, 1, head_dim // 2] for ``positions`` [T], cast to ``dtype``.

        The full-width HF tensors are ``cat(half, half)``; applying the
        rotation on the two halves separately is the same arithmetic.
        """
        freqs = positions.to(torch.float)[:, None] * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, H, D] by half-width ``cos``/``sin`` [T, 1, D/2].

    Equals HF's ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)``.
    """
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
