"""Coordinators: one pool, one manager per KV cache group, one answer.

* :class:`NoPrefixCacheCoordinator` - caching off: allocation only.
* :class:`UnitaryCoordinator` - one group: the manager's hit is the hit.
* :class:`HybridCoordinator` - several groups (e.g. full + sliding window):
  the hit must be usable by every group. Requests hash at the smallest block
  size; a group with bigger blocks reads the hashes through a lazy
  :class:`BlockHashesView`. The common hit is a fixed point: each group
  searches up to the current length and may shorten it; repeat until no
  group shortens it. Full attention is downward closed (a hit of L tokens
  contains every shorter hit), so after its first search it is truncated
  instead of searched again.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice
from math import lcm
from typing import overload

from kvstrata.kv.block import KVCacheBlock
from kvstrata.kv.block_pool import BlockPool
from kvstrata.kv.managers import SingleTypeKVCacheManager, get_manager_class
from kvstrata.kv.specs import ChunkedLocalAttentionSpec, CrossAttentionSpec, KVCacheConfig
from kvstrata.kv.types import BlockHash, KVRequest

GroupBlocks = tuple[Sequence[KVCacheBlock], ...]


class BlockHashesView(Sequence[BlockHash]):
    """The hashes of a request at ``factor`` times the hash block size,
    computed on access: big block i ends where small block
    ``(i + 1) * factor - 1`` ends, and that small hash already names the
    whole prefix, so it is the big block's hash. Grows with the request."""

    __slots__ = ("_hashes", "_factor")

    def __init__(self, hashes: Sequence[BlockHash], factor: int) -> None:
        self._hashes = hashes
        self._factor = factor

    def __len__(self) -> int:
        return len(self._hashes) // self._factor

    @overload
    def __getitem__(self, i: int) -> BlockHash: ...
    @overload
    def __getitem__(self, i: slice) -> list[BlockHash]: ...

    def __getitem__(self, i: int | slice) -> BlockHash | list[BlockHash]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        return self._hashes[(i + 1) * self._factor - 1]

    def __iter__(self) -> Iterator[BlockHash]:
        f = self._factor
        return islice(self._hashes, f - 1, len(self) * f, f)


class KVCacheCoordinator:
    """Owns: the block pool and the managers (one per group, same order)."""

    def __init__(
        self,
        config: KVCacheConfig,
        *,
        enable_caching: bool,
        pool: BlockPool,
        hash_block_size: int,
    ) -> None:
        self.pool = pool
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.managers: list[SingleTypeKVCacheManager] = [
            get_manager_class(g.spec)(g.spec, pool, i, enable_caching) for i, g in enumerate(config.groups)
        ]
        self._is_cross = [isinstance(g.spec, CrossAttentionSpec) for g in config.groups]
        self._factors = [m.block_size // hash_block_size for m in self.managers]
        # Immutable, shared: the "no blocks" answer costs no allocation.
        self.empty: GroupBlocks = tuple(() for _ in self.managers)

    def hashes_for(self, group_id: int, block_hashes: Sequence[BlockHash]) -> Sequence[BlockHash]:
        factor = self._factors[group_id]
        return block_hashes if factor == 1 else BlockHashesView(block_hashes, factor)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[GroupBlocks, int]:
        raise NotImplementedError

    def has_request(self, request_id: str) -> bool:
        return request_id in self.managers[0].req_to_blocks

    @property
    def num_requests(self) -> int:
        """Requests holding blocks."""
        return len(self.managers[0].req_to_blocks)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: GroupBlocks,
        total_computed_tokens: int,
        num_tokens_main_model: int,
        num_encoder_tokens: int,
    ) -> int:
        total = 0
        for gid, manager in enumerate(self.managers):
            n = num_encoder_tokens if self._is_cross[gid] else num_tokens
            total += manager.get_num_blocks_to_allocate(
                request_id, n, new_computed_blocks[gid], total_computed_tokens, num_tokens_main_model
            )
        return total

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: GroupBlocks,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> GroupBlocks:
        """Every group takes its prefix hits first (touched: out of the free
        queue), then the groups take new blocks for external tokens, so no
        new block can be a hit another group is about to hold (block ids stay
        unique across groups). Returns the new blocks per group."""
        managers = self.managers
        new_request = not self.has_request(request_id)
        for gid, m in enumerate(managers):
            m.take_computed_blocks(request_id, new_computed_blocks[gid], num_local_computed_tokens,
                                   num_external_computed_tokens)
        if not new_request or num_external_computed_tokens <= 0:
            return self.empty
        total = num_local_computed_tokens + num_external_computed_tokens
        return tuple(m.allocate_external_blocks(request_id, total) for m in managers)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int, num_encoder_tokens: int
    ) -> GroupBlocks:
        return tuple(
            m.allocate_new_blocks(
                request_id, num_encoder_tokens if self._is_cross[gid] else num_tokens, num_tokens_main_model
            )
            for gid, m in enumerate(self.managers)
        )

    def cache_blocks(self, request: KVRequest, num_tokens: int) -> None:
        hashes = request.block_hashes
        for gid, m in enumerate(self.managers):
            m.cache_blocks(request, self.hashes_for(gid, hashes), num_tokens)

    def count_freeable_skipped(self, request_id: str, total_computed_tokens: int) -> int:
        return sum(m.count_freeable_skipped(request_id, total_computed_tokens) for m in self.managers)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        for m in self.managers:
            m.remove_skipped_blocks(request_id, total_computed_tokens)

    def free(self, request_id: str) -> None:
        for m in self.managers:
            m.free(request_id)

    def get_blocks(self, request_id: str) -> GroupBlocks:
        return tuple(m.req_to_blocks.get(request_id, []) for m in self.managers)

    def new_step_starts(self) -> None:
        for m in self.managers:
            m.new_step_starts()


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    """Caching off: nothing is hashed into the pool and nothing hits."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[GroupBlocks, int]:
        return self.empty, 0

    def cache_blocks(self, request: KVRequest, num_tokens: int) -> None:
        return None


class UnitaryCoordinator(KVCacheCoordinator):
    """One group: its manager's search is the answer."""

    def __init__(self, config: KVCacheConfig, **kwargs: object) -> None:
        super().__init__(config, **kwargs)  # type: ignore[arg-type]
        manager = self.managers[0]
        self._manager = manager
        self._find = type(manager).find_longest_cache_hit
        self._block_size = manager.block_size

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[GroupBlocks, int]:
        m = self._manager
        hits = self._find(self.hashes_for(0, block_hashes), max_length, self.pool, m.spec, 0, self._block_size)
        return (hits,), len(hits) * self._block_size


class HybridCoordinator(KVCacheCoordinator):
    """Several groups: the longest hit every group can use (fixed point)."""

    def __init__(self, config: KVCacheConfig, **kwargs: object) -> None:
        super().__init__(config, **kwargs)  # type: ignore[arg-type]
        self.alignment = lcm(*(m.block_size for m in self.managers))
        for g in config.groups:
            if isinstance(g.spec, ChunkedLocalAttentionSpec) and g.spec.block_size != self.alignment:
                raise ValueError(
                    "ChunkedLocalAttentionSpec.block_size must equal every other group's block size "
                    f"in a hybrid config ({g.spec.block_size} vs alignment {self.alignment})"
                )
        for m in self.managers:
            m.hit_alignment = self.alignment  # what their cached blocks may serve
        # Downward-closed groups first: they set the first bound cheaply.
        self._order = sorted(range(len(self.managers)), key=lambda g: not self.managers[g].downward_closed)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[GroupBlocks, int]:
        hits: list[list[KVCacheBlock] | None] = [None] * len(self.managers)
        hit_length = max_length
        while True:
            length = hit_length
            for gid in self._order:
                m = self.managers[gid]
                found = hits[gid]
                bs = m.block_size
                if m.downward_closed and found is not None:
                    del found[length // bs :]
                else:
                    found = type(m).find_longest_cache_hit(
                        self.hashes_for(gid, block_hashes), length, self.pool, m.spec, gid, self.alignment
                    )
                    hits[gid] = found
                length = min(length, len(found) * bs)
            if length >= hit_length:
                break
            hit_length = length
        for gid, m in enumerate(self.managers):
            if m.downward_closed:
                del hits[gid][hit_length // m.block_size :]  # type: ignore[index]
        return tuple(h if h is not None else [] for h in hits), hit_length

    def cache_blocks(self, request: KVRequest, num_tokens: int) -> None:
        """Cache up to the last hit boundary (a multiple of ``alignment``) at
        or before ``num_tokens``, as vLLM's hybrid coordinator does. A block
        past it serves no hit until the request reaches the next boundary
        (a window block there is needed only by a hit ending at that
        boundary), and is cached then: caching it now would publish a
        ``BlockStored`` no request can hit."""
        super().cache_blocks(request, num_tokens // self.alignment * self.alignment)


def make_coordinator(
    config: KVCacheConfig, *, enable_caching: bool, pool: BlockPool, hash_block_size: int
) -> KVCacheCoordinator:
    if not enable_caching:
        cls: type[KVCacheCoordinator] = NoPrefixCacheCoordinator
    elif len(config.groups) == 1:
        cls = UnitaryCoordinator
    else:
        cls = HybridCoordinator
    return cls(config, enable_caching=enable_caching, pool=pool, hash_block_size=hash_block_size)
