"""The quantized matmul kernel compiled for an sm_90 GPU on this CPU host
(no GPU needed: triton's CUDA backend and its bundled ptxas), for every
packed type with the tiles ``tiles`` picks on CUDA: the GEMV tiles of
decode batches and the tl.dot tiles of prefill, with bf16 and fp32
activations; and the prefill path's row dequantizer for every type (bf16
scratch; fp16 and fp32 for one type each). A kernel the interpreter runs can still fail to compile
(shapes of tl.dot, layouts of the reshape of the dequantized tile)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from sm90 import compile_sm90  # noqa: E402

from kvstrata.kernels._triton_quant import (  # noqa: E402
    QT_CODES,
    _dequant_rows_kernel,
    _dequant_tile,
    _f16,
    _LAUNCH_OPTIONS,
    _quant_matmul_kernel,
    tiles,
)
from kvstrata.kernels.quant import quant_type  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")

_DT = {"bf16": tl.bfloat16, "fp32": tl.float32}


def _compile(qtype: str, tokens: int, n: int, k: int, dtype: str):
    t = tiles(tokens, n, k, interpreted=False)
    launch = {key: t.pop(key) for key in ("num_warps", "num_stages") if key in t}
    qt = quant_type(qtype)
    types = dict(x_ptr=f"*{dtype}", w_ptr="*u8", bias_ptr=f"*{dtype}", out_ptr=f"*{dtype}", num_tokens="i32",
                 x_stride="i32", out_stride="i32")
    consts = dict(N=n, K=k, QT=QT_CODES[qtype], QK=qt.block, TS=qt.type_size, DOT_DT=_DT[dtype], HAS_BIAS=False,
                  F16=triton.jit(_f16), DEQUANT=triton.jit(_dequant_tile), **t)
    return compile_sm90(_quant_matmul_kernel, types, consts, **launch, **_LAUNCH_OPTIONS), t


@pytest.mark.parametrize("qtype", sorted(QT_CODES))
@pytest.mark.parametrize(("tokens", "dtype"), [(1, "bf16"), (8, "bf16"), (64, "bf16"), (1, "fp32"), (64, "fp32")])
def test_quant_matmul_compiles_for_sm90(qtype, tokens, dtype):
    kernel, t = _compile(qtype, tokens, 2048, 2048, dtype)
    assert "cubin" in kernel.asm
    assert t["USE_DOT"] is (tokens > 8)
    ptx = kernel.asm["ptx"]
    if t["USE_DOT"] and dtype == "bf16":
        assert "mma" in ptx  # prefill tiles run on tensor cores


@pytest.mark.parametrize(("qtype", "dtype"), [(q, "bf16") for q in sorted(QT_CODES)] + [("Q4_K", "fp16"), ("Q6_K", "fp32")])
def test_dequantize_rows_compiles_for_sm90(qtype, dtype):
    # the prefill path's kernel: the weight's rows into a scratch buffer of x's dtype
    qt = quant_type(qtype)
    types = dict(w_ptr="*u8", out_ptr=f"*{dtype}", first_row="i32", num_rows="i32")
    consts = dict(K=4096, QK=qt.block, QT=QT_CODES[qtype], TS=qt.type_size, BLOCK_N=16, BLOCK_K=256,
                  F16=triton.jit(_f16), DEQUANT=triton.jit(_dequant_tile))
    kernel = compile_sm90(_dequant_rows_kernel, types, consts, div16=("out_ptr",), num_warps=4, **_LAUNCH_OPTIONS)
    assert "cubin" in kernel.asm
