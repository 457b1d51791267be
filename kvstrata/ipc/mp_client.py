"""The multiprocess engine client: the AsyncEngine API over ZMQ.

    client = await MPEngineClient.start(EngineConfig(...))      # spawns the engine
    client = await MPEngineClient.connect("ipc:///.../engine.sock")  # another client
    async for out in client.generate("Hello", SamplingParams(max_tokens=8)): ...
    await client.abort(rid); await client.stats(); await client.reset_prefix_cache()
    await client.aclose()

Engine death is seen three ways, whichever comes first: an ``EngineDead``
message (clean shutdown, fatal engine error), the pidfd of a process this
client started, or the socket monitor's disconnect event (any client). Every
pending stream and utility call then fails with ``EngineDeadError``.
"""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import structlog
import zmq

from kvstrata.config import EngineConfig
from kvstrata.errors import EngineDeadError, EngineOverloadedError, RequestError
from kvstrata.types import EngineStats, RequestOutput, SamplingParams
from kvstrata.ipc import protocol as P
from kvstrata.ipc.addresses import EngineAddress, check_address, make_address
from kvstrata.ipc.launcher import ProcessWatch, spawn_engine, stop_process
from kvstrata.ipc.zmq_io import ZmqReader

log = structlog.get_logger(__name__)


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
    """Owns: the DEALER socket and its monitor, the reader, the streams of this
    client's in-flight requests, pending utility calls, and (when it started
    the engine) the engine process."""

    def __init__(self, sock: zmq.Socket, address: str, private: EngineAddress | None,
                 proc: subprocess.Popen | None) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock = sock
        self.address = address
        self._private = private
        self._proc = proc
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = P.make_outbound_decoder()
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._next_call = 0
        self._dead: EngineDeadError | None = None
        self._closed = False
        self.num_protocol_errors = 0
        self.info: P.EngineInfo | None = None
        self.config: EngineConfig | None = None
        self._reader = ZmqReader(self._loop, sock, self._on_message)
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._monitor_reader = ZmqReader(self._loop, self._monitor, self._on_monitor)
        self._watch = ProcessWatch(self._loop, proc, self._on_process_exit) if proc else None
        self._reader.start()
        self._monitor_reader.start()

    # --- construction ---------------------------------------------------------

    @classmethod
    async def start(cls, config: EngineConfig | None = None, *, transport: str = "ipc",
                    address: str | None = None, startup_timeout_s: float = 300.0,
                    max_frame_bytes: int | None = None) -> "MPEngineClient":
        """Spawn an engine subprocess, connect, and wait for its handshake."""
        config = config or EngineConfig()
        config.validate()
        private = None
        if address is None:
            private = make_address(transport)
            address = private.url
        proc = spawn_engine(config, check_address(address), max_frame_bytes=max_frame_bytes)
        client = cls(_dealer(address), address, private, proc)
        await client._handshake(startup_timeout_s)
        return client

    @classmethod
    async def connect(cls, address: str, *, timeout_s: float = 30.0) -> "MPEngineClient":
        """Connect to a running engine (several clients may share one)."""
        client = cls(_dealer(check_address(address)), address, None, None)
        await client._handshake(timeout_s)
        return client

    async def _handshake(self, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                raw = await self._call("handshake")
        except TimeoutError:
            await self.aclose()
            raise EngineDeadError(f"engine at {self.address} did not answer the handshake in {timeout_s}s") from None
        except BaseException:
            await self.aclose()
            raise
        info = msgspec.convert(raw, P.EngineInfo)
        if info.protocol_version != P.PROTOCOL_VERSION:
            await self.aclose()
            raise EngineDeadError(f"protocol version {info.protocol_version} != {P.PROTOCOL_VERSION}")
        self.info = info
        self.config = msgspec.convert(info.config, EngineConfig)
        log.info("engine_connected", address=self.address, engine_pid=info.pid)

    async def __aenter__(self) -> "MPEngineClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- the AsyncEngine API ---------------------------------------------------

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                       request_id: str | None = None, priority: int = 0,
                       cache_salt: str | None = None,
                       lora_name: str | None = None) -> AsyncIterator[RequestOutput]:
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise EngineDeadError("client is closed")
        _check_prompt(prompt)
        if params is not None:
            try:
                params.validate()
            except ValueError as e:
                raise RequestError(str(e).split(" ", 1)[0], str(e)) from None
        rid = request_id if request_id is not None else uuid.uuid4().hex
        if rid in self._streams:
            raise RequestError("request_id", f"{rid!r} is already in flight")
        frame = self._encoder.encode(P.AddRequest(rid, prompt, params, priority, cache_salt, lora_name))
        if self.info is not None and len(frame) > self.info.max_frame_bytes:
            raise RequestError("prompt", f"request of {len(frame)} bytes exceeds the engine's frame limit")
        stream = self._streams[rid] = _Stream()
        finished = False
        try:
            self._send(frame)
            while True:
                if not stream.items:
                    if stream.error is not None:
                        raise stream.error
                    stream.waiter = self._loop.create_future()
                    await stream.waiter
                    stream.waiter = None
                    continue
                items, stream.items = stream.items, []
                for out in items:
                    if out.finished:
                        finished = True
                    yield out
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished and stream.error is None and self._dead is None and not self._closed:
                self._send(self._encoder.encode(P.AbortRequests([rid])))

    async def abort(self, request_id: str) -> None:
        """Abort one request of this client; unknown or finished ids are a no-op."""
        stream = self._streams.get(request_id)
        if stream is None or self._dead is not None or self._closed:
            return
        self._send(self._encoder.encode(P.AbortRequests([request_id])))

    async def stats(self) -> EngineStats:
        return msgspec.convert(await self._call("stats"), EngineStats)

    async def reset_prefix_cache(self) -> bool:
        return bool(await self._call("reset_prefix_cache"))

    async def health(self) -> P.HealthInfo:
        return msgspec.convert(await self._call("health"), P.HealthInfo)

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    async def shutdown_engine(self) -> None:
        """Ask the engine to stop (every client's requests end with EngineDeadError)."""
        if self._dead is None and not self._closed:
            self._send(self._encoder.encode(P.Shutdown()))

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
                    self._send(self._encoder.encode(P.Shutdown("owner_closed")))
                await stop_process(self._proc, self._watch.exited, grace_s=10.0)
        finally:
            self._mark_dead("client closed")
            self._teardown()

    # --- internals ------------------------------------------------------------

    async def _call(self, method: str) -> Any:
        if self._dead is not None:
            raise self._dead
        self._next_call += 1
        call_id = self._next_call
        fut = self._calls[call_id] = self._loop.create_future()
        try:
            self._send(self._encoder.encode(P.Utility(call_id, method)))
            return await fut
        finally:
            self._calls.pop(call_id, None)

    def _send(self, frame: bytes) -> None:
        try:
            self._sock.send(frame, zmq.NOBLOCK, copy=len(frame) < 65536)
        except zmq.ZMQError as e:
            self._mark_dead(f"send failed: {e}")
            raise self._dead from None  # type: ignore[misc]
        self._reader.kick()

    def _on_message(self, frames: list[bytes]) -> None:
        try:
            msg = self._decoder.decode(frames[-1])
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.num_protocol_errors += 1
            log.error("engine_message_undecodable", error=str(e))
            return
        match msg:
            case P.Outputs(outputs=outputs):
                streams = self._streams
                for out in outputs:
                    s = streams.get(out.request_id)
                    if s is not None:
                        s.put(out)
            case P.UtilityResult(call_id=call_id, result=result, error=error):
                fut = self._calls.get(call_id)
                if fut is not None and not fut.done():
                    if error is None:
                        fut.set_result(result)
                    else:
                        fut.set_exception(RuntimeError(f"utility call failed: {error}"))
            case P.RequestRejected():
                self._on_rejected(msg)
            case P.ProtocolError(message=message, num_errors=n):
                self.num_protocol_errors += 1
                log.warning("engine_protocol_error", message=message, num_errors=n)
            case P.EngineDead(reason=reason):
                self._mark_dead(reason)

    def _on_rejected(self, msg: P.RequestRejected) -> None:
        s = self._streams.get(msg.request_id)
        if s is None:
            return
        if msg.kind == "overloaded":
            limit = self.config.scheduler.max_waiting_requests if self.config else 0
            s.fail(EngineOverloadedError(limit))
        else:
            field = msg.field or ("request_id" if msg.kind == "duplicate" else "request")
            s.fail(RequestError(field, msg.message))

    def _on_monitor(self, frames: list[bytes]) -> None:
        self._mark_dead(f"connection to {self.address} lost")

    def _on_process_exit(self, code: int | None) -> None:
        self._mark_dead(f"engine process exited with code {code}")

    def _mark_dead(self, reason: str) -> None:
        if self._dead is not None:
            return
        self._dead = EngineDeadError(f"engine is dead ({reason})")
        if not self._closed:
            log.error("engine_dead", reason=reason, pending_requests=len(self._streams))
        for s in self._streams.values():
            s.fail(self._dead)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(self._dead)
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


def _dealer(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    if address.startswith("tcp://"):
        # ZMTP pings catch a peer whose host or network vanished without a
        # FIN/RST (a killed process closes its sockets: the monitor sees that).
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    sock.connect(address)
    return sock


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt", "must not be empty")
        return
    if not isinstance(prompt, list) or not prompt:
        raise RequestError("prompt", "must be a non-empty string or list of token ids")
    if not all(type(t) is int and t >= 0 for t in prompt):
        raise RequestError("prompt", "token ids must be non-negative integers")
