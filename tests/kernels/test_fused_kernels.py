"""The fused decoder-layer kernels (``kvstrata.kernels.fused``) on CPU.

Three things are pinned here:
- each torch reference is bit-equal to the unfused model code it replaces
  (``RMSNorm``, ``residual + x``, ``apply_rotary`` + ``reshape_and_cache``);
- each Triton kernel, run by the interpreter (``impl="triton"`` on CPU
  tensors), and each C kernel (``impl="auto"`` on CPU: ``fused_native``)
  equals its reference: exactly for the residual sum and RoPE, and
  for the norm and SiLU up to an ulp on a few elements (fp32 reduction order,
  ``exp``);
- bad arguments raise KernelArgumentError naming the argument, and the
  kernels compile for sm_90 with 16-byte loads (ptxas ships with triton).

Shapes are odd on purpose (hidden 96 and 200, head_dim 24, token counts 1, 7
and 33) and small: the interpreter pays per program step.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from kvstrata.kernels import (
    KV_LAYOUTS,
    KernelArgumentError,
    KVCacheShape,
    allocate_kv_caches,
    fused_add_rms_norm,
    reshape_and_cache,
    rotary_and_cache,
    silu_and_mul,
)
from kvstrata.kernels.fused_native import fused_kernels, fused_status
from kvstrata.worker.model.config import RopeConfig
from kvstrata.worker.model.layers import RMSNorm
from kvstrata.worker.model.rope import RotaryEmbedding, apply_rotary

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# impl "auto" on CPU tensors: the C kernels (fused_native), skipped where they cannot be built
NATIVE = pytest.param("auto", marks=pytest.mark.skipif(fused_kernels() is None, reason=f"no C fused kernels: {fused_status()}"))
TOKENS = [1, 7, 33]
EPS = 1e-5


def _randn(shape, dtype, seed, scale=1.0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _norm_weight(hidden, dtype, seed=0):
    return _randn((hidden,), torch.float32, seed, 0.2).add(1.0).to(dtype)


def _rms_module(weight: torch.Tensor) -> RMSNorm:
    norm = RMSNorm(weight.shape[0], EPS, weight.dtype, "cpu")
    norm.weight.data.copy_(weight)
    return norm


def _assert_near(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: within a few ulp. fp16/bf16: at most one ulp apart, on at most 1% of elements."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=4e-6, atol=1e-6)
        return
    ulp = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=ulp)
    assert (got == want).float().mean().item() >= 0.99, "more than 1% of elements differ from the reference"


# ---- fused_add_rms_norm -----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_reference_is_the_rmsnorm_module_on_the_sum(dtype):
    x, res = _randn((9, 200), dtype, 1), _randn((9, 200), dtype, 2)
    weight = _norm_weight(200, dtype)
    normed, summed = fused_add_rms_norm(x, res, weight, EPS, impl="torch")
    assert torch.equal(summed, res + x)
    assert torch.equal(normed, _rms_module(weight)(res + x))
    normed, same = fused_add_rms_norm(x, None, weight, EPS, impl="torch")
    assert same is x
    assert torch.equal(normed, _rms_module(weight)(x))


@pytest.mark.parametrize("impl", ["triton", NATIVE])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 200])
@pytest.mark.parametrize("tokens", TOKENS)
def test_add_rms_norm_triton_matches_reference(impl, dtype, hidden, tokens):
    # x is a strided view (rows of a wider buffer), as a projection's slice would be
    x = _randn((tokens, hidden + 8), dtype, tokens, 3.0)[:, 4 : 4 + hidden]
    res = _randn((tokens, hidden), dtype, tokens + 1, 3.0)
    weight = _norm_weight(hidden, dtype, seed=hidden)
    normed, summed = fused_add_rms_norm(x, res, weight, EPS, impl=impl)
    want_normed, want_summed = fused_add_rms_norm(x, res, weight, EPS, impl="torch")
    assert torch.equal(summed, want_summed), "the residual sum must round exactly as residual + x"
    _assert_near(normed, want_normed)


@pytest.mark.parametrize("impl", ["triton", NATIVE])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_without_residual_norms_x_and_returns_it(impl, dtype):
    x = _randn((7, 96), dtype, 5)
    weight = _norm_weight(96, dtype)
    before = x.clone()
    normed, residual = fused_add_rms_norm(x, None, weight, EPS, impl=impl)
    assert residual is x and torch.equal(x, before)
    _assert_near(normed, _rms_module(weight)(x))
    # with a static residual buffer (a captured graph's first layer): x is copied there
    buf = torch.full_like(x, 7.0)
    normed2, residual2 = fused_add_rms_norm(x, None, weight, EPS, residual_out=buf, impl=impl)
    assert residual2 is buf and torch.equal(buf, x) and torch.equal(normed2, normed)


@pytest.mark.parametrize("impl", ["torch", "triton", NATIVE])
def test_add_rms_norm_in_place_into_x_and_residual(impl):
    x, res = _randn((33, 200), torch.bfloat16, 6), _randn((33, 200), torch.bfloat16, 7)
    weight = _norm_weight(200, torch.bfloat16)
    want_normed, want_summed = fused_add_rms_norm(x, res, weight, EPS, impl="torch")
    normed, summed = fused_add_rms_norm(x, res, weight, EPS, out=x, residual_out=res, impl=impl)
    assert normed is x and summed is res
    assert torch.equal(res, want_summed)
    _assert_near(x, want_normed)


# ---- silu_and_mul -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [96, 200])
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul_triton_matches_llama_mlp_arithmetic(dtype, inter, tokens):
    gate_up = _randn((tokens, 2 * inter + 6), dtype, inter + tokens, 4.0)[:, 3 : 3 + 2 * inter]  # strided rows
    gate, up = gate_up.split(inter, dim=-1)  # LlamaMLP's split: gate first
    want = F.silu(gate) * up
    assert torch.equal(silu_and_mul(gate_up, impl="torch"), want)
    out = torch.full((tokens, inter), float("nan"), dtype=dtype)
    got = silu_and_mul(gate_up, out=out, impl="triton")
    assert got is out
    _assert_near(got, want)


# ---- rotary_and_cache ---------------------------------------------------------------


def _qkv(tokens, q_heads, kv_heads, head_dim, dtype, seed):
    """q, k, v as LlamaAttention makes them: views into one fused projection
    output, here with a padded row so the token stride is not the packed one."""
    width = (q_heads + 2 * kv_heads) * head_dim
    qkv = _randn((tokens, width + 8), dtype, seed, 2.0)[:, :width]
    q, k, v = qkv.split((q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    return (q.view(tokens, q_heads, head_dim), k.view(tokens, kv_heads, head_dim),
            v.view(tokens, kv_heads, head_dim))


def _cos_sin(tokens, head_dim, dtype, seed):
    positions = torch.randint(0, 5000, (tokens,), generator=torch.Generator().manual_seed(seed))
    return RotaryEmbedding(RopeConfig(theta=10000.0), head_dim).cos_sin(positions, dtype)


def _caches(layout, dtype, kv_heads, head_dim, num_blocks=12, block_size=4):
    shape = KVCacheShape(num_layers=2, num_blocks=num_blocks, block_size=block_size, num_kv_heads=kv_heads,
                         head_size=head_dim)
    backing, caches = allocate_kv_caches(shape, layout, dtype, "cpu")
    backing.copy_(_randn(backing.shape, dtype, 99))
    return backing, caches


def _slots(tokens, seed, num_slots=48):
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))[:tokens]
    slots[1::3] = -1  # padding
    return slots


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_reference_is_apply_rotary_then_reshape_and_cache(dtype):
    q, k, v = _qkv(7, 6, 2, 24, dtype, 1)
    cos, sin = _cos_sin(7, 24, dtype, 1)
    backing, caches = _caches("per_layer", dtype, 2, 24)
    want_backing = backing.clone()
    slots = _slots(7, 1)
    q_rot = rotary_and_cache(q, k, v, cos, sin, *caches[1], slots, impl="torch")
    assert torch.equal(q_rot, apply_rotary(q, cos, sin))
    reshape_and_cache(apply_rotary(k, cos, sin), v, want_backing[1, 0], want_backing[1, 1], slots, impl="torch")
    assert torch.equal(backing, want_backing)


@pytest.mark.parametrize("impl", ["triton", NATIVE])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", KV_LAYOUTS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rotary_and_cache_triton_equals_reference(impl, dtype, layout, tokens):
    q, k, v = _qkv(tokens, 6, 2, 24, dtype, tokens)
    cos, sin = _cos_sin(tokens, 24, dtype, tokens)
    backing, caches = _caches(layout, dtype, 2, 24)
    original, want_backing = backing.clone(), backing.clone()
    slots = _slots(tokens, tokens)
    want = rotary_and_cache(q, k, v, cos, sin, *_views(want_backing, layout)[1], slots, impl="torch")
    got = rotary_and_cache(q, k, v, cos, sin, *caches[1], slots, impl=impl)
    assert got.is_contiguous()
    assert torch.equal(got, want), "RoPE must round exactly as apply_rotary"
    assert torch.equal(backing, want_backing), "cache contents (k rotated, v copied, padding skipped)"
    assert not torch.equal(backing, original), "the kernel must have written the caches"


def _views(backing, layout):
    if layout == "per_layer":
        return [(backing[i, 0], backing[i, 1]) for i in range(backing.shape[0])]
    return [(backing[:, i, 0], backing[:, i, 1]) for i in range(backing.shape[1])]


@pytest.mark.parametrize("impl", ["torch", "triton", NATIVE])
def test_rotary_flat_cos_sin_in_place_q_and_gqa_group_of_eight(impl):
    dtype = torch.bfloat16
    q, k, v = _qkv(5, 8, 1, 64, dtype, 3)
    q = q.contiguous()
    cos, sin = _cos_sin(5, 64, dtype, 3)
    backing, caches = _caches("cross_layer", dtype, 1, 64, block_size=16, num_blocks=3)
    want_backing = backing.clone()
    want = rotary_and_cache(q, k, v, cos, sin, *_views(want_backing, "cross_layer")[0],
                            torch.tensor([3, 17, 18, -1, 40]), impl="torch")
    got = rotary_and_cache(q, k, v, cos[:, 0], sin[:, 0], *caches[0], torch.tensor([3, 17, 18, -1, 40]),
                           q_out=q, impl=impl)
    assert got is q and torch.equal(q, want)
    assert torch.equal(backing, want_backing)


def test_rotary_kernel_drops_slots_past_the_cache():
    # On CPU the entry point rejects such a slot (below); the kernel, which on
    # CUDA is not range-checked, must drop it rather than write out of bounds.
    from kvstrata.kernels._triton_fused import rotary_and_cache_triton

    q, k, v = _qkv(3, 2, 2, 8, torch.float32, 4)
    cos, sin = _cos_sin(3, 8, torch.float32, 4)
    backing, caches = _caches("per_layer", torch.float32, 2, 8, num_blocks=2)
    before = backing.clone()
    q_out = torch.empty(q.shape)
    rotary_and_cache_triton(q, k, v, cos, sin, *caches[0], torch.tensor([8, -1, 3]), q_out)
    assert torch.equal(q_out, apply_rotary(q, cos, sin))
    expected = before.clone()
    expected[0, 0, 0, 3] = apply_rotary(k, cos, sin)[2]  # layer 0, K, block 0, offset 3
    expected[0, 1, 0, 3] = v[2]
    assert torch.equal(backing, expected), "only slot 3 may have been written"


def test_empty_batches_launch_nothing():
    x = torch.empty((0, 96), dtype=torch.bfloat16)
    normed, summed = fused_add_rms_norm(x, x.clone(), torch.ones(96, dtype=torch.bfloat16), EPS, impl="triton")
    assert normed.shape == (0, 96) and summed.shape == (0, 96)
    assert silu_and_mul(torch.empty((0, 64)), impl="triton").shape == (0, 32)
    q, k, v = _qkv(0, 2, 1, 8, torch.float32, 0)
    backing, caches = _caches("per_layer", torch.float32, 1, 8)
    cos = torch.empty((0, 1, 4))
    assert rotary_and_cache(q, k, v, cos, cos, *caches[0], torch.empty(0, dtype=torch.int64),
                            impl="triton").shape == (0, 2, 8)


# ---- argument checks ----------------------------------------------------------------


def _norm_call(**over):
    args = dict(x=torch.zeros(4, 16), residual=torch.zeros(4, 16), weight=torch.ones(16), eps=EPS)
    args.update(over)
    return lambda: fused_add_rms_norm(**args)


def _rotary_call(**over):
    q, k, v = _qkv(3, 4, 2, 8, torch.float32, 0)
    kc, vc = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    args = dict(q=q, k=k, v=v, cos=torch.ones(3, 1, 4), sin=torch.ones(3, 1, 4), key_cache=kc, value_cache=vc,
                slot_mapping=torch.tensor([0, 1, 2]))
    args.update(over)
    return lambda: rotary_and_cache(**args)


@pytest.mark.parametrize("call,name", [
    (_norm_call(residual=torch.zeros(4, 8)), "residual"),
    (_norm_call(weight=torch.ones(8)), "weight"),
    (_norm_call(weight=torch.ones(16, dtype=torch.float16)), "weight"),
    (_norm_call(x=torch.zeros(16, 4).t()), "x"),
    (_norm_call(x=torch.zeros(4, 16, dtype=torch.int32)), "x"),
    (_norm_call(eps=-1.0), "eps"),
    (_norm_call(out=torch.zeros(4, 16, dtype=torch.bfloat16)), "out"),
    (_norm_call(residual=None, out=torch.zeros(4, 16)), None),  # fine: a separate out buffer
    (lambda: silu_and_mul(torch.zeros(4, 7)), "x"),
    (lambda: silu_and_mul(torch.zeros(4, 8), out=torch.zeros(4, 8)), "out"),
    (_rotary_call(q=torch.zeros(3, 4, 7), k=torch.zeros(3, 2, 7), v=torch.zeros(3, 2, 7)), "head_dim"),
    (_rotary_call(k=torch.zeros(3, 1, 8)), "key_cache"),
    (_rotary_call(v=torch.zeros(2, 2, 8)), "v"),
    (_rotary_call(cos=torch.ones(3, 1, 8)), "cos"),
    (_rotary_call(sin=torch.ones(3, 4, dtype=torch.bfloat16)), "sin"),
    (_rotary_call(q=torch.zeros(3, 8, 4).transpose(1, 2)), "q"),
    (_rotary_call(slot_mapping=torch.tensor([0, 1])), "slot_mapping"),
    (_rotary_call(slot_mapping=torch.tensor([0, 1, 16])), "slot_mapping"),
    (_rotary_call(slot_mapping=torch.tensor([0.0, 1.0, 2.0])), "slot_mapping"),
    (_rotary_call(q_out=torch.zeros(3, 4, 4)), "q_out"),
])
def test_bad_arguments_name_the_argument(call, name):
    if name is None:
        call()
        return
    with pytest.raises(KernelArgumentError, match=name):
        call()


def test_norm_outputs_must_not_alias_each_other_or_the_residual():
    x = torch.zeros(4, 16)
    with pytest.raises(KernelArgumentError, match="out and residual_out"):
        fused_add_rms_norm(x, torch.zeros(4, 16), torch.ones(16), EPS, out=x, residual_out=x)
    with pytest.raises(KernelArgumentError, match="out must not be x"):
        fused_add_rms_norm(x, None, torch.ones(16), EPS, out=x)


# ---- compiled for sm_90 -------------------------------------------------------------


def _compile_ptx(raw, types: dict[str, str], consts: dict[str, object]) -> str:
    pytest.importorskip("triton")
    from sm90 import compile_sm90  # skips where this triton cannot compile for CUDA here

    # what triton's launcher assumes of 16-byte-aligned pointers and strides divisible by 16
    aligned = tuple(name for name, ty in types.items() if ty.startswith("*") or name.endswith("stride"))
    kernel = compile_sm90(raw, types, consts, div16=aligned, enable_fp_fusion=False)
    assert "cubin" in kernel.asm
    return kernel.asm["ptx"]


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_fused_kernels_compile_for_sm90_with_16_byte_accesses(dtype):
    from kvstrata.kernels import _triton_fused as k

    rnd = dict(ROUND=k.round_fn.for_device(torch.device("cuda")), BF16_BITS=False)
    ptr = f"*{dtype}"
    norm = _compile_ptx(
        k._add_rms_norm_kernel,
        dict(x_ptr=ptr, res_ptr=ptr, w_ptr=ptr, out_ptr=ptr, res_out_ptr=ptr, num_rows="i32", x_stride="i32",
             res_stride="i32", out_stride="i32", res_out_stride="i32", eps="fp32"),
        dict(H=2048, H_PAD=2048, BLOCK_T=1, HAS_RESIDUAL=True, STORE_RESIDUAL=True, **rnd))
    silu = _compile_ptx(
        k._silu_and_mul_kernel, dict(x_ptr=ptr, out_ptr=ptr, num_rows="i32", x_stride="i32", out_stride="i32"),
        dict(I=5632, BLOCK_T=4, BLOCK_C=1024, **rnd))
    rope = _compile_ptx(
        k._rotary_and_cache_kernel,
        dict(q_ptr=ptr, k_ptr=ptr, v_ptr=ptr, cos_ptr=ptr, sin_ptr=ptr, key_cache_ptr=ptr, value_cache_ptr=ptr,
             slot_ptr="*i64", q_out_ptr=ptr, num_tokens="i32", num_slots="i32", q_stride="i32", k_stride="i32",
             v_stride="i32", cs_stride="i32", q_out_stride="i32", block_stride="i32"),
        dict(HQ=32, HKV=4, D=64, HALF_PAD=32, HEAD_BLOCK=4, VROW_PAD=256, BLOCK_SIZE=16, BLOCK_T=8, **rnd))
    for name, ptx in (("norm", norm), ("silu", silu), ("rope", rope)):
        narrow = re.findall(r"(?:ld|st)\.global\.(?:b16|u16|b32|u32|f32) ", ptx)
        wide = re.findall(r"(?:ld|st)\.global\.v4", ptx)
        assert wide and len(narrow) <= 2, f"{name}: {len(wide)} 16-byte and {len(narrow)} narrow accesses"
