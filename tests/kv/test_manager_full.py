"""KVCacheManager over one full-attention group: vLLM v1 semantics."""

import pytest

from kvstrata.kv import BlockRemoved, BlockStored, UnknownRequestError

from .builders import free_ids, make_manager, make_request, ref_counts, schedule

BS = 16


def _prompt(prefix_blocks, tail, start=0):
    """``prefix_blocks`` full blocks of shared tokens, then ``tail`` unique ones."""
    return list(range(prefix_blocks * BS)) + list(range(10_000 + start, 10_000 + start + tail))


def test_prefill_shares_the_common_prefix_and_frees_tail_first():
    m = make_manager(11)
    r0 = make_request("r0", _prompt(3, 7, start=0))
    hit, n_hit, new = schedule(m, r0)
    assert (hit.get_block_ids(), n_hit) == (([],), 0)
    assert new.get_block_ids() == ([1, 2, 3, 4],)
    assert [m.block_pool.blocks[i].block_hash for i in (1, 2, 3)] == r0.block_hashes
    assert m.block_pool.blocks[4].block_hash is None  # partial block is not cached
    r1 = make_request("r1", _prompt(3, 5, start=100))
    hit, n_hit, new = schedule(m, r1)
    assert (hit.get_block_ids(), n_hit) == (([1, 2, 3],), 48)
    assert new.get_block_ids() == ([5],)
    assert m.get_block_ids("r1") == ([1, 2, 3, 5],)
    assert ref_counts(m, [1, 2, 3, 4, 5]) == [2, 2, 2, 1, 1]
    assert free_ids(m) == [6, 7, 8, 9, 10]
    m.free(r0)
    m.free(r1)
    # the partial (uncached) blocks at the head, last freed first; then the
    # unallocated; then r1's cached blocks, tail first
    assert free_ids(m) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert m.num_free_blocks == 10 and m.usage == 0.0


def test_eviction_victims_follow_the_free_queue():
    m = make_manager(11)
    r0 = make_request("r0", _prompt(3, 7))
    schedule(m, r0)
    m.free(r0)
    assert free_ids(m) == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]  # uncached block 4 first
    r1 = make_request("r1", list(range(50_000, 50_000 + 8 * BS)))
    _, n_hit, new = schedule(m, r1)
    assert n_hit == 0
    assert new.get_block_ids() == ([4, 5, 6, 7, 8, 9, 10, 3],)
    # block 3 (tail of r0's chain) was evicted; its head survives
    r2 = make_request("r2", _prompt(3, 7, start=500))
    hit, n_hit, _ = m.get_computed_blocks(r2), None, None
    assert hit[0].get_block_ids() == ([1, 2],) and hit[1] == 32


def test_hit_never_covers_the_whole_prompt():
    m = make_manager(11)
    r0 = make_request("r0", list(range(3 * BS)))
    schedule(m, r0)
    m.free(r0)
    r1 = make_request("r1", list(range(3 * BS)))
    hit, n_hit = m.get_computed_blocks(r1)
    assert (hit.get_block_ids(), n_hit) == (([1, 2],), 32)  # last block recomputed
    r2 = make_request("r2", list(range(3 * BS + 1)))
    assert m.get_computed_blocks(r2)[1] == 48


def test_allocation_that_does_not_fit_returns_none_and_changes_nothing():
    m = make_manager(5)  # 4 usable blocks
    r0 = make_request("r0", list(range(2 * BS)))
    schedule(m, r0)
    before = (free_ids(m), ref_counts(m, range(5)))
    r1 = make_request("r1", list(range(100, 100 + 3 * BS)))
    hit, n_hit = m.get_computed_blocks(r1)
    assert m.allocate_slots(r1, 3 * BS, n_hit, hit) is None
    assert (free_ids(m), ref_counts(m, range(5))) == before
    assert not m.has_request("r1")
    assert m.allocate_slots(r1, 2 * BS) is not None


def test_evictable_hit_blocks_count_against_room():
    m = make_manager(5)  # 4 usable blocks
    r0 = make_request("r0", list(range(3 * BS + 1)))
    schedule(m, r0)
    m.free(r0)
    assert free_ids(m) == [4, 3, 2, 1]
    r1 = make_request("r1", list(range(3 * BS)) + list(range(900, 900 + 2 * BS)))
    hit, n_hit = m.get_computed_blocks(r1)
    assert (hit.get_block_ids(), n_hit) == (([1, 2, 3],), 48)
    # 3 free cached hits + 2 new blocks = 5 > 4 free: refused
    assert m.allocate_slots(r1, 2 * BS, n_hit, hit) is None
    assert free_ids(m) == [4, 3, 2, 1]
    # one new block fits: the hits leave the queue, block 4 is taken
    new = m.allocate_slots(r1, BS, n_hit, hit)
    assert new.get_block_ids() == ([4],)
    assert free_ids(m) == []


def test_decode_caches_a_block_when_it_fills():
    m = make_manager(11)
    r0 = make_request("r0", list(range(BS + 15)))
    schedule(m, r0)
    r0.num_computed_tokens = BS + 15
    r0.append_output_token_ids([7])  # 32 tokens: block 2 full
    assert m.block_pool.blocks[2].block_hash is None
    assert m.allocate_slots(r0, 1).get_block_ids() == ([],)
    assert m.block_pool.blocks[2].block_hash == r0.block_hashes[1]
    r0.num_computed_tokens += 1
    r0.append_output_token_ids([8])
    assert m.allocate_slots(r0, 1).get_block_ids() == ([3],)


def test_lookahead_slots_are_allocated_but_not_cached():
    m = make_manager(11)
    r0 = make_request("r0", list(range(BS)))
    _, _, new = m.get_computed_blocks(r0), 0, m.allocate_slots(r0, BS, num_lookahead_tokens=BS + 1)
    assert new.get_block_ids() == ([1, 2, 3],)
    assert [m.block_pool.blocks[i].block_hash is not None for i in (1, 2, 3)] == [True, False, False]


def test_lookahead_is_capped_by_max_model_len():
    m = make_manager(11, max_model_len=2 * BS)
    r0 = make_request("r0", list(range(BS)))
    assert m.allocate_slots(r0, BS, num_lookahead_tokens=5 * BS).get_block_ids() == ([1, 2],)


def test_delayed_caching_waits_for_cache_blocks():
    m = make_manager(11)
    r0 = make_request("r0", list(range(2 * BS + 3)))
    new = m.allocate_slots(r0, 2 * BS + 3, delay_cache_blocks=True)
    assert new.get_block_ids() == ([1, 2, 3],)
    assert m.block_pool.get_cached_block(r0.block_hashes[0]) is None
    m.cache_blocks(r0, 2 * BS + 3)
    assert [m.block_pool.get_cached_block(h).block_id for h in r0.block_hashes] == [1, 2]


def test_external_computed_tokens_get_blocks_after_the_local_hit():
    m = make_manager(11)
    r0 = make_request("r0", list(range(2 * BS)) + [5])
    schedule(m, r0)
    m.free(r0)
    r1 = make_request("r1", list(range(5 * BS + 4)))
    hit, n_hit = m.get_computed_blocks(r1)
    assert n_hit == 2 * BS
    # the connector holds 2 more blocks; 4 tokens left to compute
    new = m.allocate_slots(r1, 4, n_hit, hit, num_external_computed_tokens=3 * BS)
    assert new.get_block_ids() == ([3, 4, 5, 6],)  # r0's uncached block 3 is reused first
    assert m.get_block_ids("r1") == ([1, 2, 3, 4, 5, 6],)
    cached = [m.block_pool.get_cached_block(h) for h in r1.block_hashes]
    assert [b.block_id if b else None for b in cached] == [1, 2, 3, 4, 5]


def test_external_tokens_alone_may_allocate_with_zero_new_tokens():
    m = make_manager(11)
    r0 = make_request("r0", list(range(2 * BS + 1)))
    new = m.allocate_slots(r0, 0, num_external_computed_tokens=2 * BS, delay_cache_blocks=True)
    assert new.get_block_ids() == ([1, 2],)


def test_freeing_an_unknown_request_names_it_and_changes_nothing():
    m = make_manager(11)
    r0 = make_request("r0", list(range(20)))
    schedule(m, r0)
    before = free_ids(m)
    with pytest.raises(UnknownRequestError, match="'ghost'"):
        m.free(make_request("ghost", [1, 2, 3]))
    m.free(r0)
    with pytest.raises(KeyError):
        m.free(r0)  # already freed
    assert free_ids(m) == [2, 3, 4, 5, 6, 7, 8, 9, 10, 1] and len(before) == 8


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_new_tokens": 0}, "num_new_tokens must be >= 1"),
        ({"num_new_tokens": -1}, "num_new_tokens must be an integer >= 0"),
        ({"num_new_tokens": 4, "num_lookahead_tokens": -2}, "num_lookahead_tokens"),
        ({"num_new_tokens": 4, "num_external_computed_tokens": 1.5}, "num_external_computed_tokens"),
    ],
)
def test_bad_allocation_arguments_are_named(kwargs, message):
    m = make_manager(11)
    r0 = make_request("r0", list(range(20)))
    with pytest.raises(ValueError, match=message):
        m.allocate_slots(r0, **kwargs)
    assert m.num_free_blocks == 10 and not m.has_request("r0")


def test_missing_block_hashes_are_reported_before_any_change():
    m = make_manager(11)
    r0 = make_request("r0", list(range(40)))
    r0.block_hashes.clear()
    with pytest.raises(ValueError, match="block_hashes cover 0 tokens but 40 are to be cached"):
        m.allocate_slots(r0, 40)
    assert m.num_free_blocks == 10 and not m.has_request("r0")


def test_caching_disabled_never_hits():
    m = make_manager(11, enable_caching=False)
    r0 = make_request("r0", list(range(40)))
    schedule(m, r0)
    m.free(r0)
    r1 = make_request("r1", list(range(40)))
    hit, n_hit, new = schedule(m, r1)
    assert (hit.get_block_ids(), n_hit) == (([],), 0)
    assert new.get_block_ids() == ([4, 5, 6],)
    assert m.make_prefix_cache_stats().queries == 0


def test_prefix_cache_stats_count_tokens_and_split_preempted():
    m = make_manager(11)
    r0 = make_request("r0", list(range(40)))
    schedule(m, r0)
    m.free(r0)
    schedule(m, make_request("r1", list(range(40))))
    schedule(m, make_request("r2", list(range(33)), num_preemptions=1))
    stats = m.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 80, 32)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 33, 32)
    assert stats.hit_rate == 32 / 80
    assert m.make_prefix_cache_stats().queries == 0
    assert make_manager(11, log_stats=False).make_prefix_cache_stats() is None


def test_a_request_is_counted_once_when_it_gets_its_first_blocks():
    m = make_manager(4)  # 3 usable blocks
    r0 = make_request("r0", list(range(40)))
    schedule(m, r0)
    m.free(r0)
    r1 = make_request("r1", list(range(40)))
    hog = make_request("hog", list(range(100, 132)))
    m.allocate_slots(hog, 32)  # no lookup, no query; takes r0's partial block and evicts its second one
    for _ in range(3):  # the scheduler retries a lookup while there is no room
        hit, n_hit = m.get_computed_blocks(r1)
        assert n_hit == 16 and m.allocate_slots(r1, 40 - n_hit, n_hit, hit) is None
    m.free(hog)
    hit, n_hit = m.get_computed_blocks(r1)
    assert m.allocate_slots(r1, 40 - n_hit, n_hit, hit) is not None
    r1.num_computed_tokens = 40
    r1.append_output_token_ids([7])
    m.allocate_slots(r1, 1)  # a running request's allocation is no query
    totals = m.prefix_cache_totals()
    assert (totals.requests, totals.queries, totals.hits) == (2, 40 + 40, 16)
    assert m.make_prefix_cache_stats().queries == 80
    assert m.prefix_cache_totals() == totals  # snapshots derive from the totals, never reset them
    assert make_manager(11, log_stats=False).prefix_cache_totals() is None


def test_skip_reading_prefix_cache_is_honoured_and_not_counted():
    m = make_manager(11)
    r0 = make_request("r0", list(range(40)))
    schedule(m, r0)
    r1 = make_request("r1", list(range(40)))
    r1.skip_reading_prefix_cache = True
    hit, n_hit = m.get_computed_blocks(r1)
    assert n_hit == 0
    m.allocate_slots(r1, 40, n_hit, hit)
    assert m.make_prefix_cache_stats().requests == 1


def test_events_report_stores_and_evictions():
    m = make_manager(4, enable_events=True)  # 3 usable blocks
    r0 = make_request("r0", list(range(2 * BS + 1)))
    schedule(m, r0)
    assert m.take_events() == [
        BlockStored(
            block_hashes=r0.block_hashes[:2],
            parent_block_hash=None,
            token_ids=list(range(2 * BS)),
            block_size=BS,
        )
    ]
    m.free(r0)
    r1 = make_request("r1", list(range(100, 100 + 3 * BS)))
    m.allocate_slots(r1, 3 * BS)
    events = m.take_events()
    assert events[0] == BlockRemoved(block_hashes=[r0.block_hashes[1], r0.block_hashes[0]])
    assert isinstance(events[1], BlockStored) and events[1].block_hashes == r1.block_hashes


def test_reset_prefix_cache_through_the_manager():
    m = make_manager(11)
    r0 = make_request("r0", list(range(40)))
    schedule(m, r0)
    assert m.reset_prefix_cache() is False
    m.free(r0)
    assert m.reset_prefix_cache() is True
    assert m.get_computed_blocks(make_request("r1", list(range(40))))[1] == 0
    assert m.make_prefix_cache_stats().reset is True


def test_running_request_may_not_take_new_computed_blocks():
    m = make_manager(11)
    r0 = make_request("r0", list(range(40)))
    schedule(m, r0)
    r1 = make_request("r1", list(range(40)))
    hit, n_hit = m.get_computed_blocks(r1)
    with pytest.raises(ValueError, match="already holds blocks"):
        m.allocate_slots(r0, 1, n_hit, hit)
