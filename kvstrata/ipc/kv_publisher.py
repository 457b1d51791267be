"""Publishing KV cache events over ZMQ, with replay of missed messages.

Wire format (every message on the PUB socket, three frames)::

    [topic bytes] [seq: 8-byte big-endian unsigned] [msgpack(KVEventBatch)]

Sequence numbers start at 0 and have no gaps, so a subscriber that sees
``seq`` jump knows what it missed. It asks the ROUTER replay socket for them
from a DEALER socket, sending one frame, the 8-byte big-endian first
sequence number it wants; the publisher answers with one
``[seq, payload]`` message per buffered batch from there on, then the end
marker ``[-1 as 8 signed bytes, b""]``. The buffer is a bounded ring (the
last ``buffer_steps`` batches): older ones are gone for good, which the
subscriber sees as replayed sequence numbers starting later than asked.

``publish`` never blocks the caller (the engine loop): it hands the batch to
a bounded queue and returns; a background thread owns both sockets,
encodes, numbers, sends and serves replays. When the queue is full the
batch is dropped and counted (these are cache hints, never correctness).
"""

from __future__ import annotations

import queue
import threading
from collections import deque

import msgspec
import structlog
import zmq

from kvstrata.kv.events import KVEventBatch

log = structlog.get_logger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_SHUTDOWN = object()


class ZmqEventPublisher:
    """Owns: the hand-off queue, the publisher thread and, inside that thread
    only, the ZMQ context's sockets, the sequence counter and the ring buffer.

    ``endpoint``/``replay_endpoint`` may use a wildcard port
    (``tcp://127.0.0.1:*``); the bound addresses are in ``self.endpoint`` and
    ``self.replay_endpoint`` once the constructor returns.
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        *,
        replay_endpoint: str | None = None,
        topic: str = "kv-events",
        buffer_steps: int = 10_000,
        max_queue_size: int = 100_000,
        hwm: int = 100_000,
        poll_interval_s: float = 0.01,
    ) -> None:
        if buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {buffer_steps}")
        if max_queue_size < 1:
            raise ValueError(f"max_queue_size must be >= 1, got {max_queue_size}")
        self.topic = topic.encode("utf-8")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.dropped = 0
        self._buffer_steps = buffer_steps
        self._hwm = hwm
        self._poll_s = poll_interval_s
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queue_size)
        self._closed = False
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise ValueError(f"cannot bind kv event sockets ({endpoint!r}, {replay_endpoint!r}): {self._error}")

    def publish(self, batch: KVEventBatch) -> bool:
        """Queue ``batch`` for sending; never blocks. False if dropped."""
        if self._closed:
            return False
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, stop the thread, close the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(_SHUTDOWN, timeout=timeout)
        except queue.Full:
            log.warning("kv_event_publisher_close_queue_full", dropped=self.dropped)
        self._thread.join(timeout)
        if self.dropped:
            log.warning("kv_event_publisher_dropped", dropped=self.dropped)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the publisher thread ---------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context()
        pub = replay = None
        try:
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self._hwm)
            pub.setsockopt(zmq.LINGER, 1000)
            pub.bind(self.endpoint)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if self.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._error = e
            self._ready.set()
            for s in (pub, replay):
                if s is not None:
                    s.close(0)
            ctx.term()
            return
        self._ready.set()
        try:
            self._loop(pub, replay)
        except Exception:
            log.exception("kv_event_publisher_failed")
        finally:
            pub.close()
            if replay is not None:
                replay.close()
            ctx.term()

    def _loop(self, pub: zmq.Socket, replay: zmq.Socket | None) -> None:
        encoder = msgspec.msgpack.Encoder()
        ring: deque[tuple[int, bytes]] = deque(maxlen=self._buffer_steps)
        seq = 0
        topic = self.topic
        while True:
            if replay is not None:
                while replay.poll(0):
                    self._serve_replay(replay, ring)
            try:
                item = self._queue.get(timeout=self._poll_s)
            except queue.Empty:
                continue
            if item is _SHUTDOWN:
                return
            payload = encoder.encode(item)
            pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            ring.append((seq, payload))
            seq += 1

    @staticmethod
    def _serve_replay(replay: zmq.Socket, ring: deque[tuple[int, bytes]]) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 2 or len(frames[1]) != 8:
            log.warning("kv_event_replay_bad_request", num_frames=len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[1], "big")
        for seq, payload in ring:
            if seq >= start:
                replay.send_multipart((client, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, END_OF_REPLAY, b""))


def request_replay(
    ctx: zmq.Context, replay_endpoint: str, start_seq: int, timeout_ms: int = 5000
) -> list[tuple[int, KVEventBatch]]:
    """Ask a publisher's replay socket for every buffered batch from
    ``start_seq`` on (a helper for subscribers; blocking, for their threads)."""
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(replay_endpoint)
        sock.send(start_seq.to_bytes(8, "big"))
        out: list[tuple[int, KVEventBatch]] = []
        while True:
            if not sock.poll(timeout_ms):
                raise TimeoutError(f"no replay from {replay_endpoint} within {timeout_ms} ms")
            seq_bytes, payload = sock.recv_multipart()
            if seq_bytes == END_OF_REPLAY:
                return out
            out.append((int.from_bytes(seq_bytes, "big"), decoder.decode(payload)))
    finally:
        sock.close()
