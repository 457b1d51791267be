"""Packed GGUF weights and the dequantizing matmul (``kvstrata.kernels.quant``, ``quant_cpu``, ``quant_linear``) on CPU.

Pinned here:
- ``dequantize`` is bit-equal to ``gguf.quants.dequantize`` (then cast) for
  every packed type, on blocks of random bytes whose fp16 fields are any
  finite value (the gguf package cannot write K-quants, so blocks are built
  by hand), and on blocks gguf itself quantized (the 32-weight types);
- ``quant_matmul`` against ``x @ dequantize(W, x.dtype).T + b``, per path:
    "dequant" (CPU default)       bit-equal
    Triton (interpreter)          fp32: |err| <= K * 2^-24 * S;  bf16: <= 2^-7 * S
    "int4" (bf16 int4 kernel)     <= 2^-7 * S
  where S = |x| @ |W|.T + |b| (the scale of the sum's terms) and K =
  in_features: the kernels differ from the reference in accumulation order
  (K * 2^-24 bounds any order of a K-term fp32 sum), and for bf16 in when
  the weights and the result round to bf16 (2^-9 each), or the int4 path's
  bf16 scales;
- bad arguments raise KernelArgumentError naming the argument or type, and
  the kernel compiles for sm_90 (ptxas ships with triton).

Shapes are small (in_features 64 or 512, a few dozen rows): the interpreter
pays per program step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstrata.kernels import (
    KernelArgumentError,
    PackedWeight,
    QuantScratch,
    cat_rows,
    choose_cpu_path,
    dequantize,
    pack_weight,
    quant_matmul,
    quant_matmul_ref,
    quant_matmul_unchecked,
    packed_embedding,
    quant_type,
    with_cpu_path,
)
from kvstrata.kernels.quant import QUANT_TYPES

gguf_quants = pytest.importorskip("gguf.quants")
from gguf.constants import GGMLQuantizationType  # noqa: E402

TYPES = list(QUANT_TYPES)
SMALL_TYPES = [t for t in TYPES if QUANT_TYPES[t].block == 32]
# byte offsets of each type's fp16 fields (d, and m / dmin) in its block
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
def tolerance(dtype: torch.dtype, in_features: int) -> float:
    """The stated bound on |quant_matmul - reference| / S (see the module docstring)."""
    return in_features * 2.0**-24 if dtype == torch.float32 else 2.0**-7


# ---- builders ----------------------------------------------------------------------


def random_blocks(qtype: str, rows: int, cols: int, seed: int, *, any_scale: bool = False) -> np.ndarray:
    """uint8 [rows, cols // block * type_size]: random quant bits; fp16 fields
    of either sign with magnitudes in [1e-3, 1e-1] (weights of order 0.1..1),
    or any finite fp16 when ``any_scale`` (subnormals and 65504 included)."""
    qt = QUANT_TYPES[qtype]
    rng = np.random.default_rng(seed)
    nblocks = rows * cols // qt.block
    blocks = rng.integers(0, 256, (nblocks, qt.type_size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        if any_scale:
            bits = rng.integers(0, 1 << 16, nblocks, dtype=np.uint16)
            bits[(bits >> 10) & 31 == 31] &= np.uint16(0xBFFF)  # no inf / nan: clear an exponent bit
            value = bits.view(np.float16)
        else:
            value = (rng.uniform(1e-3, 1e-1, nblocks) * rng.choice([-1.0, 1.0], nblocks)).astype(np.float16)
        blocks[:, at:at + 2] = value.view(np.uint8).reshape(nblocks, 2)
    return blocks.reshape(rows, -1)


def random_packed(qtype: str, rows: int, cols: int, seed: int = 0, device: str = "cpu") -> PackedWeight:
    return pack_weight(torch.from_numpy(random_blocks(qtype, rows, cols, seed)), qtype, (rows, cols), device)


def gguf_dequantize(blocks: np.ndarray, qtype: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf_quants.dequantize(blocks, GGMLQuantizationType[qtype])))


def cols_for(qtype: str) -> int:
    """in_features: two blocks of a K-quant, two 32-blocks otherwise."""
    return 2 * QUANT_TYPES[qtype].block


def term_scale(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """S = |x| @ |W|.T + |b| in float64: what an error of the sum is measured against."""
    s = x.double().abs() @ dequantize(packed).double().abs().T
    return s if bias is None else s + bias.double().abs()


def assert_within(got: torch.Tensor, want: torch.Tensor, x, packed, bias, tol: float | None = None) -> None:
    """|got - want| <= tol * S elementwise; tol: the stated bound for x's dtype unless given."""
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = tolerance(x.dtype, packed.in_features) if tol is None else tol
    err = (got.double() - want.double()).abs() / term_scale(x, packed, bias)
    assert err.max().item() <= tol, f"max error {err.max().item():.3g} x S > {tol:.3g} x S"


def _inputs(qtype, tokens, dtype, seed, rows=40, bias=True):
    packed = random_packed(qtype, rows, cols_for(qtype), seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, packed.in_features, generator=gen).to(dtype)
    b = torch.randn(rows, generator=gen).to(dtype) if bias else None
    return x, packed, b


# ---- dequantize --------------------------------------------------------------------


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_is_gguf_bit_exact_on_any_finite_scales(qtype):
    blocks = random_blocks(qtype, 6, cols_for(qtype), seed=1, any_scale=True)
    want = gguf_dequantize(blocks, qtype)
    packed = pack_weight(torch.from_numpy(blocks), qtype, (6, cols_for(qtype)))
    got = dequantize(packed)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(dequantize(packed, dtype).view(torch.int16), want.to(dtype).view(torch.int16))


@pytest.mark.parametrize("qtype", SMALL_TYPES)
def test_dequantize_is_gguf_bit_exact_on_blocks_gguf_quantized(qtype):
    weights = np.random.default_rng(2).standard_normal((8, 96)).astype(np.float32)
    blocks = gguf_quants.quantize(weights, GGMLQuantizationType[qtype])
    got = dequantize(pack_weight(torch.from_numpy(blocks), qtype, (8, 96)))
    assert torch.equal(got, gguf_dequantize(blocks, qtype))


def test_quant_type_accepts_a_name_a_ggml_id_or_the_gguf_enum():
    assert quant_type("Q4_K") is quant_type(12) is quant_type(GGMLQuantizationType.Q4_K) is QUANT_TYPES["Q4_K"]


@pytest.mark.parametrize("qtype", ["Q2_K", "IQ4_NL", 10, GGMLQuantizationType.F16, None])
def test_unknown_quant_types_name_the_type(qtype):
    with pytest.raises(KernelArgumentError, match=f"qtype {qtype!r} is not a packed quant type"):
        pack_weight(torch.zeros(18, dtype=torch.uint8), qtype, (1, 32))


def test_rows_and_cat_rows_move_whole_weight_rows():
    a, b = random_packed("Q5_K", 4, 256, seed=3), random_packed("Q5_K", 2, 256, seed=4)
    order = torch.tensor([3, 0, 2, 1])
    assert torch.equal(dequantize(a.rows(order)), dequantize(a)[order])
    assert torch.equal(dequantize(cat_rows([a, b])), torch.cat([dequantize(a), dequantize(b)]))
    with pytest.raises(KernelArgumentError, match=r"weights\[1\] is Q6_K"):
        cat_rows([a, random_packed("Q6_K", 2, 256)])


# ---- quant_matmul ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", TYPES)
def test_cpu_dequant_path_equals_the_reference(qtype, dtype):
    x, packed, bias = _inputs(qtype, 5, dtype, seed=5)
    assert packed.cpu_path == "dequant"
    want = x @ dequantize(packed, dtype).T + bias
    assert torch.equal(quant_matmul(x, packed, bias, impl="torch"), quant_matmul_ref(x, packed, bias))
    assert_within(quant_matmul(x, packed, bias), want, x, packed, bias)


def test_cpu_dequant_path_in_chunks_reuses_the_scratch():
    # 4200 rows x 512: chunks of 2^20 weights = 2048 rows, the last one short
    packed = pack_weight(torch.from_numpy(random_blocks("Q4_0", 4200, 512, seed=6)), "Q4_0", (4200, 512))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    bias = torch.randn(4200, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    scratch = QuantScratch()
    got = quant_matmul(x, packed, bias, scratch=scratch)
    assert scratch.nbytes == 2048 * 512 * (4 + 2)  # one fp32 and one bf16 chunk
    assert torch.equal(got, quant_matmul_ref(x, packed, bias))
    quant_matmul(x, packed, bias, scratch=scratch)
    assert scratch.nbytes == 2048 * 512 * 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", TYPES)
def test_triton_kernel_matches_the_reference(qtype, dtype):
    # 3 tokens: broadcast (GEMV) tiles; 20 tokens: tl.dot tiles; 40 rows: a partial row tile
    for tokens, bias in ((3, True), (20, False)):
        x, packed, b = _inputs(qtype, tokens, dtype, seed=7 + tokens, bias=bias)
        got = quant_matmul(x, packed, b, impl="triton")
        assert_within(got, quant_matmul_ref(x, packed, b), x, packed, b)


@pytest.mark.parametrize("qtype", TYPES)
def test_cuda_tiles_run_by_the_interpreter_match_the_reference(qtype):
    # CUDA's tiles, not the interpreter's: GEMV with BLOCK_K 256 (1 token) and 32 (8 tokens),
    # GEMM with BLOCK_K 64 (40 tokens), so K-quant blocks span several tiles
    from kvstrata.kernels._triton_quant import quant_matmul_triton, tiles

    qt = QUANT_TYPES[qtype]
    for tokens in (1, 8, 40):
        x, packed, bias = _inputs(qtype, tokens, torch.float32, seed=10 + tokens, rows=20)
        out = torch.empty(tokens, 20)
        config = tiles(tokens, 20, packed.in_features, interpreted=False)
        quant_matmul_triton(x, packed.data, qtype, qt.block, qt.type_size, 20, bias, out, tile_config=config)
        assert_within(out, quant_matmul_ref(x, packed, bias), x, packed, bias)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K"])
def test_int4_path_is_within_bf16_tolerance(qtype):
    for dtype in (torch.float32, torch.bfloat16):
        x, packed, bias = _inputs(qtype, 5, dtype, seed=8, rows=32)
        fast = with_cpu_path(packed, "int4")
        assert fast.cpu_path == "int4" and fast.nbytes > packed.nbytes
        got = quant_matmul(x, fast, bias)
        assert_within(got, quant_matmul_ref(x, packed, bias), x, packed, bias, 2.0**-7)


def test_int4_path_may_drop_the_blocks_and_then_runs_nothing_else():
    x, packed, bias = _inputs("Q4_1", 3, torch.bfloat16, seed=11, rows=32)
    fast = with_cpu_path(packed, "int4")
    lean = with_cpu_path(fast, "int4", keep_blocks=False)
    assert lean.data is None and lean.nbytes == fast.nbytes - packed.nbytes
    assert torch.equal(quant_matmul(x, lean, bias), quant_matmul(x, fast, bias))
    for call in (lambda: dequantize(lean), lambda: quant_matmul(x, lean, impl="triton"),
                 lambda: with_cpu_path(lean, "dequant"), lambda: lean.rows(slice(0, 16))):
        with pytest.raises(KernelArgumentError, match="no GGUF blocks left"):
            call()
    with pytest.raises(KernelArgumentError, match="keep_blocks=False needs path 'int4'"):
        with_cpu_path(packed, "dequant", keep_blocks=False)


@pytest.mark.parametrize("rows", [32, 80, 208])  # a last block of 32, 16 and 16 rows after whole 64-row ones
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q5_K"])
def test_embedding_rows_read_back_from_the_int4_planes_are_the_planes_values(qtype, rows):
    """Once the blocks are dropped, ``packed_embedding`` rebuilds rows from
    torch's int4 layout: the exact rows up to the bf16 rounding of the
    planes' scales, and the weights the int4 kernel multiplies by (x = the
    identity gives W.T) up to its own bf16 arithmetic."""
    x, packed, _ = _inputs(qtype, 1, torch.bfloat16, seed=12, rows=rows)
    lean = with_cpu_path(packed, "int4", keep_blocks=False)
    ids = torch.tensor([0, rows - 1, rows // 2 + 1, 5, rows // 2, 5])
    got = packed_embedding(ids, lean, torch.float32)
    exact = dequantize(packed)[ids]
    scale = exact.abs().view(len(ids), -1, 32).amax(-1, keepdim=True).expand(-1, -1, 32).reshape(exact.shape)
    assert ((got - exact).abs() <= 2.0**-7 * scale).all()
    assert not torch.equal(got[0], got[1])  # a wrong row would be off by far more than the scales' rounding
    eye = torch.eye(packed.in_features, dtype=torch.bfloat16)
    kernel_w = quant_matmul(eye, lean).float().T  # [rows, in]
    assert ((got - kernel_w[ids]).abs() <= 2.0**-7 * scale).all()
    assert torch.equal(packed_embedding(ids, packed, torch.float32), exact)  # with the blocks: exact


def test_choose_cpu_path_offers_int4_to_fp32_activations_when_allowed():
    packed = random_packed("Q4_1", 32, 64)
    choice = choose_cpu_path(packed, (1,), dtype=torch.float32, reps=1, ring_bytes=0, allow_inexact=True)
    assert set(choice.times_ms) == {"dequant", "int4", "dense"}


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_out_may_be_a_column_slice_of_a_wider_buffer(impl):
    x, packed, bias = _inputs("Q6_K", 2, torch.float32, seed=9, rows=16)
    fused = torch.full((2, 40), 7.0)
    quant_matmul(x, packed, bias, out=fused[:, 8:24], impl=impl)
    assert torch.equal(fused[:, :8], torch.full((2, 8), 7.0)) and torch.equal(fused[:, 24:], torch.full((2, 16), 7.0))
    assert_within(fused[:, 8:24], quant_matmul_ref(x, packed, bias), x, packed, bias)


@pytest.mark.parametrize("path", ["dequant", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unchecked_matmul_is_the_checked_one_without_the_checks(path, dtype):
    # PackedLinear's entry: the same code as quant_matmul into a column slice, bit for bit
    x, packed, bias = _inputs("Q4_1", 3, dtype, seed=13, rows=32)
    weight = with_cpu_path(packed, path)
    want = torch.full((3, 48), 7.0, dtype=dtype)
    got = want.clone()
    quant_matmul(x, weight, bias, out=want[:, 8:40])
    quant_matmul_unchecked(x, weight, bias, got[:, 8:40], QuantScratch())
    assert torch.equal(got, want)
    quant_matmul_unchecked(x[:0], weight, bias, got[:0, 8:40], None)  # no tokens: nothing to do


def test_no_tokens_launch_nothing():
    packed = random_packed("Q4_0", 16, 64)
    for impl in ("torch", "triton"):
        assert quant_matmul(torch.empty(0, 64), packed, impl=impl).shape == (0, 16)


def test_choose_cpu_path_times_every_candidate_and_dense():
    packed = random_packed("Q4_1", 32, 64)
    exact = choose_cpu_path(packed, (1, 4), dtype=torch.float32, reps=1, ring_bytes=0)
    assert exact.path == "dequant" and set(exact.times_ms) == {"dequant", "dense"}
    assert set(exact.times_ms["dense"]) == {1, 4}
    fast = choose_cpu_path(packed, (1,), dtype=torch.bfloat16, reps=1, ring_bytes=0)
    assert set(fast.times_ms) == {"dequant", "int4", "dense"}
    assert fast.weight.cpu_path == fast.path and (fast.weight.planes is not None) == (fast.path == "int4")
    only = choose_cpu_path(random_packed("Q6_K", 16, 256), (1,), dtype=torch.bfloat16, reps=1, ring_bytes=0)
    assert set(only.times_ms) == {"dequant", "dense"}  # no int4 planes for Q6_K's 16-weight scales


# ---- argument errors ---------------------------------------------------------------

_P = random_packed("Q4_0", 16, 64)
_X = torch.zeros(2, 64)

BAD_CALLS = {
    "x_cols": (lambda: quant_matmul(torch.zeros(2, 32), _P), "x must have 64 columns"),
    "x_dims": (lambda: quant_matmul(torch.zeros(64), _P), "x must have 2 dims"),
    "x_dtype": (lambda: quant_matmul(_X.double(), _P), "x dtype"),
    "x_inner": (lambda: quant_matmul(torch.zeros(64, 2).T, _P), "x must be contiguous"),
    "bias_shape": (lambda: quant_matmul(_X, _P, torch.zeros(8)), "bias must have shape"),
    "bias_dtype": (lambda: quant_matmul(_X, _P, torch.zeros(16, dtype=torch.bfloat16)), "bias dtype"),
    "out_shape": (lambda: quant_matmul(_X, _P, out=torch.zeros(2, 8)), "out must have shape"),
    "impl": (lambda: quant_matmul(_X, _P, impl="cuda"), "impl must be one of"),
    "raw_size": (lambda: pack_weight(torch.zeros(17, dtype=torch.uint8), "Q4_0", (1, 32)), "raw has 17 bytes"),
    "raw_dtype": (lambda: pack_weight(torch.zeros(18, dtype=torch.int8), "Q4_0", (1, 32)), "raw dtype"),
    "in_features": (lambda: pack_weight(torch.zeros(18, dtype=torch.uint8), "Q4_K", (1, 32)), "multiple of Q4_K"),
    "data_shape": (lambda: dequantize(PackedWeight(_P.qtype, (16, 96), _P.data)), r"packed.data must be \[16"),
    "cpu_path": (lambda: quant_matmul(_X, PackedWeight(_P.qtype, _P.shape, _P.data, "int4")), "does not match"),
    "int4_rows": (lambda: with_cpu_path(random_packed("Q4_0", 8, 64), "int4"), "out_features % 16"),
    "int4_type": (lambda: with_cpu_path(random_packed("Q6_K", 16, 256), "int4"), "got Q6_K"),
    "path": (lambda: with_cpu_path(_P, "fast"), "path must be one of"),
    "dtype": (lambda: dequantize(_P, torch.int8), "dtype must be one of"),
    "tokens": (lambda: choose_cpu_path(_P, (0,)), "sample_tokens"),
    "ids_dtype": (lambda: packed_embedding(torch.zeros(2), _P, torch.float32), "ids dtype"),
    "no_planes": (lambda: packed_embedding(torch.zeros(2, dtype=torch.long),
                                           PackedWeight(_P.qtype, _P.shape, None), torch.float32), "nor planes"),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_arguments_name_the_argument(case):
    call, message = BAD_CALLS[case]
    with pytest.raises((KernelArgumentError, ValueError), match=message):
        call()


def test_a_non_packed_weight_is_a_type_error():
    with pytest.raises(TypeError, match="packed must be a PackedWeight"):
        quant_matmul(_X, torch.zeros(16, 64))


# ---- compiled for sm_90 ------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("qtype, dtype, tokens", [  # one type of each branch of _dequant_tile
    ("Q8_0", "bf16", 1), ("Q4_1", "fp32", 64), ("Q5_0", "bf16", 4), ("Q5_K", "bf16", 64), ("Q6_K", "fp32", 2),
])
def test_kernel_compiles_for_sm90(qtype, dtype, tokens):
    pytest.importorskip("triton")
    import triton.language as tl
    from sm90 import compile_sm90  # skips where this triton cannot compile for CUDA here

    from kvstrata.kernels import _triton_quant as k

    qt, cuda = QUANT_TYPES[qtype], torch.device("cuda")
    tiles = k.tiles(tokens, 4096, 4096, interpreted=False)
    ptr = f"*{dtype}"
    types = dict(x_ptr=ptr, w_ptr="*u8", bias_ptr=ptr, out_ptr=ptr, num_tokens="i32", x_stride="i32",
                 out_stride="i32")
    consts = dict(N=4096, K=4096, QT=k.QT_CODES[qtype], QK=qt.block, TS=qt.type_size,
                  DOT_DT=tl.bfloat16 if dtype == "bf16" else tl.float32, HAS_BIAS=True,
                  F16=k.f16_fn.for_device(cuda), DEQUANT=k.dequant_tile_fn.for_device(cuda),
                  **{name: v for name, v in tiles.items() if name.isupper()})
    kernel = compile_sm90(k._quant_matmul_kernel, types, consts, num_warps=tiles["num_warps"],
                          num_stages=tiles.get("num_stages", 1), enable_fp_fusion=False)
    assert "cubin" in kernel.asm
