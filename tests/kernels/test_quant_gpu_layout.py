"""The GPU layout of packed weights (``kvstrata.kernels.quant_gpu_layout``)
and its kernels (``_triton_quant_gpu_layout``), run by the Triton
interpreter on CPU, and compiled for sm_90 on this host.

Pinned here:
- the layout holds the file's values and scales unchanged: read back, it
  is ``dequantize`` bit for bit (fp32) for every type it takes, on blocks
  with any finite fp16 scale; its bytes are the blocks' (Q4_K +2.8 %: the
  6-bit scales as bytes); ``rows``, ``cat_rows``, ``to`` and
  ``packed_embedding`` work on it, mixing it with blocks is refused;
- the GEMV's weights are ``dequantize``'s: one-hot rows of x read single
  weights back bit for bit, 1-8 tokens, at every position of a vector;
- its sums are within the stated tolerance of ``quant_matmul_ref`` for 1-8
  tokens, float32 / bfloat16 x, bias, rows and tokens that do not fill
  their tile, a K loop of many steps; more tokens dequantize the layout
  into the scratch buffer (bit-equal) then F.linear: the reference's result;
- without the interpreter a CPU runs the torch reference from the layout;
- what has no layout, or a bad one, is refused with an error naming it;
- the GEMV compiles for sm_90 with 128-bit loads of the words, no barrier
  or spill in its K loop, and at most ~5 instructions per weight at one
  token for Q4_0 (``tools/quant_gemv_sass.py`` prints the counts).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvstrata.config import EngineConfig, ModelConfig
from kvstrata.kernels import KernelArgumentError, QuantScratch, cat_rows, dequantize, pack_weight, quant_matmul
from kvstrata.kernels.quant_gpu_layout import (
    GPU_LAYOUT_TYPES,
    check_gpu_layout,
    gpu_layout_dequantize,
    with_gpu_layout,
)
from kvstrata.kernels.quant_linear import packed_embedding, quant_matmul_ref

triton = pytest.importorskip("triton")
from test_quant_kernels import assert_within, random_blocks  # noqa: E402

from kvstrata.kernels import _triton_quant_gpu_layout as kernels  # noqa: E402

TYPES = list(GPU_LAYOUT_TYPES)
TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _packed(qtype: str, rows: int, cols: int, seed: int = 0, any_scale: bool = False):
    blocks = torch.from_numpy(random_blocks(qtype, rows, cols, seed, any_scale=any_scale))
    return pack_weight(blocks, qtype, (rows, cols))


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# ---- the layout (pure torch) ------------------------------------------------------------------


@pytest.mark.parametrize("qtype", TYPES)
def test_layout_reads_back_dequantize_bit_for_bit(qtype):
    packed = _packed(qtype, 6, 512, seed=1, any_scale=True)
    relaid = with_gpu_layout(packed)
    assert relaid.data is None and relaid.planes is None and check_gpu_layout(relaid) is relaid
    assert _bits_equal(gpu_layout_dequantize(relaid), dequantize(packed))
    assert torch.equal(gpu_layout_dequantize(relaid, torch.bfloat16), dequantize(packed, torch.bfloat16))
    extra = 6 * 512 // 256 * 4 if qtype == "Q4_K" else 0  # the 6-bit scales and mins as 16 bytes, not 12
    assert relaid.nbytes == packed.nbytes + extra <= 1.03 * packed.nbytes


@pytest.mark.parametrize("qtype", TYPES)
def test_rows_cat_and_to_act_on_each_layout_tensor(qtype):
    a, b = _packed(qtype, 5, 256, seed=2), _packed(qtype, 3, 256, seed=3)
    ra, rb = with_gpu_layout(a), with_gpu_layout(b)
    index = torch.tensor([4, 0, 2])
    assert _bits_equal(gpu_layout_dequantize(ra.rows(index)), dequantize(a)[index])
    assert _bits_equal(gpu_layout_dequantize(ra.rows(slice(1, 3))), dequantize(a)[1:3])
    both = cat_rows([ra, rb])
    assert both.shape == (8, 256)
    assert _bits_equal(gpu_layout_dequantize(both), torch.cat([dequantize(a), dequantize(b)]))
    moved = ra.to("cpu")
    assert moved.gpu_layout is not None and _bits_equal(gpu_layout_dequantize(moved), dequantize(a))
    ids = torch.tensor([1, 1, 4])
    assert torch.equal(packed_embedding(ids, ra, torch.float32), dequantize(a)[ids])
    with pytest.raises(KernelArgumentError, match="mix GGUF blocks and GPU layouts"):
        cat_rows([ra, b])


def test_what_has_no_layout_or_a_bad_one_is_refused():
    with pytest.raises(KernelArgumentError, match="no GPU layout for Q4_1"):
        with_gpu_layout(_packed("Q4_1", 2, 64))
    relaid = with_gpu_layout(_packed("Q4_0", 2, 64))
    with pytest.raises(KernelArgumentError, match="GGUF blocks are gone"):
        with_gpu_layout(relaid)
    with pytest.raises(KernelArgumentError, match="re-laid for the GPU"):
        dequantize(relaid)
    q, d = relaid.gpu_layout
    with pytest.raises(KernelArgumentError, match=r"d must be torch.float16 \[2, 2\]"):
        check_gpu_layout(type(relaid)(relaid.qtype, relaid.shape, None, gpu_layout=(q, d[:, :1].contiguous())))
    with pytest.raises(KernelArgumentError, match="in_features a multiple of the block"):
        check_gpu_layout(type(relaid)(relaid.qtype, (2, 48), None, gpu_layout=relaid.gpu_layout))
    with pytest.raises(KernelArgumentError, match="beside its blocks"):
        check_gpu_layout(type(relaid)(relaid.qtype, relaid.shape, torch.zeros(2, 36, dtype=torch.uint8),
                                      gpu_layout=relaid.gpu_layout))
    with pytest.raises(KernelArgumentError, match="x must have 64 columns"):
        quant_matmul(torch.zeros(1, 32), relaid)
    with pytest.raises(ValueError, match="NV 3 must be a power of two"):
        kernels.layout_gemv_triton(torch.zeros(1, 64), relaid, None, torch.empty(1, 2),
                                   dict(BLOCK_T=1, BLOCK_N=1, NV=3, num_warps=4))
    k_quant = with_gpu_layout(_packed("Q4_K", 2, 512))
    with pytest.raises(ValueError, match="multiple of 8"):
        kernels.layout_gemv_triton(torch.zeros(1, 512), k_quant, None, torch.empty(1, 2),
                                   dict(BLOCK_T=1, BLOCK_N=1, NV=4, num_warps=4))


def test_the_config_switch_defaults_off_and_is_validated():
    assert ModelConfig().gpu_quant_layout is False
    EngineConfig(model=ModelConfig(gpu_quant_layout=True)).validate()
    with pytest.raises(ValueError, match="model.gpu_quant_layout must be true or false"):
        EngineConfig(model=ModelConfig(gpu_quant_layout="yes")).validate()


def test_a_cpu_without_the_interpreter_runs_the_reference_from_the_layout(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    packed = _packed("Q4_K", 24, 512, seed=4)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    assert torch.equal(quant_matmul(x, with_gpu_layout(packed), scratch=QuantScratch()), quant_matmul_ref(x, packed))


# ---- the kernels, interpreted ---------------------------------------------------------------


@pytest.mark.parametrize("qtype", TYPES)
def test_gemv_weights_are_dequantize_bit_for_bit(qtype, interpret):
    # one-hot rows of x, 8 tokens a call: over the calls the columns cover every position of a
    # vector (and of a K-quant block); every fp16 scale is any finite value
    rows, cols = 6, 512
    packed = _packed(qtype, rows, cols, seed=3, any_scale=True)
    relaid, want = with_gpu_layout(packed), dequantize(packed)
    for start in range(0, 64, 8):
        col = torch.arange(start, start + 8) + 64 * torch.arange(8)
        x = torch.zeros(8, cols)
        x[torch.arange(8), col] = 1.0
        # torch.equal: a weight -0.0 reads back +0.0 (the sum's zeros), every other value bit for bit
        assert torch.equal(quant_matmul(x, relaid), want[:, col].T), f"{qtype} columns {col.tolist()}"
    x = torch.zeros(1, cols)
    x[0, 37] = 1.0
    assert torch.equal(quant_matmul(x, relaid), want[:, 37:38].T)


def _reference(x, packed, bias=None) -> torch.Tensor:
    """x @ W.T + bias in float64, rounded once to x's dtype."""
    want = x.double() @ dequantize(packed).double().T + (0 if bias is None else bias.double())
    return want.to(x.dtype)


@pytest.mark.parametrize("qtype", TYPES)
def test_gemv_is_within_tolerance_of_the_reference(qtype, interpret):
    gen = torch.Generator().manual_seed(11)
    for tokens, rows, dtype, bias in ((1, 6, torch.float32, True), (2, 7, torch.bfloat16, True),
                                      (3, 9, torch.float32, False), (5, 5, torch.bfloat16, True),
                                      (8, 6, torch.float32, False)):
        packed = _packed(qtype, rows, 1024, seed=tokens)
        x = torch.randn(tokens, 1024, generator=gen).to(dtype)
        b = torch.randn(rows, generator=gen).to(dtype) if bias else None
        assert_within(quant_matmul(x, with_gpu_layout(packed), b), _reference(x, packed, b), x, packed, b)


@pytest.mark.parametrize("qtype", TYPES)
def test_gemv_tiles_rows_tokens_and_k_steps_that_do_not_fill(qtype, interpret):
    # 20 rows in tiles of 16, 3 tokens in tiles of 4, K in 4 steps
    packed = _packed(qtype, 20, 1024, seed=6)
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(6))
    out = torch.empty(3, 20)
    tiles = dict(BLOCK_T=4, BLOCK_N=16, NV=1024 // kernels.VECTOR_WEIGHTS[qtype] // 4, num_warps=4)
    kernels.layout_gemv_triton(x, with_gpu_layout(packed), None, out, tiles)
    assert_within(out, _reference(x, packed), x, packed, None)


@pytest.mark.parametrize("qtype", TYPES)
def test_larger_batches_dequantize_the_layout_then_multiply(qtype, interpret):
    packed = _packed(qtype, 24, 512, seed=5, any_scale=True)
    relaid = with_gpu_layout(packed)
    out = torch.empty(24 - 5, 512)
    kernels.layout_dequantize_rows_triton(relaid, 5, out)
    assert _bits_equal(out, dequantize(packed)[5:])
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(1))
    packed = _packed(qtype, 24, 512, seed=5)  # sane scales: F.linear of the reference's weights, bit for bit
    assert torch.equal(quant_matmul(x, with_gpu_layout(packed), scratch=QuantScratch()), quant_matmul_ref(x, packed))


# ---- compiled for sm_90 (no GPU needed) ------------------------------------------------------


def _sass_tool():
    sys.path.insert(0, str(TOOLS))
    try:
        import quant_gemv_sass
    finally:
        sys.path.remove(str(TOOLS))
    return quant_gemv_sass


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize(("qtype", "tokens", "most"), [("Q4_0", 1, 5.0), ("Q4_0", 8, 20.0), ("Q6_K", 1, 8.0)])
def test_compiles_for_sm90_with_128_bit_loads(qtype, tokens, most):
    tool = _sass_tool()
    try:
        c = tool.count(tool.compile_layout(qtype, tokens, 4096, 14336, "bf16"))
    except (NotImplementedError, RuntimeError) as e:  # pragma: no cover - no CUDA backend or ptxas here
        pytest.skip(f"cannot compile for sm_90 here: {e}")
    assert c["barriers"] == 0 and c["shuffles"] == 0 and c["local_memory"] == 0
    assert c["load_widths"]["LDG.E.128"] == c["weights_per_thread_step"] // 32  # every 4 words one load
    assert c["k_loop"] / c["weights_per_thread_step"] <= most


# ---- on a GPU --------------------------------------------------------------------------------

gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize(("tokens", "dtype"), [(1, torch.float32), (1, torch.bfloat16), (2, torch.bfloat16),
                                               (3, torch.bfloat16), (8, torch.bfloat16), (9, torch.bfloat16),
                                               (130, torch.bfloat16)])
def test_on_cuda_within_tolerance_and_one_hot_exact(qtype, tokens, dtype):
    packed = _packed(qtype, 4096 + 40, 1024, seed=tokens).to("cuda")
    relaid = with_gpu_layout(packed)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 1024, generator=gen, device="cuda").to(dtype)
    bias = torch.randn(packed.out_features, generator=gen, device="cuda").to(dtype)
    assert_within(quant_matmul(x, relaid, bias, scratch=QuantScratch()), _reference(x, packed, bias), x, packed, bias)
    hot = min(tokens, 8)
    one_hot = torch.zeros(hot, 1024, device="cuda")
    cols = torch.arange(hot, device="cuda") * 97 + 3
    one_hot[torch.arange(hot, device="cuda"), cols] = 1.0
    assert torch.equal(quant_matmul(one_hot, relaid), dequantize(packed)[:, cols].T)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qtype", TYPES)
def test_on_cuda_layout_and_dequantize_kernel_are_bit_exact(qtype):
    packed = _packed(qtype, 64, 2048, seed=9, any_scale=True).to("cuda")
    relaid = with_gpu_layout(packed)  # built on the GPU
    want = dequantize(packed)
    assert _bits_equal(gpu_layout_dequantize(relaid), want)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(64 - 3, 2048, device="cuda", dtype=dtype)
        kernels.layout_dequantize_rows_triton(relaid, 3, out)
        assert torch.equal(out, want[3:].to(dtype))
