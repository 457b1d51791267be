"""KV events as msgspec Structs (the ZMQ publisher's tests are in
tests/ipc/test_kv_publisher.py)."""

import msgspec
import pytest

from kvstrata.kv import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvstrata.kv.events import make_batch_decoder


def _batch(i):
    return KVEventBatch(
        ts=float(i),
        events=[
            BlockStored(block_hashes=[i.to_bytes(4, "big")], parent_block_hash=None, token_ids=[i, i + 1], block_size=2),
            BlockRemoved(block_hashes=[b"\x00" * 4], medium="cpu"),
        ],
    )


def test_events_round_trip_through_msgpack_with_their_medium():
    batch = KVEventBatch(ts=1.5, events=[*_batch(3).events, AllBlocksCleared(medium="disk")])
    decoded = make_batch_decoder().decode(msgspec.msgpack.encode(batch))
    assert decoded == batch
    assert [e.medium for e in decoded.events] == ["device", "cpu", "disk"]
    assert BlockStored(block_hashes=[], parent_block_hash=None, token_ids=[], block_size=1).medium == "device"


def test_events_are_frozen():
    ev = BlockRemoved(block_hashes=[b"a"])
    with pytest.raises(AttributeError):
        ev.medium = "cpu"
