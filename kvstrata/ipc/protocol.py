"""Wire messages between engine clients and the engine subprocess.

Every frame is one msgpack-encoded msgspec Struct from a tagged union, decoded
by one typed decoder and dispatched with ``match``:

    client (DEALER) ── Inbound ──▶  engine (ROUTER)
        AddRequest | AbortRequests | Utility(call_id, Call) | Shutdown
    client (DEALER) ◀── Outbound ── engine (ROUTER)
        Outputs (one batch per engine step and client)
        | UtilityResult(call_id, Result) | UtilityError(call_id, ErrorCode, message)
        | RequestRejected | ProtocolError | EngineDead | KVEvents | LoadReport

Requests and outputs carry token ids only: the client tokenizes, checks,
detokenizes and applies stop strings (``kvstrata.enginecore.processing``).

A utility call is a typed ``Call`` wrapped in a ``Utility`` with the
client's ``call_id``; it is answered by one ``UtilityResult`` holding the
call's own result type, or one ``UtilityError`` with an ``ErrorCode`` the
client maps to an exception (``call_error``):

    Handshake        -> EngineInfo (sent once the engine is ready)
    HealthCheck      -> HealthInfo
    GetStats         -> StatsResult
    ResetPrefixCache -> PrefixCacheReset
    FlushKV          -> Flushed            | TIMEOUT
    GetKVPosition    -> KVPosition         | KV_EVENTS_OFF
    GetKVSnapshot    -> KVSnapshot         | KV_EVENTS_OFF
    KVSubscribe      -> KVPosition, then KVEvents and LoadReport frames | KV_EVENTS_OFF

Any call may also fail with NOT_READY (engine work before the engine is
up) or FAILED (the engine raised). A ``Utility`` whose call does not
decode (an unknown call, bad arguments) is a protocol error, answered with
BAD_CALL too so the caller does not wait; the engine keeps serving.
``KVSubscribe`` makes the engine send its KV events as ``KVEvents`` frames
(``kvstrata.ipc.kv_feed``) and its queued work as ``LoadReport`` frames
(when it changes, at most every ``LOAD_REPORT_INTERVAL_S``): every router
sees the load all routers put on the engine.

Both sides bound their queues (ZMQ high-water marks, counted in messages):
a send that finds a peer's queue full raises ``zmq.Again``, and the sender
keeps a bounded backlog for that peer, flushed when the peer drains (see
``kvstrata.ipc.engine_server`` and ``mp_client``).
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, ClassVar

import msgspec

from kvstrata.config import EngineConfig
from kvstrata.enginecore.processing import ModelFacts
from kvstrata.kv.hashing import CacheIdentity
from kvstrata.types import EngineHealth, EngineLoad, EngineStats, RequestOutput, SamplingParams

# 5: typed utility calls, results and error codes (4: string-keyed methods).
PROTOCOL_VERSION = 5
# Frames larger than this are rejected with a ProtocolError (the engine never
# decodes them). A generous bound: a 1M-token prompt as msgpack ints is ~5 MiB.
DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024

# How often, at most, an engine reports its load to the clients that
# subscribed to its KV events (only when it changed).
LOAD_REPORT_INTERVAL_S = 0.02
# An unchanged load is reported again this often; a router takes a report
# older than LOAD_REPORT_STALE_S as stale (its own counts stand in).
LOAD_REPORT_REFRESH_S = 1.0
LOAD_REPORT_STALE_S = 3.0

# High-water marks (messages) of the engine's ROUTER and each client's
# DEALER, both ways. The engine sends one Outputs frame per step and client,
# so SEND_HWM frames are that many steps of backlog inside ZMQ.
SEND_HWM = 1000
RECV_HWM = 1000
# What the engine keeps for one client beyond ZMQ's queue (encoded bytes)
# before it gives up on that client: aborts its requests and drops it.
MAX_CLIENT_BACKLOG_BYTES = 64 * 1024 * 1024
# A client whose backlog has not moved for this long is dropped the same way.
CLIENT_STALL_TIMEOUT_S = 30.0
# What a client holds when the engine does not read fast enough (encoded
# bytes): beyond it, generate waits for the outbox to drain.
MAX_OUTBOX_BYTES = 64 * 1024 * 1024


class _Wire(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False, tag_field="t"):
    """Base of every wire message: positional msgpack arrays, tag first."""


# --- inbound (client -> engine) -------------------------------------------


class AddRequest(_Wire, tag="add"):
    """A request the client tokenized and checked; the engine checks it again
    (``validate_request``) because any local process may connect."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = SamplingParams()
    priority: int = 0
    cache_salt: str | None = None
    lora_name: str | None = None
    # The prompt's block hash chain from a fleet client's router (see
    # EngineRequest.block_hashes); every client is authenticated (ipc: the
    # engine's uid; tcp: the owner's CURVE key), so the engine trusts it.
    block_hashes: list[bytes] | None = None


class AbortRequests(_Wire, tag="abort"):
    request_ids: list[str]


# --- utility calls (inside a Utility) ---------------------------------------


class Handshake(_Wire, tag="handshake"):
    """-> EngineInfo, sent once the engine is ready (the call waits till then)."""


class HealthCheck(_Wire, tag="health"):
    """-> HealthInfo (answered while the engine starts too)."""


class GetStats(_Wire, tag="stats"):
    """-> StatsResult."""


class ResetPrefixCache(_Wire, tag="reset_prefix_cache"):
    """-> PrefixCacheReset."""


class FlushKV(_Wire, tag="flush_kv"):
    """-> Flushed once every KV transfer started so far is done; TIMEOUT
    after ``timeout_s``."""

    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0


class GetKVPosition(_Wire, tag="kv_position"):
    """-> KVPosition of the engine's KV event stream."""


class GetKVSnapshot(_Wire, tag="kv_snapshot"):
    """-> KVSnapshot: every cache's content now."""


class KVSubscribe(_Wire, tag="kv_subscribe"):
    """-> KVPosition, then the buffered KVEvents from ``start_seq``, then
    each later batch and the engine's LoadReports."""

    start_seq: Annotated[int, msgspec.Meta(ge=0)] = 0


Call = Handshake | HealthCheck | GetStats | ResetPrefixCache | FlushKV | GetKVPosition | GetKVSnapshot | KVSubscribe


class Utility(_Wire, tag="utility"):
    call_id: int
    call: Call


class Shutdown(_Wire, tag="shutdown"):
    """Ask the engine to stop now (no draining): every client gets EngineDead
    and its pending requests fail with EngineDeadError. Obeyed only with the
    owner's ``token`` (the one that started the engine holds it); anyone
    else's is a protocol error and the engine keeps serving."""

    reason: str = "client_requested"
    token: str = ""


Inbound = AddRequest | AbortRequests | Utility | Shutdown


# --- outbound (engine -> client) ------------------------------------------


class Outputs(_Wire, tag="outputs"):
    """All outputs of one engine step for one client, in engine order."""

    outputs: list[RequestOutput]


# --- utility results (inside a UtilityResult) -----------------------------


class EngineInfo(_Wire, kw_only=True, tag="info"):
    """The handshake result: what the engine runs and whether it is ready.
    ``facts`` is what a client needs to check its requests (the engine's
    max_model_len after capping by its KV pool, its vocabulary)."""

    protocol_version: int
    pid: int
    ready: bool
    # EngineConfig as plain data, secrets redacted and the connector's
    # free-form options left out (``engine_server.client_view``): not an
    # EngineConfig, since a redacted field need not pass its checks.
    config: dict[str, Any]  # Any: a config tree of plain values
    max_frame_bytes: int
    facts: ModelFacts | None = None
    # One engine start: a router fences blocks of older epochs.
    epoch: int = 0
    # What a router hashes prompts with; None while the engine is starting.
    cache_identity: CacheIdentity | None = None
    # Whether the KV event calls are served (cache.enable_kv_events).
    kv_events: bool = False


class HealthInfo(_Wire, kw_only=True, tag="health"):
    healthy: bool
    num_clients: int
    num_requests: int
    num_protocol_errors: int
    uptime_s: float
    engine: EngineHealth | None = None  # None while the engine is starting


class StatsResult(_Wire, tag="stats"):
    stats: EngineStats


class PrefixCacheReset(_Wire, tag="reset"):
    """``reset``: False when blocks were in use (nothing was reset)."""

    reset: bool


class Flushed(_Wire, tag="flushed"):
    """Every KV transfer started before the FlushKV call is done."""


class KVPosition(_Wire, tag="kv_position"):
    """Where an engine's KV event stream is: this engine start's ``epoch``,
    the next batch's number and the oldest one its replay ring holds."""

    epoch: int
    next_seq: int
    oldest_seq: int


class KVSnapshot(_Wire, tag="kv_snapshot"):
    """``payload``: a msgpack KVEventBatch of every cache's content now,
    consistent with the stream up to ``next_seq - 1``."""

    epoch: int
    next_seq: int
    oldest_seq: int
    payload: bytes


Result = EngineInfo | HealthInfo | StatsResult | PrefixCacheReset | Flushed | KVPosition | KVSnapshot


class UtilityResult(_Wire, tag="result"):
    call_id: int
    result: Result


class ErrorCode(enum.Enum):
    """Why a utility call failed; each maps to one exception (``call_error``)."""

    NOT_READY = "not_ready"  # engine work asked for before the engine is up
    KV_EVENTS_OFF = "kv_events_off"  # a KV event call on an engine without cache.enable_kv_events
    BAD_CALL = "bad_call"  # an unknown call or bad arguments (also a ProtocolError)
    TIMEOUT = "timeout"  # FlushKV's timeout passed
    FAILED = "failed"  # the engine raised; ``message`` says what


class UtilityError(_Wire, tag="call_error"):
    call_id: int
    code: ErrorCode
    message: str = ""


class RequestRejected(_Wire, tag="rejected"):
    """An AddRequest that was not queued. ``kind`` is "invalid" (a bad field,
    named in ``message``), "overloaded" (the waiting queue is full) or
    "duplicate" (the request id is already running)."""

    request_id: str
    kind: str
    message: str
    field: str = ""


class ProtocolError(_Wire, tag="protocol_error"):
    """A frame the engine could not accept: malformed msgpack, wrong field
    types, an oversized frame, an unknown tag or an unknown request id.
    ``num_errors`` is the running count for this client."""

    message: str
    num_errors: int


class EngineDead(_Wire, tag="dead"):
    reason: str


class KVEvents(_Wire, tag="kv_events"):
    """One engine step's KV events for a client that subscribed
    (``KVSubscribe(start_seq)``; ``kvstrata.ipc.kv_feed``):
    ``payload`` is the msgpack ``KVEventBatch`` as vLLM's publisher sends it,
    ``seq`` its number (from 0, no gaps, per ``epoch``: one engine start)."""

    epoch: int
    seq: int
    payload: bytes


class LoadReport(_Wire, tag="load"):
    """The engine's queued work for a client that subscribed to its KV
    events (a router), sent when it changed, at most every
    ``LOAD_REPORT_INTERVAL_S``, and unchanged every ``LOAD_REPORT_REFRESH_S``:
    ``load`` is every client's work, ``received``
    how many of *this* client's AddRequest frames the engine has taken in
    (so the router knows which of its own dispatches the load includes)."""

    epoch: int
    load: EngineLoad
    received: int


Outbound = Outputs | UtilityResult | UtilityError | RequestRejected | ProtocolError | EngineDead | KVEvents | LoadReport


class UtilityCallError(RuntimeError):
    """A utility call the engine answered with an ``ErrorCode``. A
    RuntimeError, as every utility failure was before codes."""

    code: ClassVar[ErrorCode] = ErrorCode.FAILED


class EngineNotReadyError(UtilityCallError):
    code = ErrorCode.NOT_READY


class KVEventsOffError(UtilityCallError):
    code = ErrorCode.KV_EVENTS_OFF


class BadCallError(UtilityCallError):
    code = ErrorCode.BAD_CALL


class CallTimeoutError(UtilityCallError, TimeoutError):
    code = ErrorCode.TIMEOUT


class CallFailedError(UtilityCallError):
    code = ErrorCode.FAILED


CALL_ERRORS: dict[ErrorCode, type[UtilityCallError]] = {
    cls.code: cls for cls in (EngineNotReadyError, KVEventsOffError, BadCallError, CallTimeoutError, CallFailedError)}


def call_error(msg: UtilityError) -> UtilityCallError:
    """The exception a client raises for ``msg``."""
    return CALL_ERRORS[msg.code](msg.message or msg.code.value)


class CallHeader(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The first two fields of a frame: enough to answer a ``Utility`` whose
    call did not decode (its ``call_id`` is the second field)."""

    tag: str
    call_id: int


def make_inbound_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Inbound)


def make_outbound_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Outbound)


def make_header_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CallHeader)


class Credentials(msgspec.Struct, frozen=True, kw_only=True):
    """Secrets of one engine, made by the owner that starts it and handed to
    the engine through its stdin pipe (never argv, never a log, never the
    wire). ``owner_token``: what a Shutdown must carry. Over tcp:// the
    engine is a ZMQ CURVE server (``server_*``) admitting only the client
    key ``client_public``; clients use ``client_*`` (z85 text keys)."""

    owner_token: str
    server_public: str | None = None
    server_secret: str | None = None
    client_public: str | None = None
    client_secret: str | None = None

    @classmethod
    def new(cls, *, curve: bool) -> "Credentials":
        import secrets

        import zmq

        if not curve:
            return cls(owner_token=secrets.token_hex(16))
        spub, ssec = zmq.curve_keypair()
        cpub, csec = zmq.curve_keypair()
        return cls(owner_token=secrets.token_hex(16), server_public=spub.decode(), server_secret=ssec.decode(),
                   client_public=cpub.decode(), client_secret=csec.decode())

    @property
    def curve(self) -> bool:
        return self.server_public is not None

    def for_engine(self) -> "Credentials":
        """What the engine needs: not the client's secret key."""
        return msgspec.structs.replace(self, client_secret=None)

    def for_client(self) -> "Credentials":
        """What another client of the same owner needs to connect (not to shut down)."""
        return msgspec.structs.replace(self, owner_token="", server_secret=None)


class Launch(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine process reads from its stdin: config and credentials."""

    config: EngineConfig
    credentials: Credentials
