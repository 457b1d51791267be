"""The matmul over packed GGUF weights (``quant.PackedWeight``), dequantizing
on the fly, and the embedding lookup of packed rows.

    quant_matmul(x [T, in], packed, bias=None, *, out=None, scratch=None, impl="auto") -> [T, out]
    quant_matmul_ref(x, packed, bias) = F.linear(x, dequantize(packed, x.dtype), bias)
    packed_embedding(ids [T], packed, dtype) -> [T, in]      the rows ``ids`` of the weight

Which code runs: CUDA -> the Triton kernels (impl "auto"/"triton": decode
batches of up to 8 tokens take ``_triton_quant_gemv`` (every packed type; 1-2
tokens its few-token kernel);
from PREFILL_DEQUANT_TOKENS (128) tokens, row chunks of the weight are
dequantized into the scratch buffer by ``_triton_quant.dequantize_rows_triton``
and multiplied by F.linear; everything else takes ``_triton_quant``'s
GEMV/GEMM; a weight re-laid for the GPU (``quant_gpu_layout``) takes
``_triton_quant_gpu_layout``: its GEMV up to 8 tokens, its layout
dequantized into the scratch buffer then F.linear above) or the reference
("torch"); CPU -> the weight's CPU path (``packed.cpu_path``, ``quant_cpu``;
a re-laid weight: the reference by row chunks read from its layout), or the
Triton interpreter ("triton", or "auto" under TRITON_INTERPRET=1).

Exactness and tolerance (S = |x| @ |W|.T + |bias|, the scale of the sum's terms):

    CPU "dequant" path         bit-equal to quant_matmul_ref
    Triton kernels             fp32 x: |err| <= K * 2^-24 * S (any order of a K-term fp32 sum)
                               bf16 x: <= 2^-7 * S (weights and sum rounded to bf16, 2^-9 each)
    few-token GEMV, Q4_1 Q5_1  as above with S' = |x| @ (|q d| + |m|).T for S: it sums d * x.q
    Q4_K Q5_K (with a min)     and m * sum(x) apart (S' is ~2-4x S on blocks centred by their min)
    GPU layout GEMV (1-8)      as the few-token GEMV: fp32 bound, S' for Q4_K; one-hot x bit for bit
    Triton, >= 128 tokens      F.linear on ``dequantize(W, x.dtype)``'s very values, by row chunks:
                               bit-equal to quant_matmul_ref where one chunk holds W (CPU, tested)
    CPU "int4" path            <= 2^-7 * S (bf16 x, scales and plane sums; measured <= 2^-8 * S)
    CPU "native" path          weights exact, x as given (float32 x: float32 FMAs; bf16 x: bf16 dot
                               products), float32 sums: |err| <= K * 2^-24 * S (3e-8 - 7e-8 S measured
                               against dequantize in float64, F.linear fp32 3e-8 - 1e-7 S); a float16
                               x goes as float32

The Triton kernels rebuild each weight with ``dequantize``'s operations
(fp-contraction off; the GEMV's FMAs are explicit), so they multiply by the
very same fp32 weights and differ from the reference by accumulation order
only (and for bf16 x by when the sum, and in ``_triton_quant`` the weights,
round to bf16); the few-token GEMV applies a word's scale to its sum of
x * (q - offset), so a single weight (one-hot x) is still ``dequantize``'s
rounding bit for bit. ``packed_embedding`` is
``dequantize`` of the rows (exact) while the blocks are kept, and the int4
planes' values (``quant_cpu.int4_rows``: scales in bf16, |err| <= 2^-8 of
each row's group scale times 15) once they were dropped for the int4 path,
or the native planes' (``quant_relayout.native_rows``: bit-equal to
``dequantize``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvstrata.kernels._checks import (
    KV_DTYPES,
    KernelArgumentError,
    check_inner_contiguous,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
)
from kvstrata.kernels.dispatch import is_interpreted, use_triton
from kvstrata.kernels.quant import PackedWeight, check_packed, dequantize
from kvstrata.kernels.quant_cpu import CPU_PATHS, QuantScratch, dequantized_linear, planes_rows
from kvstrata.kernels.quant_gpu_layout import check_gpu_layout, gpu_layout_dequantize, gpu_layout_rows_into

def quant_matmul(
    x: torch.Tensor,
    packed: PackedWeight,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    scratch: QuantScratch | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """``x @ W.T + bias`` [T, out_features] for x [T, in_features] (last dim
    contiguous) and W = the packed weight, never materialised whole.

    ``out``: a [T, out_features] buffer in x's dtype, any row stride (e.g. a
    column slice of a fused qkv output). ``scratch``: the buffers the CPU
    "dequant" path reuses (one per model); without it each call allocates.
    CUDA: the Triton kernel (impl "auto"/"triton") or ``quant_matmul_ref``
    ("torch"). CPU: ``packed.cpu_path`` ("auto"/"torch"), or the kernel in
    the Triton interpreter ("triton", or "auto" under TRITON_INTERPRET).
    """
    triton = use_triton(impl, x.device)
    relaid = isinstance(packed, PackedWeight) and packed.gpu_layout is not None  # a non-PackedWeight: a TypeError below
    _check_matmul_args(x, packed, bias, out, scratch, need_blocks=not relaid and (triton or x.device.type != "cpu"))
    if out is None:
        out = torch.empty((x.shape[0], packed.out_features), dtype=x.dtype, device=x.device)
    _run(x, packed, bias, out, scratch, triton)
    return out


def quant_matmul_unchecked(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor,
                         scratch: QuantScratch | None) -> None:
    """:func:`quant_matmul` into ``out`` for a caller that has already checked
    the arguments (``PackedLinear``: its parts at construction, its input's
    width): the same code runs, without the per-call argument checks (~8 us,
    a few percent of a small model's decode step over ~120 such calls)."""
    _run(x, packed, bias, out, scratch, use_triton("auto", x.device))


def _run(x, packed, bias, out, scratch, triton: bool) -> None:
    """The matmul into ``out`` on the code the arguments' device and ``triton`` pick."""
    if x.shape[0] == 0:
        return
    if triton:
        _matmul_triton(x, packed, bias, out, scratch)
    elif packed.gpu_layout is not None:  # the torch reference, by row chunks read from the layout
        dequantized_linear(x, packed, bias, out, scratch, PREFILL_CHUNK, torch.float32,
                           lambda start, w: gpu_layout_rows_into(packed, start, start + w.shape[0], w))
    elif x.device.type == "cpu":
        CPU_PATHS[packed.cpu_path].matmul(x, packed, bias, out, scratch)
    else:
        out.copy_(quant_matmul_ref(x, packed, bias))


def quant_matmul_ref(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference: F.linear with the weight dequantized to x's dtype (no checks;
    a weight re-laid for the GPU is read back from its layout, bit-equal)."""
    return F.linear(x, _dequantized(packed, x.dtype), bias)


def _dequantized(packed: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    if packed.gpu_layout is not None:
        return gpu_layout_dequantize(packed, dtype)
    return dequantize(packed, dtype)


# Token counts from which the Triton path dequantizes the weight into a scratch buffer (chunks of
# up to PREFILL_CHUNK weights, in x's dtype) and multiplies with torch: a prefill. The dequantizing
# GEMM re-reads and re-converts every weight once per 64 tokens, the dequantize-then-GEMM path once
# per call (the crossover by instruction counts is ~100 tokens; not yet timed on a GPU:
# ``tools/bench_quant.py --gpu-kernels`` times both at 512 tokens).
PREFILL_DEQUANT_TOKENS = 128
PREFILL_CHUNK = 1 << 25  # weights: 64 MB of bf16 scratch; a [4096, 4096] weight in one chunk

# The token counts the Triton path compiles apart, by their largest count: the few-token GEMV's 1
# and 2, the GEMV's and the small-tile kernel's power-of-two token tiles up to GEMV_MAX_TOKENS (4,
# 8), _triton_quant.tiles' 32 and 64 token tiles, then dequantize-then-multiply. (Which kernel
# and tile a count takes is by its class alone; tests/worker/test_warm_up_shapes.py checks it
# against the tile functions themselves.)
TOKEN_CLASS_TOPS = (1, 2, 4, 8, 32, PREFILL_DEQUANT_TOKENS - 1)


def token_class(num_tokens: int) -> int:
    """The class of ``num_tokens`` rows: calls of one class run the same compiled kernels."""
    return next((i for i, top in enumerate(TOKEN_CLASS_TOPS) if num_tokens <= top), len(TOKEN_CLASS_TOPS))


def token_class_counts(limit: int) -> list[int]:
    """One token count of each class that counts up to ``limit`` reach (its
    largest within the limit): what a warm-up runs so that no count up to
    ``limit`` compiles a packed matmul later."""
    counts, low = [], 1
    for top in (*TOKEN_CLASS_TOPS, PREFILL_DEQUANT_TOKENS):
        if low > limit:
            break
        counts.append(min(top, limit))
        low = top + 1
    return counts


def _matmul_triton(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor,
                   scratch: QuantScratch | None = None) -> None:
    from kvstrata.kernels._triton_quant import GEMV_MAX_TOKENS, quant_matmul_triton
    from kvstrata.kernels._triton_quant_gemv import GEMV_TYPES, quant_gemv_triton

    qt = packed.qtype
    if packed.gpu_layout is not None:
        _matmul_layout(x, packed, bias, out, scratch)
        return
    if x.shape[0] >= PREFILL_DEQUANT_TOKENS:
        _dequantize_then_mm(x, packed, bias, out, scratch)
        return
    # the interpreter's fp32 -> bf16/fp16 casts truncate: it writes fp32, torch rounds
    direct = out.dtype == torch.float32 or not is_interpreted(x.device)
    dest = out if direct else torch.empty(out.shape, dtype=torch.float32, device=out.device)
    # the GEMV reads 16/32-bit words of the blocks: their rows must start 4-byte aligned (an
    # allocation is; a PackedWeight built on a view at an odd offset takes the byte-wise kernel)
    if x.shape[0] <= GEMV_MAX_TOKENS and qt.name in GEMV_TYPES and packed.data.data_ptr() % 4 == 0:
        quant_gemv_triton(x, packed.data, qt.name, qt.type_size, packed.out_features, bias, dest)
    else:
        quant_matmul_triton(x, packed.data, qt.name, qt.block, qt.type_size, packed.out_features, bias, dest)
    if not direct:
        out.copy_(dest)


def _matmul_layout(x, packed: PackedWeight, bias, out, scratch: QuantScratch | None) -> None:
    """A weight re-laid for the GPU (``quant_gpu_layout``): up to LAYOUT_GEMV_MAX_TOKENS (8)
    tokens by its GEMV, more by row chunks dequantized from the layout into the scratch
    buffer (bit-equal to ``dequantize``), then F.linear (as ``_dequantize_then_mm``)."""
    from kvstrata.kernels._triton_quant_gpu_layout import (
        LAYOUT_GEMV_MAX_TOKENS,
        layout_dequantize_rows_triton,
        layout_gemv_triton,
    )

    interpreted = is_interpreted(x.device)
    if x.shape[0] > LAYOUT_GEMV_MAX_TOKENS:
        # the interpreter's float32 -> bf16 cast truncates: there the kernel writes float32, torch rounds
        w_dtype = torch.float32 if interpreted else x.dtype
        dequantized_linear(x, packed, bias, out, scratch, PREFILL_CHUNK, w_dtype,
                           lambda start, w: layout_dequantize_rows_triton(packed, start, w))
        return
    direct = out.dtype == torch.float32 or not interpreted
    dest = out if direct else torch.empty(out.shape, dtype=torch.float32, device=out.device)
    layout_gemv_triton(x, packed, bias, dest)
    if not direct:
        out.copy_(dest)


def _dequantize_then_mm(x, packed: PackedWeight, bias, out, scratch: QuantScratch | None) -> None:
    """``out`` = x @ W.T + bias by row chunks of W dequantized by the Triton kernel into the
    scratch buffer, in x's dtype (``dequantize(packed, x.dtype)``'s values, bit for bit), then
    F.linear: what the dequantize-at-load model computes, chunk by chunk."""
    from kvstrata.kernels._triton_quant import dequantize_rows_triton

    qt, k = packed.qtype, packed.in_features
    # the interpreter's float32 -> bf16 cast truncates: there the kernel writes float32, torch rounds
    w_dtype = torch.float32 if is_interpreted(x.device) else x.dtype
    dequantized_linear(x, packed, bias, out, scratch, PREFILL_CHUNK, w_dtype,
                       lambda start, w: dequantize_rows_triton(packed.data, qt.name, qt.block, qt.type_size, k,
                                                               start, w))


def _check_matmul_args(x, packed, bias, out, scratch, need_blocks: bool) -> None:
    check_packed(packed, need_blocks=need_blocks)
    if packed.gpu_layout is not None:
        check_gpu_layout(packed)
    check_tensor("x", x, 2, KV_DTYPES)
    check_inner_contiguous("x", x, 1)
    if x.shape[1] != packed.in_features:
        raise KernelArgumentError(
            f"x must have {packed.in_features} columns (the weight's in_features), got shape {tuple(x.shape)}"
        )
    held = packed.data if packed.data is not None else (packed.gpu_layout or packed.planes[0])[0]
    tensors = {"x": x, "packed": held}
    if bias is not None:
        check_tensor("bias", bias, 1, KV_DTYPES)
        check_shape("bias", bias, (packed.out_features,))
        check_same_dtype("x", x, bias=bias)
        check_inner_contiguous("bias", bias, 1)
        tensors["bias"] = bias
    if out is not None:
        check_tensor("out", out, 2, KV_DTYPES)
        check_shape("out", out, (x.shape[0], packed.out_features))
        check_same_dtype("x", x, out=out)
        check_inner_contiguous("out", out, 1)
        tensors["out"] = out
    check_same_device(**tensors)
    if scratch is not None and not isinstance(scratch, QuantScratch):
        raise TypeError(f"scratch must be a QuantScratch or None, got {type(scratch).__name__}")



def packed_embedding(ids: torch.Tensor, packed: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight's rows ``ids`` (int64 [T], on its device) in ``dtype``: an
    embedding lookup that reads only those rows' blocks (or planes)."""
    check_packed(packed, need_blocks=False)
    check_tensor("ids", ids, 1, (torch.int64, torch.int32))
    if packed.data is None and packed.planes is None and packed.gpu_layout is None:
        raise KernelArgumentError("packed has neither GGUF blocks nor planes nor a GPU layout")
    if dtype not in KV_DTYPES:
        raise KernelArgumentError(f"dtype must be one of float32, float16, bfloat16, got {dtype}")
    if ids.device != packed.device:
        raise KernelArgumentError(f"ids are on {ids.device}, packed on {packed.device}")
    if packed.gpu_layout is not None:
        return gpu_layout_dequantize(packed.rows(ids), dtype)
    if packed.data is None:
        return planes_rows(packed, ids, dtype)
    return dequantize(packed.rows(ids), dtype)
