"""CacheBlend over HTTP (the ``blend`` extension of /v1/completions and
/v1/chat/completions): passages given as texts, a separator or token spans;
their KV stored once and found again when they come back in another order;
bad specs are 400s naming the field, and the server keeps serving."""

from __future__ import annotations

import json

import aiohttp
import pytest

from kvstrata.api_server.server import OpenAIServer, run_http_server
from kvstrata.config import CacheConfig, EngineConfig, ModelConfig
from kvstrata.connector import KVTransferConfig
from kvstrata.enginecore import AsyncEngine
from kvstrata.ipc.addresses import free_port

PASSAGES = ["Veloria's capital is Marnek. ", "The river Tansu runs north. ", "Oskel bread is baked at dawn. "]
HEAD = "Answer from the passages.\n"
QUESTION = "Question: what is the capital of Veloria? Answer:"
SEP = "\n##\n"


def offload() -> KVTransferConfig:
    return KVTransferConfig(connector="offload", options={
        "chunk_size": 16, "store": {"cpu": {"capacity_bytes": 64 << 20, "pin_memory": False}}})


@pytest.fixture
async def served():
    servers = []

    async def serve(kv_transfer):
        engine = await AsyncEngine.start(EngineConfig(
            model=ModelConfig(max_model_len=512), device="cpu", log_level="WARNING",
            cache=CacheConfig(block_size=16, num_blocks=128), kv_transfer=kv_transfer))
        port = free_port()
        runner = await run_http_server(OpenAIServer(engine, model_name="m"), "127.0.0.1", port)
        servers.append((engine, runner))
        return engine, f"http://127.0.0.1:{port}/v1"

    async with aiohttp.ClientSession() as session:
        yield serve, session
    for engine, runner in servers:
        await runner.cleanup()
        await engine.aclose()


async def post(session, url: str, body: dict) -> tuple[int, dict]:
    async with session.post(url, data=json.dumps(body), headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json()


def blend_counts(stats) -> dict[str, float]:
    return {k.split(".", 1)[1]: v for k, v in stats.extra.items() if k.startswith("connector.blend_")}


async def test_passages_as_texts_then_shuffled_are_reused(served):
    serve, session = served
    engine, base = await serve(offload())
    for order in ([0, 1, 2], [2, 0, 1]):
        passages = [PASSAGES[i] for i in order]
        body = {"model": "m", "prompt": HEAD + "".join(passages) + QUESTION, "max_tokens": 4, "temperature": 0,
                "blend": {"segments": passages, "recompute_ratio": 0.3}}
        status, out = await post(session, f"{base}/completions", body)
        assert status == 200, out
        assert out["usage"]["completion_tokens"] == 4
    counts = blend_counts(await engine.stats())
    assert counts["blend_requests"] == 2
    assert counts["blend_segment_misses"] == 3 and counts["blend_segment_hits"] == 3


async def test_a_separator_and_chat(served):
    serve, session = served
    engine, base = await serve(offload())
    prompt = HEAD + SEP + SEP.join(PASSAGES) + SEP + QUESTION
    status, out = await post(session, f"{base}/completions", {
        "model": "m", "prompt": prompt, "max_tokens": 3, "blend": {"separator": SEP}})
    assert status == 200, out
    status, out = await post(session, f"{base}/chat/completions", {
        "model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": prompt}],
        "blend": {"separator": SEP, "recompute_ratio": 0.05}})
    assert status == 200, out
    counts = blend_counts(await engine.stats())
    assert counts["blend_requests"] == 2 and counts["blend_segment_hits"] >= 3


BAD = [
    (HEAD + PASSAGES[0] + QUESTION, {"segments": [PASSAGES[0], PASSAGES[1]]}, "blend.segments[1]"),
    (HEAD + PASSAGES[1] + PASSAGES[0] + QUESTION, {"segments": [PASSAGES[0], PASSAGES[1]]}, "blend.segments[1]"),
    (HEAD + PASSAGES[0] + QUESTION, {"segments": [PASSAGES[0]], "recompute_ratio": 1.5}, "blend.recompute_ratio"),
    (HEAD + PASSAGES[0] + QUESTION, {"segments": [PASSAGES[0]], "recompute_ratio": -0.2}, "blend.recompute_ratio"),
    (HEAD + PASSAGES[0] + QUESTION, {"segments": [PASSAGES[0]], "separator": SEP}, "blend"),
    (HEAD + PASSAGES[0] + QUESTION, {}, "blend"),
    (HEAD + PASSAGES[0] + QUESTION, {"separator": SEP}, "blend.separator"),
    (HEAD + PASSAGES[0] + QUESTION, {"spans": [[0, 4]]}, "blend.spans"),
    ([5, 6, 7, 8, 9, 10], {"spans": [[2, 6]]}, "blend.segments"),
    ([5, 6, 7, 8, 9, 10], {"spans": [[3, 5], [1, 2]]}, "blend.segments[1]"),
    ([5, 6, 7, 8, 9, 10], {"segments": ["x"]}, "blend.segments"),
    (HEAD + PASSAGES[0] + QUESTION, {"segments": [PASSAGES[0]], "ratio": 0.1}, "blend"),  # unknown field
]


async def test_bad_blend_specs_are_400s_naming_the_field(served):
    serve, session = served
    engine, base = await serve(offload())
    for prompt, blend, param in BAD:
        status, out = await post(session, f"{base}/completions", {"model": "m", "prompt": prompt, "max_tokens": 2,
                                                                  "blend": blend})
        assert status == 400, (blend, out)
        assert out["error"]["param"] == param, (blend, out)
        status, _ = await post(session, f"{base}/completions", {"model": "m", "prompt": prompt, "max_tokens": 2})
        assert status == 200


async def test_an_engine_that_cannot_blend_says_so(served):
    serve, session = served
    _, base = await serve(None)
    status, out = await post(session, f"{base}/completions", {
        "model": "m", "prompt": HEAD + PASSAGES[0] + QUESTION, "max_tokens": 2,
        "blend": {"segments": [PASSAGES[0]]}})
    assert status == 400 and out["error"]["param"] == "blend"
    assert "offload connector" in out["error"]["message"]
