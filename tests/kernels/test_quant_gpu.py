"""The dequantizing matmul compiled on CUDA: ``quant_matmul`` (Triton: the
decode GEMV up to 8 tokens, tl.dot tiles above, and from 128 tokens the
weight dequantized then F.linear, bit-equal to the reference) against ``x @ dequantize(W).T + b`` within the tolerance
``test_quant_kernels`` states, at decode and prefill token counts and a
realistic width; the decode GEMV's weights bit-equal to ``dequantize``'s;
``dequantize`` on the device bit-equal to the CPU one; no host sync, and a
CUDA graph replay equal to eager calls. Skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch

from kvstrata.kernels import dequantize, packed_embedding, quant_matmul, quant_matmul_ref
from kvstrata.kernels.quant import QUANT_TYPES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from test_quant_kernels import assert_within, random_packed  # noqa: E402

TYPES = list(QUANT_TYPES)
TOKENS = [1, 3, 8, 9, 40, 300]


def _inputs(qtype, tokens, dtype, seed, rows=392, cols=1024):
    packed = random_packed(qtype, rows, cols, seed, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, cols, generator=gen, device="cuda").to(dtype)
    bias = torch.randn(rows, generator=gen, device="cuda").to(dtype)
    return x, packed, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("qtype", TYPES)
def test_triton_matches_the_reference_at_decode_and_prefill_sizes(qtype, dtype):
    for tokens in TOKENS:
        x, packed, bias = _inputs(qtype, tokens, dtype, seed=tokens)
        got = quant_matmul(x, packed, bias)
        tol = 2.0**-7 if dtype == torch.float16 else None  # fp16: the bf16 bound holds a fortiori
        assert_within(got, quant_matmul_ref(x, packed, bias), x, packed, bias, tol)


@pytest.mark.parametrize("qtype", TYPES)
def test_device_dequantize_equals_the_cpu_one(qtype):
    packed = random_packed(qtype, 64, 512, seed=1, device="cuda")
    assert torch.equal(dequantize(packed).cpu(), dequantize(packed.to("cpu")))


def test_strided_x_and_an_out_slice():
    x, packed, bias = _inputs("Q4_K", 5, torch.bfloat16, seed=2)
    wide = torch.randn(5, 2048, device="cuda").to(torch.bfloat16)
    wide[:, 512:1536] = x
    fused = torch.zeros(5, 500, device="cuda", dtype=torch.bfloat16)
    quant_matmul(wide[:, 512:1536], packed, bias, out=fused[:, 100:492])
    assert_within(fused[:, 100:492], quant_matmul_ref(x, packed, bias), x, packed, bias)
    assert not fused[:, :100].any() and not fused[:, 492:].any()


def test_no_host_sync_and_graph_replay_equals_eager():
    x, packed, bias = _inputs("Q6_K", 4, torch.bfloat16, seed=3)
    out = torch.empty(4, packed.out_features, device="cuda", dtype=torch.bfloat16)
    quant_matmul(x, packed, bias, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        quant_matmul(x, packed, bias, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quant_matmul(x, packed, bias, out=out)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, quant_matmul(x, packed, bias))


@pytest.mark.parametrize("qtype", TYPES)
def test_decode_gemv_multiplies_by_the_exact_weights(qtype):
    # compiled: one-hot float32 rows read the weights back bit for bit, for 1-8 tokens
    # (every token tile), at a width of several K steps and a row count of several programs
    rows, cols = 2100, 4096
    packed = random_packed(qtype, rows, cols, seed=3, device="cuda")
    want = dequantize(packed)
    for tokens in range(1, 9):
        col = (torch.arange(tokens, device="cuda") * 577 + 63 * tokens) % cols
        x = torch.zeros(tokens, cols, device="cuda")
        x[torch.arange(tokens, device="cuda"), col] = 1.0
        assert torch.equal(quant_matmul(x, packed), want[:, col].T), f"{qtype}, {tokens} tokens"
    # one token (the few-token kernel: scale after each word's sum), float32 and bf16 x (two
    # values a 32-bit load; the sum rounds to bf16 as torch rounds): every position of a chunk
    for j in range(64):
        col = 37 * j % cols
        x = torch.zeros(1, cols, device="cuda")
        x[0, col] = 1.0
        assert torch.equal(quant_matmul(x, packed)[0], want[:, col]), f"{qtype}, column {col}"
        got = quant_matmul(x.to(torch.bfloat16), packed)[0]
        assert torch.equal(got, want[:, col].to(torch.bfloat16)), f"{qtype}, column {col}, bf16"


@pytest.mark.parametrize("qtype", TYPES)
def test_prefill_is_the_dequantized_models_matmul(qtype):
    # from 128 tokens: the weight dequantized to x's dtype in one chunk, then F.linear:
    # the very operands (and cuBLAS call) of the dequantize-at-load model
    x, packed, bias = _inputs(qtype, 300, torch.bfloat16, seed=4)
    assert torch.equal(quant_matmul(x, packed, bias), quant_matmul_ref(x, packed, bias))


@pytest.mark.parametrize("qtype", TYPES)
def test_a_packed_embedding_lookup_syncs_nothing_and_captures(qtype):
    """The packed token embedding runs inside the captured decode forward:
    its dequantize of the looked-up rows may make no host copy (a list made
    into a device tensor is one: a sync, which capture refuses)."""
    packed = random_packed(qtype, 96, 512, seed=4, device="cuda")
    ids = torch.tensor([5, 0, 95, 5], device="cuda")
    want = dequantize(packed, torch.bfloat16)[ids]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = packed_embedding(ids, packed, torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = packed_embedding(ids, packed, torch.bfloat16)
    ids.copy_(torch.tensor([1, 2, 3, 4]))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, dequantize(packed, torch.bfloat16)[ids])
