"""Wire messages: every inbound/outbound Struct round-trips through msgpack
unchanged; what is not one of them fails to decode (the engine answers it
with a ProtocolError)."""

import msgspec
import pytest

from kvstrata.types import EngineStats, Logprobs, RequestOutput, SamplingParams
from kvstrata.ipc import protocol as P

INBOUND = [
    P.AddRequest("r1", [104, 101, 108, 108, 111], SamplingParams(max_tokens=3, temperature=0.0), 2, "salt", None),
    P.AddRequest("r2", [1, 2, 3]),
    P.AbortRequests(["r1", "r2"]),
    P.Utility(7, P.GetStats()),
    P.Utility(8, P.FlushKV(30.0)),
    P.Utility(9, P.KVSubscribe(12)),
    P.Shutdown(),
]
OUTBOUND = [
    P.Outputs([RequestOutput(request_id="r1", new_token_ids=[5], text_delta="x"),
               RequestOutput(request_id="r2", finished=True, finish_reason="length",
                             logprobs=[Logprobs([1, 2], [-0.5, -1.5])])]),
    P.UtilityResult(7, P.StatsResult(EngineStats(num_running=1, extra={"a": 1.0}))),
    P.UtilityResult(8, P.Flushed()),
    P.UtilityResult(9, P.KVSnapshot(epoch=3, next_seq=5, oldest_seq=0, payload=b"x")),
    P.UtilityError(8, P.ErrorCode.TIMEOUT, "boom"),
    P.RequestRejected("r3", "invalid", "max_tokens: must be >= 1", "max_tokens"),
    P.ProtocolError("bad", 3),
    P.EngineDead("shutdown"),
]


@pytest.mark.parametrize("msg", INBOUND, ids=lambda m: type(m).__name__)
def test_inbound_round_trip(msg):
    assert P.make_inbound_decoder().decode(msgspec.msgpack.encode(msg)) == msg


@pytest.mark.parametrize("msg", OUTBOUND, ids=lambda m: type(m).__name__)
def test_outbound_round_trip(msg):
    assert P.make_outbound_decoder().decode(msgspec.msgpack.encode(msg)) == msg


def test_messages_are_positional_arrays_tag_first():
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(P.AbortRequests(["a"])))
    assert raw == ["abort", ["a"]]


@pytest.mark.parametrize("frame", [
    b"\xc1",                                           # never-used msgpack byte
    msgspec.msgpack.encode(["nope", 1]),               # unknown tag
    msgspec.msgpack.encode(["add", 5, [1, 2]]),        # request_id of the wrong type
    msgspec.msgpack.encode(["add", "r", "text"]),      # text: the wire carries token ids only
    msgspec.msgpack.encode(["abort"]),                 # missing field
    msgspec.msgpack.encode({"t": "add"}),              # a map, not an array
    msgspec.msgpack.encode(P.Outputs([])),             # outbound tag sent inbound
    msgspec.msgpack.encode(["utility", 1, "stats"]),   # a call named by a string (protocol 4)
    msgspec.msgpack.encode(["utility", 1, ["nope"]]),  # an unknown call
], ids=["malformed", "unknown_tag", "wrong_type", "text_prompt", "missing_field", "map_not_array", "outbound_tag",
        "string_call", "unknown_call"])
def test_bad_inbound_frames_do_not_decode(frame):
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        P.make_inbound_decoder().decode(frame)
