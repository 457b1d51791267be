"""GGUF files of the other families, written in the test as llama.cpp's
converter writes them (``qwen2``: q/k/v biases; ``qwen3``: per-head q/k
norms, explicit head_dim, tied embeddings; both with q/k unpermuted, NeoX
RoPE): every loaded weight equals the original's (F32) or its quantized
round trip (Q8_0); an end-of-turn/end-of-message id joins the EOS ids; a
GGUF architecture we do not map is named; tensors come in the dtype asked."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "enginecore"))
from gguf_writing import loaded_weights, write_tiny_gguf  # noqa: E402
from hf_utils import build_tiny_family  # noqa: E402

from kvstrata.worker.model import CheckpointError, load_checkpoint  # noqa: E402
from kvstrata.worker.model.gguf_file import GGUFCheckpoint  # noqa: E402

@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_every_weight_is_the_original(tmp_path, family, qtype):
    model = build_tiny_family(tmp_path / "src", family)
    path = tmp_path / f"{family}.gguf"
    expect = write_tiny_gguf(path, model, family, qtype)
    ckpt = load_checkpoint(str(path), quantized_weights="dequantize")  # the exact path, tensor by tensor
    assert ckpt.arch.architecture == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    if family == "qwen3":
        assert ckpt.arch.head_dim == model.config.head_dim != model.config.hidden_size // model.config.num_attention_heads
    got = loaded_weights(ckpt)
    assert set(got) == set(expect)
    for name, want in expect.items():
        assert np.array_equal(got[name], want.astype(np.float32)), name


def test_end_of_turn_and_message_ids_are_eos(tmp_path):
    model = build_tiny_family(tmp_path / "src", "qwen2")
    path = tmp_path / "eot.gguf"
    write_tiny_gguf(path, model, "qwen2", Q.F32, eot=300)
    assert GGUFCheckpoint(path).hf_config()["eos_token_id"] == [model.config.eos_token_id, 300, 301]
    assert load_checkpoint(str(path)).arch.eos_token_ids == (model.config.eos_token_id, 300, 301)


def test_tensors_come_in_the_dtype_asked(tmp_path):
    model = build_tiny_family(tmp_path / "src", "qwen3")
    path = tmp_path / "q3.gguf"
    expect = write_tiny_gguf(path, model, "qwen3", Q.F32)
    got = dict(GGUFCheckpoint(path).tensors(torch.bfloat16))
    assert {t.dtype for t in got.values()} == {torch.bfloat16}
    name = "model.layers.0.self_attn.q_norm.weight"
    assert torch.equal(got[name], torch.from_numpy(expect[name]).to(torch.bfloat16))


def test_an_unmapped_gguf_architecture_is_named(tmp_path):
    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="phi.gguf.*'phi3' is not supported"):
        load_checkpoint(str(path))
