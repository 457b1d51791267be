"""Split-K decode attention, compiled on a GPU: against no split and the torch
reference, under CUDA-graph capture and replay with new lengths, and with no
compile for a new batch size. Skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch

from kvstrata.kernels import paged_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# bf16 output; the kernels round p to bf16 for the PV dot, the reference does not
ATOL = RTOL = 1e-2
MODELS = {"tinyllama": (32, 4, 64), "hkv8_d128": (32, 8, 128)}


def _decode_step(batch: int, ctx: int, q_heads: int, kv_heads: int, head_dim: int, *, lens: list[int] | None = None,
                 window: int | None = None, block_size: int = 16, seed: int = 0) -> dict:
    """One new token per sequence over a bf16 paged cache with room for ``ctx``
    positions per sequence on shuffled blocks; the null block (0) is NaN and
    stands for every block slid wholly out of the window."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    per_seq = -(-ctx // block_size)
    shape = (1 + batch * per_seq, block_size, kv_heads, head_dim)
    kc = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
    kc[0] = float("nan")
    vc[0] = float("nan")
    table = (torch.randperm(shape[0] - 1, generator=g, device="cuda") + 1).view(batch, per_seq).int()
    lens = lens or [ctx] * batch
    if window is not None:
        for b, n in enumerate(lens):
            table[b, : max(0, n - window) // block_size] = 0
    query = 2 * torch.randn((batch, q_heads, head_dim), generator=g, device="cuda", dtype=torch.bfloat16)
    return dict(query=query, key_cache=kc, value_cache=vc, block_tables=table,
                query_start_loc=torch.arange(batch + 1, device="cuda", dtype=torch.int32),
                seq_lens=torch.tensor(lens, device="cuda", dtype=torch.int32))


def _attend(step: dict, window: int | None = None, **kwargs) -> torch.Tensor:
    return paged_attention(step["query"], step["key_cache"], step["value_cache"], step["block_tables"],
                           step["query_start_loc"], step["seq_lens"], step["query"].shape[-1] ** -0.5, window,
                           **kwargs)


def _forced(step: dict, num_splits: int, window: int | None = None) -> torch.Tensor:
    from kvstrata.kernels._triton_attention import paged_attention_triton

    out = torch.empty_like(step["query"])
    paged_attention_triton(step["query"], step["key_cache"], step["value_cache"], step["block_tables"],
                           step["query_start_loc"], step["seq_lens"], step["query"].shape[-1] ** -0.5, window, out,
                           num_splits=num_splits)
    return out


def _mixed_lens(batch: int, ctx: int, seed: int) -> list[int]:
    """Full contexts, and (past the first half) lengths down to 1: shorter than the splits."""
    g = torch.Generator().manual_seed(seed)
    lens = [ctx] * ((batch + 1) // 2) + torch.randint(1, ctx + 1, (batch // 2,), generator=g).tolist()
    if batch > 2:
        lens[-1], lens[-2] = 1, 17
    return lens


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("ctx", [2048, 4096])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_decode_split_matches_no_split_and_torch(batch, ctx, model):
    step = _decode_step(batch, ctx, *MODELS[model], lens=_mixed_lens(batch, ctx, seed=batch), seed=ctx + batch)
    expected = _attend(step, impl="torch")
    auto, unsplit, split8 = _attend(step, split_decode=True), _forced(step, 1), _forced(step, 8)
    for got in (auto, unsplit, split8, _attend(step)):  # the last: the default single-pass decode
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(auto, unsplit, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("window", [33, 1000])
def test_decode_split_sliding_window_never_reads_null_block(window):
    step = _decode_step(8, 4096, *MODELS["hkv8_d128"], lens=_mixed_lens(8, 4096, seed=5), window=window, seed=6)
    expected = _attend(step, window, impl="torch")
    for got in (_attend(step, window), _attend(step, window, split_decode=True), _forced(step, 1, window),
                _forced(step, 32, window)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_decode_graph_replays_with_new_lengths(batch):
    """Captured once (split count from shapes only), replayed after the lengths
    change on the device: no host sync inside, the right answer each time."""
    ctx = 4096
    step = _decode_step(batch, ctx, *MODELS["tinyllama"], seed=7)
    out = torch.empty_like(step["query"])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        _attend(step, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _attend(step, out=out)
    g = torch.Generator().manual_seed(batch)
    for _ in range(3):
        step["seq_lens"].copy_(torch.randint(1, ctx + 1, (batch,), generator=g, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, _attend(step, impl="torch"), atol=ATOL, rtol=RTOL)


def _compiled(lazy) -> int:
    jit = lazy.for_device(torch.device("cuda"))
    return sum(len(cache[0]) for cache in jit.device_caches.values())


def test_new_batch_sizes_and_table_widths_compile_nothing():
    from kvstrata.kernels._triton_attention import combine_splits_kernel, paged_attention_kernel, paged_decode_kernel

    step = _decode_step(64, 512, *MODELS["hkv8_d128"], seed=8)
    prefill = dict(step, query=torch.randn((40, 32, 128), device="cuda", dtype=torch.bfloat16))

    def run(batch: int, width: int, q_lens: list[int] | None = None) -> None:
        table = step["block_tables"][:batch, :width].contiguous()  # row stride = width
        if q_lens is None:  # decode over the whole table row
            lens = torch.full((batch,), width * 16, device="cuda", dtype=torch.int32)
            s = dict(step, query=step["query"][:batch], block_tables=table, seq_lens=lens,
                     query_start_loc=step["query_start_loc"][: batch + 1])
        else:
            qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
            s = dict(prefill, query=prefill["query"][: sum(q_lens)], block_tables=table,
                     seq_lens=torch.tensor(q_lens, device="cuda", dtype=torch.int32), query_start_loc=qsl)
        _attend(s)

    run(5, 20)
    run(2, 20, [9, 11])
    kernels = (paged_decode_kernel, combine_splits_kernel, paged_attention_kernel)
    before = [_compiled(k) for k in kernels]
    for batch, width in ((1, 16), (16, 32), (32, 17), (64, 32), (3, 1)):
        run(batch, width)
    run(1, 16, [16])
    run(16, 32, [2] * 16)
    torch.cuda.synchronize()
    assert [_compiled(k) for k in kernels] == before
