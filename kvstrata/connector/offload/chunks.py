"""Where a chunk sits in a request::

    blocks   |b0 .. b3|b4 .. b7|b8 b9|           block_size 4, chunk_size 16 (bpc 4)
    chunks   | chunk 0| chunk 1| 2   |           chunk c: tokens [16c, 16c + n), blocks [4c, 4c + ceil(n / 4))
    keys     hash(b3)  hash(b7) hash(b9)         a chunk is keyed by the hash of its last block

A chunk of ``n < chunk_size`` tokens (a partial chunk, ``save_partial_chunks``)
ends at a full block. Which chunk starts a request's unsaved or unloaded
part is the loads' and saves' business; the arithmetic is here, once.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.connector.base import ConnectorRequest
from kvstrata.connector.events import ChunkInfo
from kvstrata.io import ChunkKey
from kvstrata.kv.types import BlockHash


class ChunkGeometry:
    """Owns nothing mutable: the store identity's fingerprint and the sizes."""

    __slots__ = ("fingerprint", "block_size", "chunk_size", "bpc")

    def __init__(self, fingerprint: str, block_size: int, chunk_size: int) -> None:
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.bpc = chunk_size // block_size  # blocks per chunk

    def num_blocks(self, n: int) -> int:
        """Blocks that ``n`` tokens of a chunk cover."""
        return -(-n // self.block_size)

    def key(self, block_hashes: Sequence[BlockHash], c: int, n: int) -> ChunkKey:
        """The key of chunk ``c`` cut at ``n`` tokens (``n`` a multiple of the block size)."""
        return ChunkKey(self.fingerprint, block_hashes[c * self.bpc + self.num_blocks(n) - 1], n)

    def blocks(self, block_ids: Sequence[int], c: int, n: int) -> list[int]:
        """The device blocks of ``n`` tokens of chunk ``c``."""
        first = c * self.bpc
        return list(block_ids[first: first + self.num_blocks(n)])

    def info(self, request: ConnectorRequest, c: int, n: int) -> ChunkInfo:
        """How to publish chunk ``c`` of ``n`` tokens: its blocks' hashes, the
        hash before them and its tokens."""
        bh, first, cs = request.block_hashes, c * self.bpc, self.chunk_size
        return ChunkInfo(bh[first: first + self.num_blocks(n)], bh[first - 1] if first else None,
                         request.all_token_ids[c * cs: c * cs + n])
