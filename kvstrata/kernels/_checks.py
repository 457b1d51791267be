"""Launch-time argument checks shared by every kernel entry point.

Each check raises before anything is launched, with a message that names the
argument, so a bad call from the model runner fails loudly at the call site
instead of as an illegal memory access (GPU) or silent garbage (interpreter).
"""

from __future__ import annotations

import torch

KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


class KernelArgumentError(ValueError):
    """A kernel was called with an argument of the wrong shape, dtype,
    device or memory layout. The message names the argument."""


def check_tensor(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise KernelArgumentError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise KernelArgumentError(f"{name} dtype must be one of {names}, got {t.dtype}")
    return t


def check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise KernelArgumentError(f"{name} must have shape {tuple(expected)}, got {tuple(t.shape)}")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    for name, dev in devices.items():
        if dev != first:
            raise KernelArgumentError(f"{name} is on {dev}, expected {first} like the other arguments")
    return first


def check_same_dtype(ref_name: str, ref: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != ref.dtype:
            raise KernelArgumentError(f"{name} dtype {t.dtype} differs from {ref_name} dtype {ref.dtype}")


def check_inner_contiguous(name: str, t: torch.Tensor, num_inner: int) -> None:
    """The last ``num_inner`` dims must be densely packed (row-major), so a
    token's [heads, head_dim] row (or a block's [block_size, heads, head_dim])
    is one contiguous run. Outer dims may have any stride: that is how the
    cross-layer layout hands out per-layer views."""
    expected = 1
    for dim in range(t.dim() - 1, t.dim() - 1 - num_inner, -1):
        if t.shape[dim] != 1 and t.stride(dim) != expected:
            raise KernelArgumentError(
                f"{name} must be contiguous in its last {num_inner} dims, got strides {tuple(t.stride())}"
            )
        expected *= t.shape[dim]


def check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Checks one layer's K and V caches; returns (num_blocks, block_size, kv_heads, head_dim)."""
    check_tensor("key_cache", key_cache, 4, KV_DTYPES)
    check_tensor("value_cache", value_cache, 4, KV_DTYPES)
    check_shape("value_cache", value_cache, tuple(key_cache.shape))
    check_same_dtype("key_cache", key_cache, value_cache=value_cache)
    check_inner_contiguous("key_cache", key_cache, 3)
    check_inner_contiguous("value_cache", value_cache, 3)
    if key_cache.stride(0) != value_cache.stride(0):
        raise KernelArgumentError(
            f"key_cache and value_cache must share the block stride, got {key_cache.stride(0)} "
            f"and {value_cache.stride(0)}"
        )
    nb, bs, h, d = key_cache.shape
    if key_cache.stride(0) % (h * d) != 0 or key_cache.stride(0) < bs * h * d:
        raise KernelArgumentError(
            f"key_cache block stride {key_cache.stride(0)} must be a multiple of Hkv*D={h * d} "
            f"and at least block_size*Hkv*D={bs * h * d}"
        )
    return nb, bs, h, d


def check_kv_caches(kv_caches: object) -> tuple[int, int, int, int]:
    """Checks a per-layer list of (key_cache, value_cache) pairs that all share
    one shape, dtype and device; returns (num_blocks, block_size, kv_heads, head_dim)."""
    if not isinstance(kv_caches, (list, tuple)) or not kv_caches:
        raise KernelArgumentError("kv_caches must be a non-empty list of (key_cache, value_cache) pairs")
    dims = None
    first = None
    for i, pair in enumerate(kv_caches):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise KernelArgumentError(f"kv_caches[{i}] must be a (key_cache, value_cache) pair")
        k, v = pair
        try:
            layer_dims = check_cache_pair(k, v)
        except KernelArgumentError as e:
            raise KernelArgumentError(f"kv_caches[{i}]: {e}") from None
        if first is None:
            dims, first = layer_dims, k
        elif layer_dims != dims or k.dtype != first.dtype or k.device != first.device:
            raise KernelArgumentError(
                f"kv_caches[{i}] has shape {tuple(k.shape)} {k.dtype} on {k.device}; layer 0 has "
                f"{tuple(first.shape)} {first.dtype} on {first.device}"
            )
    assert dims is not None
    return dims


def check_slot_mapping(slot_mapping: object, num_tokens: int, name: str = "slot_mapping") -> torch.Tensor:
    check_tensor(name, slot_mapping, 1, INDEX_DTYPES)
    if slot_mapping.shape[0] != num_tokens:
        raise KernelArgumentError(f"{name} must have {num_tokens} entries, got {slot_mapping.shape[0]}")
    return slot_mapping
