"""Chunk keys for the tiered store.

A chunk is ``chunk_size`` tokens (256 by default) of one request's prefix. Its
key is (store identity fingerprint, the device hash of the chunk's *last*
block). The device hash chain already names the whole prefix, so the key names
the whole prefix too and no token is hashed twice::

    blocks   |b0|b1|..|b15|b16|..|b31|b32|..|b37|      block_size = 16
    chunks   |<-- chunk 0 ---->|<-- chunk 1 ->|<-partial->|   chunk_size = 256
    keys        hash(b15)          hash(b31)     hash(b37)   (partial only if configured)

The identity fingerprint covers everything that changes what a chunk's bytes
mean (model, KV dtype and layout, block and chunk size, hash algorithm,
namespace), so two processes agree on a key exactly when they agree on the
bytes. ``layer >= 0`` keys one layer of a chunk for layerwise storage.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import msgspec

ALL_LAYERS = -1
_IDENTITY_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class StoreIdentity(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a stored chunk's bytes depend on; plain data, mirrors the KV
    manager's cache identity plus the chunk size."""

    model_fingerprint: str
    kv_dtype: str
    kv_layout: str
    block_size: int
    hash_algo: str
    namespace: str | None = None
    chunk_size: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"identity.block_size must be an integer >= 1, got {self.block_size!r}")
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"identity.chunk_size must be an integer >= 1, got {self.chunk_size!r}")
        if self.chunk_size % self.block_size:
            raise ValueError(
                f"identity.chunk_size ({self.chunk_size}) must be a multiple of "
                f"identity.block_size ({self.block_size})"
            )

    def fingerprint(self) -> str:
        """32 hex chars, stable across processes and machines (msgpack of the
        fields in declaration order, then sha256)."""
        return hashlib.sha256(msgspec.msgpack.encode(self)).hexdigest()[:32]


class ChunkKey(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Key of one stored object. ``num_tokens`` is determined by (identity,
    prefix_hash) and carried only so stats and headers can count tokens."""

    identity: str
    prefix_hash: bytes
    num_tokens: int
    layer: int = ALL_LAYERS

    def __post_init__(self) -> None:
        if not isinstance(self.identity, str) or not _IDENTITY_RE.match(self.identity):
            raise ValueError(f"key.identity must match [A-Za-z0-9_.-]{{1,64}}, got {self.identity!r}")
        if not isinstance(self.prefix_hash, bytes) or not self.prefix_hash:
            raise ValueError("key.prefix_hash must be non-empty bytes")
        if not isinstance(self.num_tokens, int) or self.num_tokens < 1:
            raise ValueError(f"key.num_tokens must be an integer >= 1, got {self.num_tokens!r}")
        if not isinstance(self.layer, int) or self.layer < ALL_LAYERS:
            raise ValueError(f"key.layer must be an integer >= -1, got {self.layer!r}")

    @property
    def name(self) -> str:
        """File/remote name within the identity's namespace."""
        h = self.prefix_hash.hex()
        return h if self.layer == ALL_LAYERS else f"{h}.L{self.layer}"

    def for_layer(self, layer: int) -> ChunkKey:
        return ChunkKey(self.identity, self.prefix_hash, self.num_tokens, layer)

    def layer_keys(self, num_layers: int) -> list[ChunkKey]:
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be an integer >= 1, got {num_layers!r}")
        return [ChunkKey(self.identity, self.prefix_hash, self.num_tokens, i) for i in range(num_layers)]

    def chunk_key(self) -> ChunkKey:
        """The whole-chunk key this (layer) key belongs to."""
        if self.layer == ALL_LAYERS:
            return self
        return ChunkKey(self.identity, self.prefix_hash, self.num_tokens)


class ChunkSpan(msgspec.Struct, frozen=True, gc=False):
    """A chunk key with the token range [start, end) of the request it covers."""

    key: ChunkKey
    start: int
    end: int


class ChunkKeyer:
    """Turns a request's device block-hash chain into chunk keys.

    Owns nothing mutable: the identity fingerprint and sizes are fixed at
    construction. O(number of chunks) per call; it never hashes a token.
    """

    __slots__ = ("identity", "fingerprint", "block_size", "chunk_size", "save_partial", "_bpc")

    def __init__(self, identity: StoreIdentity, *, save_partial: bool = False) -> None:
        if not isinstance(identity, StoreIdentity):
            raise TypeError(f"identity must be a StoreIdentity, got {type(identity).__name__}")
        self.identity = identity
        self.fingerprint = identity.fingerprint()
        self.block_size = identity.block_size
        self.chunk_size = identity.chunk_size
        self.save_partial = bool(save_partial)
        self._bpc = identity.chunk_size // identity.block_size

    def spans(self, block_hashes: Sequence[bytes], *, start_chunk: int = 0) -> list[ChunkSpan]:
        """Spans for chunks ``start_chunk..``: every full chunk, then the
        trailing partial chunk (ending at the last full block) if
        ``save_partial`` and there is one."""
        if start_chunk < 0:
            raise ValueError(f"start_chunk must be >= 0, got {start_chunk}")
        bpc, csize, fp = self._bpc, self.chunk_size, self.fingerprint
        n_blocks = len(block_hashes)
        n_full = n_blocks // bpc
        out: list[ChunkSpan] = []
        for c in range(start_chunk, n_full):
            start = c * csize
            out.append(ChunkSpan(ChunkKey(fp, block_hashes[(c + 1) * bpc - 1], csize), start, start + csize))
        if self.save_partial and n_blocks % bpc and n_full >= start_chunk:
            start, end = n_full * csize, n_blocks * self.block_size
            out.append(ChunkSpan(ChunkKey(fp, block_hashes[-1], end - start), start, end))
        return out

    def keys(self, block_hashes: Sequence[bytes], *, start_chunk: int = 0) -> list[ChunkKey]:
        return [s.key for s in self.spans(block_hashes, start_chunk=start_chunk)]
