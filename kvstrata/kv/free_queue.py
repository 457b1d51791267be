"""The free block queue: an intrusive doubly linked list of free blocks.

Its order is the eviction order, vLLM v1's: blocks are taken from the head
when allocated. A freed block that holds a cached prefix (it has a hash) is
appended at the tail, so a cached block freed long ago is evicted before one
freed recently (LRU), and a request's blocks, freed tail first, give their
chain's tail up before its head. A freed block with no hash can never be a
prefix hit, so it is prepended at the head and reused first, keeping the
cached ones longer::

    head <-> U2 <-> U5 <-> B7 <-> B3 <-> ... <-> B4 <-> tail
    ^ prepend_n (freed, no hash)  ^ popleft       ^ append_n (freed, cached)

A prefix-cache hit on a free block takes it out of the middle (``remove``),
which is why the list is intrusive: the links live in the block itself, so
removal is O(1) and the queue allocates nothing per operation (a
``collections.deque`` would need O(n) removal; a Python node object per block
would double the objects the garbage collector walks).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvstrata.kv.block import KVCacheBlock


class FreeBlockQueue:
    """Doubly linked list of free blocks with two sentinels.

    Owns: the ``prev_free_block``/``next_free_block`` links of the blocks in
    it and ``num_free_blocks``. The sentinels (id -1) never leave the list,
    so no operation has a branch for an empty list or an end block.
    """

    __slots__ = ("num_free_blocks", "_head", "_tail")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = 0
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block (the next eviction victim)."""
        if self.num_free_blocks == 0:
            raise IndexError("popleft from an empty free block queue")
        head = self._head
        block = head.next_free_block
        nxt = block.next_free_block  # type: ignore[union-attr]
        head.next_free_block = nxt
        nxt.prev_free_block = head  # type: ignore[union-attr]
        block.prev_free_block = block.next_free_block = None  # type: ignore[union-attr]
        self.num_free_blocks -= 1
        return block  # type: ignore[return-value]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first ``n`` blocks, head first."""
        if n > self.num_free_blocks:
            raise IndexError(f"popleft_n({n}) from a free block queue of {self.num_free_blocks}")
        if n <= 0:
            return []
        out = [None] * n
        curr = self._head.next_free_block
        for i in range(n):
            out[i] = curr
            nxt = curr.next_free_block  # type: ignore[union-attr]
            curr.prev_free_block = curr.next_free_block = None  # type: ignore[union-attr]
            curr = nxt
        self._head.next_free_block = curr
        curr.prev_free_block = self._head  # type: ignore[union-attr]
        self.num_free_blocks -= n
        return out  # type: ignore[return-value]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it is in the queue (O(1))."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free block queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (evicted last)."""
        last = self._tail.prev_free_block
        last.next_free_block = block  # type: ignore[union-attr]
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the tail, in order (the last one is evicted last)."""
        if not blocks:
            return
        last = self._tail.prev_free_block
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block  # type: ignore[union-attr]
            last = block
        last.next_free_block = self._tail  # type: ignore[union-attr]
        self._tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the head, in order (the first one is the next victim)."""
        if not blocks:
            return
        prev = self._head
        first = prev.next_free_block
        for block in blocks:
            block.prev_free_block = prev
            prev.next_free_block = block
            prev = block
        prev.next_free_block = first
        first.prev_free_block = prev  # type: ignore[union-attr]
        self.num_free_blocks += len(blocks)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Iterate head (next victim) to tail. Do not mutate while iterating."""
        curr = self._head.next_free_block
        tail = self._tail
        while curr is not tail:
            yield curr  # type: ignore[misc]
            curr = curr.next_free_block  # type: ignore[union-attr]

    def __len__(self) -> int:
        return self.num_free_blocks
