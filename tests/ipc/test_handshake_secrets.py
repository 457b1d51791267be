"""The handshake never carries a secret: an engine subprocess configured with
a Redis tier password (in free-form tier options) tells clients its config
without the connector's options (and with any other secret field redacted);
no byte a client receives contains it."""

from __future__ import annotations

import msgspec

from kvstrata.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig
from kvstrata.config_io import REDACTED, redact_secrets
from kvstrata.ipc.addresses import make_address
from kvstrata.ipc.launcher import spawn_engine
from kvstrata.ipc.mp_client import MPEngineClient
from kvstrata.ipc.protocol import Credentials

SECRET = "hunter2-do-not-leak"


def _config() -> EngineConfig:
    redis = {"type": "redis", "name": "redis",
             "options": {"host": "127.0.0.1", "port": 1, "password": SECRET, "connect_timeout_s": 0.2}}
    store = {"cpu": {"capacity_bytes": 1 << 20, "pin_memory": False}, "tiers": [redis]}
    # the default (seeded random, tiny) model: the null executor runs no connector
    return EngineConfig(device="cpu", log_level="WARNING", model=ModelConfig(max_model_len=256),
                        cache=CacheConfig(num_blocks=64),
                        kv_transfer=KVTransferConfig(connector="offload", options={"store": store}))


def test_redaction_reaches_every_depth_and_spares_ordinary_fields():
    data = msgspec.to_builtins(_config())
    red = redact_secrets(data)
    assert SECRET not in repr(red)
    assert red["kv_transfer"]["options"]["store"]["tiers"][0]["options"]["password"] == REDACTED
    assert red["scheduler"] == data["scheduler"] and red["model"] == data["model"]
    assert redact_secrets({"api_token": "x", "max_tokens": 3, "tokenizer": "t"}) == \
        {"api_token": REDACTED, "max_tokens": 3, "tokenizer": "t"}


async def test_the_handshake_and_health_carry_no_secret():
    addr = make_address("ipc")
    proc = spawn_engine(_config(), addr.url, Credentials.new(curve=False))
    try:
        async with await MPEngineClient.connect(addr.url, timeout_s=60) as client:
            received = msgspec.msgpack.encode(client.info) + msgspec.msgpack.encode(await client.health())
            assert SECRET.encode() not in received
            assert SECRET not in repr(client.config)
            assert client.config.kv_transfer.connector == "offload"  # told; its options are not
            assert client.config.kv_transfer.options == {}
        import asyncio

        assert SECRET.encode() not in await asyncio.to_thread(_raw_handshake_bytes, addr.url)
    finally:
        proc.terminate()
        proc.wait(10)
        addr.cleanup()


def _raw_handshake_bytes(address: str) -> bytes:
    """Every byte a hand-made DEALER receives for its handshake (the raw
    frame, before any decoding a client would do)."""
    import zmq

    from kvstrata.ipc import protocol as P

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send(msgspec.msgpack.encode(P.Utility(1, P.Handshake())))
        assert sock.poll(60_000), "the engine did not answer the handshake"
        return b"".join(sock.recv_multipart())
    finally:
        sock.close()


async def test_free_form_connector_options_never_reach_a_client():
    """A connector's options are free-form: a secret under a key no rule
    knows (a DSN with a password; the noop connector takes any options, as
    a third-party one may) must not reach a client either. The client does
    not need them: the raw handshake frame carries none."""
    import asyncio

    dsn = f"redis://:{SECRET}@127.0.0.1:1/0"
    cfg = EngineConfig(device="cpu", log_level="WARNING", model=ModelConfig(max_model_len=256),
                       cache=CacheConfig(num_blocks=64),
                       kv_transfer=KVTransferConfig(connector="noop", options={"dsn": dsn, "note": "x"}))
    addr = make_address("ipc")
    proc = spawn_engine(cfg, addr.url, Credentials.new(curve=False))
    try:
        raw = await asyncio.to_thread(_raw_handshake_bytes, addr.url)
        assert SECRET.encode() not in raw
        assert b"noop" in raw  # the connector's name is told, its options are not
    finally:
        proc.terminate()
        proc.wait(10)
        addr.cleanup()
