"""Identifiers, the request protocol and the errors of ``kvstrata.kv``.

(``RequestId`` is the engine's, ``kvstrata.types.RequestId``.)

The KV manager never owns a request: it reads the fields of any object that
satisfies :class:`KVRequest` (the engine's ``Request`` does; tests use a tiny
class of their own).
"""

from __future__ import annotations

from typing import NewType, Protocol, runtime_checkable

import msgspec

BlockId = NewType("BlockId", int)
BlockHash = NewType("BlockHash", bytes)


class MultiModalFeature(msgspec.Struct, frozen=True, kw_only=True):
    """A multimodal item placed in the prompt: its content identifier (a hash
    of the image/audio) and the token range ``[offset, offset + length)`` of
    its placeholder tokens. Blocks overlapping that range carry
    ``(identifier, offset)`` in their hash, so the same tokens with a
    different image never share KV."""

    identifier: str
    offset: int
    length: int


@runtime_checkable
class KVRequest(Protocol):
    """What the KV manager reads from a request.

    ``all_token_ids`` is the prompt followed by the outputs so far and grows;
    ``block_hashes`` holds one hash per *full* block (at the hash block size)
    and is grown by the request itself with the hasher from
    :func:`kvstrata.kv.make_block_hasher` whenever tokens are appended.

    Two optional attributes are read with defaults when present:
    ``num_preemptions`` (int, prefix-cache stats split preempted requests out)
    and ``skip_reading_prefix_cache`` (bool, e.g. a request that wants prompt
    logprobs must compute every prompt token).
    """

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_hashes: list[BlockHash]
    lora_name: str | None
    cache_salt: str | None
    mm_features: list[MultiModalFeature]
    prompt_embeds_digest: bytes | None

    @property
    def num_tokens(self) -> int: ...


class KVCacheError(Exception):
    """Base class of the errors raised by ``kvstrata.kv``."""


class UnknownRequestError(KVCacheError, KeyError):
    """A request id that holds no blocks in this manager (never allocated,
    or already freed)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(request_id)
        self.request_id = request_id

    def __str__(self) -> str:
        return f"request_id {self.request_id!r} holds no KV blocks (never allocated or already freed)"


class UnknownHashAlgorithmError(KVCacheError, ValueError):
    """``hash_algo`` names no known block hash function."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def require_positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int >= 1, else raise ValueError naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def require_non_negative_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int >= 0, else raise ValueError naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value
