"""``ModelRunner.warm_up`` (run at start on CUDA) covers every token tile of
the packed GGUF matmul (the few-token GEMV's for 1-2 tokens, the decode
GEMV's for 3-8 tokens of its formats, ``_triton_quant``'s otherwise), so a
step of any token count (decode batch, prefill or mixed) compiles nothing
on the request path, with CUDA graphs off too (on, their captures cover the
sizes); and the LM head's, on every count of rows a step samples."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from kvstrata.kernels._triton_quant import GEMV_MAX_TOKENS, tiles  # noqa: E402
from kvstrata.kernels._triton_quant_gemv import FEW_MAX_TOKENS, GEMV_TYPES, gemv_few_tiles, gemv_tiles  # noqa: E402
from kvstrata.kernels.quant_linear import PREFILL_DEQUANT_TOKENS, token_class  # noqa: E402
from kvstrata.worker.model_runner import warm_up_logits_rows, warm_up_shapes  # noqa: E402


def _key(tokens: int, n: int, k: int, qtype: str) -> tuple:
    """The kernel ``quant_matmul`` takes on CUDA and its compile-time tiles."""
    if tokens <= FEW_MAX_TOKENS and qtype in GEMV_TYPES:  # x of the engine's activations: rows 4-byte aligned
        return ("few", *sorted(gemv_few_tiles(tokens, n, k, qtype).items()))
    if tokens <= GEMV_MAX_TOKENS and qtype in GEMV_TYPES:
        return ("gemv", *sorted(gemv_tiles(tokens, n, k, qtype).items()))
    return ("general", *sorted(tiles(tokens, n, k, interpreted=False).items()))


def _head_key(rows: int, qtype: str) -> tuple:
    """The LM head's kernel (N: a vocabulary of 128256): from
    PREFILL_DEQUANT_TOKENS rows it dequantizes, then F.linear."""
    return ("dequantize",) if rows >= PREFILL_DEQUANT_TOKENS else _key(rows, 128256, 4096, qtype)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_K", "Q6_K", "Q8_0"])
def test_a_token_class_is_one_kernel_and_tile(qtype):
    """quant_linear's classes of token counts agree with the tile functions:
    counts of one class take one compiled kernel, of two classes two."""
    for n, k in ((2560, 2048), (32000, 2048), (14336, 4096)):
        by_class: dict[int, set] = {}
        for t in range(1, 300):
            by_class.setdefault(token_class(t), set()).add(_head_key(t, qtype) if t >= PREFILL_DEQUANT_TOKENS
                                                           else _key(t, n, k, qtype))
        assert all(len(keys) == 1 for keys in by_class.values()), by_class
        assert len(set().union(*by_class.values())) == len(by_class)


LIMITS = [(8192, 256), (2048, 64), (512, 16), (64, 8), (2048, 4), (2048, 2), (2048, 1), (100, 1)]


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize(("max_tokens", "max_seqs"), LIMITS)
@pytest.mark.parametrize(("n", "k"), [(2560, 2048), (32000, 2048), (14336, 4096)])
def test_every_token_count_of_a_step_has_its_quant_tiles_warmed(max_tokens, max_seqs, n, k, qtype):
    """Any step (decode batch, prefill, mixed) of up to the longest a step
    can be: with few sequences a prompt takes the counts decode batches
    cannot reach."""
    shapes = warm_up_shapes(max_tokens, max_seqs, 4096)
    assert all(sum(q) <= max_tokens and len(q) <= max_seqs for q in shapes)
    warmed = {_key(sum(q), n, k, qtype) for q in shapes}
    missing = [t for t in range(1, min(max_tokens, 4096) + 1)
               if t < PREFILL_DEQUANT_TOKENS and _key(t, n, k, qtype) not in warmed]
    assert not missing, missing
    if min(max_tokens, 4096) >= PREFILL_DEQUANT_TOKENS:
        assert max(sum(q) for q in shapes) >= PREFILL_DEQUANT_TOKENS


@pytest.mark.parametrize("qtype", ["Q4_0", "Q6_K"])
@pytest.mark.parametrize("max_rows", [1, 2, 3, 8, 16, 40, 96, 127, 128, 160, 768])
def test_every_count_of_sampled_rows_has_its_lm_head_tiles_warmed(max_rows, qtype):
    """The LM head runs on the rows a step samples (one per sequence, and
    one per draft with speculative decoding), with the vocabulary as its N:
    its own tiles, warmed on their own."""
    rows = warm_up_logits_rows(max_rows)
    assert max(rows) <= max_rows
    warmed = {_head_key(r, qtype) for r in rows}
    missing = [r for r in range(1, max_rows + 1) if _head_key(r, qtype) not in warmed]
    assert not missing, missing


def test_prefill_shapes_come_first_and_fit_the_model():
    shapes = warm_up_shapes(8192, 256, 2048)
    assert shapes[0] == [2048] and shapes[1] == [1025] and [17, 1, 33] in shapes
    assert [1] * 64 in shapes and [1] * 2 in shapes
    # one sequence: the decode batches' counts come as prompts
    assert warm_up_shapes(2048, 1, 4096) == [[2048], [1025], [1], [2], [4], [8], [32], [127]]
