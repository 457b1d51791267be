"""Attention that reads only a recent span: sliding window and chunked local.

Blocks wholly before the span map to the null block and are freed early;
they keep their hash, so another request can still hit them.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.kv.block import KVCacheBlock
from kvstrata.kv.block_pool import BlockPool
from kvstrata.kv.managers.base import SingleTypeKVCacheManager
from kvstrata.kv.specs import ChunkedLocalAttentionSpec, KVCacheSpec, SlidingWindowSpec
from kvstrata.kv.types import BlockHash, cdiv


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A token attends to itself and the ``sliding_window - 1`` tokens before.

    A prefix of L tokens is a hit when the blocks covering the window of the
    next token (the last ``cdiv(sliding_window - 1, block_size)`` blocks
    before L) are cached; earlier positions need nothing. The search runs
    right to left and stops at the first long enough run::

        window 8, block 4: cached = [-, 3, -, 8, 9, -]  ->  [NULL, NULL, NULL, 8, 9]
    """

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group_id: int, enable_caching: bool) -> None:
        super().__init__(spec, pool, group_id, enable_caching)
        assert isinstance(spec, SlidingWindowSpec)
        self.sliding_window = spec.sliding_window

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
        assert isinstance(spec, SlidingWindowSpec)
        block_size = spec.block_size
        needed = cdiv(spec.sliding_window - 1, block_size)
        get = pool.hash_maps[group_id].get_one
        null = pool.null_block
        max_blocks = min(max_length // block_size, len(block_hashes))
        if needed == 0:  # a window of one token reads no earlier block
            return [null] * (max_blocks * block_size // alignment * alignment // block_size)
        hits = [null] * max_blocks
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            block = get(block_hashes[i])
            if block is None:
                run = 0
                continue
            if run == 0 and (i + 1) * block_size % alignment:
                continue  # a hit must end on an alignment boundary
            hits[i] = block
            run += 1
            if run >= needed:
                del hits[i + run :]
                return hits
        # No full window anywhere: only a run starting at block 0 is usable
        # (nothing before it is needed), trimmed to the alignment.
        del hits[run:]
        while hits and len(hits) * block_size % alignment:
            hits.pop()
        return hits

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def reachable_blocks(self, start: int, end: int) -> list[bool] | None:
        """A hit of L tokens (L a multiple of ``hit_alignment``) reads the
        ``cdiv(sliding_window - 1, block_size)`` blocks before L, so block i
        can serve a hit only if it is among those before the first aligned L
        at or after its end. With one-block alignment that is every block;
        beside bigger blocks (a hybrid model) most window blocks never can,
        and are not cached (vLLM's ``reachable_block_mask``).

        ``end`` lies on an aligned boundary (the hybrid coordinator caches
        only up to the last one), so that L is within the tokens cached: a
        block past the last boundary waits for the call that reaches the
        next one instead of being cached for a hit that cannot exist yet."""
        bs, align = self.block_size, self.hit_alignment
        assert end * bs % align == 0, f"cache end {end * bs} is not a multiple of the hit alignment {align}"
        needed = cdiv(self.sliding_window - 1, bs)
        if align == bs and needed >= 1:
            return None
        return [(i + 1) * bs > (cdiv((i + 1) * bs, align) * align) - needed * bs for i in range(start, end)]


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """A token attends only within its chunk of ``attention_chunk_size``.

    For a prefix of L tokens, blocks of earlier chunks are not needed (null);
    the blocks of L's own chunk are looked up left to right::

        chunk 8, block 4, L = 15: [NULL, NULL] + hits among block 2
    """

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group_id: int, enable_caching: bool) -> None:
        super().__init__(spec, pool, group_id, enable_caching)
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        self.attention_chunk_size = spec.attention_chunk_size

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
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        block_size = spec.block_size
        chunk = spec.attention_chunk_size
        max_blocks = min(max_length // block_size, len(block_hashes))
        first_in_chunk = (max_length // chunk * chunk) // block_size
        first_in_chunk = min(first_in_chunk, max_blocks)
        hits = [pool.null_block] * first_in_chunk
        get = pool.hash_maps[group_id].get_one
        for i in range(first_in_chunk, max_blocks):
            block = get(block_hashes[i])
            if block is None:
                break
            hits.append(block)
        while hits and len(hits) * block_size % alignment:
            hits.pop()
        return hits

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size
