"""Grouped-query self-attention over the paged KV cache.

Per layer and step: project q/k/v (one fused matmul), rotate q and k, write
the step's k/v into the paged cache at ``slot_mapping``
(``kvstrata.kernels.reshape_and_cache``), then attend from the cache
(``kvstrata.kernels.paged_attention``, varlen: every sequence's new tokens
back to back). Prefill, chunked prefill after a prefix-cache hit, and decode
are the same call; only the metadata differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kvstrata.worker.model.layers import Linear, RMSNorm
from kvstrata.worker.model.rope import apply_rotary
from kvstrata.kernels import paged_attention, reshape_and_cache, rotary_and_cache


@dataclass(slots=True, frozen=True)
class AttentionMetadata:
    """Where one step's tokens live in the paged cache (built by the model runner).

    ``slot_mapping`` int64 [T]: cache slot of each new token
    (block_id * block_size + offset). ``block_tables`` int32 [B, max_blocks]
    (0-padded), ``query_start_loc`` int32 [B + 1], ``seq_lens`` int32 [B]
    (context length including the new tokens). ``plans``: what the torch
    reference attention derives from them, kept by the first layer for the
    others (``paged_attention(plans=...)``): one step's, as these tensors are.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    plans: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def checked(self) -> bool:
        """A layer of this step has run with every kernel argument checked:
        the later ones, whose tensors have its shapes (one model, one cache
        shape), skip the checks (``check=False``), ~10 % of a CPU decode step."""
        return _CHECKED in self.plans

    def mark_checked(self) -> None:
        self.plans[_CHECKED] = True


_CHECKED = "kernel_args_checked"  # a key of AttentionMetadata.plans besides paged_attention's own


KVCache = tuple[torch.Tensor, torch.Tensor]  # (key_cache, value_cache) [num_blocks, block_size, Hkv, D]


class LlamaAttention(nn.Module):
    """q/k/v are one fused projection (``qkv_proj``), filled by the loader from
    HF's ``q_proj``/``k_proj``/``v_proj``: one matmul instead of three."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        o_bias: bool | None = None,
        qk_norm_eps: float | None = None,
        sliding_window: int | None = None,
    ) -> None:
        """``bias``: on q/k/v (and on o_proj unless ``o_bias`` says otherwise);
        ``qk_norm_eps``: RMSNorm each head of q and k before RoPE (Qwen3)."""
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        qkv_rows = self.q_size + 2 * self.kv_size
        self.qkv_proj = Linear(qkv_rows, hidden_size, bias, dtype, device)
        self.o_proj = Linear(hidden_size, self.q_size, bias if o_bias is None else o_bias, dtype, device)
        self.sliding_window = sliding_window
        self.fused = False  # RoPE and the KV cache write in one kernel
        self.split_decode = False  # decode attention split over the KV range (``paged_attention``)
        self.qk_norm = qk_norm_eps is not None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, dtype, device)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        key_cache, value_cache = kv_cache
        check = not meta.checked
        if self.fused:
            v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
            q = rotary_and_cache(q, k, v, cos, sin, key_cache, value_cache, meta.slot_mapping, check=check)
        else:
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
            v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
            reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        out = paged_attention(
            q,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            self.scale,
            sliding_window=self.sliding_window,
            split_decode=self.split_decode,
            plans=meta.plans,
            check=check,
        )
        return self.o_proj(out.reshape(num_tokens, self.q_size))
