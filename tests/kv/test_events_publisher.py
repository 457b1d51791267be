"""KV events as msgspec Structs, and the ZMQ publisher with replay."""

import time

import msgspec
import pytest
import zmq

from kvstrata.kv import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvstrata.kv.events import make_batch_decoder
from kvstrata.ipc.kv_publisher import END_OF_REPLAY, ZmqEventPublisher, request_replay


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


@pytest.fixture
def publisher():
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", buffer_steps=10_000)
    yield pub
    pub.close()


def _subscribe(ctx, endpoint, topic=b"kv-events"):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


def _recv(sub, decoder, timeout_ms=10_000):
    assert sub.poll(timeout_ms), "no message from the publisher"
    topic, seq, payload = sub.recv_multipart()
    return topic, int.from_bytes(seq, "big"), decoder.decode(payload)


def test_subscriber_that_missed_messages_recovers_them_by_replay(publisher):
    ctx = zmq.Context()
    decoder = make_batch_decoder()
    published = [_batch(i) for i in range(5)]
    for b in published:  # nobody is listening yet: these are missed
        assert publisher.publish(b)
    sub = _subscribe(ctx, publisher.endpoint)
    try:
        # Publish until the subscription has propagated and one message arrives.
        first = None
        deadline = time.monotonic() + 30
        while first is None and time.monotonic() < deadline:
            published.append(_batch(len(published) % 250))
            publisher.publish(published[-1])
            if sub.poll(20):
                first = _recv(sub, decoder)
        assert first is not None, "the subscription never reached the publisher"
        topic, first_seq, batch = first
        assert topic == b"kv-events" and first_seq >= 5 and batch == published[first_seq]
        replayed = request_replay(ctx, publisher.replay_endpoint, 0, timeout_ms=10_000)
        assert [seq for seq, _ in replayed[:first_seq]] == list(range(first_seq))
        assert [b for _, b in replayed[:first_seq]] == published[:first_seq]
        # the live stream continues without a gap after the first received message
        publisher.publish(_batch(255))
        seqs = []
        while True:
            _, seq, b = _recv(sub, decoder)
            seqs.append(seq)
            if b.ts == 255.0:
                break
        assert seqs == list(range(first_seq + 1, len(published) + 1))
    finally:
        sub.close()
        ctx.term()


def test_replay_buffer_is_bounded_to_the_latest_batches():
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", buffer_steps=3)
    ctx = zmq.Context()
    try:
        for i in range(7):
            pub.publish(_batch(i))
        deadline = time.monotonic() + 5
        replayed = []
        while time.monotonic() < deadline:
            replayed = request_replay(ctx, pub.replay_endpoint, 0)
            if replayed and replayed[-1][0] == 6:
                break
        assert [seq for seq, _ in replayed] == [4, 5, 6]
        assert [b.ts for _, b in replayed] == [4.0, 5.0, 6.0]
        assert request_replay(ctx, pub.replay_endpoint, 6)[0][0] == 6
    finally:
        pub.close()
        ctx.term()


def test_raw_replay_protocol_ends_with_the_marker(publisher):
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(publisher.replay_endpoint)
        dealer.send((10**6).to_bytes(8, "big"))  # nothing that far: only the marker
        assert dealer.poll(2000)
        assert dealer.recv_multipart() == [END_OF_REPLAY, b""]
    finally:
        dealer.close()
        ctx.term()


def test_publish_after_close_is_refused_and_close_is_idempotent():
    pub = ZmqEventPublisher("tcp://127.0.0.1:*")
    assert pub.publish(_batch(0))
    pub.close()
    pub.close()
    assert pub.publish(_batch(1)) is False


def test_full_queue_drops_instead_of_blocking():
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", max_queue_size=1,
                            buffer_steps=100_000)
    ctx = zmq.Context()
    try:
        accepted = sum(pub.publish(_batch(i % 200)) for i in range(3000))
        assert accepted + pub.dropped == 3000
        assert pub.dropped > 0
        deadline = time.monotonic() + 5
        replayed = []
        while time.monotonic() < deadline:
            replayed = request_replay(ctx, pub.replay_endpoint, 0)
            if len(replayed) == accepted:
                break
        assert [seq for seq, _ in replayed] == list(range(accepted))  # numbered without gaps
    finally:
        pub.close()
        ctx.term()


def test_bad_endpoint_raises_naming_it():
    with pytest.raises(ValueError, match="cannot bind kv event sockets"):
        ZmqEventPublisher("not-a-transport://x")
