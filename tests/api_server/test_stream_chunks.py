"""Streaming sends one chunk per output that carries tokens, even when the
token produces no text yet (half of a UTF-8 character): the first chunk
leaves with the first token, and usage counts every token (issue 16 item 15)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "enginecore"))
from engine_fakes import FakeRunner, engine_config  # noqa: E402

from kvstrata.api_server.server import OpenAIServer, run_http_server  # noqa: E402
from kvstrata.enginecore.async_engine import AsyncEngine  # noqa: E402
from kvstrata.ipc.addresses import free_port  # noqa: E402
from kvstrata.text.tokenizer import ByteTokenizer  # noqa: E402

# "a", then "é" as two byte tokens (the first decodes to nothing yet), then "b".
SCRIPT = [ord("a"), 0xC3, 0xA9, ord("b")]


async def test_a_token_without_text_still_gets_its_chunk():
    runner = FakeRunner(tokenizer=ByteTokenizer(), script={"cmpl-x": SCRIPT})
    engine = await AsyncEngine.start(engine_config(), runner=runner)
    server = OpenAIServer(engine, model_name="tiny")
    port = free_port()
    app = await run_http_server(server, "127.0.0.1", port)
    try:
        async with aiohttp.ClientSession() as s:
            body = {"prompt": [ord("x"), ord("y")], "max_tokens": 4, "stream": True, "request_id": "cmpl-x",
                    "stream_options": {"include_usage": True}}
            async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                assert r.status == 200
                events = [json.loads(line[6:]) async for line in r.content
                          if line.startswith(b"data: ") and line.strip() != b"data: [DONE]"]
    finally:
        await app.cleanup()
        await engine.aclose()
    texts = [e["choices"][0]["text"] for e in events if e["choices"]]
    assert texts == ["a", "", "é", "b"]  # one chunk per token, the empty delta included
    assert events[-1]["usage"]["completion_tokens"] == 4
