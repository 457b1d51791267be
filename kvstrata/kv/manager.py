"""KVCacheManager: the scheduler's view of the device KV cache.

The scheduler asks two questions per request and step, in this order:

1. ``get_computed_blocks(req)``: which leading blocks are already cached?
   Never the whole prompt: the last token is always computed, since its
   logits are needed (the hit is capped at ``num_tokens - 1``, block aligned).
2. ``allocate_slots(req, n, ...)``: make room for ``n`` more tokens (plus the
   hit blocks, external tokens, lookahead). Returns the newly allocated
   blocks, or None when the pool (counting evictable cached blocks) cannot
   supply them; then nothing has changed.

Blocks layout of one request (tokens)::

    | computed | new hit | external | new | lookahead |
    |<--------- cached / loaded ----->|<- computed now ->|
               |<---------------- allocated now ---------------->|

Results hide the pool: the caller gets block ids (``get_block_ids``).
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog

from kvstrata.kv.block_pool import BlockPool
from kvstrata.kv.coordinator import GroupBlocks, make_coordinator
from kvstrata.kv.events import AnyKVCacheEvent
from kvstrata.kv.metrics import PrefixCacheStats, PrefixCacheStatsCollector, ResidencySampler
from kvstrata.kv.specs import CrossAttentionSpec, FullAttentionSpec, KVCacheConfig, SinkFullAttentionSpec
from kvstrata.kv.types import KVRequest, UnknownRequestError, require_non_negative_int, require_positive_int
from kvstrata.types import BlockResidencyStats

log = structlog.get_logger(__name__)


class KVCacheBlocks:
    """Blocks per KV cache group (``blocks[g][i]``), opaque to the caller
    except through ``get_block_ids``. Pass a ``get_computed_blocks`` result
    back to ``allocate_slots`` unchanged."""

    __slots__ = ("blocks",)

    def __init__(self, blocks: GroupBlocks) -> None:
        self.blocks = blocks

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.blocks)

    @property
    def num_blocks(self) -> int:
        """Blocks of the first group (every group covers the same tokens)."""
        return len(self.blocks[0]) if self.blocks else 0

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([*a, *b] for a, b in zip(self.blocks, other.blocks)))

    def __bool__(self) -> bool:
        return any(self.blocks)

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.get_block_ids()})"


class KVCacheManager:
    """Owns: the coordinator (and through it the pool and the managers),
    the prefix-cache stats collector and the residency sampler."""

    def __init__(
        self,
        config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool = True,
        log_stats: bool = True,
        enable_events: bool = False,
        metrics_sample_rate: float = 0.01,
        hash_block_size: int | None = None,
    ) -> None:
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        self.max_model_len = require_positive_int("max_model_len", max_model_len)
        block_sizes = [g.spec.block_size for g in config.groups]
        if hash_block_size is None:
            hash_block_size = min(block_sizes)
        require_positive_int("hash_block_size", hash_block_size)
        for bs in block_sizes:
            if bs % hash_block_size:
                raise ValueError(f"hash_block_size {hash_block_size} must divide every group's block size {bs}")
        if enable_caching and any(isinstance(g.spec, CrossAttentionSpec) for g in config.groups):
            raise ValueError("enable_caching must be False when a group uses CrossAttentionSpec")
        self.enable_caching = bool(enable_caching)
        self.log_stats = bool(log_stats)
        sampler = None
        if log_stats and enable_caching and metrics_sample_rate:
            sampler = ResidencySampler(metrics_sample_rate)
        self._sampler = sampler
        self.block_pool = BlockPool(
            config.num_blocks,
            enable_caching=self.enable_caching,
            num_groups=len(config.groups),
            enable_events=enable_events,
            sampler=sampler,
        )
        self.coordinator = make_coordinator(
            config, enable_caching=self.enable_caching, pool=self.block_pool, hash_block_size=hash_block_size
        )
        self.config = config
        self.hash_block_size = hash_block_size
        self.block_size = block_sizes[0]
        self._stats = PrefixCacheStatsCollector() if log_stats else None
        # Full attention (and sinks, cross) never skip: no window bookkeeping.
        self._no_skips = all(
            isinstance(g.spec, (FullAttentionSpec, SinkFullAttentionSpec, CrossAttentionSpec)) for g in config.groups
        )
        self._empty = KVCacheBlocks(self.coordinator.empty)

    # -- properties ------------------------------------------------------------

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        """Pool size including the null block."""
        return self.block_pool.num_blocks

    # -- the two scheduler calls -----------------------------------------------

    def get_computed_blocks(self, request: KVRequest) -> tuple[KVCacheBlocks, int]:
        """The cached leading blocks of ``request`` and their token count.

        Counted in the prefix-cache stats when ``allocate_slots`` takes this
        answer (``new_computed_blocks``), not here: a lookup the scheduler
        retries (no room yet) is one query, not several."""
        num_tokens = request.num_tokens
        if num_tokens <= 0:
            raise ValueError(f"request {request.request_id!r}: all_token_ids must not be empty")
        if not self.enable_caching or getattr(request, "skip_reading_prefix_cache", False):
            return self._empty, 0
        if len(request.block_hashes) > num_tokens // self.hash_block_size:
            raise ValueError(
                f"request {request.request_id!r}: {len(request.block_hashes)} block_hashes for {num_tokens} "
                f"tokens; hash with a block hasher of block_size {self.hash_block_size}"
            )
        blocks, num_hit = self.coordinator.find_longest_cache_hit(request.block_hashes, num_tokens - 1)
        return KVCacheBlocks(blocks), num_hit

    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_external_computed_tokens: int = 0,
        num_encoder_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Reserve slots; None (and no change) when there is not enough room.

        Blocks already outside the attention window (sliding window, chunked
        local, Mamba) are released on success, and count as room. Returns the
        blocks allocated by this call (including blocks for external tokens);
        ``get_block_ids(request_id)`` gives the whole table.
        """
        rid = request.request_id
        self._check_allocate_args(request, num_new_tokens, num_new_computed_tokens, num_lookahead_tokens,
                                  num_external_computed_tokens, num_encoder_tokens)
        coordinator = self.coordinator
        hit_blocks = new_computed_blocks.blocks if new_computed_blocks is not None else self._empty.blocks
        if hit_blocks is not self._empty.blocks and any(hit_blocks) and coordinator.has_request(rid):
            raise ValueError(f"request {rid!r} already holds blocks; new_computed_blocks must be empty")
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        total_computed = num_local_computed + num_external_computed_tokens
        num_main = total_computed + num_new_tokens
        num_need_slot = min(num_main + num_lookahead_tokens, self.max_model_len)
        num_to_cache = min(num_main, request.num_tokens)
        if self.enable_caching and not delay_cache_blocks:
            have = len(request.block_hashes) * self.hash_block_size
            if have < num_to_cache - num_to_cache % self.hash_block_size:
                raise ValueError(
                    f"request {rid!r}: block_hashes cover {have} tokens but {num_to_cache} are to be cached; "
                    "grow request.block_hashes with the block hasher as tokens are appended"
                )
        # Blocks now outside every attention window are released first (they
        # may be reused right away), so they count as room.
        freeable = 0 if self._no_skips else coordinator.count_freeable_skipped(rid, total_computed)
        needed = coordinator.get_num_blocks_to_allocate(
            rid, num_need_slot, hit_blocks, total_computed, num_main, num_encoder_tokens  # type: ignore[arg-type]
        )
        if needed > self.block_pool.num_free_blocks + freeable:
            return None
        if not self._no_skips:
            coordinator.remove_skipped_blocks(rid, total_computed)
        new_blocks: GroupBlocks | None = None
        if hit_blocks is not self._empty.blocks or num_external_computed_tokens > 0:
            new_blocks = coordinator.allocate_new_computed_blocks(
                rid, hit_blocks, num_local_computed, num_external_computed_tokens  # type: ignore[arg-type]
            )
        allocated = coordinator.allocate_new_blocks(rid, num_need_slot, num_main, num_encoder_tokens)
        if new_blocks is not None and any(new_blocks):
            allocated = tuple(a + b for a, b in zip(new_blocks, allocated))
        if self.enable_caching and not delay_cache_blocks:
            coordinator.cache_blocks(request, num_to_cache)
        if new_computed_blocks is not None and new_computed_blocks is not self._empty and self._stats is not None:
            # A lookup's answer taken (a skipped lookup returns _empty): one query.
            self._stats.record(request.num_tokens, num_new_computed_tokens, getattr(request, "num_preemptions", 0) > 0)
        return KVCacheBlocks(allocated)

    def _check_allocate_args(
        self,
        request: KVRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        num_lookahead_tokens: int,
        num_external_computed_tokens: int,
        num_encoder_tokens: int,
    ) -> None:
        for name, value in (
            ("num_new_tokens", num_new_tokens),
            ("num_new_computed_tokens", num_new_computed_tokens),
            ("num_lookahead_tokens", num_lookahead_tokens),
            ("num_external_computed_tokens", num_external_computed_tokens),
            ("num_encoder_tokens", num_encoder_tokens),
        ):
            if value.__class__ is not int or value < 0:
                require_non_negative_int(name, value)
        if num_new_tokens == 0 and num_external_computed_tokens == 0:
            raise ValueError("num_new_tokens must be >= 1 unless num_external_computed_tokens > 0")
        if request.num_tokens <= 0:
            raise ValueError(f"request {request.request_id!r}: all_token_ids must not be empty")

    # -- lifecycle -------------------------------------------------------------

    def free(self, request: KVRequest) -> None:
        """Return the request's blocks to the pool, tail first (still cached).

        Raises UnknownRequestError if the request holds no blocks here."""
        rid = request.request_id
        if not self.coordinator.has_request(rid):
            raise UnknownRequestError(rid)
        self.coordinator.free(rid)

    def has_request(self, request_id: str) -> bool:
        """True while ``request_id`` holds blocks (allocated and not freed)."""
        return self.coordinator.has_request(request_id)

    @property
    def num_requests(self) -> int:
        """How many requests hold blocks (allocated and not freed)."""
        return self.coordinator.num_requests

    def cache_blocks(self, request: KVRequest, num_computed_tokens: int) -> None:
        """Cache the full blocks among the first ``num_computed_tokens`` tokens
        (after ``allocate_slots(..., delay_cache_blocks=True)``, once the KV
        has really arrived)."""
        require_non_negative_int("num_computed_tokens", num_computed_tokens)
        if not self.coordinator.has_request(request.request_id):
            raise UnknownRequestError(request.request_id)
        if self.enable_caching:
            self.coordinator.cache_blocks(request, min(num_computed_tokens, request.num_tokens))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """All of the request's block ids, one list per group (empty lists if none)."""
        return tuple([b.block_id for b in group] for group in self.coordinator.get_blocks(request_id))

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def new_step_starts(self) -> None:
        """Call once per scheduler step (Mamba 'align' needs it)."""
        self.coordinator.new_step_starts()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; False (nothing changed) while any request holds blocks."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self._stats is not None:
            self._stats.resets += 1
        return True

    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        """Uncache the given blocks (their KV is known to be bad)."""
        self.block_pool.evict_blocks(block_ids)

    def take_events(self) -> list[AnyKVCacheEvent]:
        return self.block_pool.take_events()

    def snapshot_events(self) -> list[AnyKVCacheEvent]:
        """The device cache's content as BlockStored events (``BlockPool.snapshot_events``)."""
        return self.block_pool.snapshot_events()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Counters and residency samples since the last call, or None
        without log_stats."""
        if self._stats is None:
            return None
        samples = self._sampler.take_samples() if self._sampler is not None else []
        return self._stats.snapshot(samples)

    def prefix_cache_totals(self) -> PrefixCacheStats | None:
        """Counters since start (what the engine reports), or None without log_stats."""
        return self._stats.totals() if self._stats is not None else None

    def block_residency(self) -> BlockResidencyStats | None:
        """Sampled block residency since start, or None when sampling is off."""
        sampler = self._sampler
        return sampler.totals.snapshot(sampler.sample_rate) if sampler is not None else None
