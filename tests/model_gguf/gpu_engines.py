"""Shared by the packed-GGUF GPU tests: a bf16 engine's greedy tokens on
random GGUFs, and the comparison of two engines' tokens up to a near tie."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvstrata.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvstrata.enginecore import AsyncEngine
from kvstrata.types import SamplingParams

PROMPTS = [[1, 17, 250, 3, 99, 42, 42, 7, 300, 5], [1, 5, 6, 7], [1] + list(range(20, 60)), [1, 300, 301, 2, 9]]
NEW = 12
# bf16 logits of magnitude 16-32 (these random models') are 0.125 apart: a margin of 0.125 is one
# step, the nearest tie there is (the H200 run parted Q8_0 at exactly that); as the bf16 HF oracle's
# LOW_PRECISION_TIE (tests/enginecore/test_oracle.py)
NEAR_TIE = 0.125


async def greedy(path: Path, tokenizer_dir: Path, logprobs: int | None = None, device: str = "cuda",
                 **model) -> tuple[list[list[int]], list[list[float]], int, object]:
    """Greedy tokens of ``PROMPTS``, each position's top-2 margin (with
    ``logprobs``), the engine's resident weight bytes and its model (``model``:
    more ``ModelConfig`` fields, e.g. quantized_weights, cuda_graphs)."""
    # four requests: graphs of 1, 2 and 4 (fewer captures and kernel specializations to compile)
    cfg = EngineConfig(model=ModelConfig(model=str(path), tokenizer=str(tokenizer_dir), max_model_len=128,
                                         dtype="bfloat16", cuda_graph_sizes=[1, 2, 4], **model),
                       scheduler=SchedulerConfig(max_num_seqs=4), device=device,
                       cache=CacheConfig(num_blocks=128), log_level="WARNING")
    engine = await AsyncEngine.start(cfg)
    try:
        async def one(ids):
            sp = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=logprobs)
            toks, margins = [], []
            async for o in engine.generate(ids, sp):
                toks += o.new_token_ids
                margins += [lp.logprobs[1] - lp.logprobs[2] for lp in o.logprobs or []]
            return toks, margins

        outs = await asyncio.gather(*(one(ids) for ids in PROMPTS))
        runner = engine.core.runner
        return [t for t, _ in outs], [m for _, m in outs], runner.weight_bytes, runner.model
    finally:
        await engine.aclose()


def assert_same_up_to_near_ties(got: list[list[int]], want: list[list[int]], margins: list[list[float]]) -> None:
    """``got`` equals ``want`` (whose top-2 margins are ``margins``) per prompt up
    to where they part, which must be a near tie; mostly they do not part."""
    compared = 0
    for toks, ref, margin in zip(got, want, margins, strict=True):
        assert len(margin) == len(ref) == NEW
        parted = next((i for i, (a, b) in enumerate(zip(toks, ref, strict=True)) if a != b), None)
        if parted is not None:
            assert margin[parted] <= NEAR_TIE, (toks, ref, margin)
        compared += NEW if parted is None else parted
    assert compared >= NEW * len(PROMPTS) // 2, (got, want)  # mostly no tie at all
