"""The Triton kernels compile for CUDA (sm_90) on this CPU-only machine.

The interpreter runs the kernels' Python, not triton's compiler: loop-carried
types, early returns, constexpr branches and dot shapes are checked only when
compiling. Triton compiles ahead of time without a GPU (the wheel ships
ptxas), so these tests catch compile errors that would otherwise surface only
on the first GPU run. Integer arguments equal to 1 are compiled as
constants, as triton's launcher specialises them.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvstrata.kernels._triton_attention import _paged_attention_kernel  # noqa: E402
from kvstrata.kernels._triton_cache_write import _reshape_and_cache_kernel  # noqa: E402
from kvstrata.kernels._triton_transfer import _transfer_kernel  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")


def _compile(raw, types: dict[str, str], consts: dict[str, object]):
    fn = triton.jit(raw)
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    constexprs = {(fn.arg_names.index(name),): value for name, value in consts.items()}
    try:
        return triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=TARGET)
    except RuntimeError as e:  # pragma: no cover - only without the bundled ptxas
        if "ptxas" in str(e):
            pytest.skip(f"no ptxas: {e}")
        raise


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_attention_kernel_compiles(dtype):
    types = {name: "i32" for name in ("num_seqs", "window", "q_stride_t", "q_stride_h", "o_stride_t",
                                        "o_stride_h", "block_stride", "table_stride")}
    types.update(out_ptr=f"*{dtype}", q_ptr=f"*{dtype}", key_cache_ptr=f"*{dtype}", value_cache_ptr=f"*{dtype}",
                 table_ptr="*i32", qsl_ptr="*i32", seq_lens_ptr="*i32", scale_log2="fp32")
    consts = dict(NUM_KV_HEADS=8, GROUP=4, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SIZE=16, BLOCK_Q=4, BLOCK_M=16,
                  TILE_N=64, HAS_WINDOW=dtype == "fp16", UPCAST=False)
    if dtype == "bf16":  # one sequence, window 1: both specialised to constants by the launcher
        del types["num_seqs"], types["window"]
        consts.update(num_seqs=1, window=1)
    kernel = _compile(_paged_attention_kernel, types, consts)
    assert "cubin" in kernel.asm


@pytest.mark.parametrize("to_cache", [False, True])
def test_transfer_kernel_compiles(to_cache):
    types = dict(cache_ptr="*bf16", chunk_ptr="*bf16", slot_ptr="*i64", num_tokens="i32", num_slots="i32",
                 layer_stride="i64", kv_stride="i64", block_stride="i32")
    consts = dict(BLOCK_SIZE=16, ROW=1024, ROW_PAD=1024, BLOCK_T=4, TO_CACHE=to_cache)
    assert "cubin" in _compile(_transfer_kernel, types, consts).asm


def test_cache_write_kernel_compiles():
    types = dict(key_ptr="*fp16", value_ptr="*fp16", key_cache_ptr="*fp16", value_cache_ptr="*fp16",
                 slot_ptr="*i32", num_tokens="i32", num_slots="i32", key_stride="i32", value_stride="i32",
                 block_stride="i32")
    consts = dict(BLOCK_SIZE=16, ROW=640, ROW_PAD=1024, BLOCK_T=4)
    assert "cubin" in _compile(_reshape_and_cache_kernel, types, consts).asm
