"""``ModelRunner.warm_up`` (run at start on CUDA) covers every token tile of
the packed GGUF matmul (the few-token GEMV's for 1-2 tokens, the decode
GEMV's for 3-8 tokens of its formats, ``_triton_quant``'s otherwise), so a decode batch of any size compiles
nothing on the request path, with CUDA graphs off too (on, their captures
cover the sizes); and the LM head's, on every count of rows a step samples."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from kvstrata.kernels._triton_quant import GEMV_MAX_TOKENS, tiles  # noqa: E402
from kvstrata.kernels._triton_quant_gemv import FEW_MAX_TOKENS, GEMV_TYPES, gemv_few_tiles, gemv_tiles  # noqa: E402
from kvstrata.kernels.quant_linear import PREFILL_DEQUANT_TOKENS  # noqa: E402
from kvstrata.worker.model_runner import warm_up_logits_rows, warm_up_shapes  # noqa: E402


def _key(tokens: int, n: int, k: int, qtype: str) -> tuple:
    """The kernel ``quant_matmul`` takes on CUDA and its compile-time tiles."""
    if tokens <= FEW_MAX_TOKENS and qtype in GEMV_TYPES:  # x of the engine's activations: rows 4-byte aligned
        return ("few", *sorted(gemv_few_tiles(tokens, n, k, qtype).items()))
    if tokens <= GEMV_MAX_TOKENS and qtype in GEMV_TYPES:
        return ("gemv", *sorted(gemv_tiles(tokens, n, k, qtype).items()))
    return ("general", *sorted(tiles(tokens, n, k, interpreted=False).items()))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize(("max_tokens", "max_seqs"), [(8192, 256), (2048, 64), (512, 16), (64, 8)])
@pytest.mark.parametrize(("n", "k"), [(2560, 2048), (32000, 2048), (14336, 4096)])
def test_every_decode_batch_size_has_its_quant_tiles_warmed(max_tokens, max_seqs, n, k, qtype):
    shapes = warm_up_shapes(max_tokens, max_seqs, 4096)
    assert all(sum(q) <= max_tokens and len(q) <= max_seqs for q in shapes)
    warmed = {_key(sum(q), n, k, qtype) for q in shapes}
    missing = [t for t in range(1, max_seqs + 1) if _key(t, n, k, qtype) not in warmed]
    assert not missing, missing


@pytest.mark.parametrize("qtype", ["Q4_0", "Q6_K"])
@pytest.mark.parametrize(("max_tokens", "max_seqs"), [(8192, 256), (2048, 128), (2048, 64), (512, 16), (64, 8)])
def test_every_count_of_sampled_rows_has_its_lm_head_tiles_warmed(max_tokens, max_seqs, qtype):
    """The LM head runs on the rows a step samples (one per sequence), with
    the vocabulary as its N: its own tiles, warmed on their own."""
    n, k = 128256, 4096

    def key(rows: int) -> tuple:  # from PREFILL_DEQUANT_TOKENS rows: dequantize, then F.linear
        return ("dequantize",) if rows >= PREFILL_DEQUANT_TOKENS else _key(rows, n, k, qtype)

    shapes = warm_up_shapes(max_tokens, max_seqs, 4096)
    rows = warm_up_logits_rows(shapes, max_seqs)
    assert max(rows) <= max_seqs
    warmed = {key(r) for r in rows}
    missing = [r for r in range(1, max_seqs + 1) if key(r) not in warmed]
    assert not missing, missing


def test_prefill_shapes_come_first_and_fit_the_model():
    shapes = warm_up_shapes(8192, 256, 2048)
    assert shapes[0] == [2048] and shapes[1] == [1025] and [17, 1, 33] in shapes
    assert [1] * 64 in shapes and [1] * 2 in shapes
