"""Cross attention (encoder-decoder): per-request encoder KV, no sharing."""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.kv.block import KVCacheBlock
from kvstrata.kv.block_pool import BlockPool
from kvstrata.kv.managers.base import SingleTypeKVCacheManager
from kvstrata.kv.specs import KVCacheSpec
from kvstrata.kv.types import BlockHash, KVRequest


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Allocates slots for a request's encoder tokens (the coordinator passes
    ``num_encoder_tokens`` as the token count). Encoder states differ per
    input, so nothing is ever cached or hit; a manager with prefix caching
    on refuses a cross-attention group at construction."""

    supports_caching = False

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
        return []

    def cache_blocks(self, request: KVRequest, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        return None
