"""The base of the per-attention-type managers.

A manager keeps, for each request, the list of blocks of one KV cache group,
indexed by token position (``blocks[i]`` holds tokens ``[i*bs, (i+1)*bs)``).
Positions the attention no longer reads are replaced by the null block and
their blocks freed early (still cached, so other requests can hit them).
Each subclass supplies its cache-hit search and its skip rule
(``get_num_skipped_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.kv.block import KVCacheBlock
from kvstrata.kv.block_pool import BlockPool
from kvstrata.kv.specs import KVCacheSpec
from kvstrata.kv.types import BlockHash, KVRequest, cdiv


class SingleTypeKVCacheManager:
    """Owns: ``req_to_blocks`` (each request's block list for this group) and
    ``num_cached_block`` (how many leading blocks of it are cached)."""

    #: False for types whose blocks are never shared through the prefix cache.
    supports_caching = True
    #: True when a hit of length L implies hits of every shorter aligned length
    #: (lets the hybrid coordinator truncate instead of searching again).
    downward_closed = False

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group_id: int, enable_caching: bool) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = pool
        self.group_id = group_id
        self.enable_caching = enable_caching
        self.null_block = pool.null_block
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        # Hits end on multiples of this (the hybrid coordinator sets the lcm
        # of every group's block size); what a cached block may serve.
        self.hit_alignment = self.block_size

    # -- prefix-cache search (classmethod: the hybrid coordinator calls it
    #    with shortened lengths without touching any request state) ---------

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        pool: BlockPool,
        spec: KVCacheSpec,
        group_id: int,
        alignment: int,
    ) -> list[KVCacheBlock]:
        """The cached blocks of the longest usable prefix of at most
        ``max_length`` tokens whose length is a multiple of ``alignment``;
        skipped positions hold the null block."""
        raise NotImplementedError

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens the next token's attention does not read."""
        return 0

    # -- allocation ------------------------------------------------------------

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_tokens_main_model: int,
    ) -> int:
        """Free blocks the allocation would consume: new blocks plus prefix-hit
        blocks that are now free (touching them takes them out of the queue)."""
        num_required = cdiv(num_tokens, self.block_size)
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is not None:
            return max(num_required - len(req_blocks), 0)
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_new = max(num_required - max(num_skipped_blocks, len(new_computed_blocks)), 0)
        kept = new_computed_blocks[num_skipped_blocks:] if num_skipped_blocks else new_computed_blocks
        num_evictable = 0
        for block in kept:
            if block.ref_cnt == 0 and not block.is_null:
                num_evictable += 1
        return num_new + num_evictable

    def take_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Start a new request's list with its prefix hits (touched, so they
        cannot be evicted) and null blocks for the skipped ones. Every group
        does this before any group takes new blocks (``allocate_external_blocks``):
        a new block popped from the free queue must never be another group's hit."""
        if request_id in self.req_to_blocks:
            if new_computed_blocks:
                raise ValueError(f"request {request_id!r} already holds blocks; new_computed_blocks must be empty")
            return
        total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_blocks = self.get_num_skipped_tokens(total) // self.block_size
        kept = new_computed_blocks[num_skipped_blocks:] if num_skipped_blocks else new_computed_blocks
        if self.enable_caching:
            self.pool.touch(kept)
        req_blocks = [self.null_block] * num_skipped_blocks
        req_blocks.extend(kept)
        self.req_to_blocks[request_id] = req_blocks
        self.num_cached_block[request_id] = len(req_blocks)

    def allocate_external_blocks(self, request_id: str, num_computed_tokens: int) -> list[KVCacheBlock]:
        """New blocks for the tokens an external connector will load, up to
        ``num_computed_tokens`` (local hits + external); returns them."""
        req_blocks = self.req_to_blocks[request_id]
        num_new = cdiv(num_computed_tokens, self.block_size) - len(req_blocks)
        if num_new <= 0:
            return []
        new_blocks = self.pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        return new_blocks

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> list[KVCacheBlock]:
        """Give the request slots for ``num_tokens`` tokens in total."""
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new <= 0:
            return []
        new_blocks = self.pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: KVRequest, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """Cache the request's full blocks among its first ``num_tokens`` tokens."""
        request_id = request.request_id
        num_cached = self.num_cached_block.get(request_id, 0)
        num_full = num_tokens // self.block_size
        if num_cached >= num_full:
            return
        self.pool.cache_full_blocks(
            request, self.req_to_blocks[request_id], block_hashes, num_cached, num_full, self.block_size, self.group_id,
            self.reachable_blocks(num_cached, num_full),
        )
        self.num_cached_block[request_id] = num_full

    def reachable_blocks(self, start: int, end: int) -> list[bool] | None:
        """Which of blocks ``[start, end)`` some hit (ending on a multiple of
        ``hit_alignment`` tokens) could use; None: all of them (full attention)."""
        return None

    def skipped_indices(self, request_id: str, total_computed_tokens: int) -> list[int]:
        """Positions (last first) of the request's blocks that the attention
        no longer reads and that are not yet nulled."""
        num_skipped_tokens = self.get_num_skipped_tokens(total_computed_tokens)
        if num_skipped_tokens <= 0:
            return []
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return []
        null = self.null_block
        out = []
        for i in range(min(num_skipped_tokens // self.block_size, len(blocks)) - 1, -1, -1):
            if blocks[i] is null:
                break  # everything before was nulled by an earlier call
            out.append(i)
        return out

    def count_freeable_skipped(self, request_id: str, total_computed_tokens: int) -> int:
        """Blocks that ``remove_skipped_blocks`` would return to the free queue."""
        indices = self.skipped_indices(request_id, total_computed_tokens)
        if not indices:
            return 0
        blocks = self.req_to_blocks[request_id]
        return sum(1 for i in indices if blocks[i].ref_cnt == 1)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        """Null out and free (tail first) the blocks the attention no longer reads."""
        indices = self.skipped_indices(request_id, total_computed_tokens)
        if not indices:
            return
        blocks = self.req_to_blocks[request_id]
        removed = [blocks[i] for i in indices]
        for i in indices:
            blocks[i] = self.null_block
        self.pool.free_blocks(removed)

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first (its tail is evicted first)."""
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def new_step_starts(self) -> None:
        """Called once per scheduler step."""
