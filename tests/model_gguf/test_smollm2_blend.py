"""CacheBlend through the engine on the real SmolLM2 (GGUF, its tokenizer
and chat template): with every token recomputed the blended request answers
exactly as a plain prefill of the same ids; passages shuffled between
requests come from the store; the HTTP chat route takes a separator."""

from __future__ import annotations

import pytest

from kvstrata.config import CacheConfig, EngineConfig, ModelConfig
from kvstrata.connector import KVTransferConfig
from kvstrata.enginecore import AsyncEngine
from kvstrata.text.chat import chat_text
from kvstrata.text.segments import segments_in
from kvstrata.types import BlendSpec, SamplingParams

pytest.importorskip("gguf")
PASSAGES = ["The capital of Veloria is Marnek.", "The river Tansu flows north into Lake Orim.",
            "Oskel bread is baked at dawn in clay ovens."]
N = 8


@pytest.fixture
async def engine(smollm2_gguf):
    cfg = EngineConfig(model=ModelConfig(model=str(smollm2_gguf), max_model_len=512), device="cpu",
                       cache=CacheConfig(num_blocks=128), log_level="WARNING",
                       kv_transfer=KVTransferConfig(connector="offload", options={
                           "chunk_size": 16, "store": {"cpu": {"capacity_bytes": 256 << 20, "pin_memory": False}}}))
    eng = await AsyncEngine.start(cfg)
    yield eng
    await eng.aclose()


def rag_prompt(tok, order: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    passages = [PASSAGES[i] for i in order]
    content = "Passages:\n" + "\n".join(passages) + "\nQuestion: What is the capital of Veloria?"
    text, special = chat_text(tok, [{"role": "user", "content": content}])
    return segments_in(tok, text, passages, add_special=special)


async def gen(engine, ids, blend=None) -> list[int]:
    sp = SamplingParams(temperature=0.0, max_tokens=N, blend=blend)
    return [t async for o in engine.generate(ids, sp) for t in o.new_token_ids]


def counts(stats) -> dict[str, float]:
    return {k.split(".", 1)[1]: v for k, v in stats.extra.items() if k.startswith("connector.blend_")}


async def test_full_recompute_equals_a_plain_prefill_and_shuffled_passages_hit(engine):
    tok = engine.tokenizer
    ids, spans = rag_prompt(tok, [0, 1, 2])
    plain = await gen(engine, ids)
    assert await engine.reset_prefix_cache()
    assert await gen(engine, ids, BlendSpec(segments=spans, recompute_ratio=1.0)) == plain
    ids2, spans2 = rag_prompt(tok, [2, 0, 1])
    out = await gen(engine, ids2, BlendSpec(segments=spans2, recompute_ratio=0.3))
    assert len(out) == N
    c = counts(await engine.stats())
    assert c["blend_requests"] == 2 and c["blend_segment_hits"] == 3 and c["blend_segment_misses"] == 3
