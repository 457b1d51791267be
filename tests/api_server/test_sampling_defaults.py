"""Sampling fields a request leaves unset take the checkpoint's
generation_config.json (temperature, top_p, top_k, min_p; max_new_tokens as
max_tokens), then OpenAI's; a field the request sets wins. ``max_tokens``
unset on a chat request means until EOS or the end of the context, as in
vLLM; on a completion, the server's default (16)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from pathlib import Path

import aiohttp
import pytest
from http_helpers import write_bpe_checkpoint

from kvstrata.api_server.server import OpenAIServer, run_http_server
from kvstrata.config import EngineConfig, ModelConfig
from kvstrata.enginecore import AsyncEngine
from kvstrata.ipc.addresses import free_port
from kvstrata.text.tokenizer import load_tokenizer
from kvstrata.types import EngineHealth, RequestOutput, SamplingParams

GENERATION_CONFIG = {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "do_sample": True, "bos_token_id": 0}


class RecordingEngine:
    """An EngineClient that records the params each request got and answers one token."""

    max_model_len = 128
    is_dead = False

    def __init__(self, ckpt: Path) -> None:
        self.config = EngineConfig(model=ModelConfig(model=str(ckpt)))
        self.model_name = ckpt.name
        self.tokenizer = load_tokenizer(str(ckpt))
        self.params: list[SamplingParams] = []
        self.session_keys: list[str | None] = []

    async def generate(self, prompt, params, **kwargs) -> AsyncGenerator[RequestOutput, None]:
        self.params.append(params)
        self.session_keys.append(kwargs["session_key"])
        yield RequestOutput(request_id=kwargs["request_id"], new_token_ids=[5], text_delta="x", finished=True,
                            finish_reason="length", num_prompt_tokens=3)

    async def check_health(self) -> EngineHealth:
        return EngineHealth(healthy=True, status="ok")


async def _serve(engine):
    port = free_port()
    runner = await run_http_server(OpenAIServer(engine), "127.0.0.1", port)
    return runner, aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}")


@pytest.fixture
async def recording(tmp_path):
    servers = []

    async def serve(generation_config):
        engine = RecordingEngine(write_bpe_checkpoint(tmp_path / f"m{len(servers)}",
                                                      generation_config=generation_config))
        runner, session = await _serve(engine)
        servers.append((runner, session))
        return engine, session

    yield serve
    for runner, session in servers:
        await session.close()
        await runner.cleanup()


async def _params(engine, session, path: str, body: dict) -> SamplingParams:
    async with session.post(path, json=body) as r:
        assert r.status == 200, await r.text()
    return engine.params[-1]


async def test_unset_fields_take_the_checkpoints_generation_config(recording):
    engine, session = await recording(GENERATION_CONFIG)
    p = await _params(engine, session, "/v1/completions", {"prompt": "hi"})
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (0.2, 0.9, 40, 0.0, 16)
    p = await _params(engine, session, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "hi"}], "temperature": None})
    assert (p.temperature, p.top_p, p.top_k) == (0.2, 0.9, 40)


async def test_fields_the_request_sets_win(recording):
    engine, session = await recording(GENERATION_CONFIG)
    p = await _params(engine, session, "/v1/completions",
                      {"prompt": "hi", "temperature": 0, "top_p": 1.0, "top_k": -1, "min_p": 0.1, "max_tokens": 3})
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (0.0, 1.0, -1, 0.1, 3)


async def test_without_a_generation_config_openais_defaults_apply(recording):
    engine, session = await recording(None)
    p = await _params(engine, session, "/v1/completions", {"prompt": "hi"})
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1.0, 1.0, -1, 0.0, 16)


async def test_max_new_tokens_is_the_default_max_tokens(recording):
    engine, session = await recording({**GENERATION_CONFIG, "max_new_tokens": 7})
    assert (await _params(engine, session, "/v1/completions", {"prompt": "hi"})).max_tokens == 7
    chat = await _params(engine, session, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert chat.max_tokens == 7


async def test_unset_max_tokens_on_chat_is_the_context(recording):
    engine, session = await recording(None)
    p = await _params(engine, session, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert p.max_tokens == engine.max_model_len
    p = await _params(engine, session, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5})
    assert p.max_tokens == 5


async def test_a_chat_without_max_tokens_runs_to_the_end_of_the_context():
    engine = await AsyncEngine.start(EngineConfig(executor="null", device="cpu", log_level="WARNING",
                                                  model=ModelConfig(max_model_len=64)))
    runner, session = await _serve(engine)
    try:
        async with session.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}) as r:
            out = await r.json()
        usage = out["usage"]
        assert out["choices"][0]["finish_reason"] == "length"
        assert usage["total_tokens"] == 64 and usage["completion_tokens"] > 16
    finally:
        await session.close()
        await runner.cleanup()
        await engine.aclose()


async def test_the_openai_user_field_reaches_the_engine_as_its_session_key(recording):
    """A fleet routes a conversation by it (EngineClient.generate's session_key)."""
    engine, session = await recording(GENERATION_CONFIG)
    await _params(engine, session, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                            "user": "alice"})
    await _params(engine, session, "/v1/completions", {"prompt": "hi"})
    assert engine.session_keys == ["alice", None]
