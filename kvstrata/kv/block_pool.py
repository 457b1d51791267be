"""The block pool: every device KV block, the free queue, the prefix cache.

Block 0 is the null block: a placeholder for positions a manager skips (out
of a sliding window, before a chunk, an old Mamba state). It is never in the
free queue, never reference-counted, never cached and never evicted.

A block is *free* when no request holds it (``ref_cnt == 0``); a free block
may still be *cached* (it carries a hash and can be revived by a prefix
hit). Allocation takes blocks from the head of the free queue and evicts
the cached ones it takes: the least recently freed go first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import structlog

from kvstrata.kv.block import KVCacheBlock
from kvstrata.kv.events import AllBlocksCleared, AnyKVCacheEvent, BlockRemoved, BlockStored
from kvstrata.kv.free_queue import FreeBlockQueue
from kvstrata.kv.hash_map import BlockHashToBlockMap
from kvstrata.kv.metrics import ResidencySampler
from kvstrata.kv.types import BlockHash, KVRequest, require_positive_int

log = structlog.get_logger(__name__)


class BlockPool:
    """Owns: every :class:`KVCacheBlock` and its fields, the free queue, the
    per-group hash maps, the null block, the reserved (sink) blocks and the
    pending KV events.

    ``num_blocks`` counts the null block, so ``num_blocks - 1`` are usable.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        enable_caching: bool = True,
        num_groups: int = 1,
        enable_events: bool = False,
        sampler: ResidencySampler | None = None,
    ) -> None:
        require_positive_int("num_blocks", num_blocks)
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        require_positive_int("num_groups", num_groups)
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self.sampler = sampler
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.hash_maps = [BlockHashToBlockMap() for _ in range(num_groups)]
        self.num_reserved_blocks = 0
        self._events: list[AnyKVCacheEvent] = []

    # -- queries -------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached free blocks count as free)."""
        usable = self.num_blocks - 1
        return (usable - self.free_block_queue.num_free_blocks) / usable

    def get_cached_block(self, block_hash: BlockHash, group_id: int = 0) -> KVCacheBlock | None:
        """A block cached under ``block_hash`` for ``group_id``, or None."""
        return self.hash_maps[group_id].get_one(block_hash)

    # -- allocation ----------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, evicting
        the cached ones (their hashes stop hitting). Callers check room first."""
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: only {queue.num_free_blocks} are free"
            )
        blocks = queue.popleft_n(num_blocks)
        if self.enable_caching and (self.enable_events or len(self.hash_maps) > 1):
            removed: list[tuple[int, BlockHash]] | None = [] if self.enable_events else None
            for block in blocks:
                block_hash = block.block_hash
                if block_hash is not None:
                    self._evict(block, block_hash, removed)
                elif block.sample is not None:
                    block.sample = None  # sampled, never cached: not a residency
                block.ref_cnt = 1
            if removed:
                self._record_removed(removed)
        elif self.enable_caching:
            # The hot path (one group, no events), with _evict inlined. While
            # no hash names two blocks, a cached block is its hash's primary.
            hmap = self.hash_maps[0]
            primary = hmap.primary
            for block in blocks:
                block_hash = block.block_hash
                if block_hash is not None:
                    if hmap.has_extra:
                        hmap.pop(block_hash, block)
                    else:
                        del primary[block_hash]
                    block.block_hash = None
                    if block.sample is not None:
                        self.sampler.on_evicted(block)  # type: ignore[union-attr]
                elif block.sample is not None:
                    block.sample = None  # sampled, never cached: not a residency
                block.ref_cnt = 1
        else:
            for block in blocks:
                block.ref_cnt = 1
        if self.sampler is not None:
            self.sampler.on_allocated(blocks)
        return blocks

    def _evict(
        self, block: KVCacheBlock, block_hash: BlockHash, removed: list[tuple[int, BlockHash]] | None
    ) -> None:
        hmap = self.hash_maps[block.group_id]
        hmap.pop(block_hash, block)
        block.block_hash = None
        if removed is not None:
            removed.append((block.group_id, block_hash))
        if block.sample is not None:
            self.sampler.on_evicted(block)  # type: ignore[union-attr]

    def _record_removed(self, removed: list[tuple[int, BlockHash]]) -> None:
        by_group: dict[int, list[bytes]] = {}
        for group_id, block_hash in removed:
            by_group.setdefault(group_id, []).append(block_hash)
        for group_id, hashes in by_group.items():
            self._events.append(BlockRemoved(block_hashes=hashes, group_idx=group_id))

    def reserve_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks out of circulation for good (attention sinks): they are
        held (``ref_cnt == 1``) by the pool itself and never freed."""
        blocks = self.get_new_blocks(num_blocks)
        self.num_reserved_blocks += num_blocks
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks; a free one leaves the free
        queue so it cannot be evicted while the request holds it."""
        remove = self.free_block_queue.remove
        sampler = self.sampler
        for block in blocks:
            ref_cnt = block.ref_cnt
            if ref_cnt == 0:
                if block.is_null:
                    continue
                remove(block)
            block.ref_cnt = ref_cnt + 1
            if block.sample is not None:
                sampler.on_touched(block)  # type: ignore[union-attr]

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block. Those that reach zero go back to
        the free queue *in the given order* (pass a request's blocks tail
        first, so a chain's tail is evicted before its head): cached blocks
        (with a hash) at the tail, blocks no hit can use (no hash) at the
        head, to be reused first. With caching off every block goes to the
        tail (vLLM's rule)."""
        cached: list[KVCacheBlock] = []
        plain: list[KVCacheBlock] = cached if not self.enable_caching else []
        for block in ordered_blocks:
            if block.is_null:
                continue
            ref_cnt = block.ref_cnt - 1
            block.ref_cnt = ref_cnt
            if ref_cnt == 0:
                (cached if block.block_hash is not None else plain).append(block)
        queue = self.free_block_queue
        if plain is not cached:
            queue.prepend_n(plain)
        queue.append_n(cached)

    # -- caching -------------------------------------------------------------

    def cache_full_blocks(
        self,
        request: KVRequest,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        group_id: int = 0,
        reachable: Sequence[bool] | None = None,
    ) -> None:
        """Cache ``blocks[num_cached_blocks:num_full_blocks]`` under
        ``block_hashes`` (same indexing, this group's block size). Null blocks
        are skipped, and so are those ``reachable`` (one flag per block of
        the range) marks as never usable by a hit: no hash, no BlockStored.
        Blocks already cached keep their hash: the caller tracks how many of
        a request's blocks are cached."""
        if num_cached_blocks >= num_full_blocks:
            return
        if len(block_hashes) < num_full_blocks:
            raise ValueError(
                f"request {request.request_id!r} has {len(block_hashes)} block_hashes but "
                f"{num_full_blocks} full blocks to cache; grow request.block_hashes with the block hasher"
            )
        hmap = self.hash_maps[group_id]
        primary = hmap.primary
        new_blocks = blocks[num_cached_blocks:num_full_blocks]
        new_hashes = block_hashes[num_cached_blocks:num_full_blocks]
        if reachable is not None:
            null = self.null_block
            new_blocks = [b if keep else null for b, keep in zip(new_blocks, reachable, strict=True)]
        for block, block_hash in zip(new_blocks, new_hashes):
            if block.is_null:
                continue
            assert block.block_hash is None, f"block {block.block_id} is already cached"
            block.block_hash = block_hash
            block.group_id = group_id
            if block_hash in primary:
                hmap.insert(block_hash, block)
            else:
                primary[block_hash] = block
        if self.enable_events:
            self._record_stored(
                request, new_blocks, new_hashes, block_hashes, num_cached_blocks, block_size, group_id
            )

    def _record_stored(
        self,
        request: KVRequest,
        new_blocks: Sequence[KVCacheBlock],
        new_hashes: Sequence[BlockHash],
        block_hashes: Sequence[BlockHash],
        first_index: int,
        block_size: int,
        group_id: int,
    ) -> None:
        # One event per run of consecutive non-null blocks, so token_ids and
        # parent_block_hash always describe exactly the hashes listed.
        run_start = None
        tokens = request.all_token_ids
        for k in range(len(new_blocks) + 1):
            is_real = k < len(new_blocks) and not new_blocks[k].is_null
            if is_real and run_start is None:
                run_start = k
            elif not is_real and run_start is not None:
                i0 = first_index + run_start
                i1 = first_index + k
                self._events.append(
                    BlockStored(
                        block_hashes=list(new_hashes[run_start:k]),
                        parent_block_hash=block_hashes[i0 - 1] if i0 > 0 else None,
                        token_ids=list(tokens[i0 * block_size : i1 * block_size]),
                        block_size=block_size,
                        lora_name=request.lora_name,
                        group_idx=group_id,
                    )
                )
                run_start = None

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the hashes of the given blocks (e.g. their KV was found
        invalid); held blocks stay held, free ones stay free, uncached."""
        removed: list[tuple[int, BlockHash]] | None = [] if self.enable_events else None
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.block_hash is not None and not block.is_null:
                self._evict(block, block.block_hash, removed)
        if removed:
            self._record_removed(removed)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False, nothing changed) while
        any request still holds a block, since its blocks' hashes would be
        re-registered inconsistently."""
        num_held = self.num_blocks - 1 - self.num_reserved_blocks - self.num_free_blocks
        if num_held > 0:
            log.warning("prefix_cache_reset_refused", num_held_blocks=num_held)
            return False
        for hmap in self.hash_maps:
            hmap.clear()
        for block in self.blocks:
            block.block_hash = None
            block.sample = None
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        log.info("prefix_cache_reset")
        return True

    def snapshot_events(self) -> list[AnyKVCacheEvent]:
        """What the pool caches now, as ``BlockStored`` events (one per group,
        hashes only: no tokens, no parents), for a router that lost the
        event stream. The pending events (not yet taken) are already
        reflected: replaying them after this snapshot changes nothing."""
        out: list[AnyKVCacheEvent] = []
        for group_id, hash_map in enumerate(self.hash_maps):
            hashes = list(dict.fromkeys(h for h, _ in hash_map.items()))
            if hashes:
                out.append(BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=0,
                                       group_idx=group_id))
        return out

    def take_events(self) -> list[AnyKVCacheEvent]:
        events = self._events
        self._events = []
        return events
