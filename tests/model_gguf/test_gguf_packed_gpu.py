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

import sys
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from kvstrata.worker.model.gguf_random import write_random_gguf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engines import assert_same_up_to_near_ties, greedy  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


# a K-quant and the 8-bit type (every type's kernel: tests/kernels/test_quant_gpu.py)
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0], ids=lambda q: q.name)
async def test_packed_engine_on_cuda(tmp_path, qtype):
    path = tmp_path / f"rand-{qtype.name}.gguf"
    write_random_gguf(path, qtype, hidden=512, inter=1024, layers=2, heads=8, kv_heads=2, vocab=512,
                      seed=int(qtype), context_length=128)
    tok = tmp_path / "bytes"  # no tokenizer.json: byte-level
    tok.mkdir()
    graphs, _, packed_bytes, _ = await greedy(path, tok, quantized_weights="packed", cuda_graphs=True)
    eager, _, _, _ = await greedy(path, tok, quantized_weights="packed", cuda_graphs=False)
    dense, margins, dense_bytes, _ = await greedy(path, tok, logprobs=2, quantized_weights="dequantize",
                                                  cuda_graphs=True)
    assert graphs == eager
    assert_same_up_to_near_ties(graphs, dense, margins)
    assert packed_bytes < 0.6 * dense_bytes
