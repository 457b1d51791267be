"""kvstrata.kv: the paged, prefix-cached device KV cache manager.

KVCacheManager -> coordinator (no-prefix-cache, unitary, hybrid) ->
single-type managers (full, sliding window, chunked local, mamba, cross,
sink) -> BlockPool (blocks, free queue, hash map, null block).
"""

from kvstrata.kv.block import KVCacheBlock
from kvstrata.kv.block_pool import BlockPool
from kvstrata.kv.coordinator import (
    BlockHashesView,
    HybridCoordinator,
    KVCacheCoordinator,
    NoPrefixCacheCoordinator,
    UnitaryCoordinator,
)
from kvstrata.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)
from kvstrata.kv.free_queue import FreeBlockQueue
from kvstrata.kv.hashing import (
    HASH_ALGOS,
    BlockHasher,
    CacheIdentity,
    HashFunction,
    get_hash_fn,
    make_block_hasher,
    root_hash,
)
from kvstrata.kv.manager import KVCacheBlocks, KVCacheManager
from kvstrata.kv.managers import SPEC_MANAGERS, get_manager_class
from kvstrata.kv.metrics import BlockResidencySample, PrefixCacheStats
from kvstrata.kv.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from kvstrata.kv.types import (
    BlockHash,
    BlockId,
    KVCacheError,
    KVRequest,
    MultiModalFeature,
    RequestId,
    UnknownHashAlgorithmError,
    UnknownRequestError,
)

__all__ = [
    "HASH_ALGOS",
    "SPEC_MANAGERS",
    "AllBlocksCleared",
    "BlockHash",
    "BlockHasher",
    "BlockHashesView",
    "BlockId",
    "BlockPool",
    "BlockRemoved",
    "BlockResidencySample",
    "BlockStored",
    "CacheIdentity",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec",
    "FreeBlockQueue",
    "FullAttentionSpec",
    "HashFunction",
    "HybridCoordinator",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheCoordinator",
    "KVCacheError",
    "KVCacheEvent",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVCacheSpec",
    "KVEventBatch",
    "KVRequest",
    "MambaSpec",
    "MultiModalFeature",
    "NoPrefixCacheCoordinator",
    "PrefixCacheStats",
    "RequestId",
    "SinkFullAttentionSpec",
    "SlidingWindowSpec",
    "UnitaryCoordinator",
    "UnknownHashAlgorithmError",
    "UnknownRequestError",
    "get_hash_fn",
    "get_manager_class",
    "make_block_hasher",
    "root_hash",
]
