"""The engine side of the ZMQ transport: one ROUTER socket, many clients.

    clients (DEALER) ──▶ ROUTER ──▶ EngineServer ──▶ engine (AsyncEngine API)
                    ◀── one Outputs batch per client per engine step ◀──

A step's outputs for one client go out as one frame: the engine hands every
output of a step to its request's sink (``AsyncEngine.submit``) within one
loop iteration, the sink appends it to its client's buffer, and a single
flush (``call_soon``) sends each buffer after them. No task per request.

Bad frames (oversized, malformed msgpack, wrong types, unknown tags, unknown
request ids) get a ``ProtocolError`` back to that client only, are counted
and logged (rate-limited), and change nothing else. A ``Utility`` whose call
does not decode (an unknown call, bad arguments) is one too, and its caller
also gets a ``UtilityError(BAD_CALL)`` for its ``call_id``, so it never waits.

Utility calls are typed (``protocol.Call``), dispatched with ``match``; each
is answered with its own result type or a ``UtilityError`` with an
``ErrorCode`` (never an exception's text to match on).

Requests arrive as token ids (the client tokenized them) and outputs leave
as token ids (the client detokenizes): the server does no text work. It
checks each request once more (``validate_request``): any local process
may connect, and a bad id must not reach the model.

Flow control: the ROUTER's send high-water mark bounds each client's queue
inside ZMQ. A send that finds it full raises ``zmq.Again`` (ROUTER_MANDATORY)
instead of blocking or dropping: the frame goes to that client's backlog, in
order, and later frames queue behind it. The backlog is flushed when the
socket's FD fires (the client read some), never by a timer. A client whose
backlog passes ``max_backlog_bytes``, or does not move for
``stall_timeout_s``, is dropped: its requests are aborted in the engine, its
backlog is replaced by one frame that ends each of its streams with
finish_reason "abort" and an error saying why, and this is logged once.

A client that disconnects has its requests aborted. libzmq's ROUTER_NOTIFY
is a draft option (absent from pyzmq's wheels), so the server maps each
client's connection fd (the first frame's ZMQ_SRCFD) to its identity and
watches the socket monitor's DISCONNECTED events, which carry that fd. The
monitor is drained before a new fd is mapped, so a disconnect is always
handled before a later connection that reuses its fd number.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import time
from collections import OrderedDict, deque
from collections.abc import Coroutine
from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
import zmq
import zmq.utils.monitor

from kvstrata.config_io import redact_secrets
from kvstrata.enginecore.processing import validate_request
from kvstrata.enginecore.request import EngineRequest
from kvstrata.errors import EngineDeadError, EngineOverloadedError, RequestError
from kvstrata.ipc import protocol as P
from kvstrata.ipc.access import curve_server, peer_uid
from kvstrata.ipc.kv_feed import KVEventFeed, KVSubscriptions, new_epoch
from kvstrata.ipc.zmq_io import ZmqReader
from kvstrata.types import RequestOutput

if TYPE_CHECKING:  # the engine (torch) is imported after the socket is bound
    from kvstrata.enginecore.async_engine import AsyncEngine

log = structlog.get_logger(__name__)

_RECENT_FINISHED = 4096  # per client: aborts racing a finish are not errors
_ERROR_LOG_EVERY = 100


class _Client:
    """Owns: one client's live request ids, recently finished ids, the
    outputs buffered for the next flush, the encoded frames ZMQ refused
    (its backlog, in order), its protocol error count."""

    __slots__ = ("identity", "fd", "requests", "recent", "pending", "num_errors", "backlog",
                 "backlog_bytes", "num_unblocked", "stall_timer", "farewell", "refused", "received")

    def __init__(self, identity: bytes, fd: int) -> None:
        self.identity = identity
        self.fd = fd
        self.requests: set[str] = set()
        self.recent: OrderedDict[str, None] = OrderedDict()
        self.pending: list[RequestOutput] = []
        self.num_errors = 0
        self.backlog: deque[bytes] = deque()
        self.backlog_bytes = 0
        self.num_unblocked = 0  # backlog frames sent so far: the stall check's progress mark
        self.stall_timer: asyncio.TimerHandle | None = None
        # Requests aborted because the client did not read: the backlog's
        # first frame ends their streams; their own abort outputs are dropped.
        self.farewell: dict[str, bool] = {}  # request id -> its abort output still to come
        self.refused = False  # a peer of another user (ipc): everything it sends is ignored
        self.received = 0  # AddRequest frames taken in (the load reports' ``received``)

    def finished(self, rid: str) -> None:
        self.requests.discard(rid)
        self.recent[rid] = None
        if len(self.recent) > _RECENT_FINISHED:
            self.recent.popitem(last=False)


class EngineServer:
    """Owns: the ROUTER socket, the client table, the request-id → client
    routing table, the flush schedule, the set of backlogged clients and the
    protocol error counters. The engine itself is owned by the caller
    (``engine_proc.main``)."""

    def __init__(self, address: str, config_builtins: dict[str, Any],  # Any: a config tree of plain values
                 credentials: P.Credentials, *,
                 max_frame_bytes: int = P.DEFAULT_MAX_FRAME_BYTES, send_hwm: int = P.SEND_HWM,
                 recv_hwm: int = P.RECV_HWM, max_backlog_bytes: int = P.MAX_CLIENT_BACKLOG_BYTES,
                 stall_timeout_s: float = P.CLIENT_STALL_TIMEOUT_S, allowed_uid: int | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self.address = address
        # What the handshake tells any client: never a secret (Redis passwords, ...).
        self._config = client_view(config_builtins)
        self.max_frame_bytes = max_frame_bytes
        self.max_backlog_bytes = max_backlog_bytes
        self.stall_timeout_s = stall_timeout_s
        self._engine: AsyncEngine | None = None
        self.epoch = new_epoch()  # this engine start (a router fences older epochs' blocks)
        self._kv: KVSubscriptions | None = None  # with the engine's KV events on
        self._clients: dict[bytes, _Client] = {}
        self._by_fd: dict[int, _Client] = {}
        self._routes: dict[str, _Client] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._deferred_handshakes: list[tuple[bytes, int]] = []
        self._flush_scheduled = False
        self._backlogged: dict[bytes, _Client] = {}
        self.num_frames_held = 0  # frames a full client queue refused at first (sent later, in order)
        self.num_clients_dropped = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = P.make_inbound_decoder()
        self._header = P.make_header_decoder()
        self.num_protocol_errors = 0
        self.stopped = asyncio.Event()
        self.stop_reason = ""
        self._started = time.monotonic()
        self._owner_token = credentials.owner_token
        self._auth = None
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        for opt, val in ((zmq.ROUTER_MANDATORY, 1), (zmq.SNDHWM, send_hwm), (zmq.RCVHWM, recv_hwm),
                         (zmq.LINGER, 0), (zmq.MAXMSGSIZE, 4 * max_frame_bytes)):
            self._sock.setsockopt(opt, val)
        if address.startswith("tcp://"):
            self._auth = curve_server(self._sock, credentials)
        # ipc://: besides the 0700 directory, each client's connection is
        # checked (SO_PEERCRED on its fd) before its first message is handled.
        self._check_peer_uid = address.startswith("ipc://")
        self._uid = os.getuid() if allowed_uid is None else allowed_uid  # the engine's own user
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._monitor_reader = ZmqReader(self._loop, self._monitor, self._on_monitor)
        self._sock.bind(address)
        self._reader = ZmqReader(self._loop, self._sock, self._on_message, copy=False,
                                 on_drained=self._flush_backlogs)
        self._monitor_reader.start()
        self._reader.start()
        log.info("engine_server_listening", address=address)

    def attach(self, engine: AsyncEngine, kv_feed: KVEventFeed | None = None) -> None:
        """The engine is ready: answer the handshakes that were waiting.
        ``kv_feed``: the engine's KV events sink, served to subscribers."""
        self._engine = engine
        if kv_feed is not None:
            self._kv = KVSubscriptions(kv_feed, engine, send=self._send, send_encoded=self._send_encoded,
                                       received=self._received)
            self._spawn(self._kv.report_load())
        for identity, call_id in self._deferred_handshakes:
            self._send(identity, P.UtilityResult(call_id, self._info()))
        self._deferred_handshakes.clear()

    def stop(self, reason: str) -> None:
        if not self.stopped.is_set():
            self.stop_reason = reason
            self.stopped.set()

    async def close(self, reason: str) -> None:
        """Tell every client the engine is gone, cancel pending utility tasks, close."""
        self._reader.stop()
        self._monitor_reader.stop()
        self._flush()
        self._flush_backlogs()
        dead = self._encoder.encode(P.EngineDead(reason))
        for identity, client in self._clients.items():
            _cancel_stall_timer(client)
            try:  # the last word, ahead of any backlog: the client fails fast either way
                self._sock.send_multipart((identity, dead), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=1000)
        if self._auth is not None:
            self._auth.stop()
        log.info("engine_server_closed", reason=reason, num_protocol_errors=self.num_protocol_errors)

    # --- inbound ----------------------------------------------------------------

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        client = self._clients.get(identity)
        if client is None:
            client = self._new_client(identity, frames[0].get(zmq.SRCFD))
        if client.refused:
            return  # never an answer, not even an error
        if len(frames) != 2:
            return self._protocol_error(client, f"expected one frame per message, got {len(frames) - 1}")
        frame = frames[1].buffer
        if len(frame) > self.max_frame_bytes:
            return self._protocol_error(client, f"frame of {len(frame)} bytes exceeds the limit of {self.max_frame_bytes}")
        try:
            msg = self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return self._bad_frame(client, frame, e)
        match msg:
            case P.AddRequest():
                client.received += 1
                self._add(client, msg)
            case P.AbortRequests(request_ids=ids):
                self._abort(client, ids)
            case P.Utility(call_id=call_id, call=call):
                self._utility(client, call_id, call)
            case P.Shutdown(reason=reason, token=token):
                if not self._owner_token or not hmac.compare_digest(token, self._owner_token):
                    return self._protocol_error(client, "shutdown refused: only the engine's owner may stop it")
                log.info("engine_shutdown_requested", reason=reason)
                self.stop(f"shutdown requested by a client ({reason})")

    def _add(self, client: _Client, req: P.AddRequest) -> None:
        rid = req.request_id
        if self._engine is None:
            return self._protocol_error(client, "engine not ready: wait for the handshake")
        if rid in self._routes:
            return self._send(client.identity, P.RequestRejected(rid, "duplicate", f"request_id {rid!r} is already in flight", "request_id"))
        self._routes[rid] = client
        client.requests.add(rid)
        self._submit(client, req)

    def _abort(self, client: _Client, ids: list[str]) -> None:
        mine = [rid for rid in ids if self._routes.get(rid) is client]
        unknown = [rid for rid in ids if self._routes.get(rid) is not client and rid not in client.recent]
        if mine and self._engine is not None:
            self._spawn(self._abort_all(mine))
        if unknown:
            self._protocol_error(client, f"abort of unknown request ids: {unknown[:8]}")

    def _bad_frame(self, client: _Client, frame: memoryview, error: msgspec.MsgspecError) -> None:
        """A frame that did not decode: a protocol error; when it is a
        ``Utility`` (its call unknown or its arguments bad), its caller gets
        a ``BAD_CALL`` error too, for the call id it waits on."""
        self._protocol_error(client, f"undecodable message: {error}")
        try:
            header = self._header.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if header.tag == "utility":
            self._send(client.identity, P.UtilityError(header.call_id, P.ErrorCode.BAD_CALL, f"bad call: {error}"))

    def _utility(self, client: _Client, call_id: int, call: P.Call) -> None:
        identity = client.identity
        match call:
            case P.Handshake():
                if self._engine is None:
                    self._deferred_handshakes.append((identity, call_id))
                else:
                    self._send(identity, P.UtilityResult(call_id, self._info()))
            case P.HealthCheck():
                self._send(identity, P.UtilityResult(call_id, self._health()))
            case P.GetKVPosition() | P.GetKVSnapshot() | P.KVSubscribe():
                if self._kv is None:
                    self._send(identity, P.UtilityError(call_id, P.ErrorCode.KV_EVENTS_OFF,
                                                        "KV events are off on this engine (cache.enable_kv_events)"))
                else:
                    self._kv.call(identity, call_id, call)
            case P.GetStats() | P.ResetPrefixCache() | P.FlushKV():
                if self._engine is None:
                    self._send(identity, P.UtilityError(call_id, P.ErrorCode.NOT_READY, "engine not ready"))
                else:
                    self._spawn(self._call_engine(identity, call_id, call))

    def _received(self, identity: bytes) -> int | None:
        """How many AddRequest frames a client has sent (None: it is gone)."""
        client = self._clients.get(identity)
        return None if client is None else client.received

    def _new_client(self, identity: bytes, fd: int) -> _Client:
        self._monitor_reader.drain_now()  # an old disconnect of this fd goes first
        client = self._clients[identity] = self._by_fd[fd] = _Client(identity, fd)
        if self._check_peer_uid:
            uid = peer_uid(fd)
            if uid != self._uid:
                client.refused = True
                log.warning("engine_client_refused", reason="peer runs as another user", peer_uid=uid)
                return client
        log.info("client_connected", num_clients=len(self._clients))
        return client

    def _on_monitor(self, frames: list[bytes]) -> None:
        event = zmq.utils.monitor.parse_monitor_message(frames)
        client = self._by_fd.get(event["value"])
        if client is not None:
            self._client_gone(client, "disconnected")

    def _client_gone(self, client: _Client, reason: str) -> None:
        if self._clients.get(client.identity) is not client:
            return
        del self._clients[client.identity]
        if self._by_fd.get(client.fd) is client:
            del self._by_fd[client.fd]
        self._backlogged.pop(client.identity, None)
        if self._kv is not None:
            self._kv.drop(client.identity)
        _cancel_stall_timer(client)
        rids = list(client.requests)
        for rid in rids:
            self._routes.pop(rid, None)
        if rids and self._engine is not None:
            self._spawn(self._abort_all(rids))
        log.info("client_gone", reason=reason, aborted_requests=len(rids))

    def _protocol_error(self, client: _Client, message: str) -> None:
        client.num_errors += 1
        self.num_protocol_errors += 1
        if client.num_errors == 1 or client.num_errors % _ERROR_LOG_EVERY == 0:
            log.warning("client_protocol_error", message=message[:300], client_errors=client.num_errors,
                        total_errors=self.num_protocol_errors)
        self._send(client.identity, P.ProtocolError(message[:1000], client.num_errors))

    # --- engine work ---------------------------------------------------------------

    def _submit(self, client: _Client, msg: P.AddRequest) -> None:
        engine = self._engine
        assert engine is not None
        rid = msg.request_id
        req = EngineRequest(request_id=rid, prompt_token_ids=msg.prompt_token_ids, sampling_params=msg.params,
                            priority=msg.priority, cache_salt=msg.cache_salt, lora_name=msg.lora_name,
                            block_hashes=msg.block_hashes)
        try:
            validate_request(req, engine.facts)
            engine.submit(req, partial(self._on_output, client, rid))
        except RequestError as e:
            text = str(e).removeprefix(f"{e.field}: ")  # the client's RequestError adds it back
            self._reject(client, P.RequestRejected(rid, "invalid", text, e.field))
        except EngineOverloadedError as e:
            self._reject(client, P.RequestRejected(rid, "overloaded", str(e)))
        except EngineDeadError as e:
            self.stop(f"engine died: {e}")
        else:
            return
        self._request_done(client, rid)

    def _on_output(self, client: _Client, rid: str, out: RequestOutput | BaseException) -> None:
        """The engine's sink for one request: buffer for this iteration's flush."""
        if isinstance(out, BaseException):  # EngineDeadError: the engine is gone
            self._request_done(client, rid)
            self.stop(f"engine died: {out}")
            return
        if out.finished:
            self._request_done(client, rid)
        if rid in client.farewell:
            if out.finished:
                client.farewell[rid] = False
            return  # its stream ends in the farewell frame
        client.pending.append(out)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _request_done(self, client: _Client, rid: str) -> None:
        if self._routes.get(rid) is client:
            del self._routes[rid]
        client.finished(rid)

    def _reject(self, client: _Client, msg: P.RequestRejected) -> None:
        log.info("request_rejected", request_id=msg.request_id, kind=msg.kind, field=msg.field or None)
        self._send(client.identity, msg)

    async def _abort_all(self, rids: list[str]) -> None:
        engine = self._engine
        assert engine is not None
        for rid in rids:
            await engine.abort(rid)

    async def _call_engine(self, identity: bytes, call_id: int,
                           call: P.GetStats | P.ResetPrefixCache | P.FlushKV) -> None:
        engine = self._engine
        assert engine is not None
        result: P.Result
        try:
            match call:
                case P.GetStats():
                    result = P.StatsResult(await engine.stats())
                case P.ResetPrefixCache():
                    result = P.PrefixCacheReset(await engine.reset_prefix_cache())
                case P.FlushKV(timeout_s=timeout_s):
                    try:
                        await engine.flush_kv(timeout_s)
                    except TimeoutError:
                        self._send(identity, P.UtilityError(call_id, P.ErrorCode.TIMEOUT,
                                                            f"KV transfers still pending after {timeout_s}s"))
                        return
                    result = P.Flushed()
        except EngineDeadError as e:
            self.stop(f"engine died: {e}")
            return
        except Exception as e:  # reported to the caller; the engine keeps serving
            log.exception("utility_call_failed", call=type(call).__name__)
            self._send(identity, P.UtilityError(call_id, P.ErrorCode.FAILED, f"{type(e).__name__}: {e}"))
            return
        self._send(identity, P.UtilityResult(call_id, result))

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- outbound ------------------------------------------------------------------

    def _flush(self) -> None:
        self._flush_scheduled = False
        for client in list(self._clients.values()):
            if client.pending:
                batch, client.pending = client.pending, []
                self._send(client.identity, P.Outputs(batch))

    def _send(self, identity: bytes, msg: P.Outbound) -> None:
        self._send_encoded(identity, self._encoder.encode(msg))

    def _send_encoded(self, identity: bytes, frame: bytes) -> None:
        client = self._clients.get(identity)
        if client is not None and client.backlog:
            self._hold(client, frame)  # behind what is already waiting: order is kept
        else:
            self._send_frame(identity, frame, client)

    def _send_frame(self, identity: bytes, frame: bytes, client: _Client | None) -> bool:
        """Send now; False when the client's queue is full (the frame is held) or it is gone."""
        try:
            # zero-copy only pays off for large frames
            self._sock.send_multipart((identity, frame), zmq.NOBLOCK, copy=len(frame) < 65536)
        except zmq.Again:  # the client's queue is at its high-water mark (ROUTER_MANDATORY)
            if client is not None:
                self._hold(client, frame)
            return False
        except zmq.ZMQError as e:  # EHOSTUNREACH: the peer is gone (ROUTER_MANDATORY)
            if client is not None:
                self._client_gone(client, f"unreachable: {e}")
            return False
        self._reader.kick()
        return True

    def _hold(self, client: _Client, frame: bytes) -> None:
        if not client.backlog:
            self._backlogged[client.identity] = client
            log.info("client_backpressure", client_fd=client.fd, num_requests=len(client.requests))
            self._arm_stall_timer(client)
        client.backlog.append(frame)
        client.backlog_bytes += len(frame)
        self.num_frames_held += 1
        if client.backlog_bytes > self.max_backlog_bytes:
            self._drop_slow(client, f"its backlog passed {self.max_backlog_bytes} bytes")

    def _flush_backlogs(self) -> None:
        """The socket's FD fired: retry what the clients' full queues refused."""
        if not self._backlogged:
            return
        sent = False
        for client in list(self._backlogged.values()):
            backlog = client.backlog
            while backlog:
                frame = backlog[0]
                try:
                    self._sock.send_multipart((client.identity, frame), zmq.NOBLOCK, copy=len(frame) < 65536)
                except zmq.Again:
                    break
                except zmq.ZMQError as e:
                    self._client_gone(client, f"unreachable: {e}")
                    break
                backlog.popleft()
                client.backlog_bytes -= len(frame)
                client.num_unblocked += 1
                sent = True
            if not backlog and self._backlogged.pop(client.identity, None) is not None:
                _cancel_stall_timer(client)
                client.farewell = {rid: live for rid, live in client.farewell.items() if live}
                log.info("client_unblocked", client_fd=client.fd, frames_sent_late=client.num_unblocked)
        if sent:
            self._reader.kick()  # a send may consume the FD's edge

    def _arm_stall_timer(self, client: _Client) -> None:
        client.stall_timer = self._loop.call_later(self.stall_timeout_s, self._check_stall, client,
                                                   client.num_unblocked)

    def _check_stall(self, client: _Client, mark: int) -> None:
        client.stall_timer = None
        if not client.backlog or self._clients.get(client.identity) is not client:
            return
        if client.num_unblocked == mark:
            self._drop_slow(client, f"it read nothing for {self.stall_timeout_s}s")
        else:
            self._arm_stall_timer(client)

    def _drop_slow(self, client: _Client, why: str) -> None:
        """Give up on a client that does not read: abort its requests, and
        replace its backlog by one frame that ends each of its streams (and
        those of an earlier farewell it has not read yet). Logged once per drop."""
        reason = f"dropped by the engine: {why}"
        rids = list(client.requests)
        self.num_clients_dropped += 1
        log.warning("client_dropped_slow", reason=why, client_fd=client.fd, aborted_requests=len(rids),
                    backlog_bytes=client.backlog_bytes, num_clients_dropped=self.num_clients_dropped)
        client.pending.clear()
        for rid in rids:
            self._request_done(client, rid)
            client.farewell[rid] = True
        if rids and self._engine is not None:
            self._spawn(self._abort_all(rids))
        frame = self._encoder.encode(P.Outputs([
            RequestOutput(request_id=rid, finished=True, finish_reason="abort", error=reason)
            for rid in client.farewell]))
        client.backlog.clear()
        client.backlog.append(frame)
        client.backlog_bytes = len(frame)

    def _info(self) -> P.EngineInfo:
        engine = self._engine
        return P.EngineInfo(protocol_version=P.PROTOCOL_VERSION, pid=os.getpid(), ready=engine is not None,
                            config=self._config, max_frame_bytes=self.max_frame_bytes,
                            facts=None if engine is None else engine.facts, epoch=self.epoch,
                            cache_identity=None if engine is None else engine.identity,
                            kv_events=self._kv is not None)

    def _health(self) -> P.HealthInfo:
        engine = None
        if self._engine is not None and not self._engine.is_dead:
            engine = self._engine.health_now()
        return P.HealthInfo(healthy=engine is not None and engine.healthy and not self.stopped.is_set(),
                            num_clients=len(self._clients), num_requests=len(self._routes),
                            num_protocol_errors=self.num_protocol_errors,
                            uptime_s=time.monotonic() - self._started, engine=engine)


def client_view(config_builtins: dict[str, Any]) -> dict[str, Any]:  # Any: plain config values
    """The engine config (plain data) as the handshake tells it: the
    connector's options left out (free-form, where a secret may sit under any
    key, e.g. a DSN; a client never needs them), and every other field that
    holds a secret redacted."""
    view = redact_secrets(config_builtins)
    kv = view.get("kv_transfer")
    if isinstance(kv, dict) and "options" in kv:
        kv["options"] = {}
    return view


def _cancel_stall_timer(client: _Client) -> None:
    if client.stall_timer is not None:
        client.stall_timer.cancel()
        client.stall_timer = None
