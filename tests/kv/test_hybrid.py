"""Coordinators: unitary vs hybrid, granularity views, the fixed point."""

import pytest

from kvstrata.kv import (
    BlockHashesView,
    BlockStored,
    HybridCoordinator,
    MambaSpec,
    NoPrefixCacheCoordinator,
    SlidingWindowSpec,
    UnitaryCoordinator,
)

from .builders import full_spec, make_manager, make_request


def _sw(bs=4, window=8):
    return SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=1, sliding_window=window)


def test_coordinator_choice_follows_caching_and_group_count():
    assert type(make_manager(8).coordinator) is UnitaryCoordinator
    assert type(make_manager(8, enable_caching=False).coordinator) is NoPrefixCacheCoordinator
    assert type(make_manager(8, specs=[full_spec(4), _sw()]).coordinator) is HybridCoordinator


def test_block_hashes_view_reads_the_last_small_hash_of_each_big_block():
    hashes = [bytes([i]) for i in range(7)]
    view = BlockHashesView(hashes, 2)
    assert len(view) == 3
    assert list(view) == [b"\x01", b"\x03", b"\x05"]
    assert [view[0], view[-1]] == [b"\x01", b"\x05"]
    assert view[1:3] == [b"\x03", b"\x05"]
    with pytest.raises(IndexError):
        view[3]
    hashes.append(b"\x07")  # grows with the request
    assert list(view) == [b"\x01", b"\x03", b"\x05", b"\x07"]


def test_hash_block_size_must_divide_every_block_size():
    with pytest.raises(ValueError, match="hash_block_size 3 must divide"):
        make_manager(8, specs=[full_spec(4)], hash_block_size=3)


def _hybrid_same_size():
    m = make_manager(40, specs=[full_spec(4), _sw(4, 8)])
    r0 = make_request("r0", range(25), block_size=4)
    m.allocate_slots(r0, 25)
    m.free(r0)
    return m, r0


def test_hybrid_hit_when_every_group_has_the_prefix():
    m, r0 = _hybrid_same_size()
    r1 = make_request("r1", range(25), block_size=4)
    hit, n_hit = m.get_computed_blocks(r1)
    full, sw = hit.get_block_ids()
    assert n_hit == 24
    assert full == [1, 2, 3, 4, 5, 6]
    assert sw == [0, 0, 0, 0, 12, 13]


def test_hybrid_fixed_point_shortens_every_group_to_the_common_hit():
    m, r0 = _hybrid_same_size()
    sw_block_of_last = m.block_pool.hash_maps[1].get_one(r0.block_hashes[5])
    m.evict_blocks([sw_block_of_last.block_id])
    r1 = make_request("r1", range(25), block_size=4)
    hit, n_hit = m.get_computed_blocks(r1)
    full, sw = hit.get_block_ids()
    assert n_hit == 20
    assert full == [1, 2, 3, 4, 5]
    assert sw == [0, 0, 0, 11, 12]


def test_hybrid_groups_with_different_block_sizes_hash_at_the_smallest():
    m = make_manager(40, specs=[full_spec(8), _sw(4, 8)])
    assert m.hash_block_size == 4 and m.coordinator.alignment == 8
    r0 = make_request("r0", range(33), block_size=4)  # 8 small hashes
    m.allocate_slots(r0, 33)
    full_ids, sw_ids = m.get_block_ids("r0")
    assert (len(full_ids), len(sw_ids)) == (5, 9)
    # the 8-token group's blocks are cached under every second small hash
    full_pool = m.block_pool.hash_maps[0]
    assert [full_pool.get_one(r0.block_hashes[i]).block_id for i in (1, 3, 5, 7)] == full_ids[:4]
    assert full_pool.get_one(r0.block_hashes[0]) is None
    m.free(r0)
    r1 = make_request("r1", range(33), block_size=4)
    hit, n_hit = m.get_computed_blocks(r1)
    assert n_hit == 32
    assert hit.get_block_ids() == (full_ids[:4], [0] * 6 + sw_ids[6:8])


def test_hybrid_hit_is_aligned_to_the_lcm_of_block_sizes():
    m = make_manager(40, specs=[full_spec(8), _sw(4, 8)])
    r0 = make_request("r0", range(33), block_size=4)
    m.allocate_slots(r0, 33)
    _, sw_ids = m.get_block_ids("r0")
    m.free(r0)
    m.evict_blocks([sw_ids[7]])  # the window ending at 32 is broken
    r1 = make_request("r1", range(33), block_size=4)
    hit, n_hit = m.get_computed_blocks(r1)
    # a window ending at 28 exists but 28 is not a multiple of 8: 24 it is
    assert n_hit == 24
    full, sw = hit.get_block_ids()
    assert len(full) == 3 and sw == [0, 0, 0, 0] + sw_ids[4:6]


def test_hybrid_with_mamba_none_has_no_hits():
    m = make_manager(40, specs=[full_spec(16), MambaSpec(block_size=16, mamba_cache_mode="none")])
    r0 = make_request("r0", range(40))
    m.allocate_slots(r0, 40)
    m.free(r0)
    hit, n_hit = m.get_computed_blocks(make_request("r1", range(40)))
    assert n_hit == 0 and hit.get_block_ids() == ([], [])


def test_hybrid_allocation_counts_both_groups_against_room():
    m = make_manager(8, specs=[full_spec(4), _sw(4, 8)])  # 7 usable
    r0 = make_request("r0", range(16), block_size=4)
    assert m.allocate_slots(r0, 16) is None  # 4 + 4 > 7, nothing changed
    assert m.num_free_blocks == 7 and not m.has_request("r0")
    assert m.allocate_slots(r0, 12).get_block_ids() == ([1, 2, 3], [4, 5, 6])


def test_external_token_blocks_never_take_another_groups_hit():
    """Full + sliding window, a cached 20-token prefix, then a request with 4
    more tokens to load from a connector: the full group's new block for them
    is popped from the free queue, whose front holds the sliding group's
    still-free hits. Every group must take its hits before any group pops a
    new block, or that block lands in both groups' tables (and the loaded KV
    overwrites the other group's cache)."""
    m = make_manager(11, specs=[full_spec(4), _sw(4, 8)])  # 10 usable
    r0 = make_request("r0", range(20), block_size=4)
    m.allocate_slots(r0, 20)
    m.free(r0)
    r1 = make_request("r1", list(range(20)) + list(range(1000, 1005)), block_size=4)
    hit, n_hit = m.get_computed_blocks(r1)
    assert n_hit == 20
    sw_hits = [b.block_id for b in hit.blocks[1] if not b.is_null]
    assert m.allocate_slots(r1, 1, n_hit, hit, num_external_computed_tokens=4, delay_cache_blocks=True) is not None
    full, sw = m.get_block_ids("r1")
    ids = [i for i in full + sw if i != 0]
    assert len(ids) == len(set(ids)), (full, sw)
    kept = set(sw_hits) & set(sw)  # the hit still inside the window (the other is skipped, reusable)
    assert kept and not kept & set(full)
    # each block is referenced exactly once (by the one table holding it)
    assert all(m.block_pool.blocks[i].ref_cnt == 1 for i in ids)
    m.free(r1)
    assert m.num_free_blocks == 10


def test_sliding_window_group_caches_only_blocks_an_aligned_hit_can_use():
    """Full attention with 16-token blocks beside a 5-token window on 4-token
    blocks: hits end on multiples of 16 and need only the window's last
    block before them, so of every four window blocks one can ever serve a
    hit. The other three are neither hashed nor announced (BlockStored);
    the hit is the same as when everything was cached."""
    m = make_manager(80, specs=[full_spec(16), _sw(4, 5)], enable_events=True)
    r0 = make_request("r0", range(65), block_size=4)
    m.allocate_slots(r0, 65)
    _, sw_ids = m.get_block_ids("r0")
    sw_map = m.block_pool.hash_maps[1]
    cached = sorted(b.block_id for _, b in sw_map.items())
    assert cached == sorted(sw_ids[i] for i in (3, 7, 11, 15))
    stored = [h for e in m.take_events() if getattr(e, "group_idx", 0) == 1 and hasattr(e, "token_ids")
              for h in e.block_hashes]
    assert stored == [r0.block_hashes[i] for i in (3, 7, 11, 15)]
    m.free(r0)
    r1 = make_request("r1", range(65), block_size=4)
    hit, n_hit = m.get_computed_blocks(r1)
    assert n_hit == 64
    assert hit.get_block_ids()[1] == [0] * 15 + [sw_ids[15]]


def test_sliding_window_caches_every_block_when_each_can_end_a_hit():
    m = make_manager(40, specs=[full_spec(4), _sw(4, 5)])
    r0 = make_request("r0", range(17), block_size=4)
    m.allocate_slots(r0, 17)
    assert len(list(m.block_pool.hash_maps[1].items())) == 4


def _stored(events, group_idx):
    """(parent hash, block hashes, token count) of each BlockStored of a group."""
    return [(e.parent_block_hash, e.block_hashes, len(e.token_ids)) for e in events
            if isinstance(e, BlockStored) and e.group_idx == group_idx]


def test_window_blocks_past_the_last_aligned_boundary_wait_until_a_hit_can_reach_them():
    """vLLM's case: full attention on 32-token blocks beside a 32-token window
    on 16-token blocks (hits end on multiples of 32), one request of 112
    tokens. No hit can end at 128 yet, so window block 6 (tokens 96-111)
    serves none: blocks 0-5 are cached and announced, block 6 is not (a
    BlockStored for it would be a hit the router counts and cannot get).
    Once the request reaches 128 tokens, blocks 6 and 7 are cached together."""
    m = make_manager(20, specs=[full_spec(32), _sw(16, 32)], enable_events=True)
    r0 = make_request("r0", range(112), block_size=16)
    m.allocate_slots(r0, 112)
    full_ids, sw_ids = m.get_block_ids("r0")
    assert (len(full_ids), len(sw_ids)) == (4, 7)
    h = r0.block_hashes
    assert sorted(b.block_id for _, b in m.block_pool.hash_maps[1].items()) == sorted(sw_ids[:6])
    assert sorted(b.block_id for _, b in m.block_pool.hash_maps[0].items()) == sorted(full_ids[:3])
    events = m.take_events()
    assert _stored(events, 1) == [(None, h[:6], 96)]
    assert _stored(events, 0) == [(None, [h[1], h[3], h[5]], 96)]

    r0.num_computed_tokens = 112
    r0.append_output_token_ids(range(1000, 1016))  # 128 tokens now
    m.allocate_slots(r0, 16)
    full_ids, sw_ids = m.get_block_ids("r0")
    events = m.take_events()
    assert _stored(events, 1) == [(h[5], h[6:8], 32)]
    assert _stored(events, 0) == [(h[5], [h[7]], 32)]
    m.free(r0)
    hit, n_hit = m.get_computed_blocks(make_request("r1", [*range(112), *range(1000, 1017)], block_size=16))
    assert n_hit == 128
    assert hit.get_block_ids() == (full_ids, [0] * 6 + sw_ids[6:8])


def test_a_request_ending_between_aligned_boundaries_caches_what_its_aligned_hit_uses():
    """The same 112 tokens, freed there: the hit a later request gets is 96
    tokens, from exactly the blocks that were cached."""
    m = make_manager(20, specs=[full_spec(32), _sw(16, 32)])
    r0 = make_request("r0", range(112), block_size=16)
    m.allocate_slots(r0, 112)
    full_ids, sw_ids = m.get_block_ids("r0")
    m.free(r0)
    hit, n_hit = m.get_computed_blocks(make_request("r1", range(113), block_size=16))
    assert n_hit == 96
    assert hit.get_block_ids() == (full_ids[:3], [0] * 4 + sw_ids[4:6])
