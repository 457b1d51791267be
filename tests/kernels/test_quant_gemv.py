"""The decode GEMV over GGUF blocks (``kvstrata.kernels._triton_quant_gemv``),
run by the Triton interpreter on CPU, and compiled for sm_90 on this host.

Pinned here:
- the weights it multiplies are ``dequantize``'s, bit for bit: one-hot rows
  of x read single weights back, on blocks whose fp16 scales are any finite
  value (subnormals and 65504 included), at every position of a chunk (the
  magic-number conversion and the scale * 2^-P trick are exact);
- sums against ``x @ dequantize(W).T + b`` within the stated tolerance for
  1-8 tokens (not only powers of two), float32 / bfloat16 / float16 x, with
  and without bias, rows and tokens that do not fill their last block, K of one block
  and K that is not a power of two (SmolLM2's 576);
- the few-token kernel (scale after the word's sum) too: one-hot rows of 1
  and 2 tokens read every position back bit for bit, in float32 and bf16 x
  (two values a 32-bit load); with a min its fp32 bound counts both terms (S');
- ``quant_matmul`` sends 1-2 tokens to the few-token kernel, 3-8 tokens and
  bf16 x at a 2-byte offset to the multi-token kernel (a spy on the
  launches), larger batches and unaligned blocks to ``_triton_quant``;
- ``gemv_tiles`` / ``gemv_few_tiles``: BLOCK_K divides K (the loop has no K
  mask), the accumulator (the few-token tile's words x tokens) stays within
  its budget, a weight of N rows gets ~N / 1024-row blocks; and the kernels
  compile for sm_90 for every format, token count and activation dtype,
  without local-memory spills, with fewer instructions per weight in their
  K loop than ``_triton_quant``'s GEMV tiles, and (1-2 tokens) no barrier:
  nothing through shared memory (``tools/quant_gemv_sass.py`` prints the
  counts);
- prefill batches (128 tokens and more) dequantize row chunks of the weight
  into the scratch buffer with ``_triton_quant.dequantize_rows_triton``
  (bit-equal to ``dequantize`` for every packed type) and multiply with
  F.linear: the reference's very result where one chunk holds the weight.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstrata.kernels import QuantScratch, dequantize, pack_weight, quant_matmul, quant_matmul_ref
from kvstrata.kernels.quant import QUANT_TYPES

triton = pytest.importorskip("triton")
pytest.importorskip("gguf.quants")
from test_quant_kernels import assert_within, random_blocks  # noqa: E402

from kvstrata.kernels import _triton_quant_gemv as gemv  # noqa: E402
from kvstrata.kernels._triton_quant import QT_CODES  # noqa: E402

_QT_NAMES = {code: name for name, code in QT_CODES.items()}

TOOLS = Path(__file__).resolve().parents[2] / "tools"
GEMV_TYPES = list(gemv.GEMV_TYPES)
BLOCK = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}  # weights per GGUF block


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


class _LaunchSpy:
    """Stands in for one of the module's LazyKernels: records (kernel, qtype) of every launch."""

    def __init__(self, real, name: str, seen: list) -> None:
        self.real, self.name, self.seen = real, name, seen

    def for_device(self, device):
        launcher = self.real.for_device(device)
        spy = self

        class _Grid:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    spy.seen.append((spy.name, _QT_NAMES[kwargs["QT"]]))
                    return launcher[grid](*args, **kwargs)

                return launch

        return _Grid()


@pytest.fixture
def calls(monkeypatch) -> list[tuple[str, str]]:
    """(kernel, qtype) of every GEMV launch: "few" (``_gemv_few_kernel``) or "many" (``_gemv_kernel``)."""
    seen: list[tuple[str, str]] = []
    monkeypatch.setattr(gemv, "gemv_few_kernel", _LaunchSpy(gemv.gemv_few_kernel, "few", seen))
    monkeypatch.setattr(gemv, "gemv_kernel", _LaunchSpy(gemv.gemv_kernel, "many", seen))
    return seen


def _packed(qtype: str, rows: int, cols: int, seed: int, any_scale: bool = False):
    return pack_weight(torch.from_numpy(random_blocks(qtype, rows, cols, seed, any_scale=any_scale)), qtype,
                       (rows, cols))


def _run(x, packed, bias=None, tiles=None) -> torch.Tensor:
    qt = packed.qtype
    out = torch.empty(x.shape[0], packed.out_features, dtype=torch.float32)
    gemv.quant_gemv_triton(x, packed.data, qt.name, qt.type_size, packed.out_features, bias, out, tile_config=tiles)
    return out


@pytest.mark.parametrize("qtype", GEMV_TYPES)
@pytest.mark.parametrize("tiles", [None, dict(BLOCK_T=8, BLOCK_N=2, BLOCK_K=256, num_warps=4)])
def test_weights_are_dequantize_bit_for_bit(qtype, tiles):
    # 8 one-hot rows per call; over the 8 calls the columns cover all 256 positions of a
    # K-quant block (so every position of every format's chunk), and across the 6 rows every
    # fp16 scale is any finite value: out[t, n] = 1 * W[n, col_t] + 0 + ... exactly
    rows, cols = 6, 512
    packed = _packed(qtype, rows, cols, seed=3, any_scale=True)
    want = dequantize(packed)
    for start in range(0, 64, 8):
        col = torch.arange(start, start + 8) + 64 * torch.arange(8)
        x = torch.zeros(8, cols)
        x[torch.arange(8), col] = 1.0
        got = _run(x, packed, tiles=tiles)
        assert torch.equal(got, want[:, col].T), f"{qtype} columns {col.tolist()}"


@pytest.mark.parametrize("c_last", [False, True])
@pytest.mark.parametrize("qtype", GEMV_TYPES)
def test_few_token_weights_are_dequantize_bit_for_bit(qtype, c_last, calls, monkeypatch):
    # the few-token kernel sums x . (q - OFF) per word and scales once: on one-hot x that is
    # still dequantize's rounding. Calls of 1 and 2 tokens in turn, token 0 at column 37 j mod
    # 256: every position of a 32-weight block (32 calls), of a K-quant's 64-weight chunk
    # (64), all 8 of its groups, half of them in each tile order (C_LAST: the triton version
    # picks one); bf16 x (read two values a 32-bit load) and float32 x alternate
    monkeypatch.setattr(gemv, "C_LAST", c_last)
    rows, cols = 6, 256
    packed = _packed(qtype, rows, cols, seed=7, any_scale=True)
    want = dequantize(packed)
    positions = 64 if BLOCK[qtype] == 256 else 32
    for i in range(positions // 2):
        j, tokens = 2 * i + c_last, 1 + i % 2
        col = torch.tensor([37 * j % cols, (37 * j + 101) % cols][:tokens])
        x = torch.zeros(tokens, cols, dtype=torch.bfloat16 if i % 4 >= 2 else torch.float32)
        x[torch.arange(tokens), col] = 1.0
        assert torch.equal(_run(x, packed), want[:, col].T), f"{qtype} columns {col.tolist()} {x.dtype}"
    assert calls == [("few", qtype)] * (positions // 2)


@pytest.mark.parametrize(("qtype", "dtype"), [(q, torch.float32) for q in GEMV_TYPES]
                         + [("Q4_0", torch.bfloat16), ("Q4_K", torch.float16), ("Q6_K", torch.bfloat16)])
def test_quant_matmul_runs_decode_batches_here_within_tolerance(qtype, dtype, calls):
    gen = torch.Generator().manual_seed(11)
    for tokens, rows, cols, bias in ((1, 6, 512, True), (2, 7, 576, True), (3, 9, 576, False), (5, 5, 256, True),
                                     (8, 6, 512, False)):
        if cols % QUANT_TYPES[qtype].block:
            cols = 512
        packed = _packed(qtype, rows, cols, seed=tokens)
        x = torch.randn(tokens, cols, generator=gen).to(dtype)
        b = torch.randn(rows, generator=gen).to(dtype) if bias else None
        got = quant_matmul(x, packed, b, impl="triton")
        want = x.double() @ dequantize(packed).double().T + (0 if b is None else b.double())
        assert_within(got, want.to(dtype), x, packed, b)
    assert calls == [("few", qtype)] * 2 + [("many", qtype)] * 3


@pytest.mark.parametrize(("qtype", "levels"), [("Q4_1", 16), ("Q5_1", 32)])
def test_few_token_bound_with_a_min_counts_both_terms(qtype, levels):
    # the few-token kernel sums d * x.q and m * sum(x) apart: the fp32 bound is K 2^-24 S' with
    # S' = |x| @ (|q d| + |m|).T. Centred blocks (m = -(levels - 1) / 2 d) make the two terms
    # cancel most: the bound holds there, where S' is over 2x S
    rows, cols = 16, 1024
    blocks = random_blocks(qtype, rows, cols, seed=4)
    flat = blocks.reshape(-1, QUANT_TYPES[qtype].type_size)
    d = flat[:, 0:2].copy().view(np.float16).astype(np.float32)
    flat[:, 2:4] = (-(levels - 1) / 2 * d).astype(np.float16).view(np.uint8)
    packed = pack_weight(torch.from_numpy(blocks), qtype, (rows, cols))
    w = dequantize(packed).double()
    m = torch.from_numpy(flat[:, 2:4].copy().view(np.float16).astype(np.float64)).reshape(rows, -1)
    m = m.repeat_interleave(32, dim=1)  # each weight's block min
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(4))
    got = _run(x, packed).double()
    s_both = x.double().abs() @ ((w - m).abs() + m.abs()).T
    err = (got - x.double() @ w.T).abs()
    assert (err <= cols * 2.0**-24 * s_both).all(), (err / s_both).max()
    assert (s_both / (x.double().abs() @ w.abs().T)).min() > 2


def test_larger_batches_take_the_general_kernel(calls):
    for qtype, tokens in (("Q4_0", 9), ("Q5_1", 12), ("Q6_K", 9)):
        packed = _packed(qtype, 8, 256, seed=1)
        x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(2))
        assert_within(quant_matmul(x, packed, impl="triton"), x @ dequantize(packed).T, x, packed, None)
    assert calls == []


@pytest.mark.parametrize("qtype", GEMV_TYPES)
def test_one_block_of_k_and_a_k_loop_of_many_steps(qtype):
    for cols, tiles in ((BLOCK[qtype], None), (1024, dict(BLOCK_T=1, BLOCK_N=4, BLOCK_K=BLOCK[qtype], num_warps=4))):
        packed = _packed(qtype, 5, cols, seed=cols)
        x = torch.randn(2, cols, generator=torch.Generator().manual_seed(cols))
        assert_within(_run(x, packed, tiles=tiles), x @ dequantize(packed).T, x, packed, None)


def _tile_cases(qtype: str, token_counts):
    """(tokens, N, K) over weight shapes whose K the format's block divides."""
    block = BLOCK[qtype]
    for tokens in token_counts:
        for n in (1, 20, 576, 1024, 4096, 14336, 28672):
            for k in (256, 576, 1536, 4096, 14336):
                if k % block == 0:
                    yield tokens, n, k


def _check_block_k(bk: int, k: int, block: int) -> None:
    assert k % bk == 0 and bk % block == 0 and (bk // block) & (bk // block - 1) == 0, (bk, k)


@pytest.mark.parametrize("qtype", GEMV_TYPES)
def test_gemv_tiles_fit_k_and_the_budget(qtype):
    block = BLOCK[qtype]
    for tokens, n, k in _tile_cases(qtype, range(1, 9)):
        t = gemv.gemv_tiles(tokens, n, k, qtype)
        bk, bn, bt = t["BLOCK_K"], t["BLOCK_N"], t["BLOCK_T"]
        _check_block_k(bk, k, block)
        assert bt >= tokens and bt * bn * bk <= 4096
        assert bn == max(1, min(16, triton.next_power_of_2(max(1, n // 1024)), 4096 // (bt * block)))
    with pytest.raises(ValueError, match="got Q2_K K=256"):
        gemv.gemv_tiles(1, 8, 256, "Q2_K")
    with pytest.raises(ValueError, match="K=96"):
        gemv.gemv_tiles(1, 8, 96, "Q4_K")
    x, packed = torch.zeros(1, 512), _packed("Q4_K", 4, 512, seed=1)
    for block_k in (128, 1024):  # not a multiple of the block; more than K
        with pytest.raises(ValueError, match=f"BLOCK_K {block_k}"):
            _run(x, packed, tiles=dict(BLOCK_T=1, BLOCK_N=1, BLOCK_K=block_k, num_warps=4))


@pytest.mark.parametrize("qtype", GEMV_TYPES)
def test_gemv_few_tiles_fit_k_and_the_word_budget(qtype):
    ch, u = gemv.GEOMETRY[qtype][:2]
    for tokens, n, k in _tile_cases(qtype, (1, 2)):
        t = gemv.gemv_few_tiles(tokens, n, k, qtype)
        bk, bn, bt = t["BLOCK_K"], t["BLOCK_N"], t["BLOCK_T"]
        _check_block_k(bk, k, BLOCK[qtype])
        assert (bt, bn) == (tokens, gemv.gemv_tiles(tokens, n, k, qtype)["BLOCK_N"])
        words = bk // ch * u * bn * bt
        assert words <= 1024 and (k % (2 * bk) or 2 * words > 1024), (n, k, t)  # the largest that fits


def test_bf16_x_at_an_odd_address_takes_the_multi_token_kernel(calls):
    # the few-token kernel reads bf16 x two values a 32-bit load: a row 2 bytes off that
    # alignment goes to the multi-token kernel, with the same result
    packed = _packed("Q4_0", 5, 256, seed=9)
    buffer = torch.randn(1, 257, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    x = buffer[:, 1:]
    assert x.data_ptr() % 4 == 2
    want = x.double() @ dequantize(packed).double().T
    assert_within(_run(x, packed), want.float(), x, packed, None)
    assert_within(_run(x.clone(), packed), want.float(), x, packed, None)
    assert calls == [("many", "Q4_0"), ("few", "Q4_0")]


def _sass_tool():
    sys.path.insert(0, str(TOOLS))
    try:
        return importlib.import_module("quant_gemv_sass")
    finally:
        sys.path.remove(str(TOOLS))


def test_sass_tool_counts_the_k_steps_an_unrolled_loop_body_makes():
    # ptxas may unroll the K loop: its exit test's counter then steps by a multiple of BLOCK_K
    unroll = _sass_tool()._unroll
    body = ["LDG.E.U16 R51, desc[UR6][R12.64+0x2]", "IADD3 R43, P0, R43, 0x400, RZ",
            "IADD3 R39, P1, R39, 0x240, RZ", "ISETP.GE.U32.AND P1, PT, R43, 0xf00, PT", "@!P1 BRA `(.L_x_0)"]
    assert unroll(body, 256) == 4 and unroll(body, 1024) == 1
    assert unroll(body, 384) == 1  # 0x400 is no multiple: one step, as before the tool counted steps
    assert unroll(["UIADD3 UR15, UP0, UR15, 0x800, URZ", "UISETP.GE.U32.AND UP0, UPT, UR15, 0xf00, UPT"], 512) == 4
    assert unroll(body[:3], 256) == 1  # no exit test on that register: one step


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("qtype", GEMV_TYPES)
def test_compiles_for_sm90_without_spills_and_with_fewer_instructions(qtype, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    tool = _sass_tool()
    try:
        tool.compile_gemv(qtype, 1, 256, 256, "bf16")
    except NotImplementedError as e:  # triton < 3.3 (as tests/kernels/sm90.py)
        pytest.skip(str(e))
    combos = ((1, "bf16"), (2, "fp16"), (4, "fp32"), (8, "bf16")) if qtype == "Q4_K" else ((1, "bf16"), (8, "fp32"))
    for tokens, dtype in combos:
        new = tool.count(tool.compile_gemv(qtype, tokens, 4096, 4096, dtype))
        assert new["local_memory"] == 0, f"{qtype} {tokens} tokens {dtype}: spills"
        assert new["k_loop"] > 0
    old = tool.count(tool.compile_general(qtype, 1, 4096, 4096, "bf16"))
    new = tool.count(tool.compile_gemv(qtype, 1, 4096, 4096, "bf16"))
    per_old = old["k_loop"] / old["weights_per_thread_step"]
    per_new = new["k_loop"] / new["weights_per_thread_step"]
    assert per_new < 0.8 * per_old, (per_new, per_old)  # measured 0.32-0.64 (triton 3.9), 0.33-0.63 (3.6)
    # the few-token kernel's loads all land in the layout its arithmetic uses: nothing goes
    # through shared memory (the multi-token kernel at 1-2 tokens: up to 148 barriers a step)
    for tokens in (1, 2):
        few = tool.count(tool.compile_gemv(qtype, tokens, 4096, 4096, "bf16"))
        assert few["barriers"] == 0 and few["local_memory"] == 0, (tokens, few)


def test_blocks_at_an_unaligned_address_take_the_byte_wise_kernel(calls):
    aligned = _packed("Q4_1", 4, 256, seed=5)
    buffer = torch.zeros(aligned.data.numel() + 2, dtype=torch.uint8)
    buffer[2:] = aligned.data.flatten()
    shifted = type(aligned)(aligned.qtype, aligned.shape, buffer[2:].view(aligned.data.shape))
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(5))
    want = x @ dequantize(aligned).T
    assert_within(quant_matmul(x, shifted, impl="triton"), want, x, aligned, None)
    assert calls == []
    assert_within(quant_matmul(x, aligned, impl="triton"), want, x, aligned, None)
    assert calls == [("few", "Q4_1")]


# ---- prefill: dequantize row chunks, then F.linear --------------------------------------


@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_dequantize_rows_kernel_is_dequantize_bit_for_bit(qtype):
    from kvstrata.kernels._triton_quant import dequantize_rows_triton

    qt = QUANT_TYPES[qtype]
    packed = _packed(qtype, 21, 512, seed=7, any_scale=True)
    want = dequantize(packed)
    for first, rows in ((0, 21), (5, 9), (20, 1)):
        out = torch.empty(rows, 512)
        dequantize_rows_triton(packed.data, qtype, qt.block, qt.type_size, 512, first, out)
        assert torch.equal(out, want[first:first + rows]), (first, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_batches_dequantize_then_multiply(dtype, calls, monkeypatch):
    from kvstrata.kernels import quant_linear

    packed = _packed("Q4_K", 40, 512, seed=8)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(quant_linear.PREFILL_DEQUANT_TOKENS, 512, generator=gen).to(dtype)
    bias = torch.randn(40, generator=gen).to(dtype)
    scratch = QuantScratch()
    # one chunk holds the weight: the reference's very computation
    assert torch.equal(quant_matmul(x, packed, bias, scratch=scratch, impl="triton"),
                       quant_matmul_ref(x, packed, bias))
    assert scratch.nbytes == 40 * 512 * (4 if dtype == torch.float32 else 4 + 2)  # interpreted: fp32, then x's
    # chunks of 6 rows (the last one 4): within the tolerance, the scratch sized for one chunk
    monkeypatch.setattr(quant_linear, "PREFILL_CHUNK", 6 * 512)
    small = QuantScratch()
    got = quant_matmul(x, packed, bias, scratch=small, impl="triton")
    assert_within(got, quant_matmul_ref(x, packed, bias), x, packed, bias)
    assert small.nbytes == 6 * 512 * (4 if dtype == torch.float32 else 6)
    # one token fewer takes the dequantizing GEMM (no scratch)
    unused = QuantScratch()
    fewer = x[:-1]
    assert_within(quant_matmul(fewer, packed, bias, scratch=unused, impl="triton"),
                  quant_matmul_ref(fewer, packed, bias), fewer, packed, bias)
    assert unused.nbytes == 0 and calls == []
