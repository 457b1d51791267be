"""Full attention (every block kept until the request ends) and its variant
with attention sinks."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from kvstrata.kv.block import KVCacheBlock
from kvstrata.kv.block_pool import BlockPool
from kvstrata.kv.managers.base import SingleTypeKVCacheManager
from kvstrata.kv.specs import KVCacheSpec, SinkFullAttentionSpec
from kvstrata.kv.types import BlockHash


class FullAttentionManager(SingleTypeKVCacheManager):
    """Hits are the longest run of cached blocks from the start: a chain
    hash that misses means every later block misses too."""

    downward_closed = True

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
        block_size = spec.block_size
        get = pool.hash_maps[group_id].get_one
        hits: list[KVCacheBlock] = []
        append = hits.append
        for block_hash in islice(block_hashes, max_length // block_size):
            block = get(block_hash)
            if block is None:
                break
            append(block)
        if alignment != block_size:
            del hits[len(hits) * block_size // alignment * alignment // block_size :]
        return hits


class SinkFullAttentionManager(FullAttentionManager):
    """Full attention whose first ``sink_len`` positions are learned sinks
    shared by all requests: their blocks are taken from the pool once, at
    start, and never freed (``sink_block_ids`` for the runner)."""

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group_id: int, enable_caching: bool) -> None:
        super().__init__(spec, pool, group_id, enable_caching)
        assert isinstance(spec, SinkFullAttentionSpec)
        num_sink_blocks = spec.sink_len // spec.block_size
        if num_sink_blocks > pool.num_free_blocks:
            raise ValueError(
                f"SinkFullAttentionSpec.sink_len={spec.sink_len} needs {num_sink_blocks} blocks, "
                f"the pool has {pool.num_free_blocks} free"
            )
        self.sink_blocks = pool.reserve_blocks(num_sink_blocks)

    @property
    def sink_block_ids(self) -> list[int]:
        return [b.block_id for b in self.sink_blocks]
