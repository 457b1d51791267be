"""Log-probabilities over HTTP in OpenAI's shapes, with the real `openai`
client: /v1/completions ``logprobs: N`` and /v1/chat/completions
``logprobs: true, top_logprobs: N``, streaming and not, equal to what the
engine itself reports for the same greedy request."""

from __future__ import annotations

import math

import pytest

from kvstrata.api_server.openai_types import token_text
from kvstrata.api_server.server import OpenAIServer, run_http_server
from kvstrata.config import CacheConfig, EngineConfig, ModelConfig
from kvstrata.enginecore import AsyncEngine
from kvstrata.ipc.addresses import free_port
from kvstrata.types import SamplingParams

openai = pytest.importorskip("openai")
PROMPT = "The capital of France is"


@pytest.fixture
async def served():
    # the seeded random default model with its byte tokenizer: real logits, real logprobs
    engine = await AsyncEngine.start(EngineConfig(model=ModelConfig(max_model_len=256), device="cpu",
                                                  cache=CacheConfig(num_blocks=64), log_level="WARNING"))
    port = free_port()
    runner = await run_http_server(OpenAIServer(engine, model_name="m"), "127.0.0.1", port)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    try:
        yield engine, client
    finally:
        await client.close()
        await runner.cleanup()
        await engine.aclose()


async def _engine_logprobs(engine, n):
    outs = [o async for o in engine.generate(PROMPT, SamplingParams(max_tokens=5, temperature=0.0, logprobs=n))]
    return [lp for o in outs for lp in (o.logprobs or [])]


async def test_completions_logprobs_match_the_engine(served):
    engine, client = served
    want = await _engine_logprobs(engine, 3)
    r = await client.completions.create(model="m", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 5
    assert lp.token_logprobs == pytest.approx([w.logprobs[0] for w in want])
    tok = engine.tokenizer  # the top-3 as a dict: token strings that decode alike (partial UTF-8) merge
    assert [len(top) for top in lp.top_logprobs] == [len({token_text(tok, t) for t in w.token_ids[1:]}) for w in want]
    assert all(len(w.token_ids) == 4 and all(v <= 0 for v in top.values()) for w, top in zip(want, lp.top_logprobs))
    # greedy: the sampled token is the most likely one
    assert all(w.token_ids[1] == w.token_ids[0] and math.isclose(w.logprobs[1], t, rel_tol=1e-5)
               for w, t in zip(want, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


async def test_chat_logprobs_streaming_and_not(served):
    engine, client = served
    kw = dict(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
              logprobs=True, top_logprobs=2)
    r = await client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 and bytes(c.bytes).decode() == c.token for c in content)
    streamed = []
    async for chunk in await client.chat.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], rel=1e-5)


async def test_no_logprobs_unless_asked(served):
    _, client = served
    r = await client.completions.create(model="m", prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.choices[0].logprobs is None
