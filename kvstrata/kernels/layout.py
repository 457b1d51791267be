"""The two paged KV cache layouts, chosen at engine start (``cache.kv_layout``).

    per_layer    backing [L, 2, num_blocks, block_size, Hkv, D]
                 layer l's K = backing[l, 0]: each layer's K (and V) is one
                 contiguous [num_blocks, block_size, Hkv, D] tensor.
    cross_layer  backing [num_blocks, L, 2, block_size, Hkv, D]
                 layer l's K = backing[:, l, 0]: all layers' K and V of one
                 block are one contiguous run, so a block offloads or reloads
                 as a single copy.

Either way the engine sees a list of per-layer (key_cache, value_cache)
pairs of shape [num_blocks, block_size, Hkv, D]; only the block stride
differs, and every kernel honours it. Caches start zeroed, so the null
block (block 0) reads as zeros.
"""

from __future__ import annotations

import msgspec
import torch

KV_LAYOUTS = ("per_layer", "cross_layer")


class KVCacheShape(msgspec.Struct, frozen=True, kw_only=True):
    """Geometry of the paged cache of all layers."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int

    def validate(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    def bytes_per_block(self, dtype: torch.dtype) -> int:
        """Bytes of one block across all layers, K and V."""
        elem = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_size * elem


def allocate_kv_caches(
    shape: KVCacheShape, layout: str, dtype: torch.dtype, device: torch.device | str
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Allocate the zeroed backing tensor in ``layout``; returns (backing, per-layer (K, V) views)."""
    shape.validate()
    L, nb, bs, h, d = shape.num_layers, shape.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_size
    if layout == "per_layer":
        backing = torch.zeros((L, 2, nb, bs, h, d), dtype=dtype, device=device)
        views = [(backing[layer, 0], backing[layer, 1]) for layer in range(L)]
    elif layout == "cross_layer":
        backing = torch.zeros((nb, L, 2, bs, h, d), dtype=dtype, device=device)
        views = [(backing[:, layer, 0], backing[:, layer, 1]) for layer in range(L)]
    else:
        raise ValueError(f"layout must be one of {KV_LAYOUTS}, got {layout!r}")
    return backing, views
