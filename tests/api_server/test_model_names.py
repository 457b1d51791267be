"""A request naming a model this server does not serve gets OpenAI's 404
``model_not_found`` (never the default model's answer); GET
/v1/models/{id} answers for the served model only."""

from __future__ import annotations

import aiohttp
import pytest

from kvstrata.api_server.server import OpenAIServer, run_http_server
from kvstrata.config import EngineConfig
from kvstrata.enginecore import AsyncEngine
from kvstrata.ipc.addresses import free_port


@pytest.fixture
async def http():
    engine = await AsyncEngine.start(EngineConfig(executor="null", device="cpu", log_level="WARNING"))
    server = OpenAIServer(engine, model_name="tiny")
    port = free_port()
    runner = await run_http_server(server, "127.0.0.1", port)
    session = aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}")
    try:
        yield session, engine
    finally:
        await session.close()
        await runner.cleanup()
        await engine.aclose()


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "gpt-4", "prompt": [1, 2, 3], "max_tokens": 2}),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}),
])
async def test_an_unknown_model_is_404_model_not_found(http, path, body):
    session, engine = http
    async with session.post(path, json=body) as r:
        assert r.status == 404 and r.content_type == "application/json"
        err = (await r.json())["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert err["type"] == "invalid_request_error" and "gpt-4" in err["message"]
    assert (await engine.stats()).num_finished == 0  # nothing reached the engine


async def test_the_served_model_or_none_is_answered(http):
    session, _ = http
    for body in ({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}, {"prompt": [1, 2, 3], "max_tokens": 2}):
        async with session.post("/v1/completions", json=body) as r:
            assert r.status == 200
            assert (await r.json())["model"] == "tiny"


async def test_get_model_by_id(http):
    session, _ = http
    async with session.get("/v1/models/tiny") as r:
        assert r.status == 200
        card = await r.json()
    assert card["id"] == "tiny" and card["object"] == "model"
    async with session.get("/v1/models/other") as r:
        assert r.status == 404
        assert (await r.json())["error"]["code"] == "model_not_found"
