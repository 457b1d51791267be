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
from gguf.quants import dequantize, quantize  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "enginecore"))
from hf_utils import build_tiny_family  # noqa: E402
from test_gguf_quant_types import _loaded  # noqa: E402

from kvstrata.worker.model import CheckpointError, load_checkpoint  # noqa: E402
from kvstrata.worker.model.gguf_file import GGUFCheckpoint  # noqa: E402

_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _gguf_name(hf: str) -> str:
    stem, _, suffix = hf.rpartition(".")
    if stem in _TOP:
        return f"{_TOP[stem]}.{suffix}"
    _, _, i, *rest = stem.split(".")
    return f"blk.{i}.{_LAYER['.'.join(rest)]}.{suffix}"


def write_family_gguf(path: Path, model, arch: str, qtype: Q, *, eot: int | None = None) -> dict[str, np.ndarray]:
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    w.add_value_length(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    if eot is not None:
        w.add_eot_token_id(eot)
        w.add_eom_token_id(eot + 1)
    expect = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output tensor for tied embeddings
        a = t.float().numpy()
        if a.ndim == 2 and qtype != Q.F32:
            data = quantize(a, qtype)
            w.add_tensor(_gguf_name(name), data, raw_shape=data.shape, raw_dtype=qtype)
            expect[name] = dequantize(data, qtype).reshape(a.shape)
        else:
            w.add_tensor(_gguf_name(name), a.astype(np.float32))
            expect[name] = a
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expect


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_every_weight_is_the_original(tmp_path, family, qtype):
    model = build_tiny_family(tmp_path / "src", family)
    path = tmp_path / f"{family}.gguf"
    expect = write_family_gguf(path, model, family, qtype)
    ckpt = load_checkpoint(str(path))
    assert ckpt.arch.architecture == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    if family == "qwen3":
        assert ckpt.arch.head_dim == model.config.head_dim != model.config.hidden_size // model.config.num_attention_heads
    got = _loaded(ckpt)
    assert set(got) == set(expect)
    for name, want in expect.items():
        assert np.array_equal(got[name], want.astype(np.float32)), name


def test_end_of_turn_and_message_ids_are_eos(tmp_path):
    model = build_tiny_family(tmp_path / "src", "qwen2")
    path = tmp_path / "eot.gguf"
    write_family_gguf(path, model, "qwen2", Q.F32, eot=300)
    assert GGUFCheckpoint(path).hf_config()["eos_token_id"] == [model.config.eos_token_id, 300, 301]
    assert load_checkpoint(str(path)).arch.eos_token_ids == (model.config.eos_token_id, 300, 301)


def test_tensors_come_in_the_dtype_asked(tmp_path):
    model = build_tiny_family(tmp_path / "src", "qwen3")
    path = tmp_path / "q3.gguf"
    expect = write_family_gguf(path, model, "qwen3", Q.F32)
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
