"""Malformed requests get a 4xx in OpenAI's JSON error shape naming the
field, never a 500, and the engine keeps serving: hand-picked cases that
used to be 500s (integers past 64 bits reaching msgpack, invalid UTF-8),
hypothesis over the request schema and over raw bytes, the real `openai`
client (a 4xx is not retried), and the multiprocess client (the msgpack
encoder is where big integers used to overflow)."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.api_server.server import OpenAIServer, run_http_server
from kvstrata.config import EngineConfig, ModelConfig
from kvstrata.enginecore import AsyncEngine
from kvstrata.ipc.addresses import free_port

BIG = 2**64


class ServerThread:
    """An in-process engine (null executor) and HTTP server on their own
    event loop in a thread, so sync tests (hypothesis) can post to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.port = free_port()

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def start(self) -> "ServerThread":
        self.thread.start()

        async def up():
            cfg = EngineConfig(executor="null", device="cpu", log_level="WARNING",
                               model=ModelConfig(max_model_len=64))
            self.engine = await AsyncEngine.start(cfg)
            self.http = OpenAIServer(self.engine, model_name="tiny")
            self.runner = await run_http_server(self.http, "127.0.0.1", self.port)
        self._run(up())
        return self

    def stats(self):
        return self._run(self.engine.stats())

    def stop(self) -> None:
        async def down():
            await self.runner.cleanup()
            await self.engine.aclose()
        self._run(down())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def post(self, path: str, body: bytes, content_type: str | None = "application/json") -> tuple[int, str, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("POST", path, body=body, headers={} if content_type is None else {"Content-Type": content_type})
            r = conn.getresponse()
            return r.status, r.getheader("Content-Type", ""), r.read()
        finally:
            conn.close()


@pytest.fixture(scope="module")
def server():
    s = ServerThread().start()
    yield s
    s.stop()


def assert_clean_answer(status: int, ctype: str, data: bytes) -> None:
    """Never a 5xx; a 4xx is OpenAI's error object; a 200 is JSON or SSE."""
    assert status < 500, (status, data[:300])
    if status >= 400:
        assert ctype.startswith("application/json"), (status, ctype, data[:200])
        err = json.loads(data)["error"]
        assert set(err) >= {"message", "type", "param", "code"} and err["message"]


def assert_still_serving(server: ServerThread) -> None:
    status, _, data = server.post("/v1/completions", json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode())
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("field, body", [
    ("max_tokens", {"prompt": [1, 2], "max_tokens": BIG}),
    ("max_tokens", {"prompt": [1, 2], "max_tokens": 2**63}),
    ("top_k", {"prompt": [1, 2], "top_k": BIG}),
    ("priority", {"prompt": [1, 2], "priority": BIG}),
    ("priority", {"prompt": [1, 2], "priority": -BIG}),
    ("prompt", {"prompt": [1, BIG]}),
    ("stop_token_ids", {"prompt": [1, 2], "stop_token_ids": [BIG]}),
    ("seed", {"prompt": [1, 2], "seed": BIG}),
    ("min_tokens", {"prompt": [1, 2], "min_tokens": BIG}),
    ("logprobs", {"prompt": [1, 2], "logprobs": BIG}),
    ("request_id", {"prompt": [1, 2], "request_id": "x" * 5000}),
    ("stop", {"prompt": [1, 2], "stop": ["s"] * 65}),
    ("stop", {"prompt": [1, 2], "stop": ["s" * 1025]}),
    ("stop", {"prompt": [1, 2], "stop": ["s" * 1000] * 17}),
    ("stop_token_ids", {"prompt": [1, 2], "stop_token_ids": [1] * 1025}),
])
def test_out_of_range_fields_are_400_naming_the_field(server, field, body):
    status, ctype, data = server.post("/v1/completions", json.dumps(body).encode())
    assert status == 400 and ctype.startswith("application/json"), data[:200]
    assert json.loads(data)["error"]["param"] == field
    assert_still_serving(server)


@pytest.mark.parametrize("raw", [
    b'{"prompt": "\xff\xfe", "max_tokens": 2}',  # invalid UTF-8 in a string
    b'\xc3\x28',
    b'{"prompt": "\\ud800"}',
    b'',
    b'null',
    b'[1, 2]',
])
def test_undecodable_bodies_are_400_json(server, raw):
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, ctype, data = server.post(path, raw)
        assert status == 400, (status, data[:200])
        assert_clean_answer(status, ctype, data)
    assert_still_serving(server)


@pytest.mark.parametrize("raw", [
    b'{"prompt": [1, 2], "max_tokens": 2, "\xff\xfe": 1}',  # in a key nobody reads
    b'{"prompt": [1, 2], "max_tokens": 2, "extra": "\xc3\x28"}',  # in a value nobody reads
    b'{"prompt": [1, 2], "max_tokens": 2, "extra": {"\xed\xa0\x80": [1]}}',  # an encoded surrogate
])
def test_invalid_utf8_anywhere_in_the_body_is_400(server, raw):
    status, ctype, data = server.post("/v1/completions", raw)
    assert status == 400, (status, data[:200])
    assert_clean_answer(status, ctype, data)
    assert "not valid UTF-8" in json.loads(data)["error"]["message"]


@pytest.mark.parametrize("content_type, status", [
    ("text/plain", 415), ("text/plain; charset=utf-8", 415), ("application/x-www-form-urlencoded", 415),
    ("multipart/form-data; boundary=x", 415),
    ("application/json", 200), ("application/json; charset=utf-8", 200), ("application/vnd.api+json", 200),
    (None, 200),  # none said: taken as JSON
])
def test_only_json_bodies_are_read(server, content_type, status):
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()
    for path in ("/v1/completions", "/tokenize"):
        got, ctype, data = server.post(path, body if path != "/tokenize" else b'{"prompt": "hi"}', content_type)
        assert got == status, (path, content_type, data[:200])
        assert_clean_answer(got, ctype, data)
        if status == 415:
            assert "application/json" in json.loads(data)["error"]["message"]


_junk = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
_small_int = st.integers(min_value=-3, max_value=40)
_fields = {
    "model": st.sampled_from(["tiny", None]) | _junk,
    "max_tokens": _small_int | _junk,
    "temperature": st.floats(-1, 3) | _junk,
    "top_p": st.floats(-0.5, 1.5) | _junk,
    "top_k": _small_int | _junk,
    "min_p": st.floats(-0.5, 1.5) | _junk,
    "seed": st.integers(-2**65, 2**65) | _junk,
    "stop": st.lists(st.text(max_size=5), max_size=3) | st.text(max_size=5) | _junk,
    "stop_token_ids": st.lists(st.integers(-5, 2**65), max_size=3) | _junk,
    "ignore_eos": st.booleans() | _junk,
    "min_tokens": _small_int | _junk,
    "logprobs": _small_int | st.booleans() | _junk,
    "top_logprobs": _small_int | _junk,
    "n": st.integers(0, 3) | _junk,
    "stream": st.booleans() | _junk,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | _junk,
    "priority": st.integers(-2**65, 2**65) | _junk,
    "cache_salt": st.text(max_size=10) | _junk,
    "request_id": st.text(max_size=10) | _junk,
    "echo": st.booleans() | _junk,
}
_prompt = (st.lists(st.integers(-3, 300), max_size=6) | st.text(max_size=12)
           | st.lists(st.lists(st.integers(0, 300), max_size=3), max_size=2) | _junk)
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]) | _junk},
                                 optional={"content": st.text(max_size=12) | _junk})
_messages = st.lists(_message, max_size=3) | _junk


def _bodies(kind: str):
    required = {"prompt": _prompt} if kind == "completions" else {"messages": _messages}
    return st.fixed_dictionaries({}, optional={**required, **_fields})


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["completions", "chat/completions"]), data=st.data())
def test_fuzz_over_the_request_schema_never_500(server, kind, data):
    body = data.draw(_bodies("completions" if kind == "completions" else "chat"))
    raw = json.dumps(body).encode()  # ensure_ascii: lone surrogates travel as \\udxxx escapes
    status, ctype, out = server.post(f"/v1/{kind}", raw)
    assert_clean_answer(status, ctype, out)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=120) | st.builds(
    lambda head, junk, tail: head + junk + tail,
    st.sampled_from([b'{"prompt": [1, 2], "max_tokens": ', b'{"messages": [{"role": "user", "content": "']),
    st.binary(max_size=30), st.sampled_from([b'}', b'"}]}', b''])))
def test_fuzz_over_raw_bytes_never_500(server, raw):
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, ctype, out = server.post(path, raw)
        assert_clean_answer(status, ctype, out)


def test_engine_alive_and_clean_after_the_fuzz(server):
    assert_still_serving(server)
    stats = server.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0


def test_openai_client_gets_bad_request_without_retrying(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=3)
    finished = server.stats().num_finished
    invalid = server.http.metrics.requests.get("invalid", 0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=BIG)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "max_tokens"
    # the first answer was final: a retry would have reached the server again
    assert server.http.metrics.requests.get("invalid", 0) == invalid + 1
    assert server.stats().num_finished == finished
    out = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=2)
    assert out.usage.completion_tokens == 2
