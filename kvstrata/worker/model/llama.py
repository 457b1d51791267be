"""A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU)
running over the paged KV cache.

Module names mirror Hugging Face's ``LlamaForCausalLM`` (``model.layers.3.
self_attn.o_proj.weight``) except the two fused projections, ``qkv_proj``
and ``gate_up_proj``, which the loader fills from HF's separate tensors.
Tied embeddings share one tensor between ``embed_tokens`` and ``lm_head``.

The forward pass takes a flat batch: T tokens of B sequences back to back,
with their positions and an ``AttentionMetadata``; it returns hidden states
[T, hidden]. Logits are computed separately, for the rows that are sampled
only (a 2,000-token prefill chunk needs one row of logits, not 2,000).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.kernels import fused_add_rms_norm, silu_and_mul
from kvstrata.worker.model.attention import AttentionMetadata, KVCache, LlamaAttention
from kvstrata.worker.model.config import LlamaArchConfig
from kvstrata.worker.model.layers import Embedding, Linear, RMSNorm
from kvstrata.worker.model.native_layer import NativeLayer
from kvstrata.worker.model.rope import RotaryEmbedding


class LlamaMLP(nn.Module):
    """SwiGLU; gate and up are one fused projection [2 * intermediate, hidden]."""

    def __init__(self, cfg: LlamaArchConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.fused = False  # silu-and-mul in one kernel (``LlamaForCausalLM.use_fused_kernels``)
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(2 * cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, dtype, device)
        self.down_proj = Linear(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused:
            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaArchConfig, dtype: torch.dtype, device: torch.device | str,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.qkv_bias,
            dtype,
            device,
            o_bias=cfg.o_bias,
            qk_norm_eps=cfg.rms_norm_eps if cfg.qk_norm else None,
            sliding_window=sliding_window,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = LlamaMLP(cfg, dtype, device)
        self.fused = False  # residual add + RMSNorm in one kernel
        self.native: NativeLayer | None = None  # the fused forward as direct C calls (``use_native_layers``)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream form: takes the previous layer's MLP output ``x``
        and the stream before it (None for the first layer), returns this
        layer's MLP output and its stream. The sums are the ones HF's
        ``x = x + attn(norm(x)); x = x + mlp(norm(x))`` makes (addition is
        commutative in floating point too). With native layers on, a step's
        later layers (after the first checked the kernel arguments) run as
        direct C calls, bit-equal (``native_layer.py``)."""
        if self.native is not None and meta.checked:
            return self.native(x, residual, cos, sin, kv_cache, meta)
        if self.fused:
            check = not meta.checked  # the first layer of a step checks, the others share its shapes
            norm = self.input_layernorm
            h, residual = fused_add_rms_norm(x, residual, norm.weight, norm.eps, check=check)
            h = self.self_attn(h, cos, sin, kv_cache, meta)
            norm = self.post_attention_layernorm
            h, residual = fused_add_rms_norm(h, residual, norm.weight, norm.eps, check=check)
            return self.mlp(h), residual
        residual = x if residual is None else residual + x
        residual = residual + self.self_attn(self.input_layernorm(residual), cos, sin, kv_cache, meta)
        return self.mlp(self.post_attention_layernorm(residual)), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaArchConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        windows = cfg.layer_windows or (None,) * cfg.num_hidden_layers
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, dtype, device, windows[i])
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class LayerHooks(Protocol):
    """Called around each decoder layer (a KV connector's worker side): wait
    for layer i's KV to be loaded before it attends, save it once written."""

    def wait_for_layer_load(self, layer: int) -> None: ...

    def save_kv_layer(self, layer: int) -> None: ...


class LlamaForCausalLM(nn.Module):
    """Owns: the weights and the rotary frequencies. The KV cache is passed
    in per call (the model runner owns it)."""

    def __init__(self, cfg: LlamaArchConfig, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.model = LlamaModel(cfg, dtype, device)
        if cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.vocab_size, cfg.hidden_size, False, dtype, "meta")
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = Linear(cfg.vocab_size, cfg.hidden_size, False, dtype, device)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata | list[AttentionMetadata],
        kv_caches: list[KVCache],
        hooks: LayerHooks | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for ``input_ids`` [T] at ``positions`` [T];
        ``meta`` is one for every layer or a list of one per layer (its KV cache group's);
        ``hooks`` are called around each layer."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        metas = meta if isinstance(meta, list) else [meta] * len(kv_caches)
        residual = None
        for i, (layer, kv_cache, m) in enumerate(zip(self.model.layers, kv_caches, metas, strict=True)):
            if hooks is not None:
                hooks.wait_for_layer_load(i)
            x, residual = layer(x, residual, cos, sin, kv_cache, m)
            m.mark_checked()  # the layers after it skip the kernel argument checks
            if hooks is not None:
                hooks.save_kv_layer(i)
        norm = self.model.norm
        if norm.fused:
            return fused_add_rms_norm(x, residual, norm.weight, norm.eps)[0]
        return norm(residual + x)

    def use_split_decode(self, on: bool) -> None:
        """Decode attention split over each sequence's KV range (flash-decoding)."""
        for layer in self.model.layers:
            layer.self_attn.split_decode = on

    def use_fused_kernels(self, on: bool) -> None:
        """Run the decoder with fused kernels (RMSNorm with the residual add,
        RoPE with the KV cache write, SiLU-and-mul) or the unfused torch ops."""
        self.model.norm.fused = on
        for layer in self.model.layers:
            layer.fused = layer.mlp.fused = layer.self_attn.fused = on
            if not on:
                layer.native = None

    def use_native_layers(self, on: bool) -> str | None:
        """Run the fused decoder layers as direct kernel calls
        (``native_layer.py``: on a CPU, bit-equal) or not.
        Every layer or none: returns why not (the first layer that does not
        qualify, or the fused kernels off), else None."""
        bound = [None] * len(self.model.layers)
        if on:
            if not self.model.norm.fused:
                return "the fused kernels are off"
            for i, layer in enumerate(self.model.layers):
                native = NativeLayer.bind(layer)
                if isinstance(native, str):
                    return f"layer {i}: {native}"
                bound[i] = native
        for layer, native in zip(self.model.layers, bound, strict=True):
            layer.native = native
        return None

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, vocab] for hidden states [N, hidden]."""
        return self.lm_head(hidden).float()
