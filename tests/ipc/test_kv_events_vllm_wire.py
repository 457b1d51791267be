"""Other routers read kvstrata's KV events unchanged: what the publisher
sends over real ZMQ decodes with structs shaped as vLLM's
(``vllm.distributed.kv_events``, array-like as vLLM's subscriber example and
the Dynamo / llm-d indexers decode them), and the replay socket answers
vLLM's replay request (a REQ socket, or a DEALER sending an empty delimiter
first). The structs below are written from vLLM's field list, not imported:
vLLM is not a dependency."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from kvstrata.ipc.kv_publisher import ZmqEventPublisher
from kvstrata.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, make_batch_decoder

LOOPBACK = "tcp://127.0.0.1:*"
ExternalBlockHash = bytes | int


# --- vLLM's shapes (field names, order and requiredness as vLLM declares them) ---

class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class VKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
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


class VBlockRemoved(VKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class VAllBlocksCleared(VKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VEventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


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


def _check_vllm_view(i: int, got: VKVEventBatch) -> None:
    ours = _our_batch(i)
    assert got.ts == ours.ts and got.data_parallel_rank is None
    stored, stored_cpu, removed, cleared = got.events
    assert isinstance(stored, VBlockStored) and isinstance(stored_cpu, VBlockStored)
    assert stored.block_hashes == ours.events[0].block_hashes and stored.parent_block_hash is None
    assert (stored.token_ids, stored.block_size, stored.lora_id, stored.medium, stored.lora_name) == (
        list(range(8)), 4, None, "GPU", None)
    assert stored.group_idx == 0
    assert (stored_cpu.parent_block_hash, stored_cpu.medium, stored_cpu.lora_name, stored_cpu.group_idx) == (
        ours.events[0].block_hashes[0], "CPU", "adapter-a", 1)
    assert isinstance(removed, VBlockRemoved) and removed.medium == "GPU"
    assert removed.block_hashes == [ours.events[0].block_hashes[0]]
    assert isinstance(cleared, VAllBlocksCleared)  # our extra medium field is ignored by vLLM's decoder


async def test_published_events_decode_with_vllms_structs(ctx):
    pub = await ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, topic="kv").start()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(pub.endpoint)
    try:
        import asyncio

        await asyncio.sleep(0.3)  # the subscription reaches the publisher
        for i in range(3):
            pub.publish(_our_batch(i))
        vdecode = msgspec.msgpack.Decoder(VKVEventBatch).decode
        for i in range(3):
            assert sub.poll(5000)
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv" and len(seq) == 8 and int.from_bytes(seq, "big") == i
            _check_vllm_view(i, vdecode(payload))

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
                    _check_vllm_view(int.from_bytes(s, "big"), vdecode(p))
            else:  # a REQ socket takes the first answer of the stream
                assert int.from_bytes(frames[0], "big") == 1
                _check_vllm_view(1, vdecode(frames[1]))
            sock.close()
    finally:
        sub.close()
        await pub.aclose()


def test_vllm_encoded_batches_decode_as_ours():
    """The other way round: a router built on kvstrata's decoder reads a
    vLLM engine's events (int block hashes aside: ours are bytes)."""
    h0, h1 = b"\x01" * 32, b"\x02" * 32
    vbatch = VKVEventBatch(ts=5.0, events=[
        VBlockStored(block_hashes=[h0, h1], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
                     lora_id=None, medium="GPU", lora_name=None),
        VBlockRemoved(block_hashes=[h1], medium="CPU"),
        VAllBlocksCleared(),
    ], data_parallel_rank=0)
    ours = make_batch_decoder().decode(msgspec.msgpack.encode(vbatch))
    stored, removed, cleared = ours.events
    assert stored == BlockStored(block_hashes=[h0, h1], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                                 block_size=2, medium="GPU", group_idx=None)
    assert removed == BlockRemoved(block_hashes=[h1], medium="CPU", group_idx=None)
    assert isinstance(cleared, AllBlocksCleared) and ours.data_parallel_rank == 0


def test_every_field_vllm_requires_is_on_the_wire():
    """No default is omitted: a BlockStored with every default still carries
    vLLM's seven required positions (tag included: eight)."""
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(
        BlockStored(block_hashes=[b"x"], parent_block_hash=None, token_ids=[1], block_size=1)))
    assert raw[0] == "BlockStored" and len(raw) >= 8
    assert raw[5:8] == [None, "device", None]  # lora_id, medium, lora_name
