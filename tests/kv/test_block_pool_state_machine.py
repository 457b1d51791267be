"""Property test: BlockPool against a plain-list model of the free queue.

The model keeps the free queue as a Python list and ref counts in a dict;
every allocation must return exactly the model's head blocks, and the
queue order must match after every operation. The model's free rule is
vLLM's: blocks reaching zero references go back in the order given, those
with a hash to the tail, those without one to the head.
"""

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstrata.kv import BlockPool

from .builders import make_request

NUM_BLOCKS = 12


class PoolMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.pool = BlockPool(NUM_BLOCKS)
        self.free = list(range(1, NUM_BLOCKS))  # model of the queue
        self.refs = {i: 0 for i in range(1, NUM_BLOCKS)}
        self.cached = {}  # block id -> hash
        self.holders = []  # lists of block ids, one per holder
        self.n = 0

    @rule(n=st.integers(0, NUM_BLOCKS))
    def allocate(self, n):
        if n > len(self.free):
            return
        got = [b.block_id for b in self.pool.get_new_blocks(n)]
        assert got == self.free[:n]
        del self.free[:n]
        for i in got:
            self.refs[i] = 1
            self.cached.pop(i, None)  # evicted
        self.holders.append(got)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def cache_holder(self, data):
        ids = data.draw(st.sampled_from(self.holders))
        blocks = [self.pool.blocks[i] for i in ids if self.pool.blocks[i].block_hash is None]
        if not blocks:
            return
        req = make_request(f"c{self.n}", range(self.n * 1000, self.n * 1000 + 4 * len(blocks)), block_size=4)
        self.n += 1
        self.pool.cache_full_blocks(req, blocks, req.block_hashes, 0, len(blocks), 4, 0)
        for b, h in zip(blocks, req.block_hashes):
            self.cached[b.block_id] = h

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def release(self, data):
        ids = self.holders.pop(data.draw(st.integers(0, len(self.holders) - 1)))
        self.pool.free_blocks([self.pool.blocks[i] for i in reversed(ids)])
        head, tail = [], []
        for i in reversed(ids):
            self.refs[i] -= 1
            if self.refs[i] == 0:
                (tail if i in self.cached else head).append(i)
        self.free[:0] = head
        self.free.extend(tail)

    @precondition(lambda self: self.cached)
    @rule(data=st.data())
    def hit(self, data):
        bid = data.draw(st.sampled_from(sorted(self.cached)))
        block = self.pool.get_cached_block(self.cached[bid])
        assert block is not None and block.block_id == bid
        self.pool.touch([block])
        if self.refs[bid] == 0:
            self.free.remove(bid)
        self.refs[bid] += 1
        self.holders.append([bid])

    @invariant()
    def queue_matches_model(self):
        assert [b.block_id for b in self.pool.free_block_queue] == self.free
        assert self.pool.num_free_blocks == len(self.free)
        assert {i: self.pool.blocks[i].ref_cnt for i in self.refs} == self.refs
        assert {b.block_id: b.block_hash for b in self.pool.blocks if b.block_hash is not None} == self.cached


TestPoolStateMachine = PoolMachine.TestCase
TestPoolStateMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
