"""KV transfer between the paged cache and contiguous chunk buffers.

The offload/reload path of the tiered store: gather the tokens at a list of
slots (a chunk, which may start or end inside a block) into one contiguous
buffer, and scatter such a buffer back into given slots.

    all layers:  chunk [num_layers, 2, n, Hkv, D]   (index 0 = K, 1 = V)
    one layer:   chunk [2, n, Hkv, D]
    segments:    S chunks in one call, [S, num_layers, 2, n, Hkv, D], over
                 S * n slots (segment s: slots [s * n, (s + 1) * n)): one
                 kernel launch for a step's chunks instead of one per chunk
                 (``scatter_kv_layer_segments`` / ``gather_kv_layer_segments``:
                 one layer of them, in place in a staging buffer)

``kv_caches`` is the per-layer list of (key_cache, value_cache) pairs, each
[num_blocks, block_size, Hkv, D]; per-layer tensors and cross-layer views
(``layout.py``) are both accepted. A negative slot is padding: gather writes
zeros for it and scatter skips it.

The gathers take ``max_programs``: at most that many Triton programs loop
over the copy instead of one program per tile (same result). A bounded grid
holds only a few SMs, but holds them for the whole copy; see ``streams.py``
for how that compares beside a forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstrata.kernels._checks import (
    INDEX_DTYPES,
    KV_DTYPES,
    KernelArgumentError,
    check_cache_pair,
    check_inner_contiguous,
    check_kv_caches,
    check_same_device,
    check_shape,
    check_tensor,
)
from kvstrata.kernels.cache_write import check_slots_in_range, slot_rows, token_rows
from kvstrata.kernels.dispatch import use_triton

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def gather_kv(
    kv_caches: KVCaches,
    slot_mapping: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    impl: str = "auto",
    max_programs: int | None = None,
) -> torch.Tensor:
    """All layers' K/V at ``slot_mapping`` as one contiguous chunk [L, 2, n, Hkv, D]."""
    dims = check_kv_caches(kv_caches)
    if out is not None:
        _check_chunk(out, (len(kv_caches), 2, _num_slots(slot_mapping), *dims[2:]), kv_caches[0][0], name="out")
        out = out.unsqueeze(0)
    return _gather(kv_caches, dims, slot_mapping, 1, out, impl, max_programs)[0]


def scatter_kv(chunk: torch.Tensor, kv_caches: KVCaches, slot_mapping: torch.Tensor, *, impl: str = "auto") -> None:
    """Inverse of :func:`gather_kv`: write ``chunk`` [L, 2, n, Hkv, D] to the slots (in place)."""
    dims = check_kv_caches(kv_caches)
    _check_chunk(chunk, (len(kv_caches), 2, _num_slots(slot_mapping), *dims[2:]), kv_caches[0][0])
    _scatter(chunk.unsqueeze(0), kv_caches, dims, slot_mapping, impl)


def gather_kv_segments(
    kv_caches: KVCaches,
    slot_mapping: torch.Tensor,
    num_segments: int,
    out: torch.Tensor | None = None,
    *,
    impl: str = "auto",
    max_programs: int | None = None,
) -> torch.Tensor:
    """``num_segments`` chunks of all layers' K/V in one call: [S, L, 2, n, Hkv, D]
    with segment s the :func:`gather_kv` chunk of slots [s * n, (s + 1) * n)."""
    return _gather(kv_caches, check_kv_caches(kv_caches), slot_mapping, num_segments, out, impl, max_programs)


def scatter_kv_segments(chunk: torch.Tensor, kv_caches: KVCaches, slot_mapping: torch.Tensor, *,
                        impl: str = "auto") -> None:
    """Inverse of :func:`gather_kv_segments`: write ``chunk`` [S, L, 2, n, Hkv, D]
    to the S * n slots (in place)."""
    dims = check_kv_caches(kv_caches)
    check_tensor("chunk", chunk, 6, KV_DTYPES)
    _scatter(chunk, kv_caches, dims, slot_mapping, impl)


def _gather(kv_caches: KVCaches, dims: tuple[int, int, int, int], slot_mapping: torch.Tensor, num_segments: int,
            out: torch.Tensor | None, impl: str, max_programs: int | None) -> torch.Tensor:
    nb, bs, h, d = dims
    key0 = kv_caches[0][0]
    total = _check_slots(slot_mapping, key0, nb * bs)
    n = _segment_tokens(total, num_segments)
    _check_max_programs(max_programs)
    out = _chunk_out(out, (num_segments, len(kv_caches), 2, n, h, d), key0)
    if total == 0:
        return out
    if use_triton(impl, key0.device):
        from kvstrata.kernels._triton_transfer import transfer_triton

        transfer_triton(list(kv_caches), out, slot_mapping, to_cache=False, max_programs=max_programs)
    else:
        for s in range(num_segments):
            for layer, (k, v) in enumerate(kv_caches):
                gather_kv_layer_ref(k, v, slot_mapping[s * n:(s + 1) * n], out[s, layer])
    return out


def _scatter(chunk: torch.Tensor, kv_caches: KVCaches, dims: tuple[int, int, int, int], slot_mapping: torch.Tensor,
             impl: str) -> None:
    nb, bs, h, d = dims
    key0 = kv_caches[0][0]
    total = _check_slots(slot_mapping, key0, nb * bs)
    num_segments = chunk.shape[0]
    n = _segment_tokens(total, num_segments)
    _check_chunk(chunk, (num_segments, len(kv_caches), 2, n, h, d), key0)
    if total == 0:
        return
    if use_triton(impl, key0.device):
        from kvstrata.kernels._triton_transfer import transfer_triton

        transfer_triton(list(kv_caches), chunk, slot_mapping, to_cache=True)
    else:
        for s in range(num_segments):
            for layer, (k, v) in enumerate(kv_caches):
                scatter_kv_layer_ref(chunk[s, layer], k, v, slot_mapping[s * n:(s + 1) * n])


def scatter_kv_layer_segments(
    segments: torch.Tensor,
    layer: int,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    impl: str = "auto",
) -> None:
    """Layer ``layer`` of S chunks ``segments`` [S, L, 2, n, Hkv, D] (contiguous:
    a staging buffer of whole chunks) to one layer's caches, segment s to
    slots [s * n, (s + 1) * n): one kernel launch, reading the layer in place."""
    nb, bs, h, d = check_cache_pair(key_cache, value_cache)
    total = _check_slots(slot_mapping, key_cache, nb * bs)
    num_segments, n = _check_layer_segments(segments, layer, total, key_cache, h, d)
    if total == 0:
        return
    if use_triton(impl, key_cache.device):
        from kvstrata.kernels._triton_transfer import transfer_triton

        # [S, 1, 2, n, Hkv, D]: each segment's layer contiguous, segments a whole chunk apart
        transfer_triton([(key_cache, value_cache)], segments[:, layer:layer + 1], slot_mapping, to_cache=True)
    else:
        for s in range(num_segments):
            scatter_kv_layer_ref(segments[s, layer], key_cache, value_cache, slot_mapping[s * n:(s + 1) * n])


def gather_kv_layer_segments(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    segments: torch.Tensor,
    layer: int,
    *,
    impl: str = "auto",
    max_programs: int | None = None,
) -> None:
    """Inverse of :func:`scatter_kv_layer_segments`: one layer's K/V at S * n
    slots into layer ``layer`` of ``segments`` [S, L, 2, n, Hkv, D]
    (contiguous: a staging buffer of whole chunks), slots [s * n, (s + 1) * n)
    into segment s: one kernel launch, writing the layer in place."""
    nb, bs, h, d = check_cache_pair(key_cache, value_cache)
    total = _check_slots(slot_mapping, key_cache, nb * bs)
    num_segments, n = _check_layer_segments(segments, layer, total, key_cache, h, d)
    _check_max_programs(max_programs)
    if total == 0:
        return
    if use_triton(impl, key_cache.device):
        from kvstrata.kernels._triton_transfer import transfer_triton

        transfer_triton([(key_cache, value_cache)], segments[:, layer:layer + 1], slot_mapping, to_cache=False,
                        max_programs=max_programs)
    else:
        for s in range(num_segments):
            gather_kv_layer_ref(key_cache, value_cache, slot_mapping[s * n:(s + 1) * n], segments[s, layer])


def _check_layer_segments(segments: object, layer: object, total: int, cache: torch.Tensor, h: int,
                          d: int) -> tuple[int, int]:
    """(S, n) of a staging buffer ``segments`` [S, L, 2, n, Hkv, D] over ``total`` slots, ``layer`` one of its L."""
    check_tensor("segments", segments, 6, KV_DTYPES)
    num_segments, num_layers = segments.shape[:2]
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise KernelArgumentError(f"layer must be an int in [0, {num_layers}), got {layer!r}")
    n = _segment_tokens(total, num_segments)
    _check_chunk(segments, (num_segments, num_layers, 2, n, h, d), cache, name="segments")
    return num_segments, n


def gather_kv_layer(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    impl: str = "auto",
    max_programs: int | None = None,
) -> torch.Tensor:
    """One layer's K/V at ``slot_mapping`` as a contiguous chunk [2, n, Hkv, D]."""
    nb, bs, h, d = check_cache_pair(key_cache, value_cache)
    n = _check_slots(slot_mapping, key_cache, nb * bs)
    _check_max_programs(max_programs)
    out = _chunk_out(out, (2, n, h, d), key_cache)
    if n == 0:
        return out
    if use_triton(impl, key_cache.device):
        from kvstrata.kernels._triton_transfer import transfer_triton

        transfer_triton([(key_cache, value_cache)], out[None, None], slot_mapping, to_cache=False,
                        max_programs=max_programs)
    else:
        gather_kv_layer_ref(key_cache, value_cache, slot_mapping, out)
    return out


def scatter_kv_layer(
    chunk: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    impl: str = "auto",
) -> None:
    """Inverse of :func:`gather_kv_layer`: write ``chunk`` [2, n, Hkv, D] to the slots (in place)."""
    nb, bs, h, d = check_cache_pair(key_cache, value_cache)
    n = _check_slots(slot_mapping, key_cache, nb * bs)
    _check_chunk(chunk, (2, n, h, d), key_cache)
    if n == 0:
        return
    if use_triton(impl, key_cache.device):
        from kvstrata.kernels._triton_transfer import transfer_triton

        transfer_triton([(key_cache, value_cache)], chunk[None, None], slot_mapping, to_cache=True)
    else:
        scatter_kv_layer_ref(chunk, key_cache, value_cache, slot_mapping)


def gather_kv_layer_ref(
    key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Torch reference of one layer's gather into ``out`` [2, n, Hkv, D] (contiguous)."""
    n = slot_mapping.shape[0]
    slots = slot_mapping.to(torch.int64)
    pad = slots < 0
    any_pad = bool(pad.any())
    rows = slot_rows(key_cache, slots.clamp(min=0) if any_pad else slots)
    flat = out.view(2, n, -1)
    torch.index_select(token_rows(key_cache), 0, rows, out=flat[0])
    torch.index_select(token_rows(value_cache), 0, rows, out=flat[1])
    if any_pad:
        flat[:, pad] = 0
    return out


def scatter_kv_layer_ref(
    chunk: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Torch reference of one layer's scatter of ``chunk`` [2, n, Hkv, D]."""
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    flat = chunk.reshape(2, chunk.shape[1], -1)
    k, v = flat[0], flat[1]
    if not bool(keep.all()):
        idx = keep.nonzero().squeeze(1)
        slots, k, v = slots[idx], k[idx], v[idx]
    rows = slot_rows(key_cache, slots)
    token_rows(key_cache).index_copy_(0, rows, k)
    token_rows(value_cache).index_copy_(0, rows, v)


def _check_slots(slot_mapping: object, cache: torch.Tensor, num_slots: int) -> int:
    check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
    check_same_device(cache=cache, slot_mapping=slot_mapping)
    if slot_mapping.device.type == "cpu":
        check_slots_in_range(slot_mapping, num_slots)
    return slot_mapping.shape[0]


def _num_slots(slot_mapping: object) -> int:
    check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
    return slot_mapping.shape[0]


def _segment_tokens(total: int, num_segments: object) -> int:
    if isinstance(num_segments, bool) or not isinstance(num_segments, int) or num_segments < 1:
        raise KernelArgumentError(f"num_segments must be an integer >= 1, got {num_segments!r}")
    if total % num_segments:
        raise KernelArgumentError(f"slot_mapping has {total} slots: not {num_segments} segments of equal length")
    return total // num_segments


def _check_max_programs(max_programs: object) -> None:
    if max_programs is not None and (
        isinstance(max_programs, bool) or not isinstance(max_programs, int) or max_programs < 1
    ):
        raise KernelArgumentError(f"max_programs must be None or an integer >= 1, got {max_programs!r}")


def _chunk_out(out: torch.Tensor | None, shape: tuple[int, ...], cache: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=cache.dtype, device=cache.device)
    _check_chunk(out, shape, cache, name="out")
    return out


def _check_chunk(chunk: object, shape: tuple[int, ...], cache: torch.Tensor, name: str = "chunk") -> None:
    check_tensor(name, chunk, len(shape), KV_DTYPES)
    check_shape(name, chunk, shape)
    if chunk.dtype != cache.dtype:
        raise KernelArgumentError(f"{name} dtype {chunk.dtype} differs from the cache dtype {cache.dtype}")
    if not chunk.is_contiguous():
        raise KernelArgumentError(f"{name} must be contiguous, got strides {tuple(chunk.stride())}")
    check_inner_contiguous(name, chunk, 2)
    check_same_device(cache=cache, **{name: chunk})
