"""A prompt's block hash chain, computed exactly as the engine computes it.

The router hashes with the engine's own :class:`kvstrata.kv.hashing.BlockHasher`
over the engine's :class:`CacheIdentity` (model fingerprint, KV dtype and
layout, block size, algorithm, namespace), so the hashes it looks up are the
hashes in the engines' ``BlockStored`` events. An engine with
``cache.random_hash_root`` hashes from a private root: no router can match it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.kv.hashing import BlockHasher, CacheIdentity
from kvstrata.kv.types import BlockHash


class _Prompt:
    """The KVRequest fields the block hasher reads, for a prompt not yet sent."""

    __slots__ = ("request_id", "all_token_ids", "num_prompt_tokens", "block_hashes", "lora_name",
                 "cache_salt", "mm_features", "prompt_embeds_digest")

    def __init__(self, token_ids: Sequence[int], lora_name: str | None, cache_salt: str | None) -> None:
        self.request_id = "router"
        self.all_token_ids = token_ids
        self.num_prompt_tokens = len(token_ids)
        self.block_hashes: list[BlockHash] = []
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self.mm_features: list = []
        self.prompt_embeds_digest = None


class PromptHasher:
    """``hash_prompt(token_ids)``: the hashes of the prompt's full blocks.
    Owns nothing mutable."""

    __slots__ = ("identity", "block_size", "_hasher")

    def __init__(self, identity: CacheIdentity) -> None:
        self.identity = identity
        self.block_size = identity.block_size
        self._hasher = BlockHasher(identity)

    def hash_prompt(self, token_ids: Sequence[int], *, lora_name: str | None = None,
                    cache_salt: str | None = None) -> list[BlockHash]:
        if len(token_ids) < self.block_size:
            return []
        return self._hasher(_Prompt(token_ids, lora_name, cache_salt))
