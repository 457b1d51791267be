"""One page of the device KV cache, as the manager sees it (metadata only;
the tensors live with the model runner)."""

from __future__ import annotations

from kvstrata.kv.types import BlockHash


class KVCacheBlock:
    """Metadata of one KV cache block.

    Owned by the :class:`~kvstrata.kv.block_pool.BlockPool`; every field is
    changed by the pool (and the free queue, for the two link fields) only.

    Invariants:
      * ``ref_cnt == 0`` exactly when the block sits in the free queue (the
        null block excepted: it is never in the queue and never counted);
      * ``block_hash`` is set only on a full block whose tokens are computed,
        and then ``group_id`` names the KV cache group it is cached for
        (``group_id`` is stale and meaningless while ``block_hash`` is None);
      * the link fields are None unless the block is in the free queue.
    """

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "group_id",
        "prev_free_block",
        "next_free_block",
        "is_null",
        "sample",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.group_id = -1
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False
        # Residency record while this block is sampled for metrics, else None.
        self.sample: object | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:12] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h}, group={self.group_id})"
