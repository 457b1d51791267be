"""GGUF files written in the test (gguf.GGUFWriter, the way llama.cpp's
converter lays a Llama out: q/k rows permuted, norms in F32) in several
quantization types: every weight kvstrata loads equals the quantized
round trip of the original, the q/k permutation undone."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "enginecore"))
from hf_utils import build_tiny_llama  # noqa: E402

from kvstrata.worker.model import CheckpointError, load_checkpoint  # noqa: E402

_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter layout for q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, i, *rest = hf.split(".")
    return f"blk.{i}.{_LAYER['.'.join(rest[:-1])]}.weight"


def write_tiny_gguf(path: Path, model, qtype: Q) -> dict[str, np.ndarray]:
    """Write ``model`` as a GGUF; returns, per HF name, what a loader must get back."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    expect = {}
    for name, t in model.state_dict().items():
        a = t.float().numpy()
        heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
        n_head = next((h for k, h in heads.items() if f".{k}." in name), None)
        stored = _permute(a, n_head) if n_head else a
        if a.ndim == 2 and qtype != Q.F32:
            data = quantize(stored, qtype)
            w.add_tensor(_gguf_name(name), data, raw_shape=data.shape, raw_dtype=qtype)
            back = dequantize(data, qtype).reshape(a.shape)
        else:
            w.add_tensor(_gguf_name(name), stored.astype(np.float32))
            back = stored.astype(np.float32)
        expect[name] = _unpermute_ref(back, n_head) if n_head else back
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expect


def _unpermute_ref(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _loaded(ckpt) -> dict[str, np.ndarray]:
    """The loaded model's weights under HF names (the fused projections split)."""
    out = {}
    cfg = ckpt.arch
    q, kv, inter = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    for name, p in ckpt.model.named_parameters():
        a = p.detach().float().numpy()
        if "qkv_proj" in name:
            for piece, (lo, hi) in zip(("q_proj", "k_proj", "v_proj"), ((0, q), (q, q + kv), (q + kv, q + 2 * kv))):
                out[name.replace("qkv_proj", piece)] = a[lo:hi]
        elif "gate_up_proj" in name:
            out[name.replace("gate_up_proj", "gate_proj")] = a[:inter]
            out[name.replace("gate_up_proj", "up_proj")] = a[inter:]
        else:
            out[name] = a
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-src"))


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda q: q.name)
def test_every_weight_is_the_quantized_original(tiny, tmp_path, qtype):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    expect = write_tiny_gguf(path, tiny, qtype)
    ckpt = load_checkpoint(str(path))
    got = _loaded(ckpt)
    assert set(got) == set(expect)
    for name, want in expect.items():
        assert np.array_equal(got[name], want.astype(np.float32)), name
    # and close to the original (the permutation really was undone)
    q = got["model.layers.0.self_attn.q_proj.weight"]
    orig = tiny.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert np.abs(q - orig).max() <= (1e-6 if qtype == Q.F32 else 0.25 * np.abs(orig).max())


def test_an_unknown_gguf_tensor_is_refused_by_name(tiny, tmp_path):
    path = tmp_path / "extra.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(320)
    w.add_tensor("blk.0.attn_mystery.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="attn_mystery"):
        load_checkpoint(str(path))
