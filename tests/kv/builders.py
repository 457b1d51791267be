"""Shared builders for the kv tests: tiny real requests, hashers, managers."""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.kv import (
    BlockHash,
    CacheIdentity,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    KVCacheSpec,
    MultiModalFeature,
    make_block_hasher,
)
from kvstrata.kv.hashing import BlockHasher


class TestRequest:
    """A request implementing the KVRequest protocol, the way the engine's
    Request does: block hashes grow whenever tokens are appended."""

    __test__ = False  # not a pytest class

    def __init__(
        self,
        request_id: str,
        token_ids: Sequence[int],
        hasher: BlockHasher | None,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MultiModalFeature] = (),
        prompt_embeds_digest: bytes | None = None,
        num_preemptions: int = 0,
    ) -> None:
        self.request_id = request_id
        self.all_token_ids = list(token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.num_computed_tokens = 0
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self.mm_features = list(mm_features)
        self.prompt_embeds_digest = prompt_embeds_digest
        self.num_preemptions = num_preemptions
        self.block_hashes: list[BlockHash] = []
        self._hasher = hasher
        if hasher is not None:
            self.block_hashes.extend(hasher(self))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_output_token_ids(self, token_ids: Sequence[int]) -> None:
        self.all_token_ids.extend(token_ids)
        if self._hasher is not None:
            self.block_hashes.extend(self._hasher(self))


def make_identity(block_size: int = 16, hash_algo: str = "sha256", **kw: object) -> CacheIdentity:
    fields: dict[str, object] = {
        "model_fingerprint": "tiny-llama-test",
        "kv_dtype": "float32",
        "kv_layout": "per_layer",
        "block_size": block_size,
        "hash_algo": hash_algo,
    }
    fields.update(kw)
    return CacheIdentity(**fields)  # type: ignore[arg-type]


def make_hasher(block_size: int = 16, hash_algo: str = "sha256", **kw: object) -> BlockHasher:
    return make_block_hasher(make_identity(block_size, hash_algo, **kw))


def make_request(
    request_id: str,
    token_ids: Sequence[int],
    block_size: int = 16,
    *,
    hasher: BlockHasher | None = None,
    **kw: object,
) -> TestRequest:
    if hasher is None:
        hasher = make_hasher(block_size)
    return TestRequest(request_id, token_ids, hasher, **kw)  # type: ignore[arg-type]


def full_spec(block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32")


def make_config(num_blocks: int, *specs: KVCacheSpec) -> KVCacheConfig:
    if not specs:
        specs = (full_spec(),)
    groups = [KVCacheGroupSpec(layer_names=[f"layer{i}"], spec=s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=num_blocks, groups=groups)


def make_manager(
    num_blocks: int = 11,
    block_size: int = 16,
    *,
    specs: Sequence[KVCacheSpec] = (),
    enable_caching: bool = True,
    max_model_len: int = 8192,
    log_stats: bool = True,
    enable_events: bool = False,
    metrics_sample_rate: float = 0.0,
    hash_block_size: int | None = None,
) -> KVCacheManager:
    config = make_config(num_blocks, *(specs or (full_spec(block_size),)))
    return KVCacheManager(
        config,
        max_model_len=max_model_len,
        enable_caching=enable_caching,
        log_stats=log_stats,
        enable_events=enable_events,
        metrics_sample_rate=metrics_sample_rate,
        hash_block_size=hash_block_size,
    )


def free_ids(manager: KVCacheManager) -> list[int]:
    """Free queue order, next victim first."""
    return [b.block_id for b in manager.block_pool.free_block_queue]


def ref_counts(manager: KVCacheManager, block_ids: Sequence[int]) -> list[int]:
    return [manager.block_pool.blocks[i].ref_cnt for i in block_ids]


def schedule(manager: KVCacheManager, request: TestRequest, num_new_tokens: int | None = None):
    """A new request's first step as the scheduler runs it: prefix hit, then
    allocation for the rest of the prompt (or ``num_new_tokens``)."""
    hit, num_hit = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit
    new = manager.allocate_slots(request, num_new_tokens, num_hit, hit)
    return hit, num_hit, new
