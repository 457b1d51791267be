"""The split-K decode kernels compile for CUDA (sm_90) on this CPU-only machine.

The interpreter runs the kernels' Python, not triton's compiler: loop-carried
types, the data-dependent search branch and the dot shapes are checked only
when compiling. Compiled as the launcher compiles them: per-step arguments
(``do_not_specialize``) as plain i32, the rest with 16-byte divisibility.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
from sm90 import compile_sm90  # noqa: E402

from kvstrata.kernels._triton_attention import (  # noqa: E402
    MAX_SPLITS,
    _combine_splits_kernel,
    _paged_decode_kernel,
    decode_plan,
)

pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")


_DECODE_DIV16 = ("part_ptr", "lse_ptr", "q_ptr", "key_cache_ptr", "value_cache_ptr", "q_stride_t", "q_stride_h",
                 "block_stride")


@pytest.mark.parametrize(("dtype", "q_heads", "kv_heads", "head_dim", "window"), [
    ("bf16", 32, 4, 64, False),  # TinyLlama
    ("bf16", 32, 8, 128, True),
    ("fp16", 12, 2, 128, False),  # group 6 in 16 rows
    ("fp32", 8, 8, 80, False),  # padded head dim
])
def test_decode_kernel_compiles_pipelined(dtype, q_heads, kv_heads, head_dim, window):
    plan = decode_plan(8, q_heads, kv_heads, head_dim, num_sms=132)
    types = {name: "i32" for name in ("num_seqs", "window", "num_splits", "q_stride_t", "q_stride_h",
                                        "block_stride", "table_stride")}
    types.update(part_ptr="*fp32", lse_ptr="*fp32", q_ptr=f"*{dtype}", key_cache_ptr=f"*{dtype}",
                 value_cache_ptr=f"*{dtype}", table_ptr="*i32", qsl_ptr="*i32", seq_lens_ptr="*i32",
                 scale_log2="fp32")
    consts = dict(NUM_KV_HEADS=kv_heads, GROUP=q_heads // kv_heads, HEAD_DIM=head_dim,
                  HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=16, BLOCK_M=plan.block_m,
                  TILE_N=plan.tile_n, HAS_WINDOW=window, INTERPRETED=False)
    kernel = compile_sm90(_paged_decode_kernel, types, consts, div16=_DECODE_DIV16, num_warps=plan.num_warps,
                      num_stages=plan.num_stages)
    ptx = kernel.asm["ptx"]
    assert "cp.async" in ptx, "the KV loop must be software-pipelined (an scf.for, not a while)"


def test_combine_kernel_compiles():
    types = dict(out_ptr="*bf16", part_ptr="*fp32", lse_ptr="*fp32", num_splits="i32", o_stride_t="i32",
                 o_stride_h="i32")
    consts = dict(NUM_Q_HEADS=32, HEAD_DIM=128, HEAD_DIM_PAD=128, SPLITS_PAD=MAX_SPLITS)
    kernel = compile_sm90(_combine_splits_kernel, types, consts, div16=("out_ptr", "part_ptr", "lse_ptr", "o_stride_t",
                                                              "o_stride_h"), num_warps=4)
    assert "ld.global.v4.b32" in kernel.asm["ptx"]  # 16-byte reads of the fp32 partials
