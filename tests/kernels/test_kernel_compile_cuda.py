"""The Triton kernels compile for CUDA (sm_90) on this CPU-only machine.

The interpreter runs the kernels' Python, not triton's compiler: loop-carried
types, early returns, constexpr branches and dot shapes are checked only when
compiling. Triton compiles ahead of time without a GPU (the wheel ships
ptxas), so these tests catch compile errors that would otherwise surface only
on the first GPU run. Integer arguments equal to 1 are compiled as
constants, as triton's launcher specialises them.
"""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")
from sm90 import compile_sm90  # noqa: E402

from kvstrata.kernels._triton_attention import _paged_attention_kernel  # noqa: E402
from kvstrata.kernels._triton_cache_write import _reshape_and_cache_kernel  # noqa: E402
from kvstrata.kernels._triton_transfer import _transfer_kernel  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")


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
    kernel = compile_sm90(_paged_attention_kernel, types, consts)
    assert "cubin" in kernel.asm


# The launcher marks pointers (16-byte aligned) and integers divisible by 16
# with tt.divisibility; do_not_specialize arguments (num_tokens, and the cache
# write's slot_ptr: a view into the step's buffer) never get it.
_COPY_DIV16 = ("cache_ptr", "chunk_ptr", "slot_ptr", "key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr")


def _compile_copy(raw, types, consts):
    div16 = tuple(a for a in _COPY_DIV16 if not (raw is _reshape_and_cache_kernel and a == "slot_ptr"))
    return compile_sm90(raw, types, consts, div16=div16, num_warps=4, num_stages=1)


def _memory_ops(ptx: str, op: str) -> set[str]:
    return set(re.findall(rf"{op}\.global(?:\.[a-z0-9]+)*", ptx))


_TRANSFER_TYPES = dict(cache_ptr="*bf16", chunk_ptr="*bf16", slot_ptr="*i64", num_tokens="i32", num_slots="i32",
                       seg_tokens="i32", seg_stride="i64",
                       layer_stride="i64", kv_stride="i32", block_stride="i32")


@pytest.mark.parametrize("segmented", [False, True])
@pytest.mark.parametrize("to_cache", [False, True])
@pytest.mark.parametrize(("row", "cols", "even"), [(256, 256, True), (640, 1024, False), (4096, 2048, True)])
def test_transfer_kernel_compiles_to_16_byte_accesses(to_cache, row, cols, even, segmented):
    """Strides carry no divisibility here (as when they are not multiples of 16):
    the kernel's own multiple_of hints must still give 16-byte vectors, for
    one chunk and for several (segments)."""
    consts = dict(BLOCK_SIZE=16, ROW=row, COLS=cols, BLOCK_T=max(1, 4096 // cols), EVEN=even, NUM_LKV=44,
                  ALIGN=16, TO_CACHE=to_cache, SEGMENTED=segmented)
    ptx = _compile_copy(_transfer_kernel, _TRANSFER_TYPES, consts).asm["ptx"]
    assert _memory_ops(ptx, "st") == {"st.global.v4.b32"}
    assert _memory_ops(ptx, "ld") == {"ld.global.v4.b32", "ld.global.b64"}  # data rows, int64 slots


def test_cache_write_kernel_compiles_to_16_byte_accesses():
    types = dict(key_ptr="*fp16", value_ptr="*fp16", key_cache_ptr="*fp16", value_cache_ptr="*fp16",
                 slot_ptr="*i32", num_tokens="i32", num_slots="i32", key_stride="i32", value_stride="i32",
                 block_stride="i32")
    consts = dict(BLOCK_SIZE=16, ROW=256, COLS=256, BLOCK_T=16, EVEN=True, SRC_ALIGN=8, DST_ALIGN=16)
    ptx = _compile_copy(_reshape_and_cache_kernel, types, consts).asm["ptx"]
    assert _memory_ops(ptx, "st") == {"st.global.v4.b32"}
    assert _memory_ops(ptx, "ld") == {"ld.global.v4.b32", "ld.global.b32"}


def test_cache_write_kernel_compiles_with_column_mask():
    types = dict(key_ptr="*bf16", value_ptr="*bf16", key_cache_ptr="*bf16", value_cache_ptr="*bf16",
                 slot_ptr="*i64", num_tokens="i32", num_slots="i32", key_stride="i32", value_stride="i32",
                 block_stride="i32")
    consts = dict(BLOCK_SIZE=16, ROW=640, COLS=1024, BLOCK_T=4, EVEN=False, SRC_ALIGN=16, DST_ALIGN=16)
    assert "cubin" in _compile_copy(_reshape_and_cache_kernel, types, consts).asm
