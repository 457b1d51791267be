"""Shared builders for the kernel tests: small paged caches with known contents,
and the dense (unpaged) attention they must agree with; ``run_python`` for
the switches read once per process."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import torch


def run_python(code: str, **env: str | None) -> subprocess.CompletedProcess:
    """``python -c code`` (dedented) in a fresh process run from this directory
    (these helpers and the test modules importable), with ``env`` set on top
    of ours (None: unset)."""
    full_env = {**os.environ, **{k: v for k, v in env.items() if v is not None}}
    for k in (k for k, v in env.items() if v is None):
        full_env.pop(k, None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True,
                          text=True, timeout=120, cwd=os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class PagedBatch:
    """A varlen batch whose KV sits in a paged cache, plus the same data dense."""

    query: torch.Tensor  # [T, Hq, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    query_start_loc: torch.Tensor  # int32 [B+1]
    seq_lens: torch.Tensor  # int32 [B]
    keys: list[torch.Tensor]  # per seq, dense [seq_len, Hkv, D]
    values: list[torch.Tensor]
    q_lens: list[int]


def make_paged_batch(
    seq_lens: list[int],
    q_lens: list[int],
    *,
    block_size: int = 4,
    q_heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    sliding_window: int | None = None,
    null_fill: float = float("nan"),
    extra_table_cols: int = 1,
    seed: int = 0,
) -> PagedBatch:
    """Random K/V per sequence, scattered over shuffled physical blocks (block 0
    is the null block, filled with ``null_fill``). Table padding is 0; with a
    sliding window, blocks wholly out of the first new token's window are
    replaced by the null block, as the sliding-window manager does."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + 2
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=g).to(dtype)
    value_cache = torch.randn(shape, generator=g).to(dtype)
    key_cache[0] = null_fill
    value_cache[0] = null_fill
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    max_blocks = max(blocks_per_seq) + extra_table_cols
    tables = torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32)
    keys, values = [], []
    for b, (n, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        k = torch.randn((n, kv_heads, head_dim), generator=g).to(dtype)
        v = torch.randn((n, kv_heads, head_dim), generator=g).to(dtype)
        keys.append(k)
        values.append(v)
        first_visible = 0 if sliding_window is None else max(0, n - q_len - sliding_window + 1)
        for i in range(blocks_per_seq[b]):
            if (i + 1) * block_size <= first_visible:
                continue  # slid out of the window: stays the null block
            phys = perm.pop()
            tables[b, i] = phys
            rows = slice(i * block_size, min(n, (i + 1) * block_size))
            key_cache[phys, : rows.stop - rows.start] = k[rows]
            value_cache[phys, : rows.stop - rows.start] = v[rows]
    query = torch.randn((sum(q_lens), q_heads, head_dim), generator=g).to(dtype)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    return PagedBatch(
        query, key_cache, value_cache, tables, qsl, torch.tensor(seq_lens, dtype=torch.int32),
        keys, values, list(q_lens),
    )


def dense_attention(batch: PagedBatch, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Plain causal attention per sequence in float64 on the dense K/V."""
    outs = []
    start = 0
    q_heads = batch.query.shape[1]
    for k, v, q_len in zip(batch.keys, batch.values, batch.q_lens, strict=True):
        n = k.shape[0]
        q = batch.query[start : start + q_len].double()
        start += q_len
        group = q_heads // k.shape[1]
        kk = k.double().repeat_interleave(group, dim=1)  # [n, Hq, D]
        vv = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
        q_pos = torch.arange(n - q_len, n).unsqueeze(1)
        k_pos = torch.arange(n).unsqueeze(0)
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~mask, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
    return torch.cat(outs)
