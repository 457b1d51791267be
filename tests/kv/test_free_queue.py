"""The intrusive free queue: order is eviction order, O(1) removal."""

import pytest

from kvstrata.kv import FreeBlockQueue, KVCacheBlock


def _blocks(n):
    return [KVCacheBlock(i) for i in range(n)]


def _ids(queue):
    return [b.block_id for b in queue]


def test_initial_order_is_the_given_order():
    q = FreeBlockQueue(_blocks(5))
    assert _ids(q) == [0, 1, 2, 3, 4]
    assert q.num_free_blocks == 5 and len(q) == 5


def test_popleft_takes_the_head_and_unlinks_it():
    blocks = _blocks(3)
    q = FreeBlockQueue(blocks)
    assert q.popleft() is blocks[0]
    assert blocks[0].prev_free_block is None and blocks[0].next_free_block is None
    assert _ids(q) == [1, 2]


def test_popleft_n_returns_head_first():
    q = FreeBlockQueue(_blocks(6))
    assert [b.block_id for b in q.popleft_n(4)] == [0, 1, 2, 3]
    assert _ids(q) == [4, 5]
    assert q.popleft_n(0) == []
    assert [b.block_id for b in q.popleft_n(2)] == [4, 5]
    assert _ids(q) == [] and q.num_free_blocks == 0


def test_remove_from_the_middle_keeps_neighbours_linked():
    blocks = _blocks(5)
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert _ids(q) == [0, 1, 3, 4]
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert _ids(q) == [1, 3]
    assert q.num_free_blocks == 2


def test_append_and_append_n_go_to_the_tail_in_order():
    blocks = _blocks(6)
    q = FreeBlockQueue(blocks[:2])
    q.append(blocks[5])
    q.append_n([blocks[4], blocks[2]])
    assert _ids(q) == [0, 1, 5, 4, 2]
    q.append_n([])
    assert q.num_free_blocks == 5


def test_popleft_of_empty_queue_raises():
    q = FreeBlockQueue([])
    with pytest.raises(IndexError):
        q.popleft()
    with pytest.raises(IndexError, match="popleft_n"):
        q.popleft_n(1)


def test_remove_of_a_block_not_in_the_queue_raises_and_changes_nothing():
    blocks = _blocks(3)
    q = FreeBlockQueue(blocks[:2])
    with pytest.raises(ValueError, match="block 2 is not in the free block queue"):
        q.remove(blocks[2])
    assert _ids(q) == [0, 1]
