"""The copy kernels' tiling paths (reshape_and_cache, gather/scatter) against the
torch references, on CPU under TRITON_INTERPRET=1.

Covered: rows of 2^k elements (EVEN: no column mask) and of other lengths
(masked columns), token counts spanning several programs with padding slots,
the bounded ("persistent") grid whose few programs loop over the tiles, and
rows split into several column chunks (forced with a small ``tile_bytes``,
the GPU tiling, since the interpreter's default tile holds a whole row).
"""

from __future__ import annotations

import pytest
import torch

from kvstrata.kernels import (
    KV_LAYOUTS,
    KernelArgumentError,
    KVCacheShape,
    KVStreams,
    allocate_kv_caches,
    gather_kv,
    gather_kv_layer,
    gather_kv_layer_segments,
    gather_kv_segments,
    reshape_and_cache,
    scatter_kv,
    scatter_kv_layer,
    scatter_kv_layer_segments,
    scatter_kv_segments,
)
from kvstrata.kernels._triton_cache_write import copy_tile, reshape_and_cache_triton
from kvstrata.kernels._triton_transfer import transfer_triton

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _caches(layout: str, *, heads: int, head_dim: int, num_blocks: int, num_layers: int = 2,
            dtype: torch.dtype = torch.float32, seed: int = 0):
    shape = KVCacheShape(num_layers=num_layers, num_blocks=num_blocks, block_size=16, num_kv_heads=heads,
                         head_size=head_dim)
    backing, caches = allocate_kv_caches(shape, layout, dtype, "cpu")
    backing.copy_(torch.randn(backing.shape, generator=torch.Generator().manual_seed(seed)).to(dtype))
    return backing, caches


def _views(backing: torch.Tensor, layout: str):
    num_layers = backing.shape[0] if layout == "per_layer" else backing.shape[1]
    if layout == "per_layer":
        return [(backing[i, 0], backing[i, 1]) for i in range(num_layers)]
    return [(backing[:, i, 0], backing[:, i, 1]) for i in range(num_layers)]


def _padded_slots(n: int, num_slots: int, seed: int) -> torch.Tensor:
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))[:n]
    slots[::7] = -1
    return slots


def test_tiles_even_only_for_power_of_two_rows():
    assert copy_tile(16, 4, CPU).even and copy_tile(16, 4, CPU).block_t == 1024
    assert not copy_tile(24, 4, CPU).even
    gpu_like = copy_tile(256, 2, CPU, tile_bytes=8192)  # the compiled tiling: 16 rows of 256
    assert (gpu_like.cols, gpu_like.block_t, gpu_like.even) == (256, 16, True)
    split = copy_tile(8192, 2, CPU, tile_bytes=8192)  # a row larger than a tile: column chunks
    assert (split.cols, split.block_t, split.even) == (4096, 1, True)


@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_reshape_and_cache_many_programs_with_padding(layout):
    # 2500 tokens of 16-element rows: 3 interpreter programs, the last one partial
    backing, caches = _caches(layout, heads=2, head_dim=8, num_blocks=200)
    g = torch.Generator().manual_seed(1)
    key, value = torch.randn((2500, 2, 8), generator=g), torch.randn((2500, 2, 8), generator=g)
    slots = _padded_slots(2500, 200 * 16, seed=2)
    expected = backing.clone()
    reshape_and_cache(key, value, *_views(expected, layout)[1], slots, impl="torch")
    reshape_and_cache(key, value, *caches[1], slots)
    assert torch.equal(backing, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_reshape_and_cache_row_not_power_of_two(layout, dtype):
    backing, caches = _caches(layout, heads=3, head_dim=8, num_blocks=6, dtype=dtype)
    g = torch.Generator().manual_seed(3)
    key = torch.randn((9, 5, 3, 8), generator=g).to(dtype)[:, 2]  # strided token dim
    value = torch.randn((9, 3, 8), generator=g).to(dtype)
    slots = torch.tensor([3, -1, 17, 18, 40, 95, 0, -1, 64])
    expected = backing.clone()
    reshape_and_cache(key, value, *_views(expected, layout)[0], slots, impl="torch")
    reshape_and_cache(key, value, *caches[0], slots)
    assert torch.equal(backing, expected)


@pytest.mark.parametrize(("heads", "head_dim"), [(2, 8), (3, 8)])
@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_gather_scatter_many_programs_with_padding(layout, heads, head_dim):
    backing, caches = _caches(layout, heads=heads, head_dim=head_dim, num_blocks=200, num_layers=3)
    slots = _padded_slots(2100, 200 * 16, seed=4)
    chunk = gather_kv(caches, slots)
    assert torch.equal(chunk, gather_kv(caches, slots, impl="torch"))
    assert (chunk[:, :, ::7] == 0).all()
    fresh_backing, fresh = _caches(layout, heads=heads, head_dim=head_dim, num_blocks=200, num_layers=3, seed=5)
    ref_backing = fresh_backing.clone()
    scatter_kv(chunk, fresh, slots)
    scatter_kv(chunk, _views(ref_backing, layout), slots, impl="torch")
    assert torch.equal(fresh_backing, ref_backing)


@pytest.mark.parametrize("max_programs", [1, 2, 5])
@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_bounded_grid_gather_matches_full_grid(layout, max_programs):
    # 3 token tiles x 3 layers x (K, V) = 18 tiles over a few looping programs
    _, caches = _caches(layout, heads=2, head_dim=8, num_blocks=200, num_layers=3)
    slots = _padded_slots(3000, 200 * 16, seed=6)
    expected = gather_kv(caches, slots, impl="torch")
    assert torch.equal(gather_kv(caches, slots, max_programs=max_programs), expected)
    k, v = caches[2]
    assert torch.equal(gather_kv_layer(k, v, slots, max_programs=max_programs), expected[2])


@pytest.mark.parametrize(("heads", "even"), [(3, True), (5, False)])
def test_rows_split_into_column_chunks(heads, even):
    """GPU tiling forced in the interpreter: 8-element tiles, so a row of
    heads * 8 (EVEN) or heads * 4 (masked last chunk) elements spans chunks."""
    head_dim = 8 if even else 4
    assert copy_tile(heads * head_dim, 4, CPU, tile_bytes=32).even is even
    backing, caches = _caches("cross_layer", heads=heads, head_dim=head_dim, num_blocks=4, num_layers=2)
    g = torch.Generator().manual_seed(7)
    key, value = torch.randn((6, heads, head_dim), generator=g), torch.randn((6, heads, head_dim), generator=g)
    slots = torch.tensor([5, -1, 16, 17, 63, 2])
    expected = backing.clone()
    reshape_and_cache(key, value, *_views(expected, "cross_layer")[1], slots, impl="torch")
    reshape_and_cache_triton(key, value, *caches[1], slots, tile_bytes=32)
    assert torch.equal(backing, expected)

    chunk = torch.full((2, 2, 6, heads, head_dim), float("nan"))
    transfer_triton(caches, chunk[None], slots, to_cache=False, max_programs=5, tile_bytes=32)
    assert torch.equal(chunk, gather_kv(caches, slots, impl="torch"))
    expected = backing.clone()
    scatter_kv(chunk + 1, _views(expected, "cross_layer"), slots, impl="torch")
    transfer_triton(caches, (chunk + 1)[None], slots, to_cache=True, tile_bytes=32)
    assert torch.equal(backing, expected)


def _scattered_caches(num_layers: int, heads: int, head_dim: int, num_blocks: int, seed: int):
    """Layers allocated one by one: no uniform distance, so one launch per layer."""
    g = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(num_layers):
        torch.empty(int(torch.randint(1, 97, (1,), generator=g)))  # some unrelated allocation between layers
        caches.append(tuple(torch.randn((num_blocks, 16, heads, head_dim), generator=g) for _ in range(2)))
    return caches


@pytest.mark.parametrize("num_segments", [1, 3, 4])
@pytest.mark.parametrize("layout", [*KV_LAYOUTS, "scattered"])
def test_segments_are_chunks_in_one_launch(layout, num_segments):
    """Segment s of one call is the chunk of its own slots, in both directions,
    for uniform layer layouts (one launch) and scattered layers (one per layer)."""
    if layout == "scattered":
        caches = _scattered_caches(3, 2, 8, 40, seed=8)
        fresh = _scattered_caches(3, 2, 8, 40, seed=9)
        ref = [tuple(t.clone() for t in pair) for pair in fresh]
        starts = [k.data_ptr() for k, _ in caches]
        assert len({b - a for a, b in zip(starts, starts[1:])}) > 1 or caches[0][1].data_ptr() - starts[0] != (
            caches[1][1].data_ptr() - starts[1])  # really not uniform
    else:
        _, caches = _caches(layout, heads=2, head_dim=8, num_blocks=40, num_layers=3)
        fresh_backing, fresh = _caches(layout, heads=2, head_dim=8, num_blocks=40, num_layers=3, seed=9)
        ref = _views(fresh_backing.clone(), layout)
    slots = _padded_slots(12 * num_segments, 40 * 16, seed=10)
    chunk = gather_kv_segments(caches, slots, num_segments)
    assert chunk.shape == (num_segments, 3, 2, 12, 2, 8)
    for s in range(num_segments):
        assert torch.equal(chunk[s], gather_kv(caches, slots[12 * s:12 * (s + 1)], impl="torch"))
    assert torch.equal(chunk, gather_kv_segments(caches, slots, num_segments, impl="torch"))
    scatter_kv_segments(chunk * 2, fresh, slots)
    scatter_kv_segments(chunk * 2, ref, slots, impl="torch")
    for (k, v), (rk, rv) in zip(fresh, ref, strict=True):
        assert torch.equal(k, rk) and torch.equal(v, rv)
    one = gather_kv_segments(caches[1:2], slots, num_segments)  # one layer: [S, 1, 2, n, H, D]
    assert torch.equal(one[:, 0], chunk[:, 1])


@pytest.mark.parametrize("num_segments", [1, 3])
@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_one_layer_of_staged_segments_in_one_launch(layout, num_segments):
    """Layer l of a staging buffer of whole chunks [S, L, 2, n, H, D] goes to
    one layer's caches as those chunks' layer l would, read in place (its
    segments a whole chunk apart): what a staged layer load scatters; and
    a staged save gathers each layer into its place there."""
    _, caches = _caches(layout, heads=2, head_dim=8, num_blocks=40, num_layers=3)
    staging = gather_kv_segments(caches, _padded_slots(12 * num_segments, 40 * 16, seed=3), num_segments) * 3
    slots = _padded_slots(12 * num_segments, 40 * 16, seed=11)
    for layer in range(3):
        fresh_backing, fresh = _caches(layout, heads=2, head_dim=8, num_blocks=40, num_layers=3, seed=9)
        ref = _views(fresh_backing.clone(), layout)
        scatter_kv_layer_segments(staging, layer, *fresh[layer], slots)
        for s in range(num_segments):
            scatter_kv_layer(staging[s, layer].contiguous(), *ref[layer], slots[12 * s:12 * (s + 1)], impl="torch")
        for (k, v), (rk, rv) in zip(fresh, ref, strict=True):
            assert torch.equal(k, rk) and torch.equal(v, rv)
    gathered = torch.zeros_like(staging)
    for layer in range(3):
        gather_kv_layer_segments(*caches[layer], slots, gathered, layer)
    assert torch.equal(gathered, gather_kv_segments(caches, slots, num_segments))
    with pytest.raises(KernelArgumentError, match="layer must be an int in \\[0, 3\\)"):
        scatter_kv_layer_segments(staging, 3, *caches[0], slots)
    with pytest.raises(KernelArgumentError, match="layer must be an int"):
        gather_kv_layer_segments(*caches[0], slots, gathered, True)
    with pytest.raises(KernelArgumentError, match="segments must be contiguous"):
        scatter_kv_layer_segments(torch.zeros(num_segments, 3, 2, 12, 2, 16)[..., :8], 0, *caches[0], slots)


def test_segment_arguments_are_checked():
    _, caches = _caches("per_layer", heads=2, head_dim=8, num_blocks=2)
    slots = torch.arange(6)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(KernelArgumentError, match="num_segments"):
            gather_kv_segments(caches, slots, bad)
    with pytest.raises(KernelArgumentError, match="not 4 segments"):
        gather_kv_segments(caches, slots, 4)
    with pytest.raises(KernelArgumentError, match="chunk must have"):
        scatter_kv_segments(torch.zeros(3, 2, 2, 3, 2, 8), caches, slots)
    with pytest.raises(KernelArgumentError, match="chunk"):
        scatter_kv_segments(torch.zeros(2, 2, 3, 2, 8), caches, slots)


def test_bounded_grid_arguments_are_checked():
    _, caches = _caches("per_layer", heads=2, head_dim=8, num_blocks=2)
    for bad in (0, -3, 2.0, True):
        with pytest.raises(KernelArgumentError, match="max_programs"):
            gather_kv(caches, torch.tensor([0, 1]), max_programs=bad)
        with pytest.raises(ValueError, match="store_programs"):
            KVStreams("cpu", 2, store_programs=bad)
    assert KVStreams("cpu", 2, store_programs=None).store_programs is None
