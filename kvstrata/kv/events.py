"""KV cache events for external routers (which replica holds which prefix).

Our event classes are frozen, tagged msgspec Structs. On the wire they take
one of vLLM's two shapes (``vllm.distributed.kv_events``), picked by
``cache.kv_events_format``:

    "vllm"          today's vLLM: a map batch ``{"ts", "events", ...}`` of
                    tagged maps ``{"type": "BlockStored", "block_hashes":
                    ...}`` (vLLM's structs are no longer ``array_like``)
    "vllm-legacy"   vLLM before that change: positional arrays,
                    ``[ts, [["BlockStored", block_hashes, parent, ...]], dp]``

and block hashes are bytes, or with ``cache.kv_events_int_hashes`` the low
64 bits as an unsigned int, as vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``
gives them (``int.from_bytes(h, "big") & (2**64 - 1)``). Every field is
written in both shapes (no default omitted), so a decoder that requires
vLLM's fields (``lora_id``, ``medium``, ``lora_name``) finds them all;
fields a decoder does not know are ignored. :class:`KVEventCodec` encodes;
:func:`make_batch_decoder` decodes every shape and both hash kinds into
these classes (hashes as they came: bytes or int). See docs/kv_events.md.

``medium`` says which tier the event is about: the block pool writes
"device"; the engine renames it "GPU" when it publishes
(``EngineCore.take_kv_events``), beside the connector's tiers, "CPU",
"DISK" and "REMOTE" (``kvstrata.connector.events``).

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
WIRE_FORMATS = ("vllm", "vllm-legacy")
_LOW64 = (1 << 64) - 1

# A block hash on the wire: our bytes, or (int hashes) its low 64 bits.
ExternalBlockHash = bytes | int


class KVCacheEvent(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=True):
    """Base of the three event kinds (the tag is the class name)."""


class BlockStored(KVCacheEvent, frozen=True):
    """Full blocks were cached: ``block_hashes[i]`` names the i-th block of
    ``token_ids`` (``block_size`` tokens each); ``parent_block_hash`` is the
    hash of the block before the first one, None at the start of a chain."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None  # vLLM's deprecated LoRA id: always None here (LoRA is keyed by lora_name)
    medium: str | None = DEVICE_MEDIUM
    lora_name: str | None = None
    extra_keys: list[Any] | None = None  # Any: vLLM's wire type (per-block extra hash keys); not published here
    group_idx: int | None = 0  # None (as vLLM may send it) means group 0


class BlockRemoved(KVCacheEvent, frozen=True):
    """Cached blocks were evicted; their hashes no longer hit on this medium."""

    block_hashes: list[ExternalBlockHash]
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


# --- today's vLLM shape: maps, events tagged by a "type" key -------------------
# Same fields, same order, as the classes above; decoded batches are turned
# into those classes, so consumers see one set of types.

class _MapEvent(msgspec.Struct, frozen=True, gc=False, tag_field="type"):
    pass


class _MapBlockStored(_MapEvent, frozen=True, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = DEVICE_MEDIUM
    lora_name: str | None = None
    extra_keys: list[Any] | None = None  # Any: vLLM's wire type
    group_idx: int | None = None  # as vLLM: absent means group 0


class _MapBlockRemoved(_MapEvent, frozen=True, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = DEVICE_MEDIUM
    group_idx: int | None = None  # as vLLM: absent means group 0


class _MapAllBlocksCleared(_MapEvent, frozen=True, tag="AllBlocksCleared"):
    medium: str | None = DEVICE_MEDIUM


_AnyMapEvent = _MapBlockStored | _MapBlockRemoved | _MapAllBlocksCleared


class _MapBatch(msgspec.Struct, frozen=True, gc=False):
    ts: float
    events: list[_AnyMapEvent]
    data_parallel_rank: int | None = None


class _ArrayBatchOfMaps(msgspec.Struct, frozen=True, array_like=True, gc=False):
    ts: float
    events: list[_AnyMapEvent]
    data_parallel_rank: int | None = None


class _MapBatchOfArrays(msgspec.Struct, frozen=True, gc=False):
    ts: float
    events: list[AnyKVCacheEvent]
    data_parallel_rank: int | None = None


_TO_MAP = {BlockStored: _MapBlockStored, BlockRemoved: _MapBlockRemoved, AllBlocksCleared: _MapAllBlocksCleared}
_FROM_MAP = {v: k for k, v in _TO_MAP.items()}


def low64(block_hash: ExternalBlockHash) -> int:
    """A hash as vLLM's int hashes give it: the low 64 bits, big-endian."""
    if isinstance(block_hash, int):
        return block_hash & _LOW64
    return int.from_bytes(block_hash, "big") & _LOW64


def _int_hashes(ev: AnyKVCacheEvent) -> AnyKVCacheEvent:
    if type(ev) is AllBlocksCleared:
        return ev
    hashes = [low64(h) for h in ev.block_hashes]
    if type(ev) is BlockStored:
        parent = None if ev.parent_block_hash is None else low64(ev.parent_block_hash)
        return msgspec.structs.replace(ev, block_hashes=hashes, parent_block_hash=parent)
    return msgspec.structs.replace(ev, block_hashes=hashes)


class KVEventCodec:
    """Encodes batches in one wire shape: ``wire_format`` "vllm" (maps, as
    vLLM sends since its map change) or "vllm-legacy" (positional arrays);
    ``int_hashes``: block hashes as their low 64 bits (vLLM's int hashes).
    Owns nothing mutable."""

    __slots__ = ("wire_format", "int_hashes", "_encode")

    def __init__(self, wire_format: str = "vllm", *, int_hashes: bool = False) -> None:
        if wire_format not in WIRE_FORMATS:
            raise ValueError(f"kv events format must be one of {', '.join(WIRE_FORMATS)}, got {wire_format!r}")
        self.wire_format = wire_format
        self.int_hashes = bool(int_hashes)
        self._encode = msgspec.msgpack.Encoder().encode

    def encode(self, batch: KVEventBatch) -> bytes:
        events = batch.events
        if self.int_hashes:
            events = [_int_hashes(ev) for ev in events]
        if self.wire_format == "vllm-legacy":
            if events is not batch.events:
                batch = KVEventBatch(ts=batch.ts, events=events, data_parallel_rank=batch.data_parallel_rank)
            return self._encode(batch)
        return self._encode(_MapBatch(ts=batch.ts, data_parallel_rank=batch.data_parallel_rank,
                                      events=[_TO_MAP[type(ev)](*msgspec.structs.astuple(ev)) for ev in events]))


class KVBatchDecoder:
    """Decodes a batch in either wire shape (and an array batch of map
    events, or a map batch of array events), hashes bytes or int, into
    :class:`KVEventBatch`. The batch's shape is read from its first byte;
    the events' shape is tried as last seen first. Not thread-safe: one per
    consumer thread."""

    __slots__ = ("_array", "_map", "_last")

    def __init__(self) -> None:
        # per batch shape: the decoders for the two event shapes, last used first
        self._array = [msgspec.msgpack.Decoder(KVEventBatch), msgspec.msgpack.Decoder(_ArrayBatchOfMaps)]
        self._map = [msgspec.msgpack.Decoder(_MapBatch), msgspec.msgpack.Decoder(_MapBatchOfArrays)]

    def decode(self, payload: bytes) -> KVEventBatch:
        if not payload:
            raise msgspec.DecodeError("empty KV event batch payload")
        first = payload[0]
        tries = self._map if (0x80 <= first <= 0x8F or first in (0xDE, 0xDF)) else self._array
        try:
            got = tries[0].decode(payload)
        except msgspec.ValidationError:
            got = tries[1].decode(payload)  # the other event shape; its error is the one raised
            tries.reverse()
        if type(got) is KVEventBatch:
            return got
        events = got.events
        if events and type(events[0]) in _FROM_MAP:
            events = [_FROM_MAP[type(ev)](*msgspec.structs.astuple(ev)) for ev in events]
        return KVEventBatch(ts=got.ts, events=events, data_parallel_rank=got.data_parallel_rank)


def make_batch_decoder() -> KVBatchDecoder:
    """A decoder for the publishers' payloads, in every shape (one per
    consumer thread)."""
    return KVBatchDecoder()
