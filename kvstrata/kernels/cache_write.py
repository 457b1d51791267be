"""reshape_and_cache: write new K/V rows into the paged cache at their slots.

    key/value     [T, Hkv, D]              (the step's new tokens)
    slot_mapping  int32|int64 [T]          slot = block_id * block_size + offset
    key_cache     [num_blocks, block_size, Hkv, D]   (value_cache alike)

A negative slot is padding and is skipped. The caches may be per-layer
tensors or per-layer views of the cross-layer layout (see ``layout.py``):
only the block stride differs, and every path here honours it.

On CPU the slot range is checked (it costs nothing there); on CUDA the
kernel masks out-of-range slots instead of paying a device sync to check,
so a bad slot is dropped rather than corrupting memory.
"""

from __future__ import annotations

import torch

from kvstrata.kernels._checks import (
    INDEX_DTYPES,
    KV_DTYPES,
    KernelArgumentError,
    check_cache_pair,
    check_inner_contiguous,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_slot_mapping,
    check_tensor,
)
from kvstrata.kernels.dispatch import use_triton


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    impl: str = "auto",
) -> None:
    """Write ``key[i]``/``value[i]`` to slot ``slot_mapping[i]`` of the caches (in place)."""
    _check_args(key, value, key_cache, value_cache, slot_mapping)
    if key.shape[0] == 0:
        return
    if use_triton(impl, key.device):
        from kvstrata.kernels._triton_cache_write import reshape_and_cache_triton

        reshape_and_cache_triton(key, value, key_cache, value_cache, slot_mapping)
    else:
        reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping)


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Torch reference of :func:`reshape_and_cache` (no argument checks)."""
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    if not bool(keep.all()):
        idx = keep.nonzero().squeeze(1)
        slots, key, value = slots[idx], key[idx], value[idx]
    rows = slot_rows(key_cache, slots)
    token_rows(key_cache).index_copy_(0, rows, key.flatten(1))  # flatten: also when every slot is padding
    token_rows(value_cache).index_copy_(0, rows, value.flatten(1))


def token_rows(cache: torch.Tensor) -> torch.Tensor:
    """A [rows, Hkv * D] view of ``cache`` in which every token row of every
    block is one row: row ``block * (stride(0) // (Hkv*D)) + offset``.

    Both layouts have a block stride that is a whole number of rows (the
    per-layer one exactly ``block_size`` rows; the cross-layer one skips the
    other layers' rows), so one linear index_select/index_copy serves both;
    on CPU that is several times faster than indexing the 4-D cache.
    """
    num_blocks, block_size, heads, head_dim = cache.shape
    row = heads * head_dim
    assert cache.stride(0) % row == 0, "checked by check_cache_pair"
    per_block = cache.stride(0) // row
    return cache.as_strided(((num_blocks - 1) * per_block + block_size, row), (row, 1))


def slot_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Row indices into :func:`token_rows` of ``cache`` for non-negative int64 ``slots``."""
    block_size, row = cache.shape[1], cache.shape[2] * cache.shape[3]
    per_block = cache.stride(0) // row
    if per_block == block_size:
        return slots
    return slots // block_size * per_block + slots % block_size


def _check_args(key, value, key_cache, value_cache, slot_mapping) -> None:
    check_tensor("key", key, 3, KV_DTYPES)
    check_tensor("value", value, 3, KV_DTYPES)
    check_shape("value", value, tuple(key.shape))
    num_blocks, block_size, heads, head_dim = check_cache_pair(key_cache, value_cache)
    if tuple(key.shape[1:]) != (heads, head_dim):
        raise KernelArgumentError(
            f"key must have shape [T, {heads}, {head_dim}] to match key_cache, got {tuple(key.shape)}"
        )
    check_same_dtype("key_cache", key_cache, key=key, value=value)
    check_inner_contiguous("key", key, 2)
    check_inner_contiguous("value", value, 2)
    check_slot_mapping(slot_mapping, key.shape[0])
    check_same_device(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)
    if slot_mapping.device.type == "cpu":
        check_slots_in_range(slot_mapping, num_blocks * block_size)


def check_slots_in_range(slot_mapping: torch.Tensor, num_slots: int, name: str = "slot_mapping") -> None:
    """CPU only: every slot < num_slots (negative slots are padding)."""
    assert slot_mapping.dtype in INDEX_DTYPES
    if slot_mapping.numel() and int(slot_mapping.max()) >= num_slots:
        raise KernelArgumentError(
            f"{name} has slot {int(slot_mapping.max())} but the cache holds {num_slots} slots"
        )
