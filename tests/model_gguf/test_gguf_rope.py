"""RoPE scaling in GGUF files, as llama.cpp's converter writes it: Llama 3's
scaling as a ``rope_freqs`` tensor of per-dimension divisors (what a real
Llama-3.x GGUF holds), YaRN as ``rope.scaling.*`` metadata (Qwen2.5's
long-context setting). transformers' own GGUF loading drops both, so the
oracle is transformers on the original checkpoint, the one the GGUF was
converted from: greedy tokens identical."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "enginecore"))
from gguf_writing import write_tiny_gguf  # noqa: E402
from hf_utils import build_tiny_family, build_tiny_llama, hf_greedy  # noqa: E402

from kvstrata.config import CacheConfig, EngineConfig, ModelConfig  # noqa: E402
from kvstrata.enginecore.builder import build_engine_core  # noqa: E402
from kvstrata.enginecore.request import EngineRequest  # noqa: E402
from kvstrata.types import SamplingParams  # noqa: E402
from kvstrata.worker.model import CheckpointError, load_checkpoint  # noqa: E402
from kvstrata.worker.model.rope import inv_frequencies  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
PROMPT = [256, 17, 3, 99, 140, 255, 8, 8, 8, 61, 200, 4, 77, 13, 250, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144]
NEW = 10


def llama3_rope_freqs(head_dim: int, theta: float, rope: dict) -> np.ndarray:
    """What llama.cpp's converter writes for Llama 3's scaling: per pair of
    dimensions, the divisor of its frequency."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def engine_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    tok = path.parent / "bytes"  # the tiny files carry no tokenizer: a directory without one is byte-level
    tok.mkdir(exist_ok=True)
    core = build_engine_core(EngineConfig(model=ModelConfig(model=str(path), tokenizer=str(tok)),
                                          cache=CacheConfig(block_size=4, num_blocks=64)))
    core.add_request(EngineRequest(request_id="r", prompt_token_ids=prompt,
                                   sampling_params=SamplingParams(temperature=0.0, max_tokens=n)))
    got: list[int] = []
    while core.has_work():
        got += [t for out in core.step() for t in out.new_token_ids]
    assert core.kv.num_free_blocks == core.kv.num_blocks - 1  # every block back in the pool
    return got


def rotates_as_original(tmp_path: Path, model, arch: str, **scaling):
    """Write ``model`` as a GGUF with ``scaling`` (write_tiny_gguf's), check
    the engine's greedy tokens are transformers' on the original, and that
    the same file without the scaling (another model) gives other tokens.
    Returns the scaled file's loaded architecture."""
    path, plain = tmp_path / "scaled.gguf", tmp_path / "plain.gguf"
    write_tiny_gguf(path, model, arch, Q.F32, **scaling)
    write_tiny_gguf(plain, model, arch, Q.F32)
    want = hf_greedy(model, PROMPT, NEW)
    assert engine_greedy(path, PROMPT, NEW) == want
    assert engine_greedy(plain, PROMPT, NEW) != want
    return load_checkpoint(str(path), quantized_weights="dequantize").arch


def test_a_llama3_gguf_rotates_as_its_original(tmp_path):
    model = build_tiny_llama(tmp_path / "src", rope_scaling=LLAMA3)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    factors = llama3_rope_freqs(head_dim, 10000.0, LLAMA3)
    assert {1.0, 8.0} < set(factors.tolist())  # fast, slow and ramped pairs
    arch = rotates_as_original(tmp_path, model, "llama", rope_freqs=factors)
    assert arch.rope.freq_factors == tuple(factors.tolist())
    hf_inv = model.model.rotary_emb.inv_freq
    assert torch.allclose(inv_frequencies(arch.rope, head_dim), hf_inv, rtol=1e-6, atol=0)


def test_a_yarn_gguf_rotates_as_its_original(tmp_path):
    model = build_tiny_family(tmp_path / "src", "qwen2-yarn")  # factor 4 over 128 positions
    rope = rotates_as_original(tmp_path, model, "qwen2", yarn=(4.0, 128)).rope
    assert (rope.rope_type, rope.factor, rope.original_max_position_embeddings) == ("yarn", 4.0, 128)


def test_rope_scaling_kvstrata_does_not_run_is_named(tmp_path):
    model = build_tiny_family(tmp_path / "src", "qwen2")
    path = tmp_path / "longrope.gguf"
    write_tiny_gguf(path, model, "qwen2", Q.F32,
                    metadata={"qwen2.rope.scaling.type": "longrope", "qwen2.rope.scaling.factor": 4.0})
    with pytest.raises(CheckpointError, match=r"longrope\.gguf.*rope scaling 'longrope'"):
        load_checkpoint(str(path))
    write_tiny_gguf(path, model, "qwen2", Q.F32,
                    metadata={"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0})
    with pytest.raises(CheckpointError, match=r"yarn rope scaling without qwen2\.rope\.scaling\.original_context"):
        load_checkpoint(str(path))
