"""The KV events publisher over real ZMQ sockets: vLLM's wire format, replay
over ROUTER, bounded queues, and a loop that never waits on it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq

from kvstrata.ipc.kv_publisher import END_OF_REPLAY, ZmqEventPublisher, request_replay
from kvstrata.kv import BlockRemoved, BlockStored, KVEventBatch
from kvstrata.kv.events import make_batch_decoder

LOOPBACK = "tcp://127.0.0.1:*"


def _batch(i):
    return KVEventBatch(
        ts=float(i),
        events=[
            BlockStored(block_hashes=[i.to_bytes(4, "big")], parent_block_hash=None, token_ids=[i, i + 1], block_size=2),
            BlockRemoved(block_hashes=[b"\x00" * 4], medium="cpu"),
        ],
    )


@pytest.fixture(autouse=True)
def no_thread_left():
    """After every test (each closes what it started) no publisher thread is alive."""
    yield
    deadline = time.monotonic() + 2
    while any(t.name == "kv-event-publisher" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [t for t in threading.enumerate() if t.name == "kv-event-publisher"]


@pytest.fixture
async def publisher():
    pub = await ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=10_000).start()
    yield pub
    await pub.aclose()


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


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


def _first_live(pub, sub, decoder, published):
    """Publish until the subscription has propagated and one message arrives."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        published.append(_batch(len(published) % 250))
        pub.publish(published[-1])
        if sub.poll(20):
            return _recv(sub, decoder)
    raise AssertionError("the subscription never reached the publisher")


async def _replay(ctx, pub, start, until):
    """Ask for a replay until ``until(replayed)`` (the thread sends asynchronously)."""
    deadline = time.monotonic() + 5
    replayed = []
    while time.monotonic() < deadline:
        replayed = await asyncio.to_thread(request_replay, ctx, pub.replay_endpoint, start)
        if until(replayed):
            break
    return replayed


async def test_subscriber_that_missed_messages_recovers_them_by_replay(publisher, ctx):
    decoder = make_batch_decoder()
    published = [_batch(i) for i in range(5)]
    for b in published:  # nobody is listening yet: these are missed
        assert publisher.publish(b)
    # the thread sends asynchronously: wait until it took (and sent) all five, or
    # the subscriber could connect before they leave and receive seq 0 live
    deadline = time.monotonic() + 5
    while publisher.queued and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)
    sub = _subscribe(ctx, publisher.endpoint)
    try:
        topic, first_seq, batch = _first_live(publisher, sub, decoder, published)
        assert topic == b"kv-events" and first_seq >= 5 and batch == published[first_seq]
        replayed = await asyncio.to_thread(request_replay, ctx, publisher.replay_endpoint, 0, 10_000)
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


async def test_replay_buffer_is_bounded_to_the_latest_batches(ctx):
    async with ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, buffer_steps=3) as pub:
        for i in range(7):
            pub.publish(_batch(i))
        replayed = await _replay(ctx, pub, 0, lambda r: r and r[-1][0] == 6)
        assert [seq for seq, _ in replayed] == [4, 5, 6]
        assert [b.ts for _, b in replayed] == [4.0, 5.0, 6.0]
        assert (await asyncio.to_thread(request_replay, ctx, pub.replay_endpoint, 6))[0][0] == 6


async def test_raw_replay_protocol_ends_with_the_marker(publisher, ctx):
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(publisher.replay_endpoint)
        dealer.send((10**6).to_bytes(8, "big"))  # nothing that far: only the marker
        assert dealer.poll(2000)
        assert dealer.recv_multipart() == [END_OF_REPLAY, b""]
    finally:
        dealer.close()


async def test_publish_after_close_is_refused_and_close_is_idempotent():
    pub = await ZmqEventPublisher(LOOPBACK).start()
    assert pub.publish(_batch(0))
    await pub.aclose()
    await pub.aclose()
    assert pub.publish(_batch(1)) is False


async def test_full_queue_drops_instead_of_blocking(ctx):
    pub = await ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, max_queue_size=1,
                                  buffer_steps=100_000).start()
    try:
        accepted = sum(pub.publish(_batch(i % 200)) for i in range(3000))
        assert accepted + pub.dropped == 3000
        assert pub.dropped > 0
        replayed = await _replay(ctx, pub, 0, lambda r: len(r) == accepted)
        assert [seq for seq, _ in replayed] == list(range(accepted))  # numbered without gaps
    finally:
        await pub.aclose()


async def test_bad_endpoint_raises_naming_it_from_start_and_the_constructor_binds_nothing():
    pub = ZmqEventPublisher("not-a-transport://x")  # no socket, no thread yet
    with pytest.raises(ValueError, match="cannot bind kv event sockets.*not-a-transport://x"):
        await pub.start()
    assert pub.publish(_batch(0)) is False  # a failed start leaves it closed
    await pub.aclose()


async def test_construction_does_no_io_and_start_never_blocks_the_loop(monkeypatch):
    real_bind = zmq.Socket.bind
    binding = threading.Event()

    def slow_bind(self, addr):
        binding.set()
        time.sleep(0.3)  # a slow bind (DNS, a busy interface): the thread's problem, not the loop's
        return real_bind(self, addr)

    monkeypatch.setattr(zmq.Socket, "bind", slow_bind)
    pub = ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK)
    assert not binding.is_set() and pub.endpoint == LOOPBACK
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    t = asyncio.create_task(ticker())
    try:
        started = time.monotonic()
        assert await pub.start() is pub
        assert time.monotonic() - started >= 0.6  # both binds happened, in the thread
        assert ticks >= 20  # the loop kept running meanwhile
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith("*")
        assert pub.replay_endpoint.startswith("tcp://127.0.0.1:") and pub.replay_endpoint != pub.endpoint
    finally:
        t.cancel()
        await pub.aclose()


async def test_batches_published_before_start_are_sent_from_sequence_zero(ctx):
    pub = ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK)
    try:
        assert [pub.publish(_batch(i)) for i in range(3)] == [True, True, True]
        assert pub.queued == 3
        await pub.start()
        replayed = await _replay(ctx, pub, 0, lambda r: len(r) == 3)
        assert [(seq, b.ts) for seq, b in replayed] == [(0, 0.0), (1, 1.0), (2, 2.0)]
        assert pub.published == 3 and pub.queued == 0
    finally:
        await pub.aclose()


async def test_a_publisher_never_started_drops_when_full_and_closes_at_once():
    pub = ZmqEventPublisher(LOOPBACK, max_queue_size=2)
    assert [pub.publish(_batch(i)) for i in range(4)] == [True, True, False, False]
    assert pub.dropped == 2 and pub.queued == 2
    started = time.monotonic()
    await pub.aclose()
    assert time.monotonic() - started < 0.1
    with pytest.raises(RuntimeError, match="closed"):
        await pub.start()


async def test_aclose_sends_everything_queued_before_it(ctx):
    decoder = make_batch_decoder()
    pub = await ZmqEventPublisher(LOOPBACK).start()
    sub = _subscribe(ctx, pub.endpoint)
    try:
        published = []
        _, first_seq, _ = _first_live(pub, sub, decoder, published)
        while sub.poll(50):  # what the warm-up sent after the first one
            _recv(sub, decoder)
        for i in range(100):
            assert pub.publish(_batch(1000 + i))
        await pub.aclose()  # returns once the thread has sent them and closed its sockets
        got = [_recv(sub, decoder)[2].ts for _ in range(100)]
        assert got == [float(1000 + i) for i in range(100)]
    finally:
        sub.close()
        await pub.aclose()


async def test_an_idle_publisher_answers_replays_and_sends_after_a_pause(publisher, ctx):
    """The thread sleeps in zmq.poll on the replay socket and the wake-up
    socket: both wake it."""
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    assert await asyncio.to_thread(request_replay, ctx, publisher.replay_endpoint, 0) == []
    publisher.publish(_batch(1))
    replayed = await _replay(ctx, publisher, 0, lambda r: len(r) == 1)
    assert [seq for seq, _ in replayed] == [0]
    assert time.monotonic() - t0 < 2.0
