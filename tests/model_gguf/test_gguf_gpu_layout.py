"""``model.gpu_quant_layout``: a GGUF's packed weights re-laid for the GPU
GEMV at load (``kernels/quant_gpu_layout.py``), on tiny random GGUFs:

- under TRITON_INTERPRET=1 on a CPU (where the Triton kernels run the
  matmuls, as on CUDA) the loader re-lays every packed weight of a type
  with a layout (blocks dropped; the weights within 1.03x the file's
  tensor bytes), keeps a type without one in its blocks, and greedy
  tokens equal the dequantize-at-load model's (float32: the GEMV for 1-8
  tokens, dequantize-then-F.linear for a longer prompt);
- without the interpreter the switch changes nothing on a CPU (its own
  paths run there);
- on CUDA (``pytest -m gpu``) a real engine with the switch decodes the
  dequantized engine's tokens up to a near tie. That needs ModelRunner to
  pass ``model.gpu_quant_layout`` to ``load_checkpoint``.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("triton")
from gguf import GGMLQuantizationType as Q  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gguf_writing import prompt_logits, write_random_gguf  # noqa: E402
from gpu_engines import assert_same_up_to_near_ties, greedy  # noqa: E402

from kvstrata.kernels import PackedWeight  # noqa: E402
from kvstrata.worker.model import load_checkpoint  # noqa: E402
from kvstrata.worker.model.gguf_file import GGUFCheckpoint  # noqa: E402
from kvstrata.worker.model.packed import PackedEmbedding, PackedLinear  # noqa: E402

SHAPE = dict(hidden=256, inter=256, layers=1, heads=4, kv_heads=2, vocab=320)


def _packed_parts(model) -> list[PackedWeight]:
    parts = []
    for m in model.modules():
        if isinstance(m, PackedLinear):
            parts += [p for p in m.parts if isinstance(p, PackedWeight)]
        elif isinstance(m, PackedEmbedding):
            parts.append(m.packed)
    return parts


def _greedy(ckpt, prompt: list[int], new: int, monkeypatch, interpret: bool) -> list[int]:
    """Greedy tokens, each step a prefill of the whole sequence so far; ``interpret``: the
    forwards under TRITON_INTERPRET=1 (the dequantized model runs without: its torch ops)."""
    ids = list(prompt)
    with monkeypatch.context() as m:
        if interpret:
            m.setenv("TRITON_INTERPRET", "1")
        for _ in range(new):
            ids.append(int(prompt_logits(ckpt, ids)[-1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize(("qtype", "tied", "types"), [
    (Q.Q4_0, True, None),
    (Q.Q4_K, False, {"output.weight": Q.Q6_K, "blk.0.attn_v.weight": Q.Q6_K, "blk.0.ffn_down.weight": Q.Q8_0,
                     "blk.0.attn_output.weight": Q.Q4_1}),
], ids=["Q4_0-tied", "Q4_K_M-like"])
def test_relaid_model_decodes_the_dequantized_models_tokens(tmp_path, monkeypatch, qtype, tied, types):
    path = tmp_path / "rand.gguf"
    write_random_gguf(path, qtype, **SHAPE, tied=tied, types=types, seed=7)
    with monkeypatch.context() as m:
        m.setenv("TRITON_INTERPRET", "1")
        relaid = load_checkpoint(str(path), "float32", "cpu", "packed", gpu_quant_layout=True)
    dense = load_checkpoint(str(path), "float32", "cpu", "dequantize")
    parts = _packed_parts(relaid.model)
    assert {p.qtype.name for p in parts if p.gpu_layout is not None} == ({"Q4_0"} if tied else {"Q4_K", "Q6_K", "Q8_0"})
    assert all((p.gpu_layout is None) == (p.qtype.name == "Q4_1" or p is relaid.model.model.embed_tokens.packed
                                          and not tied) for p in parts)
    file_bytes = sum(src.nbytes for _, src in GGUFCheckpoint(str(path)).tensor_sources())
    assert relaid.weight_bytes <= 1.03 * file_bytes
    assert relaid.fingerprint != load_checkpoint(str(path), "float32", "cpu", "packed").fingerprint
    prompt = [1, 17, 250, 3, 99]
    want = _greedy(dense, prompt, 6, monkeypatch, interpret=False)
    assert _greedy(relaid, prompt, 2, monkeypatch, interpret=True) == want[:2]  # 5-6 tokens a step: the GEMV
    # 9 tokens: the layout dequantized, then F.linear
    assert _greedy(relaid, prompt + want[:4], 1, monkeypatch, interpret=True) == want[4:5]


def test_without_the_interpreter_a_cpu_keeps_its_own_paths(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    path = tmp_path / "rand.gguf"
    write_random_gguf(path, Q.Q4_0, **SHAPE, seed=3)
    ckpt = load_checkpoint(str(path), "float32", "cpu", "packed", gpu_quant_layout=True)
    assert all(p.gpu_layout is None for p in _packed_parts(ckpt.model))


# ---- on a GPU --------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K], ids=lambda q: q.name)
def test_engine_with_the_gpu_layout_on_cuda(tmp_path, qtype):
    path = tmp_path / f"rand-{qtype.name}.gguf"
    write_random_gguf(path, qtype, hidden=512, inter=1024, layers=2, heads=8, kv_heads=2, vocab=512,
                      seed=int(qtype), context_length=128)
    tok = tmp_path / "bytes"
    tok.mkdir()
    got, _, packed_bytes, model = asyncio.run(greedy(path, tok, quantized_weights="packed", gpu_quant_layout=True))
    want, margins, dense_bytes, _ = asyncio.run(greedy(path, tok, logprobs=2, quantized_weights="dequantize"))
    relaid = any(p.gpu_layout is not None for p in _packed_parts(model))
    assert relaid, "ModelRunner did not pass model.gpu_quant_layout to load_checkpoint"
    assert_same_up_to_near_ties(got, want, margins)
    assert packed_bytes < 0.6 * dense_bytes
