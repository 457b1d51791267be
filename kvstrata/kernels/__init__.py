"""kvstrata.kernels: device-side KV cache operations and their stream handling.

Every operation has a torch reference and a Triton kernel (the CPU packed
matmul also native C ones, built at the first load); which one runs is
decided per call (``dispatch.py``): CUDA tensors -> compiled Triton, CPU
tensors -> the torch reference, or the Triton interpreter when
``TRITON_INTERPRET=1`` or ``impl="triton"``. Importing this package never
imports triton and never needs a GPU.

    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    paged_attention(query, key_cache, value_cache, block_tables, query_start_loc,
                    seq_lens, scale, sliding_window=None, out=None) -> Tensor
    gather_kv(kv_caches, slot_mapping, out=None) -> [L, 2, n, Hkv, D]
    scatter_kv(chunk, kv_caches, slot_mapping)
    gather_kv_segments(kv_caches, slot_mapping, S, out=None) -> [S, L, 2, n, Hkv, D]   (S chunks, one launch)
    scatter_kv_segments(chunk, kv_caches, slot_mapping)
    scatter_kv_layer_segments(chunks, layer, key_cache, value_cache, slot_mapping)  (one layer of S chunks)
    gather_kv_layer_segments(key_cache, value_cache, slot_mapping, chunks, layer)   (into one layer of S chunks)
    gather_kv_layer(key_cache, value_cache, slot_mapping, out=None) -> [2, n, Hkv, D]
    scatter_kv_layer(chunk, key_cache, value_cache, slot_mapping)
    allocate_kv_caches(KVCacheShape(...), "per_layer" | "cross_layer", dtype, device)
    KVStreams(device, num_layers)
    fused_add_rms_norm(x, residual, weight, eps, out=None, residual_out=None)
        -> (normed, new_residual)
    silu_and_mul(x, out=None) -> [T, I]
    rotary_and_cache(q, k, v, cos, sin, key_cache, value_cache, slot_mapping, q_out=None) -> q_rot
    pack_weight(raw, qtype, (out, in)) -> PackedWeight     GGUF blocks kept packed (quant.py)
    dequantize(packed, dtype) -> [out, in]                  bit-equal to gguf.quants.dequantize
    quant_matmul(x, packed, bias=None, out=None, scratch=None) -> x @ W.T + bias   (quant_linear.py)
    packed_embedding(ids, packed, dtype) -> [T, in]        the rows ids, dequantized
    choose_cpu_path(packed, sample_tokens) -> CpuChoice    one-time CPU micro-benchmark at load (quant_cpu.py)
    with_cpu_path(packed, "dequant" | "int4" | "native", keep_blocks=True) -> PackedWeight
        ("native": our C kernels, csrc/lowbit_bf16.c via quant_native.py, on quant_relayout's planes)

All kernel entry points also take ``impl="auto" | "torch" | "triton"``.
"""

from kvstrata.kernels._checks import KernelArgumentError
from kvstrata.kernels.attention import paged_attention, paged_attention_ref
from kvstrata.kernels.cache_write import reshape_and_cache, reshape_and_cache_ref
from kvstrata.kernels.dispatch import interpret_requested, use_triton
from kvstrata.kernels.fused import fused_add_rms_norm, rotary_and_cache, silu_and_mul
from kvstrata.kernels.layout import KV_LAYOUTS, KVCacheShape, allocate_kv_caches
from kvstrata.kernels.quant import QUANT_TYPES, PackedWeight, QuantType, cat_rows, dequantize, pack_weight, quant_type
from kvstrata.kernels.quant_cpu import CpuChoice, QuantScratch, choose_cpu_path, with_cpu_path
from kvstrata.kernels.quant_linear import packed_embedding, quant_matmul, quant_matmul_ref, quant_matmul_unchecked
from kvstrata.kernels.staging import StagedChunks
from kvstrata.kernels.streams import KVStreams, KVTransfer
from kvstrata.kernels.transfer import (
    gather_kv,
    gather_kv_layer,
    gather_kv_layer_ref,
    gather_kv_layer_segments,
    gather_kv_segments,
    scatter_kv,
    scatter_kv_layer,
    scatter_kv_segments,
    scatter_kv_layer_ref,
    scatter_kv_layer_segments,
)

__all__ = [
    "CpuChoice",
    "KV_LAYOUTS",
    "KVCacheShape",
    "KVStreams",
    "KVTransfer",
    "StagedChunks",
    "KernelArgumentError",
    "PackedWeight",
    "QUANT_TYPES",
    "QuantScratch",
    "QuantType",
    "allocate_kv_caches",
    "cat_rows",
    "choose_cpu_path",
    "dequantize",
    "fused_add_rms_norm",
    "gather_kv",
    "gather_kv_layer",
    "gather_kv_segments",
    "gather_kv_layer_ref",
    "gather_kv_layer_segments",
    "interpret_requested",
    "pack_weight",
    "packed_embedding",
    "paged_attention",
    "paged_attention_ref",
    "quant_matmul",
    "quant_matmul_ref",
    "quant_matmul_unchecked",
    "quant_type",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "rotary_and_cache",
    "scatter_kv",
    "scatter_kv_layer",
    "scatter_kv_segments",
    "scatter_kv_layer_ref",
    "scatter_kv_layer_segments",
    "silu_and_mul",
    "use_triton",
    "with_cpu_path",
]
