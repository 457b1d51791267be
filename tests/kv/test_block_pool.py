"""BlockPool: null block, allocation/eviction order, caching, events, reset."""

import pytest

from kvstrata.kv import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored
from .builders import make_request


def _ids(blocks):
    return [b.block_id for b in blocks]


def _free(pool):
    return _ids(pool.free_block_queue)


def test_null_block_is_block_zero_and_never_free():
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert _free(pool) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 4 and pool.usage == 0.0


@pytest.mark.parametrize("bad", [0, -3, 1, 2.0, "4", True, None])
def test_bad_num_blocks_is_rejected_by_name(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(bad)


def test_get_new_blocks_takes_from_the_head_with_one_reference():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    assert _ids(blocks) == [1, 2, 3]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert _free(pool) == [4, 5]
    assert pool.usage == 3 / 5


def test_get_new_blocks_beyond_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="cannot allocate 4 blocks: only 3 are free"):
        pool.get_new_blocks(4)
    assert _free(pool) == [1, 2, 3]


def test_free_blocks_without_hash_go_to_the_head_in_given_order_skipping_held_and_null():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # 1, 2, 3
    pool.touch([a[0]])  # block 1 now held twice
    pool.free_blocks(reversed([pool.null_block, *a]))
    assert _free(pool) == [3, 2, 4, 5]  # no hash: reused first (vLLM's order)
    assert a[0].ref_cnt == 1
    assert pool.null_block.ref_cnt == 0


def test_freed_cached_blocks_go_to_the_tail_and_uncached_ones_to_the_head():
    pool = BlockPool(8)
    req = make_request("r", range(8), block_size=4)
    blocks = pool.get_new_blocks(3)  # 1, 2, 3: two full blocks cached, the third partial
    _cache(pool, req, blocks, 2)
    pool.free_blocks(reversed(blocks))  # tail first: 3 (no hash), 2, 1 (cached)
    assert _free(pool) == [3, 4, 5, 6, 7, 2, 1]
    assert _ids(pool.get_new_blocks(1)) == [3]  # the uncached block is reused first
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]


def test_with_caching_off_every_freed_block_goes_to_the_tail():
    pool = BlockPool(6, enable_caching=False)
    a = pool.get_new_blocks(3)
    pool.free_blocks(reversed(a))
    assert _free(pool) == [4, 5, 3, 2, 1]


def _cache(pool, request, blocks, num_full, block_size=4, group_id=0):
    pool.cache_full_blocks(request, blocks, request.block_hashes, 0, num_full, block_size, group_id)


def test_cache_full_blocks_registers_hashes():
    pool = BlockPool(6)
    req = make_request("r", range(10), block_size=4)
    blocks = pool.get_new_blocks(3)
    _cache(pool, req, blocks, 2)
    assert blocks[0].block_hash == req.block_hashes[0]
    assert blocks[1].block_hash == req.block_hashes[1]
    assert blocks[2].block_hash is None
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]
    assert pool.get_cached_block(req.block_hashes[1]) is blocks[1]


def test_cache_full_blocks_without_enough_hashes_names_the_field():
    pool = BlockPool(6)
    req = make_request("r", range(6), block_size=4)  # one full block hashed
    blocks = pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="has 1 block_hashes but 2 full blocks"):
        _cache(pool, req, blocks, 2)
    assert blocks[0].block_hash is None


def test_eviction_takes_least_recently_freed_and_drops_the_hash():
    pool = BlockPool(5, enable_events=True)
    req = make_request("r", range(8), block_size=4)
    blocks = pool.get_new_blocks(2)  # 1, 2
    _cache(pool, req, blocks, 2)
    pool.take_events()
    pool.free_blocks(reversed(blocks))  # tail first
    assert _free(pool) == [3, 4, 2, 1]
    got = pool.get_new_blocks(3)
    assert _ids(got) == [3, 4, 2]
    assert got[2].block_hash is None
    assert pool.get_cached_block(req.block_hashes[1]) is None
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]  # head of chain survives
    assert pool.take_events() == [BlockRemoved(block_hashes=[req.block_hashes[1]])]


def test_one_hash_may_name_several_blocks_without_dedup():
    pool = BlockPool(6)
    r1 = make_request("a", range(4), block_size=4)
    r2 = make_request("b", range(4), block_size=4)
    b1 = pool.get_new_blocks(1)
    b2 = pool.get_new_blocks(1)
    _cache(pool, r1, b1, 1)
    _cache(pool, r2, b2, 1)
    h = r1.block_hashes[0]
    assert pool.hash_maps[0].get_all(h) == [b1[0], b2[0]]
    assert len(pool.hash_maps[0]) == 2
    pool.free_blocks(b1)
    pool.free_blocks(b2)
    assert _free(pool) == [3, 4, 5, 1, 2]
    pool.get_new_blocks(4)  # evicts block 1, the primary
    assert pool.get_cached_block(h) is b2[0]
    assert pool.hash_maps[0].get_all(h) == [b2[0]]


def test_touch_revives_a_free_cached_block_out_of_the_queue():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(reversed(blocks))
    assert _free(pool) == [2, 1, 3, 4]  # no hash: at the head
    pool.touch([blocks[1], pool.null_block])
    assert blocks[1].ref_cnt == 1
    assert _free(pool) == [1, 3, 4]
    assert pool.null_block.ref_cnt == 0


def test_stored_event_describes_blocks_tokens_and_parent():
    pool = BlockPool(6, enable_events=True)
    req = make_request("r", range(12), block_size=4, lora_name="adapter")
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, req.block_hashes, 1, 3, 4, 0)
    assert pool.take_events() == [
        BlockStored(
            block_hashes=req.block_hashes[1:3],
            parent_block_hash=req.block_hashes[0],
            token_ids=list(range(4, 12)),
            block_size=4,
            lora_name="adapter",
        )
    ]
    assert pool.take_events() == []


def test_reset_prefix_cache_refused_while_blocks_are_held():
    pool = BlockPool(5, enable_events=True)
    req = make_request("r", range(4), block_size=4)
    blocks = pool.get_new_blocks(1)
    _cache(pool, req, blocks, 1)
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(req.block_hashes[0]) is None
    assert blocks[0].block_hash is None
    assert pool.take_events() == [AllBlocksCleared()]
    assert _free(pool) == [2, 3, 4, 1]


def test_evict_blocks_uncaches_by_id():
    pool = BlockPool(5)
    req = make_request("r", range(8), block_size=4)
    blocks = pool.get_new_blocks(2)
    _cache(pool, req, blocks, 2)
    pool.evict_blocks([blocks[1].block_id, 0])
    assert pool.get_cached_block(req.block_hashes[1]) is None
    assert blocks[1].ref_cnt == 1  # still held
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]


def test_caching_disabled_pool_never_evicts_hashes():
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(blocks)
    assert _ids(pool.get_new_blocks(3)) == [1, 2, 3]
