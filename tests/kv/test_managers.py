"""Per-type managers: cache-hit search and skip rules (block size 4)."""

import pytest

from kvstrata.kv import (
    BlockPool,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    get_manager_class,
)
from kvstrata.kv.managers import (
    ChunkedLocalAttentionManager,
    CrossAttentionManager,
    FullAttentionManager,
    MambaManager,
    SinkFullAttentionManager,
    SlidingWindowManager,
)

from .builders import free_ids, full_spec, make_manager, make_request

BS = 4


def _sw(window=8):
    return SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=1, sliding_window=window)


def _chunked(chunk=8):
    return ChunkedLocalAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, attention_chunk_size=chunk)


def _mamba(mode="align", spec_blocks=0, bs=16):
    return MambaSpec(block_size=bs, mamba_cache_mode=mode, num_speculative_blocks=spec_blocks)


def _pool_with_cached(request, positions, num_blocks=20):
    """A pool where exactly the blocks at ``positions`` of ``request`` are cached."""
    pool = BlockPool(num_blocks)
    n = len(request.block_hashes)
    blocks = [pool.get_new_blocks(1)[0] if i in positions else pool.null_block for i in range(n)]
    pool.cache_full_blocks(request, blocks, request.block_hashes, 0, n, BS, 0)
    return pool, blocks


def _ids(blocks):
    return [b.block_id for b in blocks]


def test_registry_maps_each_spec_to_its_manager():
    assert get_manager_class(full_spec()) is FullAttentionManager
    assert get_manager_class(_sw()) is SlidingWindowManager
    assert get_manager_class(_chunked()) is ChunkedLocalAttentionManager
    assert get_manager_class(_mamba()) is MambaManager
    assert get_manager_class(CrossAttentionSpec(block_size=4, num_kv_heads=1, head_size=1)) is CrossAttentionManager
    spec = SinkFullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, sink_len=8)
    assert get_manager_class(spec) is SinkFullAttentionManager

    class MyFull(FullAttentionSpec, frozen=True):
        pass

    assert get_manager_class(MyFull(block_size=4, num_kv_heads=1, head_size=1)) is FullAttentionManager


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: FullAttentionSpec(block_size=0, num_kv_heads=1, head_size=1), "FullAttentionSpec.block_size"),
        (lambda: FullAttentionSpec(block_size=4, num_kv_heads=-1, head_size=1), "num_kv_heads"),
        (lambda: FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="f13"), "dtype must be"),
        (lambda: _sw(window=0), "sliding_window"),
        (lambda: _chunked(chunk=6), "multiple of block_size"),
        (lambda: _mamba(mode="all"), "mamba_cache_mode"),
        (lambda: SinkFullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, sink_len=6), "sink_len"),
        (lambda: KVCacheConfig(num_blocks=0, groups=[KVCacheGroupSpec(layer_names=[], spec=full_spec())]), "num_blocks"),
        (lambda: KVCacheConfig(num_blocks=1, groups=[KVCacheGroupSpec(layer_names=[], spec=full_spec())]), "null block"),
        (lambda: KVCacheConfig(num_blocks=8, groups=[]), "groups"),
    ],
)
def test_bad_specs_are_named(build, message):
    with pytest.raises(ValueError, match=message):
        build()


# -- sliding window (window 8, block 4: a hit needs the 2 blocks before it) --

def test_sliding_window_hit_needs_the_window_blocks_right_before_it():
    req = make_request("r", range(25), block_size=BS)  # 6 full blocks
    pool, blocks = _pool_with_cached(req, {1, 3, 4})
    hits = SlidingWindowManager.find_longest_cache_hit(req.block_hashes, 24, pool, _sw(), 0, BS)
    assert _ids(hits) == [0, 0, 0, blocks[3].block_id, blocks[4].block_id]


def test_sliding_window_run_from_the_start_is_a_hit_even_if_short():
    req = make_request("r", range(25), block_size=BS)
    pool, blocks = _pool_with_cached(req, {0})
    hits = SlidingWindowManager.find_longest_cache_hit(req.block_hashes, 24, pool, _sw(), 0, BS)
    assert _ids(hits) == [blocks[0].block_id]
    pool2, _ = _pool_with_cached(req, {2})
    assert SlidingWindowManager.find_longest_cache_hit(req.block_hashes, 24, pool2, _sw(), 0, BS) == []


def test_sliding_window_frees_blocks_that_left_the_window_tail_first():
    m = make_manager(12, specs=[_sw()])
    req = make_request("r", range(20), block_size=BS)
    assert m.allocate_slots(req, 20).get_block_ids() == ([1, 2, 3, 4, 5],)
    req.num_computed_tokens = 20
    req.append_output_token_ids([99])
    # computed 20: the next token reads tokens 13..20, so blocks 0-2 are skipped
    assert m.allocate_slots(req, 1).get_block_ids() == ([6],)
    assert m.get_block_ids("r") == ([0, 0, 0, 4, 5, 6],)
    assert free_ids(m) == [7, 8, 9, 10, 11, 3, 2, 1]
    assert m.block_pool.blocks[3].block_hash == req.block_hashes[2]  # freed early, still cached


def test_sliding_window_hit_is_taken_with_null_padding():
    m = make_manager(12, specs=[_sw()])
    r0 = make_request("r0", range(25), block_size=BS)
    m.allocate_slots(r0, 25)
    m.free(r0)
    r1 = make_request("r1", range(25), block_size=BS)
    hit, n_hit = m.get_computed_blocks(r1)
    assert (hit.get_block_ids(), n_hit) == (([0, 0, 0, 0, 5, 6],), 24)
    new = m.allocate_slots(r1, 1, n_hit, hit)
    assert new.get_block_ids() == ([7],)  # r0's uncached partial block, reused first
    assert m.get_block_ids("r1") == ([0, 0, 0, 0, 5, 6, 7],)
    assert [m.block_pool.blocks[i].ref_cnt for i in (5, 6, 7)] == [1, 1, 1]


# -- chunked local attention (chunk 8, block 4) ------------------------------

def test_chunked_local_hit_pads_earlier_chunks_and_looks_up_the_current_one():
    req = make_request("r", range(16), block_size=BS)
    pool, blocks = _pool_with_cached(req, {2})
    hits = ChunkedLocalAttentionManager.find_longest_cache_hit(req.block_hashes, 15, pool, _chunked(), 0, BS)
    assert _ids(hits) == [0, 0, blocks[2].block_id]
    empty_pool = BlockPool(8)
    assert _ids(ChunkedLocalAttentionManager.find_longest_cache_hit(req.block_hashes, 15, empty_pool, _chunked(), 0, BS)) == [0, 0]
    assert _ids(ChunkedLocalAttentionManager.find_longest_cache_hit(req.block_hashes, 16, empty_pool, _chunked(), 0, BS)) == [0, 0, 0, 0]


def test_chunked_local_skips_whole_earlier_chunks():
    m = make_manager(12, specs=[_chunked()])
    mgr = m.coordinator.managers[0]
    assert [mgr.get_num_skipped_tokens(n) for n in (7, 8, 13, 16)] == [0, 8, 8, 16]
    req = make_request("r", range(13), block_size=BS)
    m.allocate_slots(req, 13)
    req.num_computed_tokens = 13
    req.append_output_token_ids([1])
    m.allocate_slots(req, 1)
    assert m.get_block_ids("r") == ([0, 0, 3, 4],)


# -- mamba ------------------------------------------------------------------------

def test_mamba_none_mode_never_hits_and_keeps_only_the_last_state():
    m = make_manager(10, specs=[_mamba("none")], enable_caching=True)
    r0 = make_request("r0", range(40))
    assert m.allocate_slots(r0, 40).get_block_ids() == ([1, 2, 3],)
    r0.num_computed_tokens = 40
    r0.append_output_token_ids([5])
    m.allocate_slots(r0, 1)
    assert m.get_block_ids("r0") == ([0, 0, 3],)
    assert m.get_computed_blocks(make_request("r1", range(40)))[1] == 0


def test_mamba_align_caches_boundary_states_and_frees_the_previous_one():
    m = make_manager(10, specs=[_mamba("align")])
    r0 = make_request("r0", range(64))
    assert m.allocate_slots(r0, 32).get_block_ids() == ([0, 1],)
    assert m.block_pool.blocks[1].block_hash == r0.block_hashes[1]
    r0.num_computed_tokens = 32
    m.new_step_starts()
    assert m.allocate_slots(r0, 32).get_block_ids() == ([0, 2],)
    assert m.get_block_ids("r0") == ([0, 1, 0, 2],)
    r0.num_computed_tokens = 64
    r0.append_output_token_ids([7])
    assert m.allocate_slots(r0, 1).get_block_ids() == ([3],)
    assert m.get_block_ids("r0") == ([0, 0, 0, 2, 3],)
    assert m.block_pool.blocks[1].ref_cnt == 0 and m.block_pool.blocks[1].block_hash == r0.block_hashes[1]


def test_mamba_align_hit_resumes_from_the_last_cached_state_next_step():
    m = make_manager(10, specs=[_mamba("align")])
    r0 = make_request("r0", range(64))
    m.allocate_slots(r0, 64)  # state after token 64 cached under hash[3]
    r1 = make_request("r1", [*range(64), *range(500, 510)])
    hit, n_hit = m.get_computed_blocks(r1)
    assert (hit.get_block_ids(), n_hit) == (([0, 0, 0, 1],), 64)
    assert m.allocate_slots(r1, 10, n_hit, hit) is None  # state written this step
    m.new_step_starts()
    new = m.allocate_slots(r1, 10, n_hit, hit)
    assert new.get_block_ids() == ([2],)
    assert m.get_block_ids("r1") == ([0, 0, 0, 1, 2],)
    assert m.block_pool.blocks[1].ref_cnt == 2


def test_mamba_align_with_speculative_blocks_reuses_them():
    m = make_manager(12, specs=[_mamba("align", spec_blocks=1)])
    r0 = make_request("r0", range(64))
    assert m.allocate_slots(r0, 32).get_block_ids() == ([0, 1, 2],)  # state 1, draft 2
    r0.num_computed_tokens = 32
    m.new_step_starts()
    # the draft block moves forward to the new state position; one new draft block
    assert m.allocate_slots(r0, 32).get_block_ids() == ([2, 3],)
    assert m.get_block_ids("r0") == ([0, 1, 0, 2, 3],)
    r0.num_computed_tokens = 64
    r0.append_output_token_ids([1])
    m.new_step_starts()
    # one more token: the draft block 3 already sits at the state position
    assert m.allocate_slots(r0, 1).get_block_ids() == ([4],)
    assert m.get_block_ids("r0") == ([0, 0, 0, 2, 3, 4],)


# -- cross attention and sinks --------------------------------------------------

def _cross():
    return CrossAttentionSpec(block_size=16, num_kv_heads=1, head_size=1)


def test_cross_attention_refuses_prefix_caching():
    with pytest.raises(ValueError, match="enable_caching must be False"):
        make_manager(10, specs=[full_spec(), _cross()])


# Cross-attention allocation (encoder slots once): tests/kv/test_model_specs.py,
# through the builder from a model's layer specs.


def test_sink_blocks_are_reserved_at_start_and_never_freed():
    spec = SinkFullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, sink_len=32)
    m = make_manager(10, specs=[spec])
    assert m.coordinator.managers[0].sink_block_ids == [1, 2]
    assert m.num_free_blocks == 7 and m.usage == 2 / 9
    r0 = make_request("r0", range(20))
    assert m.allocate_slots(r0, 20).get_block_ids() == ([3, 4],)
    m.free(r0)
    assert m.reset_prefix_cache() is True
    assert free_ids(m) == [4, 5, 6, 7, 8, 9, 3]


def test_sinks_larger_than_the_pool_are_refused():
    spec = SinkFullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, sink_len=160)
    with pytest.raises(ValueError, match="sink_len=160 needs 10 blocks"):
        make_manager(10, specs=[spec])
