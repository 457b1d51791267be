"""Packed GGUF weights on CUDA (the Triton quant_matmul inside the real
engine), against the same file dequantized at load; skipped without a GPU.
It passes on an H200 (``tools/gpu_check.sh``); ``model.quantized_weights =
"auto"`` still dequantizes on CUDA, which decodes faster there
(docs/quantization.md).

- a packed engine's greedy tokens with CUDA graphs on are exactly those with
  graphs off (the same kernels, replayed: GEMV tiles for decode batches);
- packed and dequantized engines (both bf16) generate the same tokens, up to
  a near tie: where they part, the dequantized engine's top-2 logprob margin
  is at most ``NEAR_TIE`` (the packed kernel reads the weights exactly in
  fp32, the dequantized model holds them rounded to bf16);
- the packed engine's weights are the file's blocks: far below bf16's.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from kvstrata.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from kvstrata.enginecore import AsyncEngine  # noqa: E402
from kvstrata.types import SamplingParams  # noqa: E402
from kvstrata.worker.model.gguf_random import write_random_gguf  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [[1, 17, 250, 3, 99, 42, 42, 7, 300, 5], [1, 5, 6, 7], [1] + list(range(20, 60)), [1, 300, 301, 2, 9]]
NEW = 12
# bf16 logits of magnitude 16-32 (these random models') are 0.125 apart: a margin of 0.125 is one
# step, the nearest tie there is (the H200 run parted Q8_0 at exactly that); as the bf16 HF oracle's
# LOW_PRECISION_TIE (tests/enginecore/test_oracle.py)
NEAR_TIE = 0.125


async def _greedy(path: Path, tokenizer_dir: Path, mode: str, graphs: bool,
                  logprobs: int | None = None) -> tuple[list[list[int]], list[list[float]], int]:
    """Greedy tokens per prompt, each position's top-2 margin (with
    ``logprobs``), and the engine's resident weight bytes."""
    # four requests: graphs of 1, 2 and 4 (fewer captures and kernel specializations to compile)
    cfg = EngineConfig(model=ModelConfig(model=str(path), tokenizer=str(tokenizer_dir), max_model_len=128,
                                         quantized_weights=mode, dtype="bfloat16", cuda_graphs=graphs,
                                         cuda_graph_sizes=[1, 2, 4]),
                       scheduler=SchedulerConfig(max_num_seqs=4), device="cuda",
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
        return [t for t, _ in outs], [m for _, m in outs], engine.core.runner.weight_bytes
    finally:
        await engine.aclose()


# a K-quant and the 8-bit type (every type's kernel: tests/kernels/test_quant_gpu.py)
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0], ids=lambda q: q.name)
async def test_packed_engine_on_cuda(tmp_path, qtype):
    path = tmp_path / f"rand-{qtype.name}.gguf"
    write_random_gguf(path, qtype, hidden=512, inter=1024, layers=2, heads=8, kv_heads=2, vocab=512,
                      seed=int(qtype), context_length=128)
    tok = tmp_path / "bytes"  # no tokenizer.json: byte-level
    tok.mkdir()
    graphs, _, packed_bytes = await _greedy(path, tok, "packed", True)
    eager, _, _ = await _greedy(path, tok, "packed", False)
    dense, margins, dense_bytes = await _greedy(path, tok, "dequantize", True, logprobs=2)
    assert graphs == eager
    compared = 0
    for got, want, margin in zip(graphs, dense, margins, strict=True):
        assert len(margin) == len(want) == NEW
        parted = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        if parted is not None:
            assert margin[parted] <= NEAR_TIE, (got, want, margin)
        compared += NEW if parted is None else parted
    assert compared >= NEW * len(PROMPTS) // 2, (graphs, dense)  # mostly no tie at all
    assert packed_bytes < 0.6 * dense_bytes
