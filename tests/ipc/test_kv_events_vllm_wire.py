"""Other routers read kvstrata's KV events unchanged: what the publisher
sends over real ZMQ decodes with structs shaped as vLLM's
(``vllm.distributed.kv_events``: today's map shape and the legacy
positional one, bytes or int hashes), vLLM-shaped batches of both kinds
decode with ours, and the replay socket answers
vLLM's replay request (a REQ socket, or a DEALER sending an empty delimiter
first). The structs below are written from vLLM's field list, not imported:
vLLM is not a dependency."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from kvstrata.ipc.kv_publisher import ZmqEventPublisher
from kvstrata.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventCodec,
    make_batch_decoder,
)

LOOPBACK = "tcp://127.0.0.1:*"
ExternalBlockHash = bytes | int


# --- vLLM's shapes (field names, order and requiredness as vLLM declares them) ---
# Current: vllm/distributed/kv_events.py since vLLM's map change (no
# ``array_like``: a map batch, events tagged by a "type" key; omit_defaults).

class VEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class VKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VKVCacheEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VBlockRemoved(VKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class VAllBlocksCleared(VKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VEventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


# Legacy: the same fields as positional arrays (``array_like=True``).

class LEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class LKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class LBlockStored(LKVCacheEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None


class LBlockRemoved(LKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class LAllBlocksCleared(LKVCacheEvent, tag="AllBlocksCleared"):
    pass


class LKVEventBatch(LEventBatch):
    events: list[LBlockStored | LBlockRemoved | LAllBlocksCleared]


SHAPES = {"vllm": (VKVEventBatch, VBlockStored, VBlockRemoved, VAllBlocksCleared),
          "vllm-legacy": (LKVEventBatch, LBlockStored, LBlockRemoved, LAllBlocksCleared)}


def low64(h: bytes) -> int:
    return int.from_bytes(h, byteorder="big") & ((1 << 64) - 1)  # vLLM's maybe_convert_block_hash


def _our_batch(i: int) -> KVEventBatch:
    h0, h1 = (10 * i).to_bytes(32, "big"), (10 * i + 1).to_bytes(32, "big")
    return KVEventBatch(ts=100.0 + i, events=[
        BlockStored(block_hashes=[h0, h1], parent_block_hash=None, token_ids=list(range(8)), block_size=4,
                    medium="GPU"),
        BlockStored(block_hashes=[h1], parent_block_hash=h0, token_ids=[4, 5, 6, 7], block_size=4, medium="CPU",
                    lora_name="adapter-a", group_idx=1),
        BlockRemoved(block_hashes=[h0], medium="GPU"),
        AllBlocksCleared(medium="DISK"),
    ])


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def _check_vllm_view(i: int, got, shape: str, int_hashes: bool) -> None:
    _, stored_t, removed_t, cleared_t = SHAPES[shape]
    ours = _our_batch(i)
    h = low64 if int_hashes else (lambda x: x)
    h0, h1 = ours.events[0].block_hashes
    assert got.ts == ours.ts and got.data_parallel_rank is None
    stored, stored_cpu, removed, cleared = got.events
    assert isinstance(stored, stored_t) and isinstance(stored_cpu, stored_t)
    assert stored.block_hashes == [h(h0), h(h1)] and stored.parent_block_hash is None
    assert (stored.token_ids, stored.block_size, stored.lora_id, stored.medium, stored.lora_name) == (
        list(range(8)), 4, None, "GPU", None)
    assert stored.group_idx == 0
    assert (stored_cpu.parent_block_hash, stored_cpu.medium, stored_cpu.lora_name, stored_cpu.group_idx) == (
        h(h0), "CPU", "adapter-a", 1)
    assert isinstance(removed, removed_t) and removed.medium == "GPU" and removed.block_hashes == [h(h0)]
    assert isinstance(cleared, cleared_t)  # our extra medium field is ignored by vLLM's decoder


@pytest.mark.parametrize(("shape", "int_hashes"), [("vllm", False), ("vllm", True), ("vllm-legacy", False)])
async def test_published_events_decode_with_vllms_structs(ctx, shape, int_hashes):
    pub = await ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, topic="kv", wire_format=shape,
                                  int_hashes=int_hashes).start()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(pub.endpoint)
    try:
        import asyncio

        await asyncio.sleep(0.3)  # the subscription reaches the publisher
        for i in range(3):
            pub.publish(_our_batch(i))
        vdecode = msgspec.msgpack.Decoder(SHAPES[shape][0]).decode
        for i in range(3):
            assert sub.poll(5000)
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv" and len(seq) == 8 and int.from_bytes(seq, "big") == i
            _check_vllm_view(i, vdecode(payload), shape, int_hashes)
            assert make_batch_decoder().decode(payload).ts == 100.0 + i  # and ours reads it back

        # vLLM's replay request from a REQ socket: one 8-byte big-endian start
        # sequence; the answers are [seq, payload] ... then [-1, b""].
        for kind in ("req", "dealer+delimiter"):
            sock = ctx.socket(zmq.REQ if kind == "req" else zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(pub.replay_endpoint)
            if kind == "req":
                sock.send((1).to_bytes(8, "big"))
            else:
                sock.send_multipart([b"", (1).to_bytes(8, "big")])
            assert sock.poll(5000)
            frames = sock.recv_multipart()
            if kind == "dealer+delimiter":
                assert frames[0] == b""
                frames = frames[1:]
                replayed = [frames]
                while True:
                    assert sock.poll(5000)
                    f = sock.recv_multipart()[1:]
                    replayed.append(f)
                    if f[1] == b"":
                        break
                assert [int.from_bytes(s, "big", signed=True) for s, _ in replayed] == [1, 2, -1]
                for (s, p) in replayed[:-1]:
                    _check_vllm_view(int.from_bytes(s, "big"), vdecode(p), shape, int_hashes)
            else:  # a REQ socket takes the first answer of the stream
                assert int.from_bytes(frames[0], "big") == 1
                _check_vllm_view(1, vdecode(frames[1]), shape, int_hashes)
            sock.close()
    finally:
        sub.close()
        await pub.aclose()


@pytest.mark.parametrize("shape", ["vllm", "vllm-legacy"])
@pytest.mark.parametrize("int_hashes", [False, True])
def test_vllm_encoded_batches_decode_as_ours(shape, int_hashes):
    """The other way round: a router built on kvstrata's decoder reads a
    vLLM engine's events, in either shape, with bytes or int hashes."""
    batch_t, stored_t, removed_t, cleared_t = SHAPES[shape]
    h0, h1 = b"\x01" * 32, b"\x02" * 32
    if int_hashes:
        h0, h1 = low64(h0), low64(h1)
    extra = {"kv_cache_spec_kind": "full_attention"} if shape == "vllm" else {}
    vbatch = batch_t(ts=5.0, events=[
        stored_t(block_hashes=[h0, h1], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
                 lora_id=None, medium="GPU", lora_name=None, **extra),
        removed_t(block_hashes=[h1], medium="CPU"),
        cleared_t(),
    ], data_parallel_rank=0)
    payload = msgspec.msgpack.encode(vbatch)
    raw = msgspec.msgpack.decode(payload)
    if shape == "vllm":  # what today's vLLM puts on the wire: maps, tagged by "type", defaults omitted
        assert isinstance(raw, dict) and raw["events"][0]["type"] == "BlockStored"
        assert "group_idx" not in raw["events"][0] and raw["events"][2] == {"type": "AllBlocksCleared"}
    else:
        assert isinstance(raw, list) and raw[1][0][0] == "BlockStored"
    ours = make_batch_decoder().decode(payload)
    stored, removed, cleared = ours.events
    assert stored == BlockStored(block_hashes=[h0, h1], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                                 block_size=2, medium="GPU", group_idx=None)
    assert removed == BlockRemoved(block_hashes=[h1], medium="CPU", group_idx=None)
    assert isinstance(cleared, AllBlocksCleared) and ours.data_parallel_rank == 0


def test_an_array_batch_of_map_events_decodes_too():
    """A publisher that kept the batch positional but sends tagged-map
    events is read as well (the decoder tries the other event shape)."""
    events = [{"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": [1, 2],
               "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None},
              {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}]
    decoder = make_batch_decoder()
    for _ in range(2):  # the second time the learnt order answers first
        got = decoder.decode(msgspec.msgpack.encode([1.5, events]))
        assert got.ts == 1.5 and got.events[0].block_hashes == [7] and type(got.events[1]) is BlockRemoved
    assert decoder.decode(msgspec.msgpack.encode(_our_batch(0))) == _our_batch(0)  # and the legacy one again


def test_every_field_vllm_requires_is_on_the_wire():
    """No default is omitted, in either shape: a BlockStored with every
    default still carries vLLM's required fields (lora_id, medium, lora_name)."""
    ev = BlockStored(block_hashes=[b"x"], parent_block_hash=None, token_ids=[1], block_size=1)
    batch = KVEventBatch(ts=0.0, events=[ev])
    legacy = msgspec.msgpack.decode(KVEventCodec("vllm-legacy").encode(batch))[1][0]
    assert legacy[0] == "BlockStored" and len(legacy) >= 8
    assert legacy[5:8] == [None, "device", None]  # lora_id, medium, lora_name
    current = msgspec.msgpack.decode(KVEventCodec("vllm").encode(batch))["events"][0]
    assert {k: current[k] for k in ("type", "lora_id", "medium", "lora_name")} == {
        "type": "BlockStored", "lora_id": None, "medium": "device", "lora_name": None}
    with pytest.raises(ValueError, match="kv events format"):
        KVEventCodec("array")
