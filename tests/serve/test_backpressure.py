"""Bounded ZMQ queues with a real slow client over real sockets: the engine
server never blocks its loop and never loses an output silently. A client
that reads late gets every output, in order; one that stays stuck is
dropped (its requests aborted, its streams ended with an error saying why,
logged once) while everyone else is served."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import structlog
import zmq
import zmq.asyncio

from kvstrata.enginecore.async_engine import AsyncEngine
from kvstrata.ipc import protocol as P
from kvstrata.ipc.addresses import make_address
from kvstrata.ipc.engine_server import EngineServer
from kvstrata.ipc.mp_client import MPEngineClient
from kvstrata.types import SamplingParams
from serve_helpers import null_config

N_REQUESTS = 8


@pytest.fixture
async def serve():
    """An engine and its ZMQ server in this loop, with tiny queues."""
    made = []

    async def start(**server_kw) -> tuple[EngineServer, str]:
        addr = make_address("ipc")
        config = null_config()
        server = EngineServer(addr.url, msgspec.to_builtins(config), P.Credentials.new(curve=False),
                              send_hwm=2, recv_hwm=2, **server_kw)
        engine = await AsyncEngine.start(config)
        server.attach(engine)
        made.append((addr, server, engine))
        return server, addr.url

    yield start
    for addr, server, engine in made:
        await server.close("test over")
        await engine.aclose()
        addr.cleanup()


def _slow_client(url: str) -> zmq.asyncio.Socket:
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 2)
    sock.setsockopt(zmq.RCVBUF, 4096)  # a small kernel buffer: the engine's queue fills soon
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    return sock


async def _send_requests(sock: zmq.asyncio.Socket, max_tokens: int) -> list[str]:
    enc = msgspec.msgpack.encode
    await sock.send(enc(P.Utility(1, P.Handshake())))
    rids = [f"slow-{i}" for i in range(N_REQUESTS)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for rid in rids:
        await sock.send(enc(P.AddRequest(rid, [104, 105, 106], params)))
    return rids


async def _read_all(sock: zmq.asyncio.Socket, rids: list[str], timeout_s: float = 60.0) -> dict[str, list]:
    """Every output of ``rids`` until each has finished."""
    dec = P.make_outbound_decoder()
    outs: dict[str, list] = {rid: [] for rid in rids}
    done: set[str] = set()
    async with asyncio.timeout(timeout_s):
        while len(done) < len(rids):
            msg = dec.decode(await sock.recv())
            if isinstance(msg, P.Outputs):
                for o in msg.outputs:
                    assert o.request_id not in done, "an output after the finished one"
                    outs[o.request_id].append(o)
                    if o.finished:
                        done.add(o.request_id)
    return outs


async def _good_client_is_served(url: str) -> None:
    async with await MPEngineClient.connect(url) as good:
        outs = [o async for o in good.generate("fine", SamplingParams(max_tokens=50, ignore_eos=True))]
        assert sum(len(o.new_token_ids) for o in outs) == 50 and outs[-1].finish_reason == "length"


async def test_a_client_that_reads_late_gets_every_output_in_order(serve):
    server, url = await serve()
    slow = _slow_client(url)
    try:
        max_tokens = 2000
        rids = await _send_requests(slow, max_tokens)
        async with asyncio.timeout(30):
            while server.num_frames_held < 50:  # its queue is full: frames wait in the backlog
                await asyncio.sleep(0.01)
        await _good_client_is_served(url)  # meanwhile the loop serves everyone else
        outs = await _read_all(slow, rids)
    finally:
        slow.close(0)
    for rid in rids:
        assert sum(len(o.new_token_ids) for o in outs[rid]) == max_tokens
        assert [o.finished for o in outs[rid]] == [False] * (len(outs[rid]) - 1) + [True]
        assert outs[rid][-1].finish_reason == "length"
    assert server.num_clients_dropped == 0


@pytest.mark.parametrize("limit", ["backlog_bytes", "stall_timeout"])
async def test_a_client_that_stays_stuck_is_dropped_and_told_why(serve, limit):
    kw = {"max_backlog_bytes": 32 * 1024} if limit == "backlog_bytes" else {"stall_timeout_s": 0.5}
    server, url = await serve(**kw)
    slow = _slow_client(url)
    try:
        with structlog.testing.capture_logs() as logs:
            rids = await _send_requests(slow, 10**6)
            async with asyncio.timeout(30):
                while server.num_clients_dropped == 0:
                    await asyncio.sleep(0.01)
            await _good_client_is_served(url)
            async with await MPEngineClient.connect(url) as watcher:
                async with asyncio.timeout(10):  # its requests were aborted in the engine
                    while (await watcher.health()).num_requests:
                        await asyncio.sleep(0.01)
        outs = await _read_all(slow, rids)  # now it reads: what was queued, then the farewell
    finally:
        slow.close(0)
    dropped = [e for e in logs if e["event"] == "client_dropped_slow"]
    assert len(dropped) == 1 and dropped[0]["aborted_requests"] == N_REQUESTS
    for rid in rids:
        last = outs[rid][-1]
        assert (last.finished, last.finish_reason) == (True, "abort")
        assert "dropped by the engine" in last.error
        assert sum(len(o.new_token_ids) for o in outs[rid]) < 10**6
    assert server.num_clients_dropped == 1


async def test_the_client_waits_for_room_while_the_engine_does_not_read():
    """The client side of the same bound, against an engine that answers the
    handshake and then reads nothing for a while."""
    from kvstrata.enginecore.processing import ModelFacts
    from kvstrata.types import RequestOutput

    addr = make_address("ipc")
    mute = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    mute.setsockopt(zmq.RCVHWM, 2)
    mute.setsockopt(zmq.RCVBUF, 4096)
    mute.setsockopt(zmq.LINGER, 0)
    mute.bind(addr.url)
    enc, dec = msgspec.msgpack.Encoder(), P.make_inbound_decoder()
    info = P.EngineInfo(protocol_version=P.PROTOCOL_VERSION, pid=0, ready=True,
                        config=msgspec.to_builtins(null_config()), max_frame_bytes=1 << 24,
                        facts=ModelFacts(max_model_len=1 << 20, vocab_size=258))

    async def handshake() -> None:
        identity, frame = await mute.recv_multipart()
        await mute.send_multipart([identity, enc.encode(P.UtilityResult(dec.decode(frame).call_id, info))])

    limit = 64 * 1024
    prompt = [65] * 20_000  # ~20 KB a request
    try:
        client, _ = await asyncio.gather(MPEngineClient.connect(addr.url, hwm=2, max_outbox_bytes=limit),
                                         handshake())
        params = SamplingParams(max_tokens=1)
        tasks = [asyncio.create_task(_first(client.generate(prompt, params, request_id=f"r{i}"))) for i in range(40)]
        await asyncio.sleep(0.3)
        assert not client.is_dead and not any(t.done() for t in tasks)
        assert 0 < client.outbox_bytes <= limit + 30_000  # bounded: the rest wait for room
        got = []
        async with asyncio.timeout(30):
            while len(got) < 40:  # the engine reads now: the outbox drains with no timer
                identity, frame = await mute.recv_multipart()
                msg = dec.decode(frame)
                assert msg.prompt_token_ids == prompt
                got.append(msg.request_id)
                out = RequestOutput(request_id=msg.request_id, new_token_ids=[66], finished=True,
                                    finish_reason="length")
                await mute.send_multipart([identity, enc.encode(P.Outputs([out]))])
            results = await asyncio.gather(*tasks)
        assert sorted(got) == sorted(f"r{i}" for i in range(40))
        assert [r.text_delta for r in results] == ["B"] * 40 and client.outbox_bytes == 0
        await client.aclose()
    finally:
        mute.close(0)
        addr.cleanup()


async def _first(agen):
    async for out in agen:
        return out
