"""KV cache events for external routers (which replica holds which prefix).

Wire types: frozen, tagged, array-like msgspec Structs, so a batch crosses
ZMQ as compact msgpack and decodes back into the same classes. The field
positions are vLLM's (``vllm.distributed.kv_events``, array-like as its
subscriber example and NVIDIA Dynamo's and llm-d's indexers decode them):
``BlockStored`` is ``[tag, block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium, lora_name, extra_keys, group_idx]`` and every
field is always written (no omitted defaults), so a decoder that requires
vLLM's fields finds them all; fields after the ones it knows are ignored.
See docs/kv_events.md. ``medium``
says which tier the event is about: the block pool writes "device"; the
engine renames it "GPU" when it publishes (``EngineCore.take_kv_events``),
beside the connector's tiers, "CPU", "DISK" and "REMOTE"
(``kvstrata.connector.events``).

The block pool records events only when asked to (``enable_events``); the
engine drains them with ``KVCacheManager.take_events()`` once per step and
hands a :class:`KVEventBatch` to its events sink, which in a process with
``cache.kv_events_endpoint`` set is the ZMQ publisher of
``kvstrata.ipc.kv_publisher`` (its wire format and replay protocol are
described there). This module holds no socket and no thread.
"""

from __future__ import annotations

from typing import Any

import msgspec

DEVICE_MEDIUM = "device"


class KVCacheEvent(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=True):
    """Base of the three event kinds (the tag is the class name)."""


class BlockStored(KVCacheEvent, frozen=True):
    """Full blocks were cached: ``block_hashes[i]`` names the i-th block of
    ``token_ids`` (``block_size`` tokens each); ``parent_block_hash`` is the
    hash of the block before the first one, None at the start of a chain."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None  # vLLM's deprecated LoRA id: always None here (LoRA is keyed by lora_name)
    medium: str | None = DEVICE_MEDIUM
    lora_name: str | None = None
    extra_keys: list[Any] | None = None  # vLLM: per-block extra hash keys; not published here
    group_idx: int | None = 0  # None (as vLLM may send it) means group 0


class BlockRemoved(KVCacheEvent, frozen=True):
    """Cached blocks were evicted; their hashes no longer hit on this medium."""

    block_hashes: list[bytes]
    medium: str | None = DEVICE_MEDIUM
    group_idx: int | None = 0  # None (as vLLM may send it) means group 0


class AllBlocksCleared(KVCacheEvent, frozen=True):
    """The whole prefix cache of this medium was reset."""

    medium: str | None = DEVICE_MEDIUM


AnyKVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The events of one engine step, stamped with wall-clock time."""

    ts: float
    events: list[AnyKVCacheEvent]
    data_parallel_rank: int | None = None


def make_batch_decoder() -> msgspec.msgpack.Decoder:
    """A decoder for the publisher's payloads (one per consumer thread)."""
    return msgspec.msgpack.Decoder(KVEventBatch)
