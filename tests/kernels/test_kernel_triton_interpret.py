"""Triton kernels against their torch references, on CPU under TRITON_INTERPRET=1.

The ``interpret`` fixture sets TRITON_INTERPRET=1, so ``impl="auto"`` on CPU
tensors dispatches to the interpreted Triton kernel; the reference runs with
``impl="torch"``. Shapes are small and tiles large, so each launch runs few
interpreter programs.
"""

from __future__ import annotations

import pytest
import torch

from kernel_builders import dense_attention, make_paged_batch
from kvstrata.kernels import (
    KV_LAYOUTS,
    KVCacheShape,
    allocate_kv_caches,
    gather_kv,
    gather_kv_layer,
    paged_attention,
    reshape_and_cache,
    scatter_kv,
    scatter_kv_layer,
)
from kvstrata.kernels._triton_attention import MAX_SPLITS, decode_plan, paged_attention_triton, split_count

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ATTN_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _filled_caches(layout: str, dtype: torch.dtype, seed: int = 0, num_layers: int = 3, block_size: int = 4):
    shape = KVCacheShape(num_layers=num_layers, num_blocks=7, block_size=block_size, num_kv_heads=2, head_size=8)
    backing, caches = allocate_kv_caches(shape, layout, dtype, "cpu")
    backing.copy_(torch.randn(backing.shape, generator=torch.Generator().manual_seed(seed)).to(dtype))
    return backing, caches


# ---- reshape_and_cache --------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_reshape_and_cache_triton_matches_torch(dtype, layout):
    backing, caches = _filled_caches(layout, dtype)
    g = torch.Generator().manual_seed(1)
    # strided token dim (a slice of a wider projection), unaligned slots, padding
    key = torch.randn((6, 3, 2, 8), generator=g).to(dtype)[:, 1]
    value = torch.randn((6, 2, 8), generator=g).to(dtype)
    slots = torch.tensor([5, -1, 6, 7, 8, 27], dtype=torch.int64)
    expected = backing.clone()
    exp_caches = _views(expected, layout, 3)
    reshape_and_cache(key, value, *exp_caches[1], slots, impl="torch")
    reshape_and_cache(key, value, *caches[1], slots)
    assert torch.equal(backing, expected)
    assert not torch.equal(backing, _filled_caches(layout, dtype)[0]), "the kernel must have written something"


def _views(backing: torch.Tensor, layout: str, num_layers: int):
    if layout == "per_layer":
        return [(backing[i, 0], backing[i, 1]) for i in range(num_layers)]
    return [(backing[:, i, 0], backing[:, i, 1]) for i in range(num_layers)]


def test_reshape_and_cache_triton_int32_slots_all_padding():
    kc = torch.zeros((3, 4, 2, 8))
    vc = torch.zeros((3, 4, 2, 8))
    pad = torch.tensor([-1, -1, -1], dtype=torch.int32)
    reshape_and_cache(torch.ones((3, 2, 8)), torch.ones((3, 2, 8)), kc, vc, pad)
    assert (kc == 0).all() and (vc == 0).all()


# ---- gather / scatter -----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_gather_kv_triton_matches_torch_on_unaligned_chunk(dtype, layout):
    _, caches = _filled_caches(layout, dtype)
    slots = torch.tensor([6, 7, 8, 9, 10, 11, 12, -1, 13], dtype=torch.int32)  # starts/ends mid-block
    expected = gather_kv(caches, slots, impl="torch")
    got = gather_kv(caches, slots)
    assert torch.equal(got, expected)
    assert (got[:, :, 7] == 0).all()


@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_gather_then_scatter_triton_is_identity_on_touched_blocks(layout):
    backing, caches = _filled_caches(layout, torch.float16, seed=2)
    before = backing.clone()
    slots = torch.tensor([2, 3, 4, 5, 6, 21, 22], dtype=torch.int64)  # mid-block start and end
    scatter_kv(gather_kv(caches, slots), caches, slots)
    assert torch.equal(backing, before)


@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_scatter_triton_writes_only_its_slots(layout):
    backing, caches = _filled_caches(layout, torch.float16, seed=2)
    before = backing.clone()
    chunk = gather_kv(caches, torch.tensor([2, 3, 4, 5, 6]))
    dst = torch.tensor([13, 14, -1, 15, 16])
    scatter_kv(chunk, caches, dst)
    touched = torch.zeros((7, 4), dtype=torch.bool)
    for s in (13, 14, 15, 16):
        touched[s // 4, s % 4] = True
    after, orig = _views(backing, layout, 3), _views(before, layout, 3)
    for layer in range(3):
        for kv in range(2):
            assert torch.equal(after[layer][kv][~touched], orig[layer][kv][~touched])
            rows = after[layer][kv].reshape(-1, 2, 8)
            assert torch.equal(rows[[13, 14, 15, 16]], chunk[layer, kv, [0, 1, 3, 4]])


def test_gather_scatter_triton_separately_allocated_layers():
    g = torch.Generator().manual_seed(3)
    caches = [(torch.randn((5, 4, 2, 8), generator=g), torch.randn((5, 4, 2, 8), generator=g)) for _ in range(3)]
    slots = torch.tensor([1, 2, 3, 17, 18])
    chunk = gather_kv(caches, slots)
    assert torch.equal(chunk, gather_kv(caches, slots, impl="torch"))
    fresh = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in caches]
    scatter_kv(chunk, fresh, slots)
    ref = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in caches]
    scatter_kv(chunk, ref, slots, impl="torch")
    for (a, b), (c, d) in zip(fresh, ref, strict=True):
        assert torch.equal(a, c) and torch.equal(b, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_layer_gather_scatter_triton_matches_torch(dtype):
    _, caches = _filled_caches("cross_layer", dtype, seed=4)
    k, v = caches[2]
    slots = torch.tensor([25, 26, 27, 0, -1, 1])
    chunk = gather_kv_layer(k, v, slots)
    assert torch.equal(chunk, gather_kv_layer(k, v, slots, impl="torch"))
    kc, vc = torch.zeros_like(k), torch.zeros_like(v)
    scatter_kv_layer(chunk, kc, vc, slots)
    kr, vr = torch.zeros_like(k), torch.zeros_like(v)
    scatter_kv_layer(chunk, kr, vr, slots, impl="torch")
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


# ---- paged attention ------------------------------------------------------------


def _both(batch, scale, window=None):
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
            batch.query_start_loc, batch.seq_lens, scale, window)
    return paged_attention(*args), paged_attention(*args, impl="torch")


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_paged_attention_triton_gqa_mixed_batch(group):
    # prefill, extend over a cached prefix, decode, and a length-1 sequence
    batch = make_paged_batch([9, 21, 7, 1], [9, 6, 1, 1], q_heads=2 * group, kv_heads=2, seed=group)
    got, expected = _both(batch, 0.3)
    torch.testing.assert_close(got, expected, atol=ATTN_TOL[torch.float32], rtol=ATTN_TOL[torch.float32])


def test_paged_attention_triton_decode_only_batch_across_kv_tiles():
    # 300 context positions span several KV tiles: exercises the online softmax
    batch = make_paged_batch([300, 5, 130], [1, 1, 1], block_size=16, q_heads=4, kv_heads=1, head_dim=32, seed=7)
    got, expected = _both(batch, 0.2)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [1, 5, 70])
def test_paged_attention_triton_sliding_window_with_null_blocks(window):
    # NaN in the null block: any read of it would poison the output
    batch = make_paged_batch([150, 23, 9], [1, 7, 9], block_size=8, q_heads=4, kv_heads=2, sliding_window=window,
                             seed=window)
    got, expected = _both(batch, 0.25, window)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_triton_low_precision(dtype):
    batch = make_paged_batch([12, 5, 1], [4, 1, 1], q_heads=4, kv_heads=1, dtype=dtype, seed=11)
    got, expected = _both(batch, 0.25)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, atol=ATTN_TOL[dtype], rtol=ATTN_TOL[dtype])


def test_paged_attention_triton_odd_head_dim_and_block_size():
    batch = make_paged_batch([11, 14], [3, 1], block_size=6, q_heads=3, kv_heads=1, head_dim=24, seed=12)
    got, expected = _both(batch, 0.4)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_write_then_attend_through_both_layouts(layout):
    """The engine's sequence: reshape_and_cache the new tokens, then attend."""
    shape = KVCacheShape(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=1, head_size=16)
    backing, caches = allocate_kv_caches(shape, layout, torch.float32, "cpu")
    g = torch.Generator().manual_seed(13)
    k, v, q = (torch.randn((7, 1, 16), generator=g) for _ in range(3))
    slots = torch.tensor([12, 13, 14, 15, 4, 5, 6])  # blocks 3 then 1
    reshape_and_cache(k, v, *caches[1], slots)
    table = torch.tensor([[3, 1, 0]], dtype=torch.int32)
    qsl = torch.tensor([0, 7], dtype=torch.int32)
    lens = torch.tensor([7], dtype=torch.int32)
    got = paged_attention(q, *caches[1], table, qsl, lens, 0.25)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=0.25).transpose(0, 1)
    torch.testing.assert_close(got, dense, atol=2e-5, rtol=2e-5)
    assert (caches[0][0] == 0).all(), "layer 0 must be untouched"


# ---- split-K decode ---------------------------------------------------------------
# Forced split counts and 16-position KV tiles, so small shapes still spread
# over several splits, leave some empty, and cut windows mid-split.


def _split(batch, scale, window=None, *, num_splits, tile_n=16):
    out = torch.full_like(batch.query, float("nan"))
    paged_attention_triton(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                           batch.query_start_loc, batch.seq_lens, scale, window, out, num_splits=num_splits,
                           tile_n=tile_n)
    return out


def _reference(batch, scale, window=None):
    return paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                           batch.query_start_loc, batch.seq_lens, scale, window, impl="torch")


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("group", [1, 4, 6, 8])
def test_decode_split_matches_torch_for_gqa_groups(group, num_splits):
    # 3 and 1 positions: shorter than the splits (most are empty); 100: 7 tiles over 8 splits
    batch = make_paged_batch([37, 3, 100, 1], [1, 1, 1, 1], q_heads=2 * group, kv_heads=2, seed=20 + group)
    got = _split(batch, 0.3, num_splits=num_splits)
    torch.testing.assert_close(got, _reference(batch, 0.3), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got.double(), dense_attention(batch, 0.3), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [1, 5, 70])
def test_decode_split_sliding_window_never_reads_null_block(window):
    # NaN in the null block, which stands for every block slid out of the window
    batch = make_paged_batch([150, 23, 9, 64], [1, 1, 1, 1], block_size=8, q_heads=8, kv_heads=2,
                             sliding_window=window, seed=30 + window)
    got = _split(batch, 0.25, window, num_splits=4)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, _reference(batch, 0.25, window), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_splits", [5, MAX_SPLITS])
def test_decode_split_one_sequence(num_splits):
    batch = make_paged_batch([257], [1], block_size=16, q_heads=8, kv_heads=1, head_dim=32, seed=40)
    got = _split(batch, 0.2, num_splits=num_splits)
    torch.testing.assert_close(got, _reference(batch, 0.2), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_split_low_precision(dtype):
    batch = make_paged_batch([70, 5, 33], [1, 1, 1], q_heads=8, kv_heads=2, dtype=dtype, seed=41)
    got = _split(batch, 0.25, num_splits=4)
    assert got.dtype == dtype
    torch.testing.assert_close(got, _reference(batch, 0.25), atol=ATTN_TOL[dtype], rtol=ATTN_TOL[dtype])


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_finds_sequences_when_tokens_are_not_one_per_sequence(num_splits):
    # as many tokens as sequences, but 2 + 0 + 1 + 1 new tokens: the kernel must search
    batch = make_paged_batch([10, 5, 7, 40], [2, 0, 1, 1], q_heads=4, kv_heads=2, seed=42)
    got = _split(batch, 0.3, num_splits=num_splits)
    torch.testing.assert_close(got, _reference(batch, 0.3), atol=2e-5, rtol=2e-5)


def test_decode_without_forcing_matches_torch_with_strided_out():
    batch = make_paged_batch([300, 5, 130], [1, 1, 1], block_size=16, q_heads=6, kv_heads=3, head_dim=32, seed=43)
    out = torch.zeros((3, 2, 6, 32))[:, 1]  # token stride 2 * Hq * D
    got = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                          batch.query_start_loc, batch.seq_lens, 0.2, out=out)
    assert got is out
    torch.testing.assert_close(out, _reference(batch, 0.2), atol=2e-5, rtol=2e-5)


def test_split_plan_is_forced_on_decode_steps_only():
    batch = make_paged_batch([9, 4], [3, 1], seed=44)
    with pytest.raises(ValueError, match="decode steps"):
        _split(batch, 0.3, num_splits=2)


@pytest.mark.parametrize(("kwargs", "match"), [(dict(num_splits=0), "num_splits"),
                                               (dict(num_splits=MAX_SPLITS + 1), "num_splits"),
                                               (dict(tile_n=24), "tile_n"), (dict(tile_n=8), "tile_n")])
def test_decode_plan_rejects_bad_forced_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        decode_plan(4, 32, 8, 128, 132, **kwargs)


def test_a_hand_made_plan_past_max_splits_is_refused():
    """launch_decode takes a tuning tool's own plan: the combine kernel reads
    at most MAX_SPLITS partials, so more would be dropped without a word."""
    from kvstrata.kernels._triton_attention import DecodePlan, launch_decode

    q = torch.zeros(2, 4, 8)
    cache = torch.zeros(3, 4, 2, 8)
    with pytest.raises(ValueError, match="num_splits"):
        launch_decode(q, cache, cache, torch.zeros(2, 1, dtype=torch.int32), torch.tensor([0, 1, 2]),
                      torch.tensor([1, 1]), 1.0, None, torch.empty_like(q), DecodePlan(MAX_SPLITS + 1, 16, 16, 4, 1),
                      True)


def test_split_count_fills_the_sms_from_shapes_alone():
    # 132 SMs want >= 4 * 132 = 528 programs: B * Hkv * splits
    assert split_count(8, 8, 132) == 16  # 64 programs -> 1024
    assert split_count(32, 8, 132) == 4  # 256 -> 1024
    assert split_count(64, 8, 132) == 2  # 512 -> 1024
    assert split_count(66, 8, 132) == 1  # 528: full already
    assert split_count(256, 4, 132) == 1
    assert split_count(1, 4, 132) == MAX_SPLITS  # capped: 128 programs
    assert [split_count(b, 4, 132) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)] == [32, 32, 32, 32, 16, 8, 4, 2, 1]


def test_decode_plan_tiles():
    assert decode_plan(8, 32, 4, 64, 132) == (32, 16, 128, 4, 3)  # TinyLlama: group 8 in 16 rows
    assert decode_plan(8, 32, 8, 128, 132).tile_n == 64
    assert decode_plan(8, 64, 2, 128, 132).block_m == 32  # group 32
    assert decode_plan(8, 32, 8, 128, None) == (1, 16, 128, 4, 1)  # interpreter: no split unless forced
    assert decode_plan(8, 32, 8, 128, None, num_splits=3, tile_n=16)[:3] == (3, 16, 16)
