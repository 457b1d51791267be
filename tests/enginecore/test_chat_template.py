"""Chat templates: the checkpoint's own Jinja template (tokenizer_config.json
or chat_template.jinja) renders exactly as transformers renders it; the HTTP
chat endpoint and the embedded ``chat`` call use it (encoded without adding
special tokens: the template has them); a broken template or a conversation
the template refuses is a clear error, a 400 over HTTP."""

from __future__ import annotations

import json

import aiohttp
import pytest
from hf_utils import build_tiny_llama, write_bytelevel_bpe_tokenizer

from kvstrata.api_server.server import OpenAIServer, run_http_server
from kvstrata.config import CacheConfig, EngineConfig, ModelConfig
from kvstrata.enginecore import AsyncEngine
from kvstrata.errors import RequestError
from kvstrata.ipc.addresses import free_port
from kvstrata.text.chat import ChatTemplateError, load_chat_template
from kvstrata.text.tokenizer import load_tokenizer
from kvstrata.types import SamplingParams

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{% if message['role'] == 'assistant' and loop.previtem is defined and loop.previtem['role'] == 'assistant' %}"
    "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c ü 日本"}],
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat-tok")
    write_bytelevel_bpe_tokenizer(d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHATML
    cfg["eos_token"] = "</s>"  # transformers 5 reads special tokens as strings only
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    build_tiny_llama(d, vocab_size=512)  # a model whose vocabulary covers the tokenizer's
    return d


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_rendering_equals_transformers(tok_dir, messages):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ours = load_chat_template(tok_dir)
    assert ours is not None and ours.render(messages) == want
    assert load_tokenizer(str(tok_dir)).chat_template is not None


def test_named_templates_and_the_jinja_file(tmp_path, tok_dir):
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages|length }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_chat_template(tmp_path).render(CONVERSATIONS[0]) == "D1"
    other = tmp_path / "jinja"
    other.mkdir()
    (other / "chat_template.jinja").write_text("J{{ messages[0]['content'] }}")
    assert load_chat_template(other).render(CONVERSATIONS[0]) == "JWhat is the capital of France?"
    assert load_chat_template(tmp_path / "nothing-here") is None


def test_a_broken_template_names_its_source(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for x in %}"}))
    with pytest.raises(ChatTemplateError, match="tokenizer_config.json"):
        load_chat_template(tmp_path)


@pytest.fixture
async def engine(tok_dir):
    cfg = EngineConfig(device="cpu", log_level="WARNING", model=ModelConfig(model=str(tok_dir), max_model_len=256),
                       cache=CacheConfig(block_size=4, num_blocks=128))
    e = await AsyncEngine.start(cfg)
    yield e
    await e.aclose()


async def test_http_chat_and_embedded_chat_use_the_template(engine, tok_dir):
    tok = load_tokenizer(str(tok_dir))
    messages = CONVERSATIONS[2]
    want_ids = tok.encode(load_chat_template(tok_dir).render(messages), add_special_tokens=False)
    assert want_ids[0] != tok.bos_token_id  # no BOS added in front of the template's text
    outs = [o async for o in engine.chat(messages, SamplingParams(max_tokens=2))]
    assert outs[-1].num_prompt_tokens == len(want_ids)
    port = free_port()
    runner = await run_http_server(OpenAIServer(engine, model_name="m"), "127.0.0.1", port)
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as s:
            async with s.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2}) as r:
                assert r.status == 200
                assert (await r.json())["usage"]["prompt_tokens"] == len(want_ids)
            refused = [{"role": "assistant", "content": "x"}, {"role": "assistant", "content": "y"}]
            async with s.post("/v1/chat/completions", json={"messages": refused}) as r:
                body = await r.json()
                assert r.status == 400 and body["error"]["param"] == "messages"
                assert "alternate" in body["error"]["message"]
    finally:
        await runner.cleanup()
    with pytest.raises(RequestError, match="alternate"):
        async for _ in engine.chat(refused):
            pass
