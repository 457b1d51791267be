"""The engine subprocess through real ZMQ sockets: streaming, abort, several
clients, a client that goes away, rejected requests, the handshake."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvstrata.enginecore.async_engine import AsyncEngine
from kvstrata.enginecore.processing import ModelFacts
from kvstrata.errors import RequestError
from kvstrata.types import EngineStats, SamplingParams
from kvstrata.ipc import protocol as P
from kvstrata.ipc.addresses import check_address, make_address
from kvstrata.ipc.mp_client import MPEngineClient

from serve_helpers import null_config

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


async def _collect(engine, prompt, params=GREEDY, **kw):
    return [o async for o in engine.generate(prompt, params, **kw)]


async def _settled(client, timeout_s: float = 10.0):
    """Stats once the engine holds no request (bounded wait, never a hang)."""
    async with asyncio.timeout(timeout_s):
        while True:
            stats = await client.stats()
            if stats.num_running == 0 and stats.num_waiting == 0:
                return stats
            await asyncio.sleep(0.02)


async def test_generate_streams_the_same_outputs_as_in_process(engine_url):
    engine = await AsyncEngine.start(null_config())
    try:
        local = await _collect(engine, "hello world", request_id="a")
    finally:
        await engine.aclose()
    async with await MPEngineClient.connect(engine_url) as client:
        remote = await _collect(client, "hello world", request_id="a")
        remote_ids = await _collect(client, [104, 105, 106], request_id="b")
    assert remote == local
    assert [len(o.new_token_ids) for o in remote] == [1] * 6
    assert remote[-1].finished and remote[-1].finish_reason == "length"
    assert all(not o.finished for o in remote[:-1])
    assert remote_ids[-1].num_prompt_tokens == 3 and sum(len(o.new_token_ids) for o in remote_ids) == 6


async def test_handshake_reports_config_and_health(engine_url):
    async with await MPEngineClient.connect(engine_url) as client:
        assert client.config == null_config()
        assert client.info.ready and client.info.pid != os.getpid()
        health = await client.health()
        assert health.healthy and health.num_clients >= 1
        assert await client.reset_prefix_cache() is True


async def test_abort_ends_the_stream_with_abort(engine_url):
    async with await MPEngineClient.connect(engine_url) as client:
        params = SamplingParams(max_tokens=8000, ignore_eos=True)
        outs = []
        async for out in client.generate("x", params, request_id="long"):
            outs.append(out)
            if len(outs) == 1:
                await client.abort("long")
                await client.abort("never-existed")  # no-op, as in process
        assert outs[-1].finished and outs[-1].finish_reason == "abort"
        assert sum(len(o.new_token_ids) for o in outs) < 8000
        await _settled(client)
        assert client.num_protocol_errors == 0


async def test_leaving_the_stream_aborts_the_request(engine_url):
    async with await MPEngineClient.connect(engine_url) as client:
        before = await client.stats()
        async for _ in client.generate("y", SamplingParams(max_tokens=8000, ignore_eos=True)):
            break
        after = await _settled(client)
        assert after.num_generated_tokens - before.num_generated_tokens < 8000
        assert (await client.health()).num_requests == 0


async def test_several_clients_share_one_engine(engine_url):
    clients = await asyncio.gather(*(MPEngineClient.connect(engine_url) for _ in range(3)))
    try:
        async def run(c, k):
            results = await asyncio.gather(*(
                _collect(c, f"client {k} request {i}", SamplingParams(max_tokens=3 + i, ignore_eos=True))
                for i in range(5)))
            return [sum(len(o.new_token_ids) for o in r) for r in results]

        counts = await asyncio.gather(*(run(c, k) for k, c in enumerate(clients)))
        assert counts == [[3, 4, 5, 6, 7]] * 3
        assert (await clients[0].health()).num_clients >= 3
    finally:
        for c in clients:
            await c.aclose()


async def test_duplicate_request_id_is_rejected_naming_the_field(engine_url):
    a = await MPEngineClient.connect(engine_url)
    b = await MPEngineClient.connect(engine_url)
    try:
        gen = a.generate("z", SamplingParams(max_tokens=8000, ignore_eos=True), request_id="same")
        await anext(gen)
        with pytest.raises(RequestError) as e:
            await _collect(b, "z", request_id="same")
        assert e.value.field == "request_id"
        await gen.aclose()
    finally:
        await a.aclose()
        await b.aclose()


async def test_engine_side_validation_error_names_the_field(engine_url):
    async with await MPEngineClient.connect(engine_url) as client:
        with pytest.raises(RequestError) as e:
            await _collect(client, [10**7])  # beyond the vocabulary: only the engine knows
        assert e.value.field == "prompt" and "token ids must be in" in str(e.value)
        with pytest.raises(RequestError) as e:
            await _collect(client, "x", SamplingParams(max_tokens=0))
        assert e.value.field == "max_tokens"
        assert len(await _collect(client, "still serving")) == 6


_CHILD = """
import asyncio, sys
from kvstrata.types import SamplingParams
from kvstrata.ipc.mp_client import MPEngineClient
from kvstrata.logs import configure_logging
configure_logging("WARNING")
async def main():
    c = await MPEngineClient.connect(sys.argv[1])
    gens = [c.generate("child %d" % i, SamplingParams(max_tokens=8000, ignore_eos=True)) for i in range(32)]
    for g in gens:
        await anext(g)
    print("streaming", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


async def test_a_client_that_goes_away_has_its_requests_aborted(engine_url):
    async with await MPEngineClient.connect(engine_url) as watcher:
        before = await watcher.stats()
        child = subprocess.Popen([sys.executable, "-c", _CHILD, engine_url], stdout=subprocess.PIPE)
        try:
            line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 30)
            assert line == b"streaming\n"
            child.kill()  # no goodbye: the socket just closes
        finally:
            child.kill()
            child.wait()
            child.stdout.close()
        after = await _settled(watcher)
        generated = after.num_generated_tokens - before.num_generated_tokens
        assert generated < 32 * 8000  # they were aborted, not run to the end
        assert (await watcher.health()).num_requests == 0


def test_ipc_address_lives_in_a_private_directory():
    addr = make_address("ipc")
    try:
        mode = stat.S_IMODE(os.stat(addr.private_dir).st_mode)
        assert mode == 0o700
        assert addr.url == f"ipc://{addr.private_dir}/engine.sock"
    finally:
        addr.cleanup()
    assert not os.path.exists(addr.private_dir)
    assert make_address("tcp").url.startswith("tcp://127.0.0.1:")
    with pytest.raises(ValueError, match="loopback"):
        check_address("tcp://0.0.0.0:5555")


def test_engine_info_is_plain_data():
    from kvstrata.ipc.protocol import EngineInfo

    info = EngineInfo(protocol_version=1, pid=1, ready=True, config=msgspec.to_builtins(null_config()),
                      max_frame_bytes=10)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(info), type=EngineInfo) == info


async def test_typed_results_over_the_wire(engine_url):
    """Each call's result arrives as its own type, not as plain data."""
    async with await MPEngineClient.connect(engine_url) as client:
        assert type(await client.stats()) is EngineStats
        assert type(await client.health()) is P.HealthInfo
        assert await client.flush_kv(10.0) is None
        assert type(client.info) is P.EngineInfo and client.info.cache_identity is not None


async def test_kv_event_calls_on_an_engine_without_kv_events_raise_kv_events_off(engine_url):
    async with await MPEngineClient.connect(engine_url) as client:
        assert not client.info.kv_events
        for call in (client.kv_position, client.kv_snapshot, lambda: client.subscribe_kv_events(lambda _m: None)):
            with pytest.raises(P.KVEventsOffError, match="enable_kv_events"):
                await call()
        assert (await client.health()).healthy and not client.is_dead


@pytest.fixture
async def fake_engine():
    """A hand-made engine over real ZMQ: a ROUTER that answers the handshake
    with an EngineInfo, then each later call with the next reply the test
    queues (a function of the call id giving a message or raw bytes)."""
    addr = make_address("ipc")
    sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr.url)
    replies: asyncio.Queue = asyncio.Queue()
    dec, enc = P.make_inbound_decoder(), msgspec.msgpack.Encoder()
    info = P.EngineInfo(protocol_version=P.PROTOCOL_VERSION, pid=0, ready=True,
                        config=msgspec.to_builtins(null_config()), max_frame_bytes=1 << 20,
                        facts=ModelFacts(max_model_len=1024, vocab_size=258))

    async def serve() -> None:
        while True:
            identity, frame = await sock.recv_multipart()
            msg = dec.decode(frame)
            if not isinstance(msg, P.Utility):
                continue
            if isinstance(msg.call, P.Handshake):
                reply = P.UtilityResult(msg.call_id, info)
            else:
                reply = (await replies.get())(msg.call_id)
            await sock.send_multipart([identity, reply if isinstance(reply, bytes) else enc.encode(reply)])

    task = asyncio.create_task(serve())
    try:
        yield addr.url, replies
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        sock.close(linger=0)
        addr.cleanup()


_EXCEPTION_OF = {
    P.ErrorCode.NOT_READY: P.EngineNotReadyError,
    P.ErrorCode.KV_EVENTS_OFF: P.KVEventsOffError,
    P.ErrorCode.BAD_CALL: P.BadCallError,
    P.ErrorCode.TIMEOUT: P.CallTimeoutError,
    P.ErrorCode.FAILED: P.CallFailedError,
}


@pytest.mark.parametrize("code", list(P.ErrorCode), ids=lambda c: c.value)
async def test_an_error_code_raises_its_own_exception_on_the_client(fake_engine, code):
    url, replies = fake_engine
    client = await MPEngineClient.connect(url)
    try:
        await replies.put(lambda cid: P.UtilityError(cid, code, "the engine's words"))
        with pytest.raises(RuntimeError, match="the engine's words") as e:
            await client.stats()
        assert type(e.value) is _EXCEPTION_OF[code]
        assert isinstance(e.value, TimeoutError) == (code is P.ErrorCode.TIMEOUT)
        await replies.put(lambda cid: P.UtilityResult(cid, P.StatsResult(EngineStats(num_running=3))))
        assert (await client.stats()).num_running == 3 and not client.is_dead  # one call failed, nothing else
    finally:
        await client.aclose()


async def test_flush_kv_past_its_timeout_is_a_timeout_error(fake_engine):
    url, replies = fake_engine
    async with await MPEngineClient.connect(url) as client:
        await replies.put(lambda cid: P.UtilityError(cid, P.ErrorCode.TIMEOUT, "still pending"))
        with pytest.raises(TimeoutError, match="still pending"):
            await client.flush_kv(0.5)


async def test_a_result_of_another_type_or_an_undecodable_one_fails_the_call(fake_engine):
    """The engine answering a call with the wrong result type, or in another
    protocol version's shape, fails that call at once (it never hangs)."""
    url, replies = fake_engine
    async with await MPEngineClient.connect(url) as client:
        await replies.put(lambda cid: P.UtilityResult(cid, P.Flushed()))
        with pytest.raises(P.BadCallError, match="Flushed"):
            await client.stats()
        await replies.put(lambda cid: msgspec.msgpack.encode(["result", cid, {"num_running": 1}]))  # v4's shape
        async with asyncio.timeout(5):
            with pytest.raises(P.BadCallError, match="undecodable"):
                await client.stats()
        assert not client.is_dead


async def test_a_fleet_clients_chain_crosses_the_wire_and_the_engine_does_not_rehash(engine_url):
    from kvstrata.enginecore.request import EngineRequest
    from kvstrata.kv.hashing import CacheIdentity
    from kvstrata.router.hashes import PromptHasher

    async with await MPEngineClient.connect(engine_url) as client:
        hasher = PromptHasher(msgspec.convert(client.info.cache_identity, CacheIdentity))
        prompt = list(range(100, 100 + 3 * client.config.cache.block_size + 5))
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        before = (await client.stats()).extra
        first = EngineRequest(request_id="own", prompt_token_ids=prompt, sampling_params=params)
        [o async for o in client.generate_request(first)]
        given = msgspec.structs.replace(first, request_id="given", block_hashes=hasher.hash_prompt(prompt))
        outs = [o async for o in client.generate_request(given)]
        wrong = msgspec.structs.replace(first, request_id="wrong", block_hashes=given.block_hashes[:1])
        [o async for o in client.generate_request(wrong)]
        after = (await _settled(client)).extra
    assert outs[-1].num_cached_tokens == 3 * client.config.cache.block_size  # the chain is the engine's own
    assert after["engine.given_chains"] - before["engine.given_chains"] == 1
    assert after["engine.given_chains_refused"] - before["engine.given_chains_refused"] == 1


async def test_on_dead_tells_each_callback_once_when_the_engine_goes(tmp_path):
    from kvstrata.ipc.launcher import spawn_engine
    from kvstrata.ipc.protocol import Credentials

    addr = make_address("ipc")
    proc = spawn_engine(null_config(), addr.url, Credentials.new(curve=False))
    try:
        heard: list[str] = []
        async with await MPEngineClient.connect(addr.url) as client:
            client.on_dead(heard.append)
            proc.kill()
            proc.wait(10)
            async with asyncio.timeout(20):
                while not heard:
                    await asyncio.sleep(0.02)
            late: list[str] = []
            client.on_dead(late.append)  # already dead: told at once
            await asyncio.sleep(0.05)
            assert len(heard) == 1 and "connection" in heard[0] and late == heard
    finally:
        if proc.poll() is None:
            proc.kill()
        addr.cleanup()


async def test_on_dead_is_not_told_when_our_own_client_closes(engine_url):
    closed: list[str] = []
    async with await MPEngineClient.connect(engine_url) as client:
        client.on_dead(closed.append)
    await asyncio.sleep(0.05)
    assert closed == []
