"""Publishing KV cache events over ZMQ, with replay of missed messages.

Wire format (vLLM's; every message on the PUB socket, three frames)::

    [topic bytes] [seq: 8-byte big-endian unsigned] [msgpack(KVEventBatch)]

The batch is encoded in the shape ``wire_format`` names ("vllm": today's
vLLM maps, the default; "vllm-legacy": vLLM's earlier positional arrays),
with bytes block hashes or, with ``int_hashes``, their low 64 bits
(``kvstrata.kv.events.KVEventCodec``; ``cache.kv_events_format`` and
``cache.kv_events_int_hashes``).

Sequence numbers start at 0 and have no gaps, so a subscriber that sees
``seq`` jump knows what it missed. It asks the ROUTER replay socket for them
from a DEALER socket, sending one frame, the 8-byte big-endian first
sequence number it wants (or from a REQ socket, or a DEALER that sends an
empty delimiter frame first, as vLLM's subscribers do: the answer then
carries the same envelope); the publisher answers with one
``[seq, payload]`` message per buffered batch from there on, then the end
marker ``[-1 as 8 signed bytes, b""]``. The buffer is a bounded ring (the
last ``buffer_steps`` batches): older ones are gone for good, which the
subscriber sees as replayed sequence numbers starting later than asked.

Nothing here blocks the engine loop::

    loop                                   publisher thread (owns the sockets)
    ────                                   ───────────────────────────────────
    pub = ZmqEventPublisher(...)           (nothing yet: no socket, no thread)
    await pub.start()        ──starts──►   bind PUB (+ ROUTER); report the bound
                             ◄─future───   endpoints or the bind error
    pub.publish(batch)       ──queue──►    sleeps in zmq.poll on the wake-up
                             ──wake-up─►   socket and the ROUTER; encodes,
                                           numbers, sends; serves replays
    await pub.aclose()       ──wake-up─►   sends what is queued, closes
                             ◄─future───   the sockets, ends

``publish`` hands the batch to a bounded queue and returns; when the queue
is full the batch is dropped and counted (``dropped``: these are cache
hints, never correctness). The PUB socket's high-water mark bounds what
waits for slow subscribers (ZMQ drops beyond it), and the replay socket's
fits one full replay.
"""

from __future__ import annotations

import asyncio
import queue
import socket
import threading
from collections import deque
from collections.abc import Callable

import structlog
import zmq

from kvstrata.kv.events import KVEventBatch, KVEventCodec, make_batch_decoder

log = structlog.get_logger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class ZmqEventPublisher:
    """Owns: the hand-off queue, the wake-up socket pair, the publisher
    thread and, inside that thread only, the ZMQ context and its sockets,
    the sequence counter and the ring buffer.

    ``endpoint``/``replay_endpoint`` may use a wildcard port
    (``tcp://127.0.0.1:*``); the bound addresses are in ``self.endpoint`` and
    ``self.replay_endpoint`` once ``start()`` returns.

    States: new ─start()─► running ─aclose()─► closed (also new ─aclose()─►
    closed). ``publish`` queues in "new" too (sent once started) and refuses
    once closed.
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
        wire_format: str = "vllm",
        int_hashes: bool = False,
    ) -> None:
        self.codec = KVEventCodec(wire_format, int_hashes=int_hashes)  # ValueError naming the format
        if buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {buffer_steps}")
        if max_queue_size < 1:
            raise ValueError(f"max_queue_size must be >= 1, got {max_queue_size}")
        if hwm < 1:
            raise ValueError(f"hwm must be >= 1 (0 would be unbounded), got {hwm}")
        self.topic = topic.encode("utf-8")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.dropped = 0  # batches refused because the queue was full
        self.published = 0  # batches sent, the next sequence number (the thread's)
        self._buffer_steps = buffer_steps
        self._hwm = hwm
        self._queue: queue.SimpleQueue[KVEventBatch] = queue.SimpleQueue()
        self._queued = 0  # loop side: accepted batches not yet taken by the thread
        self._taken = 0  # thread side: batches taken off the queue
        self._max_queue = max_queue_size
        self._closed = False
        self._stop = False  # set on the loop, read by the thread after a wake-up
        self._thread: threading.Thread | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._ready: asyncio.Future[None] | None = None
        self._done: asyncio.Future[None] | None = None

    # -- the loop side ------------------------------------------------------------

    async def start(self) -> ZmqEventPublisher:
        """Start the thread and wait (without blocking the loop) until it has
        bound its sockets. Raises ValueError naming the endpoints when a bind
        fails (then the publisher is closed)."""
        if self._closed:
            raise RuntimeError("the kv event publisher is closed")
        if self._thread is not None:
            raise RuntimeError("the kv event publisher is already started")
        loop = asyncio.get_running_loop()
        self._ready, self._done = loop.create_future(), loop.create_future()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(
            target=self._run, args=(loop,), name="kv-event-publisher", daemon=True
        )
        self._thread.start()
        try:
            await asyncio.shield(self._ready)
        except BaseException:
            await self.aclose()
            raise
        log.info("kv_event_publisher_started", endpoint=self.endpoint, replay_endpoint=self.replay_endpoint)
        return self

    def publish(self, batch: KVEventBatch) -> bool:
        """Queue ``batch`` for sending; never blocks. False if dropped (the
        queue is full) or refused (closed)."""
        if self._closed:
            return False
        if self._queued - self._taken >= self._max_queue:
            self.dropped += 1
            return False
        self._queued += 1
        self._queue.put(batch)
        self._wake()
        return True

    @property
    def queued(self) -> int:
        """Batches accepted and not yet taken by the thread."""
        return self._queued - self._taken

    async def aclose(self, timeout: float = 5.0) -> None:
        """Send what is queued, stop the thread, close the sockets, without
        blocking the loop. Idempotent; a thread that does not end within
        ``timeout`` seconds is left behind (a daemon) and logged."""
        if self._closed:
            return
        self._closed = True
        self._stop = True
        done = self._done
        if done is not None:
            self._wake()
            try:
                async with asyncio.timeout(timeout):
                    await asyncio.shield(done)
            except TimeoutError:
                log.warning("kv_event_publisher_close_timeout", timeout_s=timeout, queued=self.queued)
            except Exception:
                pass  # the thread's failure was logged where it happened
        for s in (self._wake_w, self._wake_r):
            if s is not None:
                s.close()
        if self.dropped:
            log.warning("kv_event_publisher_dropped", dropped=self.dropped)

    async def __aenter__(self) -> ZmqEventPublisher:
        if self._thread is None:
            await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _wake(self) -> None:
        w = self._wake_w
        if w is None:
            return  # not started: the thread drains the queue when it starts
        try:
            w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # the buffer is full of wake-ups already (or closing): the thread will look

    # -- the publisher thread -----------------------------------------------------

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        ctx = zmq.Context()
        pub = replay = None
        try:
            try:
                pub = ctx.socket(zmq.PUB)
                pub.setsockopt(zmq.SNDHWM, self._hwm)
                pub.setsockopt(zmq.LINGER, 1000)
                pub.bind(self.endpoint)
                endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
                replay_endpoint = None
                if self.replay_endpoint is not None:
                    replay = ctx.socket(zmq.ROUTER)
                    replay.setsockopt(zmq.SNDHWM, self._buffer_steps + 1)  # one whole replay
                    replay.setsockopt(zmq.LINGER, 0)
                    replay.bind(self.replay_endpoint)
                    replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
            except zmq.ZMQError as e:
                err = ValueError(
                    f"cannot bind kv event sockets ({self.endpoint!r}, {self.replay_endpoint!r}): {e}"
                )
                _settle(loop, self._ready, err)
                return
            _settle(loop, self._ready, None, lambda: self._bound(endpoint, replay_endpoint))
            self._loop(pub, replay)
        except Exception as e:
            log.exception("kv_event_publisher_failed")
            _settle(loop, self._ready, e)
        finally:
            for s in (pub, replay):
                if s is not None:
                    s.close()
            ctx.term()
            _settle(loop, self._done, None)

    def _bound(self, endpoint: str, replay_endpoint: str | None) -> None:
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint  # on the loop

    def _loop(self, pub: zmq.Socket, replay: zmq.Socket | None) -> None:
        assert self._wake_r is not None
        wake = self._wake_r
        poller = zmq.Poller()
        poller.register(wake, zmq.POLLIN)
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        encode = self.codec.encode
        ring: deque[tuple[int, bytes]] = deque(maxlen=self._buffer_steps)
        topic = self.topic
        while True:
            stopping = self._stop  # read before draining: what was queued before it is sent
            while True:
                try:
                    batch = self._queue.get_nowait()
                except queue.Empty:
                    break
                self._taken += 1
                payload = encode(batch)
                seq = self.published
                pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                ring.append((seq, payload))
                self.published = seq + 1
            if stopping:
                return
            events = dict(poller.poll())
            if wake.fileno() in events or wake in events:
                _drain(wake)
            if replay is not None and replay in events:
                while replay.poll(0):
                    self._serve_replay(replay, ring)

    @staticmethod
    def _serve_replay(replay: zmq.Socket, ring: deque[tuple[int, bytes]]) -> None:
        frames = replay.recv_multipart()
        # [peer, seq] from a DEALER; [peer, b"", seq] from a REQ socket (or a
        # DEALER that adds the delimiter, as vLLM's subscribers do): answered
        # with the same envelope.
        if len(frames) == 3 and frames[1] == b"":
            envelope: tuple[bytes, ...] = (frames[0], b"")
        elif len(frames) == 2:
            envelope = (frames[0],)
        else:
            log.warning("kv_event_replay_bad_request", num_frames=len(frames))
            return
        if len(frames[-1]) != 8:
            log.warning("kv_event_replay_bad_request", start_seq_bytes=len(frames[-1]))
            return
        start = int.from_bytes(frames[-1], "big")
        for seq, payload in ring:
            if seq >= start:
                replay.send_multipart((*envelope, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((*envelope, END_OF_REPLAY, b""))


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(4096):
            pass
    except (BlockingIOError, OSError):
        pass


def _settle(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None] | None,
            error: BaseException | None, then: Callable[[], None] | None = None) -> None:
    """From the thread: resolve ``fut`` on its loop (after running ``then``
    there); nothing if the loop is gone or the future already settled."""
    if fut is None:
        return

    def settle() -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            if then is not None:
                then()
            fut.set_result(None)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass  # the loop is closed: nobody waits


def request_replay(
    ctx: zmq.Context, replay_endpoint: str, start_seq: int, timeout_ms: int = 5000
) -> list[tuple[int, KVEventBatch]]:
    """Ask a publisher's replay socket for every buffered batch from
    ``start_seq`` on (a helper for subscribers; blocking, for their threads).
    Reads either wire shape and either hash kind."""
    decoder = make_batch_decoder()
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
