"""Block hashing: a hash names a block *and everything before it*.

    hash(block i) = H(hash(block i-1), tokens of block i, extra keys of block i)
    hash(block -1) = root, derived from the cache identity

Encodings (never pickle, so a hash means the same in every process, Python
version and machine):

* ``sha256`` / ``xxhash`` hash a canonical byte string::

      parent (digest_size bytes) | u32 n | n x u32 token | extra TLVs

  with little-endian integers; each extra key is a tag byte and its
  length-prefixed value (``L`` LoRA name, ``M`` multimodal identifier + u64
  offset, ``S`` cache salt, ``E`` prompt-embeddings digest).
* ``sha256_cbor`` / ``xxhash_cbor`` hash canonical CBOR of
  ``[parent, [tokens...], [[tag, value...]...] | null]`` (RFC 8949 core
  deterministic encoding), for consumers that want a language-neutral form.

xxhash uses XXH3-128 (16-byte hashes); sha256 gives 32 bytes.

The root is deterministic by default: the algorithm's own hash of a msgpack
record of the :class:`CacheIdentity` (model fingerprint, KV dtype and
layout, block size, algorithm name and version, namespace). Two processes
serving the same model agree on every hash with no PYTHONHASHSEED, and a
weight change (new fingerprint) invalidates every hash by itself. A random
root (``random_root=True``) isolates one process's cache from all others.
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
from array import array
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

import cbor2
import msgspec
import xxhash

from kvstrata.kv.types import (
    BlockHash,
    KVRequest,
    MultiModalFeature,
    UnknownHashAlgorithmError,
    require_positive_int,
)

ROOT_FORMAT_VERSION = 1
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_BIG_ENDIAN = sys.byteorder == "big"

ExtraKeys = tuple[tuple[object, ...], ...]


class HashFunction:
    """One block hash algorithm: ``digest(bytes) -> bytes`` plus its encoding."""

    __slots__ = ("name", "version", "digest_size", "cbor", "digest")

    def __init__(self, name: str, version: int, digest_size: int, cbor: bool, digest: Callable[[bytes], bytes]):
        self.name = name
        self.version = version
        self.digest_size = digest_size
        self.cbor = cbor
        self.digest = digest

    def encode(self, parent: bytes, token_ids: Sequence[int], extra_keys: ExtraKeys | None) -> bytes:
        if self.cbor:
            extras = [list(k) for k in extra_keys] if extra_keys else None
            return cbor2.dumps([parent, list(token_ids), extras], canonical=True)
        return parent + _U32.pack(len(token_ids)) + pack_tokens(token_ids) + encode_extra_keys(extra_keys)

    def hash_block(self, parent: bytes, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None) -> BlockHash:
        """Hash one block given its parent's hash, its tokens and extra keys."""
        return BlockHash(self.digest(self.encode(parent, token_ids, extra_keys)))

    def __repr__(self) -> str:
        return f"HashFunction({self.name!r}, v{self.version})"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_xxh3_128 = xxhash.xxh3_128_digest


#: name -> (version, digest size, CBOR encoding?, digest function). Read-only.
_ALGOS: Mapping[str, tuple[int, int, bool, Callable[[bytes], bytes]]] = MappingProxyType({
    "sha256": (1, 32, False, _sha256),
    "sha256_cbor": (1, 32, True, _sha256),
    "xxhash": (1, 16, False, _xxh3_128),
    "xxhash_cbor": (1, 16, True, _xxh3_128),
})
HASH_ALGOS = tuple(_ALGOS)


def get_hash_fn(name: str) -> HashFunction:
    """The block hash function called ``name`` (one of :data:`HASH_ALGOS`)."""
    try:
        version, size, cbor, digest = _ALGOS[name]
    except (KeyError, TypeError):
        raise UnknownHashAlgorithmError(
            f"hash_algo must be one of {', '.join(HASH_ALGOS)}; got {name!r}"
        ) from None
    return HashFunction(name, version, size, cbor, digest)


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian u32 (C-speed; a bad id raises ValueError)."""
    try:
        arr = array("I", token_ids)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"all_token_ids must hold integers in [0, 2**32): {e}") from None
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tobytes()


def _str_tlv(tag: bytes, value: str) -> bytes:
    raw = value.encode("utf-8")
    return tag + _U32.pack(len(raw)) + raw


def encode_extra_keys(extra_keys: ExtraKeys | None) -> bytes:
    if not extra_keys:
        return b""
    out = []
    for key in extra_keys:
        kind = key[0]
        if kind == "lora":
            out.append(_str_tlv(b"L", key[1]))  # type: ignore[arg-type]
        elif kind == "mm":
            out.append(_str_tlv(b"M", key[1]) + _U64.pack(key[2]))  # type: ignore[arg-type]
        elif kind == "salt":
            out.append(_str_tlv(b"S", key[1]))  # type: ignore[arg-type]
        elif kind == "embeds":
            out.append(b"E" + _U32.pack(len(key[1])) + key[1])  # type: ignore[arg-type, operator]
        else:
            raise ValueError(f"unknown extra key kind {kind!r}")
    return b"".join(out)


class CacheIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """What must match for two caches to share a block: the root of every
    hash chain is derived from all of it."""

    model_fingerprint: str
    kv_dtype: str
    kv_layout: str
    block_size: int
    hash_algo: str = "sha256"
    namespace: str | None = None

    def __post_init__(self) -> None:
        for name in ("model_fingerprint", "kv_dtype", "kv_layout"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"CacheIdentity.{name} must be a non-empty str, got {value!r}")
        require_positive_int("CacheIdentity.block_size", self.block_size)
        get_hash_fn(self.hash_algo)
        if self.namespace is not None and not isinstance(self.namespace, str):
            raise ValueError(f"CacheIdentity.namespace must be a str or None, got {self.namespace!r}")


def root_hash(identity: CacheIdentity) -> BlockHash:
    """The deterministic parent of every first block under ``identity``."""
    fn = get_hash_fn(identity.hash_algo)
    record = msgspec.msgpack.encode(
        (
            "kvstrata.kv.root",
            ROOT_FORMAT_VERSION,
            fn.name,
            fn.version,
            identity.model_fingerprint,
            identity.kv_dtype,
            identity.kv_layout,
            identity.block_size,
            identity.namespace,
        )
    )
    return BlockHash(fn.digest(record))


def validate_extra_fields(request: KVRequest) -> None:
    """Raise ValueError/TypeError naming the first malformed extra-key field."""
    rid = request.request_id
    for name in ("lora_name", "cache_salt"):
        value = getattr(request, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"request {rid!r}: {name} must be a non-empty str or None, got {value!r}")
    digest = request.prompt_embeds_digest
    if digest is not None and (not isinstance(digest, bytes) or not digest):
        raise ValueError(f"request {rid!r}: prompt_embeds_digest must be non-empty bytes or None, got {digest!r}")
    features = request.mm_features
    if not isinstance(features, (list, tuple)):
        raise TypeError(f"request {rid!r}: mm_features must be a list of MultiModalFeature")
    prev_offset = 0
    for i, f in enumerate(features):
        if not isinstance(f, MultiModalFeature):
            raise TypeError(f"request {rid!r}: mm_features[{i}] must be a MultiModalFeature, got {type(f).__name__}")
        if not isinstance(f.identifier, str) or not f.identifier:
            raise ValueError(f"request {rid!r}: mm_features[{i}].identifier must be a non-empty str")
        if not isinstance(f.offset, int) or f.offset < 0:
            raise ValueError(f"request {rid!r}: mm_features[{i}].offset must be an integer >= 0, got {f.offset!r}")
        if not isinstance(f.length, int) or f.length < 1:
            raise ValueError(f"request {rid!r}: mm_features[{i}].length must be an integer >= 1, got {f.length!r}")
        if f.offset < prev_offset:
            raise ValueError(f"request {rid!r}: mm_features must be sorted by offset (index {i})")
        prev_offset = f.offset


def block_extra_keys(request: KVRequest, start: int, end: int, mm_index: int) -> tuple[ExtraKeys | None, int]:
    """Extra keys of the block of tokens ``[start, end)``; ``mm_index`` is the
    first multimodal feature that may still overlap (features ending before
    ``start`` are passed over and the new index returned)."""
    keys: list[tuple[object, ...]] = []
    if request.lora_name is not None:
        keys.append(("lora", request.lora_name))
    features = request.mm_features
    i = mm_index
    while i < len(features) and features[i].offset + features[i].length <= start:
        i += 1
    next_index = i
    while i < len(features) and features[i].offset < end:
        f = features[i]
        if f.offset + f.length > start:
            keys.append(("mm", f.identifier, f.offset))
        i += 1
    if start == 0 and request.cache_salt is not None:
        keys.append(("salt", request.cache_salt))
    if request.prompt_embeds_digest is not None and start < request.num_prompt_tokens:
        keys.append(("embeds", request.prompt_embeds_digest))
    return (tuple(keys) if keys else None), next_index


class BlockHasher:
    """Computes a request's hashes for blocks that became full since the
    last call: ``request.block_hashes.extend(hasher(request))``.

    Owns nothing mutable: the root is fixed at construction.
    """

    __slots__ = ("identity", "random_root", "hash_fn", "block_size", "root", "_count")

    def __init__(self, identity: CacheIdentity, *, random_root: bool = False) -> None:
        self.identity = identity
        self.random_root = random_root  # no one else can compute this engine's chains
        self.hash_fn = get_hash_fn(identity.hash_algo)
        self.block_size = identity.block_size
        self.root: BlockHash = (
            BlockHash(os.urandom(self.hash_fn.digest_size)) if random_root else root_hash(identity)
        )
        self._count = _U32.pack(self.block_size)

    def __call__(self, request: KVRequest) -> list[BlockHash]:
        tokens = request.all_token_ids
        if not tokens:
            raise ValueError(f"request {request.request_id!r}: all_token_ids must not be empty")
        bs = self.block_size
        hashes = request.block_hashes
        first = len(hashes)
        last = len(tokens) // bs
        if last <= first:
            return []
        parent = hashes[-1] if first else self.root
        plain = (
            request.lora_name is None
            and request.cache_salt is None
            and not request.mm_features
            and request.prompt_embeds_digest is None
        )
        if plain:
            if self.hash_fn.cbor:
                return self._hash_plain_cbor(tokens, first, last, parent)
            return self._hash_plain(tokens, first, last, parent)
        validate_extra_fields(request)
        return self._hash_general(request, first, last, parent)

    def _hash_plain(self, tokens: Sequence[int], first: int, last: int, parent: bytes) -> list[BlockHash]:
        bs = self.block_size
        data = pack_tokens(tokens[first * bs : last * bs])
        width = 4 * bs
        count = self._count
        out: list[BlockHash] = []
        append = out.append
        if self.hash_fn.name == "sha256":  # hashlib inline: no Python frame per block
            sha256 = hashlib.sha256
            for off in range(0, len(data), width):
                parent = sha256(parent + count + data[off : off + width]).digest()
                append(parent)  # type: ignore[arg-type]
            return out
        digest = self.hash_fn.digest
        for off in range(0, len(data), width):
            parent = digest(parent + count + data[off : off + width])
            append(parent)  # type: ignore[arg-type]
        return out

    def _hash_plain_cbor(self, tokens: Sequence[int], first: int, last: int, parent: bytes) -> list[BlockHash]:
        bs = self.block_size
        digest = self.hash_fn.digest
        dumps = cbor2.dumps
        out: list[BlockHash] = []
        for start in range(first * bs, last * bs, bs):
            parent = digest(dumps([parent, tokens[start : start + bs], None], canonical=True))
            out.append(parent)  # type: ignore[arg-type]
        return out

    def _hash_general(self, request: KVRequest, first: int, last: int, parent: bytes) -> list[BlockHash]:
        bs = self.block_size
        fn = self.hash_fn
        tokens = request.all_token_ids
        out: list[BlockHash] = []
        mm_index = 0
        for i in range(first, last):
            start = i * bs
            extra, mm_index = block_extra_keys(request, start, start + bs, mm_index)
            parent = fn.hash_block(parent, tokens[start : start + bs], extra)
            out.append(parent)  # type: ignore[arg-type]
        return out


def make_block_hasher(identity: CacheIdentity, *, random_root: bool = False) -> BlockHasher:
    """A callable ``(request) -> list[BlockHash]`` for ``identity``: the hashes
    of the request's newly full blocks beyond ``len(request.block_hashes)``."""
    return BlockHasher(identity, random_root=random_root)
