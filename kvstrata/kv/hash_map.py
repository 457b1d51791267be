"""Block hash -> cached block(s), for one KV cache group.

Two requests can compute the same prefix at the same time; both results are
cached and neither is deduplicated (the blocks are already in two block
tables), so one hash may name several blocks. A lookup wants any one of
them. The common case, one block per hash, stays a plain dict lookup: the
first block cached under a hash is the *primary*, later ones go to a side
table that is empty almost always::

    primary: {h1: B4, h2: B9}          get_one(h) == primary.get(h)
    extra:   {h2: {12: B12}}           B12 also holds h2's tokens
"""

from __future__ import annotations

from collections.abc import Iterator

from kvstrata.kv.block import KVCacheBlock
from kvstrata.kv.types import BlockHash


class BlockHashToBlockMap:
    """Owns: the map from hash to cached blocks of one group (not the blocks).

    ``get_one`` is the bound ``dict.get`` of the primary table, so the
    prefix-hit loop pays one C call per block; the pool's caching loop fills
    ``primary`` directly when a hash is new and calls ``insert`` otherwise.
    """

    __slots__ = ("primary", "_extra", "get_one")

    def __init__(self) -> None:
        self.primary: dict[BlockHash, KVCacheBlock] = {}
        self._extra: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.get_one = self.primary.get

    def insert(self, block_hash: BlockHash, block: KVCacheBlock) -> None:
        cur = self.primary.get(block_hash)
        if cur is None:
            self.primary[block_hash] = block
        elif cur is not block:
            self._extra.setdefault(block_hash, {})[block.block_id] = block

    def pop(self, block_hash: BlockHash, block: KVCacheBlock) -> bool:
        """Drop ``block`` from ``block_hash``'s entry. True if it was there."""
        primary = self.primary
        if primary.get(block_hash) is block:
            extra = self._extra.get(block_hash) if self._extra else None
            if extra:
                _, successor = extra.popitem()
                if not extra:
                    del self._extra[block_hash]
                primary[block_hash] = successor
            else:
                del primary[block_hash]
            return True
        extra = self._extra.get(block_hash)
        if extra is not None and extra.pop(block.block_id, None) is not None:
            if not extra:
                del self._extra[block_hash]
            return True
        return False

    @property
    def has_extra(self) -> bool:
        """True while some hash names more than one block."""
        return bool(self._extra)

    def get_all(self, block_hash: BlockHash) -> list[KVCacheBlock]:
        """Every block cached under ``block_hash``, primary first."""
        first = self.primary.get(block_hash)
        if first is None:
            return []
        return [first, *self._extra.get(block_hash, {}).values()]

    def clear(self) -> None:
        self.primary.clear()  # keeps the dict object, so get_one stays bound
        self._extra.clear()

    def items(self) -> Iterator[tuple[BlockHash, KVCacheBlock]]:
        """Every (hash, block) pair, duplicates included."""
        for h, b in self.primary.items():
            yield h, b
        for h, extra in self._extra.items():
            for b in extra.values():
                yield h, b

    def __len__(self) -> int:
        """Number of cached blocks (not of distinct hashes)."""
        return len(self.primary) + sum(len(e) for e in self._extra.values())

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.primary
