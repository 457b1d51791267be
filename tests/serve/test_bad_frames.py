"""Bad input over the wire: each bad frame gets a ProtocolError back to its
sender only, is counted, and the engine keeps serving everyone."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvstrata.types import SamplingParams
from kvstrata.ipc import protocol as P
from kvstrata.ipc.mp_client import MPEngineClient
from serve_helpers import TEST_MAX_FRAME_BYTES

enc = msgspec.msgpack.encode


def _raw_client(url: str) -> zmq.asyncio.Socket:
    """A DEALER that speaks the wire protocol by hand (no MPEngineClient)."""
    raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(url)
    return raw


def _bad_frames() -> list[list[bytes]]:
    kinds = [
        lambda i: [b"\xc1" + bytes([i % 256])],                     # malformed msgpack
        lambda i: [enc([f"tag{i}", 1, 2])],                          # unknown tag
        lambda i: [enc(["add", i, "prompt"])],                       # request_id of the wrong type
        lambda i: [enc(["add", f"r{i}", {"not": "a prompt"}])],      # prompt of the wrong type
        lambda i: [enc(["utility", "x", "stats"])],                  # call_id of the wrong type
        lambda i: [enc(["abort", [f"nobody-{i}"]])],                 # unknown request id
        lambda i: [b"\x00" * (TEST_MAX_FRAME_BYTES + 1)],            # oversized
        lambda i: [enc(P.Outputs([]))],                              # an outbound message sent inbound
        lambda i: [b"", b""],                                        # two frames
        lambda i: [enc({"t": "add"})],                               # a map, not an array
    ]
    return [kinds[i % len(kinds)](i) for i in range(1000)]


async def test_1000_malformed_frames_then_still_serving(engine_url):
    raw = _raw_client(engine_url)
    good = await MPEngineClient.connect(engine_url)
    try:
        before = (await good.health()).num_protocol_errors
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        during = asyncio.create_task(_count_tokens(good, params))
        for frames in _bad_frames():
            await raw.send_multipart(frames)
        dec = P.make_outbound_decoder()
        replies = []
        async with asyncio.timeout(30):
            while len(replies) < 1000:
                replies.append(dec.decode(await raw.recv()))
        assert all(isinstance(r, P.ProtocolError) for r in replies)
        assert [r.num_errors for r in replies] == list(range(1, 1001))
        assert "exceeds the limit" in replies[6].message
        assert "unknown request ids" in replies[5].message
        assert await during == 200
        assert await _count_tokens(good, params) == 200
        health = await good.health()
        assert health.healthy
        assert health.num_protocol_errors - before == 1000
        assert good.num_protocol_errors == 0  # nothing leaked to the well-behaved client
    finally:
        raw.close(linger=0)
        await good.aclose()


@pytest.mark.parametrize("call,why", [
    (["format_disk"], "format_disk"),          # a call the engine does not know
    (["kv_subscribe", -1], ">= 0"),            # a known call with a bad argument
    (["flush_kv", "soon"], "float"),           # an argument of the wrong type
], ids=["unknown_call", "bad_argument", "wrong_type"])
async def test_a_bad_call_is_a_protocol_error_and_a_bad_call_error_to_its_caller(engine_url, call, why):
    """The caller of a call that does not decode hears back for its call id
    (it never waits), the error is counted, and the engine keeps serving."""
    raw = _raw_client(engine_url)
    try:
        await raw.send(enc(["utility", 41, call]))
        await raw.send(enc(P.Utility(42, P.HealthCheck())))
        dec = P.make_outbound_decoder()
        async with asyncio.timeout(10):
            got = [dec.decode(await raw.recv()) for _ in range(3)]
        assert isinstance(got[0], P.ProtocolError) and why in got[0].message and got[0].num_errors == 1
        assert isinstance(got[1], P.UtilityError) and (got[1].call_id, got[1].code) == (41, P.ErrorCode.BAD_CALL)
        assert why in got[1].message
        assert isinstance(got[2], P.UtilityResult) and got[2].call_id == 42
        assert isinstance(got[2].result, P.HealthInfo) and got[2].result.healthy
    finally:
        raw.close(linger=0)


async def _count_tokens(client, params) -> int:
    return sum([len(o.new_token_ids) async for o in client.generate("ok", params)])


async def test_a_request_that_skipped_the_client_checks_is_rejected_by_the_engine(engine_url):
    """Any local process may connect: the engine checks what arrives again."""
    raw = _raw_client(engine_url)
    try:
        await raw.send(enc(P.Utility(1, P.Handshake())))
        await raw.send(enc(P.AddRequest("beyond", [10**7])))
        await raw.send(enc(P.AddRequest("zero", [104], SamplingParams(max_tokens=0))))
        dec = P.make_outbound_decoder()
        async with asyncio.timeout(10):
            got = [dec.decode(await raw.recv()) for _ in range(3)]
        assert isinstance(got[0], P.UtilityResult) and got[0].result.facts.vocab_size > 0
        assert got[1] == P.RequestRejected("beyond", "invalid", got[1].message, "prompt")
        assert "token ids must be in" in got[1].message
        assert (got[2].request_id, got[2].kind, got[2].field) == ("zero", "invalid", "max_tokens")
    finally:
        raw.close(linger=0)
