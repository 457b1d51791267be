"""The multiprocess engine client: the ``EngineClient`` API over ZMQ.

    client = await MPEngineClient.start(EngineConfig(...))      # spawns the engine
    client = await MPEngineClient.connect("ipc:///.../engine.sock")  # another client
    async for out in client.generate("Hello", SamplingParams(max_tokens=8)): ...
    await client.abort(rid); await client.stats(); await client.reset_prefix_cache()
    await client.aclose()

Text work happens here, in the client process, as in vLLM: the input
processor tokenizes and checks a request (the tokenizer is loaded from the
model config the handshake reports), the wire carries token ids both ways,
and each stream's output processor detokenizes and applies stop strings,
aborting the request in the engine when one matches.

Flow control: the DEALER's high-water marks bound ZMQ's queues. A send the
socket refuses (``zmq.Again``: the engine is not reading fast enough) waits
in an outbox, in order, flushed when the socket's FD fires; ``generate``
waits for room when the outbox holds more than ``max_outbox_bytes``.

Utility calls are typed (``protocol.Call``); each returns its own result
type, and an engine's ``UtilityError`` becomes the exception its
``ErrorCode`` names (``protocol.call_error``: ``KVEventsOffError``,
``CallTimeoutError``, ...; all RuntimeErrors).

Engine death is seen three ways, whichever comes first: an ``EngineDead``
message (clean shutdown, fatal engine error), the pidfd of a process this
client started, or the socket monitor's disconnect event (any client). Every
pending stream and utility call then fails with ``EngineDeadError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TypeVar, Unpack

import msgspec
import structlog
import zmq

from kvstrata.config import EngineConfig
from kvstrata.enginecore.client import GenerateOptions, generate_chat, served_model_name
from kvstrata.enginecore.processing import InputProcessor, ModelFacts, OutputProcessor
from kvstrata.enginecore.request import EngineRequest
from kvstrata.errors import EngineDeadError, EngineOverloadedError, RequestError
from kvstrata.ipc import protocol as P
from kvstrata.text.prompts import Prompt
from kvstrata.text.tokenizer import Tokenizer, load_model_tokenizer
from kvstrata.types import EngineHealth, EngineStats, RequestOutput, SamplingParams
from kvstrata.ipc.addresses import EngineAddress, check_address, make_address
from kvstrata.ipc.launcher import ProcessWatch, spawn_engine, stop_process
from kvstrata.ipc.zmq_io import ZmqReader

log = structlog.get_logger(__name__)

R = TypeVar("R", bound=P.Result)


class _Stream:
    """One request's undelivered outputs. Owns: its buffer and waiter."""

    __slots__ = ("items", "waiter", "error")

    def __init__(self) -> None:
        self.items: list[RequestOutput] = []
        self.waiter: asyncio.Future[None] | None = None
        self.error: BaseException | None = None

    def put(self, out: RequestOutput) -> None:
        self.items.append(out)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)


class MPEngineClient:
    """Owns: the DEALER socket and its monitor, the reader, the outbox, the
    streams of this client's in-flight requests, pending utility calls, the
    input processor (with the tokenizer), and (when it started the engine)
    the engine process."""

    def __init__(self, sock: zmq.Socket, address: str, private: EngineAddress | None,
                 proc: subprocess.Popen | None, *, credentials: P.Credentials | None = None,
                 max_outbox_bytes: int = P.MAX_OUTBOX_BYTES) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock = sock
        # The owner's (it started the engine) hold the shutdown token.
        self.credentials = credentials
        self.address = address
        self._private = private
        self._proc = proc
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = P.make_outbound_decoder()
        self._header = P.make_header_decoder()
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, asyncio.Future[P.Result]] = {}
        self._next_call = 0
        self._dead: EngineDeadError | None = None
        self._on_dead: list[Callable[[str], None]] = []  # told once, on the loop, when the engine is seen dead
        self._closed = False
        self.num_protocol_errors = 0
        self._kv_listener: Callable[[P.KVEvents], None] | None = None
        self._load_listener: Callable[[P.LoadReport], None] | None = None
        self.num_requests_sent = 0  # AddRequest frames sent (a LoadReport's ``received`` counts them there)
        self.info: P.EngineInfo | None = None
        self._config: EngineConfig | None = None
        self._inputs: InputProcessor | None = None  # set by the handshake
        self._outbox: deque[bytes] = deque()
        self._outbox_bytes = 0
        self.max_outbox_bytes = max_outbox_bytes
        self._room: list[asyncio.Future[None]] = []  # generate calls waiting for the outbox to drain
        self._reader = ZmqReader(self._loop, sock, self._on_message, on_drained=self._flush_outbox)
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._monitor_reader = ZmqReader(self._loop, self._monitor, self._on_monitor)
        self._watch = ProcessWatch(self._loop, proc, self._on_process_exit) if proc else None
        self._reader.start()
        self._monitor_reader.start()

    # --- construction ---------------------------------------------------------

    @classmethod
    async def start(cls, config: EngineConfig | None = None, *, transport: str = "ipc",
                    address: str | None = None, startup_timeout_s: float = 300.0,
                    max_frame_bytes: int | None = None, wrapper: Sequence[str] = ()) -> "MPEngineClient":
        """Spawn an engine subprocess, connect, and wait for its handshake.
        ``wrapper``: a command the engine process runs under (``spawn_engine``)."""
        config = config or EngineConfig()
        config.validate()
        private = None
        if address is None:
            private = make_address(transport)
            address = private.url
        address = check_address(address)
        credentials = P.Credentials.new(curve=address.startswith("tcp://"))
        proc = spawn_engine(config, address, credentials, max_frame_bytes=max_frame_bytes, wrapper=wrapper)
        client = cls(_dealer(address, credentials=credentials), address, private, proc, credentials=credentials)
        await client._handshake(startup_timeout_s)
        return client

    @classmethod
    async def connect(cls, address: str, *, timeout_s: float = 30.0, hwm: int = P.SEND_HWM,
                      max_outbox_bytes: int = P.MAX_OUTBOX_BYTES,
                      credentials: P.Credentials | None = None) -> "MPEngineClient":
        """Connect to a running engine (several clients may share one). Over
        tcp:// ``credentials`` (the owner's ``credentials.for_client()``) are
        required: the engine answers nobody else."""
        address = check_address(address, allow_remote=credentials is not None and credentials.curve)
        if address.startswith("tcp://") and (credentials is None or not credentials.curve):
            raise ValueError(f"connecting to {address} needs the engine's CURVE credentials")
        client = cls(_dealer(address, hwm, credentials=credentials), address, None, None,
                     credentials=credentials, max_outbox_bytes=max_outbox_bytes)
        await client._handshake(timeout_s)
        return client

    async def _handshake(self, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                info = await self._call(P.Handshake(), P.EngineInfo)
        except TimeoutError:
            await self.aclose()
            raise EngineDeadError(f"engine at {self.address} did not answer the handshake in {timeout_s}s") from None
        except BaseException:
            await self.aclose()
            raise
        try:
            if info.protocol_version != P.PROTOCOL_VERSION or info.facts is None:
                raise EngineDeadError(f"protocol version {info.protocol_version} != {P.PROTOCOL_VERSION}")
            config = msgspec.convert(info.config, EngineConfig)
            tokenizer = await asyncio.to_thread(load_model_tokenizer, config.model)  # file I/O
        except BaseException:
            await self.aclose()
            raise
        self.info = info
        self._config = config
        self._inputs = InputProcessor(info.facts, tokenizer)
        log.info("engine_connected", address=self.address, engine_pid=info.pid)

    async def __aenter__(self) -> "MPEngineClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- model facts (EngineClient) ------------------------------------------

    @property
    def config(self) -> EngineConfig:
        """The engine's configuration, as its handshake told it: the
        connector's options left out, other secret fields redacted."""
        assert self._config is not None, "the handshake sets it"
        return self._config

    @property
    def facts(self) -> ModelFacts:
        assert self._inputs is not None, "the handshake sets it"
        return self._inputs.facts

    @property
    def model_name(self) -> str:
        return served_model_name(self.config)

    @property
    def max_model_len(self) -> int:
        return self.facts.max_model_len

    def chat(self, messages: Sequence[object], params: SamplingParams | None = None,
             **kwargs: Unpack[GenerateOptions]) -> AsyncGenerator[RequestOutput, None]:
        return generate_chat(self, messages, params, **kwargs)

    @property
    def tokenizer(self) -> Tokenizer | None:
        assert self._inputs is not None, "the handshake sets it"
        return self._inputs.tokenizer

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def outbox_bytes(self) -> int:
        """Encoded bytes the socket refused so far (the engine reads slower
        than this client sends), waiting to go out in order."""
        return self._outbox_bytes

    async def is_healthy(self) -> bool:
        return (await self.health()).healthy

    async def check_health(self) -> EngineHealth:
        info = await self.health()
        if info.engine is None:
            return EngineHealth(healthy=False, status="starting", reason="the engine is still starting")
        return info.engine

    # --- the EngineClient API --------------------------------------------------

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, *,
                       request_id: str | None = None, priority: int = 0,
                       cache_salt: str | None = None, lora_name: str | None = None,
                       session_key: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        """EngineClient.generate (``session_key``: for a fleet's routing; one engine ignores it)."""
        self._check_alive()
        assert self._inputs is not None
        req = await self._inputs.process(prompt, params, request_id=request_id, priority=priority,
                                         cache_salt=cache_salt, lora_name=lora_name)
        async with contextlib.aclosing(self.generate_request(req)) as agen:
            async for out in agen:
                yield out

    async def generate_request(self, req: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request already made and checked by an ``InputProcessor``
        holding this engine's facts (a fleet processes each request once for
        all its replicas). The engine checks it again: it trusts no client."""
        self._check_alive()
        assert self._inputs is not None and self.info is not None
        rid = req.request_id
        frame = self._encoder.encode(P.AddRequest(rid, req.prompt_token_ids, req.sampling_params, req.priority,
                                                  req.cache_salt, req.lora_name, req.block_hashes))
        if len(frame) > self.info.max_frame_bytes:
            raise RequestError("prompt", f"request of {len(frame)} bytes exceeds the engine's frame limit")
        while self._outbox_bytes > self.max_outbox_bytes:  # the engine reads slower than we send: wait
            room: asyncio.Future[None] = self._loop.create_future()
            self._room.append(room)
            await room
        self._check_alive()
        if rid in self._streams:
            raise RequestError("request_id", f"{rid!r} is already in flight")
        outputs = OutputProcessor(self._inputs.tokenizer, req)
        stream = self._streams[rid] = _Stream()
        try:
            self._send(frame)
            self.num_requests_sent += 1
            while True:
                if not stream.items:
                    if stream.error is not None:
                        raise stream.error
                    stream.waiter = self._loop.create_future()
                    await stream.waiter
                    stream.waiter = None
                    continue
                items, stream.items = stream.items, []
                for item in items:
                    out = outputs.process(item)
                    yield out
                    if out.finished:
                        return
        finally:
            self._streams.pop(rid, None)
            # Still live in the engine: the consumer left, or a stop string ended the stream.
            engine_live = outputs.engine_still_running or not outputs.finished
            if engine_live and stream.error is None and self._dead is None and not self._closed:
                self._send(self._encoder.encode(P.AbortRequests([rid])))

    async def abort(self, request_id: str) -> None:
        """Abort one request of this client; unknown or finished ids are a no-op."""
        stream = self._streams.get(request_id)
        if stream is None or self._dead is not None or self._closed:
            return
        self._send(self._encoder.encode(P.AbortRequests([request_id])))

    async def stats(self) -> EngineStats:
        return (await self._call(P.GetStats(), P.StatsResult)).stats

    async def reset_prefix_cache(self) -> bool:
        return (await self._call(P.ResetPrefixCache(), P.PrefixCacheReset)).reset

    async def flush_kv(self, timeout_s: float = 60.0) -> None:
        """Wait until the engine's KV transfers started so far are done;
        ``CallTimeoutError`` (a TimeoutError) when they are not within ``timeout_s``."""
        await self._call(P.FlushKV(timeout_s), P.Flushed)

    @property
    def _owner_token(self) -> str:
        return self.credentials.owner_token if self.credentials is not None else ""

    async def health(self) -> P.HealthInfo:
        return await self._call(P.HealthCheck(), P.HealthInfo)

    async def subscribe_kv_events(self, listener: Callable[[P.KVEvents], None], start_seq: int = 0, *,
                                  load_listener: Callable[[P.LoadReport], None] | None = None) -> P.KVPosition:
        """Receive the engine's KV events: ``listener`` is called on this loop
        with each ``KVEvents`` (the buffered ones from ``start_seq`` first,
        then each step's), and ``load_listener`` with each ``LoadReport``
        (the engine's queued work, sent to subscribers when it changes).
        Returns the engine's ``KVPosition`` (epoch, next_seq, oldest_seq) at
        subscription; ``KVEventsOffError`` (a
        RuntimeError) when the engine runs without ``cache.enable_kv_events``.
        Calling it again re-subscribes (a replay from another ``start_seq``)."""
        self._kv_listener = listener
        self._load_listener = load_listener
        return await self._call(P.KVSubscribe(start_seq), P.KVPosition)

    async def kv_position(self) -> P.KVPosition:
        """The engine's KV event stream: epoch, next_seq, and oldest_seq (the
        oldest batch its replay ring still holds)."""
        return await self._call(P.GetKVPosition(), P.KVPosition)

    async def kv_snapshot(self) -> P.KVSnapshot:
        """Every cache of the engine now (``payload``: a msgpack KVEventBatch
        of BlockStored events, consistent with the stream up to
        ``next_seq - 1``)."""
        return await self._call(P.GetKVSnapshot(), P.KVSnapshot)

    async def shutdown_engine(self) -> None:
        """Ask the engine to stop (every client's requests end with EngineDeadError)."""
        if self._dead is None and not self._closed:
            self._send(self._encoder.encode(P.Shutdown(token=self._owner_token)))

    async def aclose(self) -> None:
        """Abort this client's requests, stop the engine if this client started
        it, close the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._dead is None and self._streams:
                self._send(self._encoder.encode(P.AbortRequests(list(self._streams))))
            if self._proc is not None and self._watch is not None:
                if self._dead is None:
                    self._send(self._encoder.encode(P.Shutdown("owner_closed", token=self._owner_token)))
                await stop_process(self._proc, self._watch.exited, grace_s=10.0)
        finally:
            self._mark_dead("client closed")
            self._teardown()

    # --- internals ------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise EngineDeadError("client is closed")

    async def _call(self, call: P.Call, result_type: type[R]) -> R:
        """Send one utility call; its result, which must be ``result_type``
        (anything else is the engine breaking the protocol: ``BadCallError``).
        An engine's ``UtilityError`` raises its code's exception."""
        if self._dead is not None:
            raise self._dead
        self._next_call += 1
        call_id = self._next_call
        fut = self._calls[call_id] = self._loop.create_future()
        try:
            self._send(self._encoder.encode(P.Utility(call_id, call)))
            result = await fut
        finally:
            self._calls.pop(call_id, None)
        if not isinstance(result, result_type):
            raise P.BadCallError(f"{type(call).__name__} answered with a {type(result).__name__}, "
                                 f"not a {result_type.__name__}")
        return result

    def _send(self, frame: bytes) -> None:
        if not self._outbox:
            try:
                self._sock.send(frame, zmq.NOBLOCK, copy=len(frame) < 65536)
            except zmq.Again:  # the engine's queue is full (high-water mark): hold it
                pass
            except zmq.ZMQError as e:
                self._mark_dead(f"send failed: {e}")
                raise self._dead from None  # type: ignore[misc]
            else:
                self._reader.kick()
                return
        self._outbox.append(frame)  # behind what already waits: order is kept
        self._outbox_bytes += len(frame)

    def _flush_outbox(self) -> None:
        """The socket's FD fired: send what the full queue refused."""
        outbox = self._outbox
        if not outbox:
            return
        sent = False
        while outbox:
            frame = outbox[0]
            try:
                self._sock.send(frame, zmq.NOBLOCK, copy=len(frame) < 65536)
            except zmq.Again:
                break
            except zmq.ZMQError as e:
                self._mark_dead(f"send failed: {e}")
                return
            outbox.popleft()
            self._outbox_bytes -= len(frame)
            sent = True
        if sent:
            self._reader.kick()
            if self._outbox_bytes <= self.max_outbox_bytes:
                self._wake_room()

    def _wake_room(self) -> None:
        room, self._room = self._room, []
        for fut in room:
            if not fut.done():
                fut.set_result(None)

    def _on_message(self, frames: list[bytes]) -> None:
        try:
            msg = self._decoder.decode(frames[-1])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.num_protocol_errors += 1
            log.error("engine_message_undecodable", error=str(e))
            self._fail_call(frames[-1], e)
            return
        match msg:
            case P.Outputs(outputs=outputs):
                streams = self._streams
                for out in outputs:
                    s = streams.get(out.request_id)
                    if s is not None:
                        s.put(out)
            case P.UtilityResult(call_id=call_id, result=result):
                fut = self._calls.get(call_id)
                if fut is not None and not fut.done():
                    fut.set_result(result)
            case P.UtilityError(call_id=call_id):
                fut = self._calls.get(call_id)
                if fut is not None and not fut.done():
                    fut.set_exception(P.call_error(msg))
            case P.RequestRejected():
                self._on_rejected(msg)
            case P.ProtocolError(message=message, num_errors=n):
                self.num_protocol_errors += 1
                log.warning("engine_protocol_error", message=message, num_errors=n)
            case P.EngineDead(reason=reason):
                self._mark_dead(reason)
            case P.KVEvents():
                if self._kv_listener is not None:
                    self._kv_listener(msg)
            case P.LoadReport():
                if self._load_listener is not None:
                    self._load_listener(msg)

    def _fail_call(self, frame: bytes, error: msgspec.MsgspecError) -> None:
        """An undecodable reply to a pending call fails that call (an engine
        of another protocol version, say) instead of leaving it waiting."""
        try:
            header = self._header.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        fut = self._calls.get(header.call_id) if header.tag in ("result", "call_error") else None
        if fut is not None and not fut.done():
            fut.set_exception(P.BadCallError(f"undecodable reply (protocol version {P.PROTOCOL_VERSION} here): {error}"))

    def _on_rejected(self, msg: P.RequestRejected) -> None:
        s = self._streams.get(msg.request_id)
        if s is None:
            return
        if msg.kind == "overloaded":
            limit = self._config.scheduler.max_waiting_requests if self._config else 0
            s.fail(EngineOverloadedError(limit))
        else:
            field = msg.field or ("request_id" if msg.kind == "duplicate" else "request")
            s.fail(RequestError(field, msg.message))

    def _on_monitor(self, frames: list[bytes]) -> None:
        self._mark_dead(f"connection to {self.address} lost")

    def _on_process_exit(self, code: int | None) -> None:
        self._mark_dead(f"engine process exited with code {code}")

    def on_dead(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` soon (on the loop) once the engine is
        seen dead (at once if it already is): an EngineDead frame, the
        connection's monitor, the process's exit or a failed send; not when
        this client closes."""
        if self._dead is not None:
            if not self._closed:
                self._loop.call_soon(callback, str(self._dead))
            return
        self._on_dead.append(callback)

    def _mark_dead(self, reason: str) -> None:
        if self._dead is not None:
            return
        self._dead = EngineDeadError(f"engine is dead ({reason})")
        callbacks, self._on_dead = self._on_dead, []
        if not self._closed:
            for callback in callbacks:
                self._loop.call_soon(callback, str(self._dead))
        if not self._closed:
            log.error("engine_dead", reason=reason, pending_requests=len(self._streams))
        for s in self._streams.values():
            s.fail(self._dead)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(self._dead)
        self._wake_room()  # they find the client dead
        self._reader.stop()
        self._monitor_reader.stop()

    def _teardown(self) -> None:
        self._reader.stop()
        self._monitor_reader.stop()
        if self._watch is not None:
            self._watch.close()
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        if self._private is not None:
            self._private.cleanup()


def _dealer(address: str, hwm: int = P.SEND_HWM, *, credentials: P.Credentials | None = None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, P.RECV_HWM)
    sock.setsockopt(zmq.LINGER, 0)
    if address.startswith("tcp://"):
        assert credentials is not None and credentials.curve and credentials.client_secret is not None
        sock.curve_serverkey = credentials.server_public.encode()  # type: ignore[union-attr]
        sock.curve_publickey = credentials.client_public.encode()  # type: ignore[union-attr]
        sock.curve_secretkey = credentials.client_secret.encode()
        # ZMTP pings catch a peer whose host or network vanished without a
        # FIN/RST (a killed process closes its sockets: the monitor sees that).
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    sock.connect(address)
    return sock

