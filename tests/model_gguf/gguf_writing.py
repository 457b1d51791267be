"""Tiny GGUF files written the way llama.cpp's converter writes them, for
the GGUF tests: metadata from an HF model's config, tensors under GGUF
names, 2-D weights in the quantization asked (norms in F32), Llama's q/k
rows permuted (its Qwen files are not), no output tensor when embeddings are
tied. ``write_tiny_gguf`` returns, per HF name, what a loader must get back."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf: str) -> str:
    stem, _, suffix = hf.rpartition(".")
    if stem in _TOP:
        return f"{_TOP[stem]}.{suffix}"
    _, _, i, *rest = stem.split(".")
    return f"blk.{i}.{_LAYER['.'.join(rest)]}.{suffix}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter layout for Llama's q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, model, arch: str, qtype: Q, *, eot: int | None = None,
                    rope_freqs: np.ndarray | None = None, yarn: tuple[float, int] | None = None,
                    metadata: dict[str, str | float] | None = None) -> dict[str, np.ndarray]:
    """``rope_freqs``: a rope_freqs tensor (llama.cpp's Llama 3 scaling);
    ``yarn``: (factor, original context) as rope.scaling metadata;
    ``metadata``: more keys (strings or float32s)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    if eot is not None:
        w.add_eot_token_id(eot)
        w.add_eom_token_id(eot + 1)
    if yarn is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(yarn[0])
        w.add_rope_scaling_orig_ctx_len(yarn[1])
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for key, value in (metadata or {}).items():
        (w.add_string if isinstance(value, str) else w.add_float32)(key, value)
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads} if arch == "llama" else {}
    expect = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output tensor for tied embeddings
        a = t.float().numpy()
        n_head = next((h for k, h in heads.items() if f".{k}." in name), None)
        stored = permute(a, n_head) if n_head else a
        if a.ndim == 2 and qtype != Q.F32:
            data = quantize(stored, qtype)
            w.add_tensor(gguf_name(name), data, raw_shape=data.shape, raw_dtype=qtype)
            back = dequantize(data, qtype).reshape(a.shape)
        else:
            w.add_tensor(gguf_name(name), stored.astype(np.float32))
            back = stored.astype(np.float32)
        expect[name] = unpermute(back, n_head) if n_head else back
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expect


def loaded_weights(ckpt) -> dict[str, np.ndarray]:
    """A loaded model's weights under HF names (the fused projections split)."""
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


from kvstrata.worker.model.gguf_random import RANDOM_FIELDS, random_quant_blocks, write_random_gguf  # noqa: E402,F401


def prompt_logits(ckpt, prompt: list[int], block_size: int = 4):
    """A loaded checkpoint's logits for every position of ``prompt`` (one prefill)."""
    import torch

    from kvstrata.kernels import KVCacheShape, allocate_kv_caches
    from kvstrata.worker.model.attention import AttentionMetadata

    arch, model, n = ckpt.arch, ckpt.model, len(prompt)
    nb = -(-n // block_size)
    shape = KVCacheShape(num_layers=arch.num_hidden_layers, num_blocks=nb + 1, block_size=block_size,
                         num_kv_heads=arch.num_key_value_heads, head_size=arch.head_dim)
    _, kv = allocate_kv_caches(shape, "per_layer", model.dtype, "cpu")
    pos = torch.arange(n)
    meta = AttentionMetadata(slot_mapping=(pos // block_size + 1) * block_size + pos % block_size,
                             block_tables=torch.arange(1, nb + 1, dtype=torch.int32)[None],
                             query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                             seq_lens=torch.tensor([n], dtype=torch.int32))
    return model.compute_logits(model(torch.tensor(prompt), pos, meta, kv))
