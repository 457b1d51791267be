"""vLLM's client tools work unchanged: ``vllm bench serve`` without
``--model`` reads ``data[0]["id"]`` and ``data[0]["root"]`` from /v1/models,
and aligns its prompts with POST /tokenize and /detokenize. Every response is
decoded here as vLLM's client reads it, and against the shape of vLLM's
protocol (``TokenizeResponse``, ``DetokenizeResponse``, ``ModelCard``), with
no field missing and none unknown."""

from __future__ import annotations

import aiohttp
import msgspec
import pytest
from http_helpers import text_of, write_bpe_checkpoint

from kvstrata.api_server.server import OpenAIServer, run_http_server
from kvstrata.config import EngineConfig, ModelConfig
from kvstrata.enginecore import AsyncEngine
from kvstrata.ipc.addresses import free_port
from kvstrata.text.chat import plain_chat
from kvstrata.text.tokenizer import load_tokenizer

MAX_MODEL_LEN = 256


class VllmModelCard(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    object: str
    created: int
    owned_by: str
    root: str | None
    parent: str | None
    max_model_len: int | None


class VllmModelList(msgspec.Struct, forbid_unknown_fields=True):
    object: str
    data: list[VllmModelCard]


class VllmTokenizeResponse(msgspec.Struct, forbid_unknown_fields=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class VllmDetokenizeResponse(msgspec.Struct, forbid_unknown_fields=True):
    prompt: str


@pytest.fixture
async def served(tmp_path):
    ckpt = write_bpe_checkpoint(tmp_path / "bpe-model")
    engine = await AsyncEngine.start(EngineConfig(
        executor="null", device="cpu", log_level="WARNING",
        model=ModelConfig(model=str(ckpt), max_model_len=MAX_MODEL_LEN)))
    port = free_port()
    runner = await run_http_server(OpenAIServer(engine), "127.0.0.1", port)
    try:
        async with aiohttp.ClientSession() as session:
            yield session, f"http://127.0.0.1:{port}", ckpt
    finally:
        await runner.cleanup()
        await engine.aclose()


async def get_first_model_from_server(session: aiohttp.ClientSession, base_url: str) -> tuple[str, str]:
    """vLLM's ``benchmarks/serve.py``: the model id and its root."""
    async with session.get(f"{base_url}/v1/models") as response:
        response.raise_for_status()
        data = await response.json()
        return data["data"][0]["id"], data["data"][0]["root"]


async def vllm_tokenize(session: aiohttp.ClientSession, base_url: str, model_id: str, prompt: str) -> list[int]:
    """vLLM's ``_align_prompts_to_server_tokenizer``: ``_tokenize``."""
    async with session.post(f"{base_url}/tokenize",
                            json={"model": model_id, "prompt": prompt, "add_special_tokens": False}) as r:
        r.raise_for_status()
        return (await r.json())["tokens"]


async def vllm_detokenize(session: aiohttp.ClientSession, base_url: str, model_id: str, tokens: list[int]) -> str:
    async with session.post(f"{base_url}/detokenize", json={"model": model_id, "tokens": tokens}) as r:
        r.raise_for_status()
        return (await r.json())["prompt"]


async def test_models_card_has_vllms_root_parent_and_max_model_len(served):
    session, base, ckpt = served
    model_id, root = await get_first_model_from_server(session, base)
    assert (model_id, root) == ("bpe-model", str(ckpt))  # root: where a client loads the tokenizer from
    async with session.get(f"{base}/v1/models") as r:
        cards = msgspec.json.decode(await r.read(), type=VllmModelList)
    assert cards.data[0].parent is None and cards.data[0].max_model_len == MAX_MODEL_LEN
    async with session.get(f"{base}/v1/models/{model_id}") as r:
        assert msgspec.json.decode(await r.read(), type=VllmModelCard) == cards.data[0]


async def test_bench_serve_alignment_tokenizes_and_detokenizes_as_the_checkpoint_does(served):
    session, base, ckpt = served
    tok = load_tokenizer(str(ckpt))
    model_id, _ = await get_first_model_from_server(session, base)
    prompt = text_of(400, seed=3)
    tokens = await vllm_tokenize(session, base, model_id, prompt)
    assert tokens == tok.encode(prompt, add_special_tokens=False)
    # bench serve's re-alignment: a prompt cut to n tokens comes back as text.
    cut = await vllm_detokenize(session, base, model_id, tokens[:20])
    assert cut == tok.decode(tokens[:20], skip_special_tokens=False) and prompt.startswith(cut)
    assert await vllm_tokenize(session, base, model_id, cut) == tokens[:20]


async def test_tokenize_response_has_vllms_shape(served):
    session, base, ckpt = served
    tok = load_tokenizer(str(ckpt))
    async with session.post(f"{base}/tokenize", json={"prompt": "the river runs", "return_token_strs": True,
                                                      "add_special_tokens": False}) as r:
        out = msgspec.json.decode(await r.read(), type=VllmTokenizeResponse)
    assert out.tokens == tok.encode("the river runs", add_special_tokens=False)
    assert out.count == len(out.tokens) and out.max_model_len == MAX_MODEL_LEN
    assert out.token_strs == tok.convert_ids_to_tokens(out.tokens) and "".join(out.token_strs) == "theĠriverĠruns"
    async with session.post(f"{base}/tokenize", json={"prompt": "the river"}) as r:
        assert msgspec.json.decode(await r.read(), type=VllmTokenizeResponse).token_strs is None
    async with session.post(f"{base}/detokenize", json={"tokens": out.tokens}) as r:
        assert msgspec.json.decode(await r.read(), type=VllmDetokenizeResponse).prompt == "the river runs"


async def test_tokenize_chat_messages_as_a_chat_request_renders_them(served):
    session, base, ckpt = served
    tok = load_tokenizer(str(ckpt))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the mill?"}]
    async with session.post(f"{base}/tokenize", json={"model": "bpe-model", "messages": messages}) as r:
        out = msgspec.json.decode(await r.read(), type=VllmTokenizeResponse)
    assert out.tokens == tok.encode(plain_chat(messages))  # no template: the plain format, as a chat request
    async with session.post(f"{base}/v1/chat/completions", json={"messages": messages, "max_tokens": 1}) as r:
        assert (await r.json())["usage"]["prompt_tokens"] == out.count


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "the " * 300}, 400, "prompt"),  # longer than max_model_len, as vLLM refuses it
    ("/tokenize", {"prompt": "x" * 100_000}, 400, "prompt"),  # past the character bound: never tokenized
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1] * (MAX_MODEL_LEN + 1)}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
async def test_tokenize_errors_name_the_field(served, path, body, status, param):
    session, base, _ = served
    async with session.post(f"{base}{path}", json=body) as r:
        assert r.status == status and r.content_type == "application/json"
        assert (await r.json())["error"]["param"] == param
