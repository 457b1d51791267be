"""`kvstrata serve`'s HTTP endpoints through a real socket and aiohttp's
client, around the multiprocess client of a real engine subprocess."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from kvstrata.types import SamplingParams
from kvstrata.ipc.addresses import free_port
from kvstrata.api_server.server import OpenAIServer, run_http_server
from kvstrata.api_server.metrics import parse_metrics
from kvstrata.ipc.mp_client import MPEngineClient


@pytest.fixture
async def http(engine_url):
    client = await MPEngineClient.connect(engine_url)
    server = OpenAIServer(client, model_name="tiny", max_model_len=8192)
    port = free_port()
    runner = await run_http_server(server, "127.0.0.1", port)
    session = aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}")
    try:
        yield session, client
    finally:
        await session.close()
        await runner.cleanup()
        await client.aclose()


async def _sse(resp) -> list:
    events = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            data = line[6:].strip()
            events.append(data.decode() if data == b"[DONE]" else json.loads(data))
    return events


async def _direct_text(client, prompt: str, n: int) -> tuple[str, int]:
    outs = [o async for o in client.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0))]
    return "".join(o.text_delta for o in outs), outs[-1].num_prompt_tokens


async def test_completion_matches_the_engine(http):
    session, client = http
    text, n_prompt = await _direct_text(client, "Once upon", 5)
    async with session.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 5, "temperature": 0}) as r:
        assert r.status == 200
        body = await r.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["choices"] == [{"index": 0, "text": text, "finish_reason": "length", "logprobs": None}]
    assert body["usage"]["prompt_tokens"] == n_prompt
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == n_prompt + 5
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


async def test_completion_streams_over_sse(http):
    session, client = http
    text, n_prompt = await _direct_text(client, "Stream me", 7)
    req = {"prompt": "Stream me", "max_tokens": 7, "temperature": 0, "stream": True,
           "stream_options": {"include_usage": True}}
    async with session.post("/v1/completions", json=req) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        events = await _sse(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 7
    chunks = events[:-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


async def test_chat_completion_and_chat_stream(http):
    session, _ = http
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    async with session.post("/v1/chat/completions", json={"messages": msgs, "max_completion_tokens": 4}) as r:
        body = await r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    content = body["choices"][0]["message"]["content"]
    assert len(content) == 4 and body["usage"]["completion_tokens"] == 4  # the null runner: one letter a token
    async with session.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "stream": True}) as r:
        events = await _sse(r)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1]) == content
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1] == "[DONE]"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": [10**7]}, "prompt"),             # beyond the model's vocabulary
    ("/v1/completions", {"prompt": [-1]}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
])
async def test_validation_errors_are_400_naming_the_field(http, path, body, param):
    session, _ = http
    async with session.post(path, json=body) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"


async def test_models_health_and_metrics(http):
    session, _ = http
    async with session.get("/v1/models") as r:
        models = await r.json()
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 8192
    async with session.get("/health") as r:
        assert r.status == 200 and (await r.json()) == {"status": "ok"}
    for _ in range(2):  # the second request hits the first one's cached prefix
        async with session.post("/v1/completions", json={"prompt": "p" * 40, "max_tokens": 3}) as r:
            assert r.status == 200
    async with session.get("/metrics") as r:
        assert r.status == 200
        metrics = {(n, tuple(sorted(lbl.items()))): v for n, lbl, v in parse_metrics(await r.text())}
    model = ("model_name", "tiny")
    assert metrics[("kvstrata_prefix_cache_hits_total", (model, ("tier", "device")))] >= 32
    assert 0 < metrics[("kvstrata_prefix_cache_hit_rate", (model, ("tier", "device")))] <= 1
    assert metrics[("kvstrata_time_to_first_token_seconds_count", ())] == 2
    assert metrics[("kvstrata_inter_token_latency_seconds_count", ())] == 4
    assert metrics[("kvstrata_http_requests_total", (model, ("outcome", "length")))] == 2
    assert ("kvstrata_num_preemptions_total", (model,)) in metrics
    assert ("kvstrata_kv_cache_usage_ratio", (model,)) in metrics


async def test_a_client_that_hangs_up_mid_stream_aborts_its_request(http):
    session, client = http
    before = await client.stats()
    req = {"prompt": "long", "max_tokens": 8000, "stream": True, "ignore_eos": True}
    async with session.post("/v1/completions", json=req) as r:
        await r.content.readline()
    # the response is closed: the server's next write fails and its handler is cancelled
    async with asyncio.timeout(10):
        while (stats := await client.stats()).num_running:
            await asyncio.sleep(0.02)
    assert stats.num_generated_tokens - before.num_generated_tokens < 8000


async def test_engine_death_ends_streams_in_band_and_fails_health():
    import os
    import signal

    from serve_helpers import null_config

    client = await MPEngineClient.start(null_config())
    server = OpenAIServer(client, model_name="tiny")
    port = free_port()
    runner = await run_http_server(server, "127.0.0.1", port)
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as session:
            req = {"prompt": "long", "max_tokens": 8000, "stream": True, "ignore_eos": True}
            async with session.post("/v1/completions", json=req) as r:
                assert (await r.content.readline()).startswith(b"data: ")
                os.kill(client.info.pid, signal.SIGKILL)
                async with asyncio.timeout(5):
                    events = await _sse(r)
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["type"] == "engine_dead"
            async with session.get("/health") as r:
                assert r.status == 503
            async with session.post("/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 503 and (await r.json())["error"]["type"] == "engine_dead"
    finally:
        await runner.cleanup()
        await client.aclose()


@pytest.mark.parametrize("field, body", [
    ("max_tokens", {"prompt": [1, 2], "max_tokens": 2**64}),
    ("priority", {"prompt": [1, 2], "max_tokens": 2, "priority": 2**64}),
    ("stop_token_ids", {"prompt": [1, 2], "max_tokens": 2, "stop_token_ids": [2**64]}),
    ("top_k", {"prompt": [1, 2], "max_tokens": 2, "top_k": 2**64}),
])
async def test_integers_past_64_bits_are_400_before_the_wire(http, field, body):
    """Through the multiprocess client the msgpack encoder used to raise
    OverflowError (a 500); the client's checks answer 400 first."""
    session, client = http
    async with session.post("/v1/completions", json=body) as r:
        assert r.status == 400 and r.content_type == "application/json"
        assert (await r.json())["error"]["param"] == field
    async with session.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}) as r:
        assert r.status == 200
