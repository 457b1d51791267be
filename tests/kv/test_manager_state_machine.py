"""Property test: random request lifecycles against KVCacheManager.

Requests share prefixes (so hits and evictions happen), some have tokens a
connector loads, finished ones come back longer, they run chunked prefills
and decodes, finish, get aborted, and the prefix cache is reset.
After every step the pool's invariants must hold.
"""

from collections import Counter

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstrata.kv import ChunkedLocalAttentionSpec, MambaSpec, SlidingWindowSpec, UnknownRequestError

from .builders import full_spec, make_manager, make_request

BS = 4
PREFIXES = [list(range(1000 * k, 1000 * k + 24)) for k in range(3)]


class KVManagerMachine(RuleBasedStateMachine):
    specs = (full_spec(BS),)
    num_blocks = 24
    external_tokens = True  # some requests have connector-loaded tokens

    @initialize()
    def setup(self):
        self.m = make_manager(self.num_blocks, specs=self.specs, max_model_len=200)
        self.pool = self.m.block_pool
        self.running = {}  # request id -> request holding blocks
        self.waiting = {}  # request id -> request never allocated
        self.finished = []  # computed tokens of the last finished requests
        self.next_id = 0

    # -- helpers ---------------------------------------------------------------

    def _snapshot(self):
        return (
            [b.block_id for b in self.pool.free_block_queue],
            [b.ref_cnt for b in self.pool.blocks],
            [b.block_hash for b in self.pool.blocks],
        )

    def _allocate(self, req, num_new, num_hit=0, hit=None, ext=0):
        before = self._snapshot()
        # external (connector-loaded) tokens enter the cache once loaded, as the scheduler does
        new = self.m.allocate_slots(req, num_new, num_hit, hit, num_external_computed_tokens=ext,
                                    delay_cache_blocks=ext > 0)
        if new is None:
            assert self._snapshot()[1:] == before[1:]
            assert self._snapshot()[0] == before[0]
            return False
        req.num_computed_tokens += num_hit + ext + num_new
        return True

    def _admit(self, tokens, chunk, external):
        if not self.external_tokens:
            external = 0
        req = make_request(f"r{self.next_id}", tokens, block_size=BS)
        self.next_id += 1
        hit, num_hit = self.m.get_computed_blocks(req)
        assert num_hit % BS == 0 and num_hit < req.num_tokens
        for group in hit.blocks:
            for i, b in enumerate(group):
                assert b.is_null or b.block_hash == req.block_hashes[i]
        ext = max(0, min(external, req.num_tokens - 1 - num_hit))
        num_new = min(chunk, req.num_tokens - num_hit - ext)
        if self._allocate(req, num_new, num_hit, hit, ext):
            self.running[req.request_id] = req
        else:
            self.waiting[req.request_id] = req

    # -- rules -------------------------------------------------------------------

    @rule(prefix=st.integers(0, len(PREFIXES)), shared=st.integers(0, 24), tail=st.integers(0, 30),
          chunk=st.integers(1, 40), external=st.sampled_from([0, 0, 0, 4, 9, 16]))
    def add_request(self, prefix, shared, tail, chunk, external):
        head = PREFIXES[prefix][:shared] if prefix < len(PREFIXES) else []
        tokens = head + [50_000 + self.next_id * 100 + i for i in range(tail)]
        self._admit(tokens or [7], chunk, external)

    @precondition(lambda self: self.finished)
    @rule(data=st.data(), extra=st.integers(1, 9), chunk=st.integers(1, 40), external=st.sampled_from([4, 9, 16]))
    def resend_finished(self, data, extra, chunk, external):
        """A finished conversation comes back longer with part of it loaded
        by a connector: its blocks are free cached hits in every group while
        new blocks are popped for the loaded tokens (issue 16 item 8)."""
        tokens = data.draw(st.sampled_from(self.finished))
        self._admit(tokens + [60_000 + self.next_id * 100 + i for i in range(extra)], chunk, external)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running[rid]
        remaining = req.num_tokens - req.num_computed_tokens
        if remaining == 0:
            if req.num_tokens >= 150:
                return
            req.append_output_token_ids([data.draw(st.integers(0, 3))])  # repeats make shared tails
            remaining = 1
        num_new = data.draw(st.integers(1, remaining))
        self.m.new_step_starts()
        self._allocate(req, num_new)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running.pop(rid)
        self.m.free(req)
        self.finished = [*self.finished[-3:], list(req.all_token_ids[: req.num_computed_tokens])]

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data):
        rid = data.draw(st.sampled_from(sorted(self.waiting)))
        req = self.waiting.pop(rid)
        before = self._snapshot()
        try:
            self.m.free(req)
            raise AssertionError("freeing a never-allocated request must raise")
        except UnknownRequestError:
            pass
        assert self._snapshot() == before

    @rule()
    def reset_prefix_cache(self):
        ok = self.m.reset_prefix_cache()
        assert ok == (not self.running)
        if ok:
            assert all(b.block_hash is None for b in self.pool.blocks)

    # -- invariants --------------------------------------------------------------

    @invariant()
    def free_plus_referenced_is_total(self):
        pool = self.pool
        free = list(pool.free_block_queue)
        assert len(free) == pool.num_free_blocks
        assert all(b.ref_cnt == 0 and not b.is_null for b in free)  # nothing both free and held
        held = [b for b in pool.blocks if b.ref_cnt > 0]
        assert len(free) + len(held) == pool.num_blocks - 1
        assert pool.null_block.ref_cnt == 0 and pool.null_block.block_hash is None

    @invariant()
    def ref_counts_equal_table_membership(self):
        counts = Counter()
        for rid in self.running:
            for group in self.m.get_blocks(rid).blocks:
                counts.update(b.block_id for b in group if not b.is_null)
        for b in self.pool.blocks[1:]:
            assert b.ref_cnt == counts[b.block_id], b

    @invariant()
    def a_block_belongs_to_one_group(self):
        """No block id in two groups' tables (loaded KV would overwrite the
        other group's cache), nor twice in one table."""
        group_of = {}
        for rid in self.running:
            for gid, group in enumerate(self.m.get_blocks(rid).blocks):
                ids = [b.block_id for b in group if not b.is_null]
                assert len(ids) == len(set(ids)), (rid, gid, ids)
                for i in ids:
                    assert group_of.setdefault(i, gid) == gid, (rid, i, group_of[i], gid)

    @invariant()
    def hash_map_entries_point_at_blocks_with_that_hash(self):
        for gid, hmap in enumerate(self.pool.hash_maps):
            entries = list(hmap.items())
            for h, b in entries:
                assert b.block_hash == h and b.group_id == gid and not b.is_null
            cached = [b for b in self.pool.blocks if b.block_hash is not None and b.group_id == gid]
            assert len(entries) == len(cached)

    @invariant()
    def all_free_once_nothing_runs(self):
        if not self.running:
            assert self.pool.num_free_blocks == self.pool.num_blocks - 1


class HybridKVManagerMachine(KVManagerMachine):
    specs = (full_spec(BS), SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=1, sliding_window=6))
    num_blocks = 20  # small: new blocks come from the front of a queue full of cached hits


class WideWindowHybridKVManagerMachine(KVManagerMachine):
    """A window over several blocks: sliding-window hits survive more
    connector-loaded tokens, so the full group pops more new blocks while
    those hits are still free (before issue 16 item 8's fix, about 8% of
    random 40-step sequences here put a block in both groups, against 3%
    with the 6-token window)."""

    specs = (full_spec(BS), SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=1, sliding_window=17))
    num_blocks = 30


class MambaHybridKVManagerMachine(KVManagerMachine):
    specs = (full_spec(BS), MambaSpec(block_size=BS, mamba_cache_mode="align", num_speculative_blocks=1))
    num_blocks = 40
    # Mamba with connector-loaded tokens under-counts its blocks (allocate
    # raises instead of returning None): not supported yet, not exercised.
    external_tokens = False


class ChunkedLocalKVManagerMachine(KVManagerMachine):
    specs = (ChunkedLocalAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, attention_chunk_size=8),)
    num_blocks = 24


_settings = settings(max_examples=80, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestKVManagerStateMachine = KVManagerMachine.TestCase
TestHybridKVManagerStateMachine = HybridKVManagerMachine.TestCase
TestWideWindowHybridKVManagerStateMachine = WideWindowHybridKVManagerMachine.TestCase
TestMambaHybridKVManagerStateMachine = MambaHybridKVManagerMachine.TestCase
TestChunkedLocalKVManagerStateMachine = ChunkedLocalKVManagerMachine.TestCase
TestKVManagerStateMachine.settings = _settings
TestHybridKVManagerStateMachine.settings = _settings
TestWideWindowHybridKVManagerStateMachine.settings = _settings
TestMambaHybridKVManagerStateMachine.settings = _settings
TestChunkedLocalKVManagerStateMachine.settings = _settings
