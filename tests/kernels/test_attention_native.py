"""The C decode attention kernel (``attention_native``) against dense float64
attention, against the SDPA path it replaces, and on the inputs it must
never read (the null block, unwritten tails, slid-out blocks)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvstrata.kernels.attention as attention_module
from kvstrata.kernels import paged_attention
from kvstrata.kernels.attention import paged_attention_ref
from kvstrata.kernels.attention_native import AttentionKernels, attention_kernels, attention_status
from kernel_builders import dense_attention, make_paged_batch, run_python

kernels = attention_kernels()
native = pytest.mark.skipif(kernels is None, reason=f"no native attention kernel here: {attention_status()}")

# float32 math inside; the output rounded once to the dtype
TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def run(batch, scale, window=None, impl="auto", plans=None):
    return paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                           batch.query_start_loc, batch.seq_lens, scale=scale, sliding_window=window, impl=impl,
                           plans={} if plans is None else plans)


def sdpa(batch, scale, window=None):
    out = torch.empty_like(batch.query)
    return paged_attention_ref(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                               batch.query_start_loc, batch.seq_lens, scale, window, out)


def poison_tails(batch):
    """NaN in every cache row past each sequence's length (unwritten slots)."""
    block_size = batch.key_cache.shape[1]
    for b, n in enumerate(batch.seq_lens.tolist()):
        last = int(batch.block_tables[b, (n - 1) // block_size])
        batch.key_cache[last, (n - 1) % block_size + 1:] = float("nan")
        batch.value_cache[last, (n - 1) % block_size + 1:] = float("nan")


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(4, 4, 16), (9, 3, 64), (8, 1, 8), (32, 2, 24), (6, 2, 80)])
@pytest.mark.parametrize("block_size", [1, 4, 16, 48])
def test_decode_matches_dense_float64(dtype, q_heads, kv_heads, head_dim, block_size):
    # lengths around chunk (16 positions) and block edges, one of a single position
    seq_lens = [1, 7, 16, 17, 33, 95, 130]
    batch = make_paged_batch(seq_lens, [1] * len(seq_lens), block_size=block_size, q_heads=q_heads,
                             kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, extra_table_cols=2,
                             seed=q_heads * 7 + block_size)
    poison_tails(batch)
    scale = head_dim ** -0.5
    out = run(batch, scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), dense_attention(batch, scale), atol=TOL[dtype], rtol=TOL[dtype])


@native
@pytest.mark.parametrize("window", [1, 5, 16, 37])
@pytest.mark.parametrize("block_size", [4, 16])
def test_sliding_window_never_reads_slid_out_blocks(window, block_size):
    seq_lens = [3, 29, 64, 77, 100]
    batch = make_paged_batch(seq_lens, [1] * len(seq_lens), block_size=block_size, q_heads=8, kv_heads=2,
                             head_dim=32, sliding_window=window, extra_table_cols=3, seed=window)
    poison_tails(batch)
    # blocks wholly before the window are the (NaN) null block already; NaN the rows
    # before the window in the first block that holds visible ones too
    for b, n in enumerate(seq_lens):
        first = max(0, n - window)
        phys = int(batch.block_tables[b, first // block_size])
        batch.key_cache[phys, : first % block_size] = float("nan")
        batch.value_cache[phys, : first % block_size] = float("nan")
    out = run(batch, 0.2, window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), dense_attention(batch, 0.2, window), atol=2e-6, rtol=2e-6)


@native
def test_the_online_softmax_survives_growing_and_far_apart_scores():
    # scores that rise along the sequence (the running max grows in every
    # chunk: every earlier chunk is rescaled) and a range of ~80 in one row
    # (e^-80: the far ones underflow to exactly 0, as in the reference)
    batch = make_paged_batch([200, 61], [1, 1], block_size=16, q_heads=4, kv_heads=1, head_dim=16, seed=3)
    ramp = torch.linspace(-4, 4, 16 * batch.key_cache.shape[0]).view(batch.key_cache.shape[0], 16, 1, 1)
    batch = dataclasses.replace(batch, key_cache=batch.key_cache + ramp, query=batch.query * 3)
    batch.keys[:] = []  # rebuilt below from the cache, as dense_attention reads them
    for b, n in enumerate(batch.seq_lens.tolist()):
        rows = [batch.key_cache[int(batch.block_tables[b, p // 16]), p % 16] for p in range(n)]
        batch.keys.append(torch.stack(rows))
    out = run(batch, 1.0)
    torch.testing.assert_close(out.double(), dense_attention(batch, 1.0), atol=3e-6, rtol=3e-6)


@native
def test_a_nan_in_a_visible_row_reaches_the_output_of_its_own_heads_only():
    batch = make_paged_batch([20, 20], [1, 1], block_size=4, q_heads=4, kv_heads=2, head_dim=16, seed=5)
    batch.key_cache[int(batch.block_tables[0, 2]), 1, 0, 3] = float("nan")  # seq 0, position 9, kv head 0
    out = run(batch, 0.25)
    assert out[0, :2].isnan().all() and torch.isfinite(out[0, 2:]).all()  # kv head 0 serves q heads 0, 1
    assert torch.isfinite(out[1]).all()


@native
def test_results_do_not_depend_on_the_batch_or_the_thread_count():
    seq_lens = [50, 3, 140, 77, 16, 9, 200, 33]
    batch = make_paged_batch(seq_lens, [1] * len(seq_lens), block_size=16, q_heads=9, kv_heads=3, head_dim=64,
                             extra_table_cols=1, seed=9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(batch, 0.125)
        torch.set_num_threads(2)  # 8 sequences, 2 threads: whole sequences per item; 1 sequence: a head each
        two = run(batch, 0.125)
        alone = []
        for b in (2, 6):
            sub = dataclasses.replace(batch, query=batch.query[b:b + 1], block_tables=batch.block_tables[b:b + 1],
                                      query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                                      seq_lens=batch.seq_lens[b:b + 1])
            alone.append(run(sub, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(alone[0][0], one[2]) and torch.equal(alone[1][0], one[6])


@native
@pytest.mark.parametrize("window", [None, 6])
def test_mixed_steps_run_decode_natively_and_the_rest_on_sdpa(window):
    # prefill, extend and decode in one step, int64 tables, a cache whose
    # blocks are strided apart (one layer's view of a K/V backing)
    seq_lens, q_lens = [9, 13, 6, 17, 1, 40], [9, 5, 1, 1, 1, 1]
    batch = make_paged_batch(seq_lens, q_lens, block_size=4, q_heads=8, kv_heads=2, head_dim=16,
                             sliding_window=window, extra_table_cols=2, seed=13)
    backing = torch.full((batch.key_cache.shape[0], 3, *batch.key_cache.shape[1:]), float("nan"))
    backing[:, 0], backing[:, 2] = batch.key_cache, batch.value_cache
    strided = dataclasses.replace(batch, key_cache=backing[:, 0], value_cache=backing[:, 2],
                                  block_tables=batch.block_tables.long())
    assert strided.key_cache.stride(0) == 3 * strided.key_cache[0].numel()
    out = run(strided, 0.3, window)
    torch.testing.assert_close(out.double(), dense_attention(batch, 0.3, window), atol=2e-6, rtol=2e-6)
    ref = sdpa(batch, 0.3, window)
    assert attention_module.NATIVE_MAX_QUERY == 8  # 9 new tokens: SDPA; 5: native, each token on its own
    assert torch.equal(out[:9], ref[:9])  # the same SDPA call, bit-equal
    torch.testing.assert_close(out[9:], ref[9:], atol=2e-6, rtol=2e-6)


@native
@pytest.mark.parametrize("window", [None, 4, 11])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_queries_attend_causally_token_by_token(window, dtype):
    # speculative verification and small chunks: 2..8 new tokens per sequence
    # run in the native kernel, each at its own position (causal within the
    # query, and its own window); 9 and more stay on SDPA
    seq_lens, q_lens = [3, 20, 41, 8, 64, 30, 9], [2, 3, 8, 8, 5, 9, 1]
    batch = make_paged_batch(seq_lens, q_lens, block_size=4, q_heads=6, kv_heads=2, head_dim=16, dtype=dtype,
                             sliding_window=window, extra_table_cols=2, seed=23)
    poison_tails(batch)
    plans = {}
    out = run(batch, 0.25, window, plans=plans)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), dense_attention(batch, 0.25, window), atol=TOL[dtype], rtol=TOL[dtype])
    (plan,) = plans.values()
    assert plan.extend == [5]  # the one 9-token query
    assert plan.native[1].numel() == sum(q for q in q_lens if q <= 8)  # one kernel item per token


@native
def test_plans_keep_the_native_and_sdpa_decodes_apart():
    batch = make_paged_batch([30, 12, 7], [1, 1, 1], block_size=4, q_heads=4, kv_heads=2, head_dim=16, seed=17)
    plans = {}
    a = run(batch, 0.25, plans=plans)
    b = run(batch, 0.25, impl="torch", plans=plans)  # the same step's plans, the SDPA decode
    assert len(plans) == 2
    assert torch.equal(b, sdpa(batch, 0.25))
    torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6)


@native
def test_shapes_the_kernel_does_not_take_go_to_sdpa():
    # head_dim 12 (not a multiple of 8) and 32 query heads per KV head (more than 16)
    for q_heads, kv_heads, head_dim in [(4, 2, 12), (32, 1, 16)]:
        batch = make_paged_batch([11, 5], [1, 1], q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, seed=1)
        assert not AttentionKernels.supports(batch.query, batch.key_cache)
        assert torch.equal(run(batch, 0.3), sdpa(batch, 0.3))
    batch = make_paged_batch([11, 5], [1, 1], q_heads=32, kv_heads=1, head_dim=16, seed=1)
    with pytest.raises(ValueError, match="outside what supports"):
        kernels.decode(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                       *torch.tensor([[0, 1], [0, 1], [0, 0], [11, 5]], dtype=torch.int32), 0.3,
                       torch.empty_like(batch.query))


@native
def test_the_decode_plan_is_built_once_per_step(monkeypatch):
    built = []
    real = attention_module._Plan

    def counting(*args):
        built.append(1)
        return real(*args)

    monkeypatch.setattr(attention_module, "_Plan", counting)
    batch = make_paged_batch([30, 12, 7], [1, 1, 1], block_size=4, q_heads=4, kv_heads=2, head_dim=16, seed=19)
    plans = {}
    first = run(batch, 0.25, plans=plans)
    for _ in range(3):  # more layers of the same step
        assert torch.equal(run(batch, 0.25, plans=plans), first)
    assert len(built) == 1


def test_the_switch_turns_the_kernel_off_and_decode_runs_on_sdpa():
    code = ("import torch\n"
            "from kvstrata.kernels.attention_native import attention_kernels, attention_status\n"
            "from kvstrata.kernels import paged_attention\nfrom kernel_builders import make_paged_batch, dense_attention\n"
            "assert attention_kernels() is None\nprint(attention_status())\n"
            "b = make_paged_batch([9, 4], [1, 1], seed=2)\n"
            "out = paged_attention(b.query, b.key_cache, b.value_cache, b.block_tables, b.query_start_loc, b.seq_lens,"
            " 0.3, plans={})\n"
            "torch.testing.assert_close(out.double(), dense_attention(b, 0.3), atol=1e-5, rtol=1e-5)\nprint('same')\n")
    done = run_python(code, KVSTRATA_NATIVE_KERNELS="0")
    assert done.returncode == 0, done.stderr
    assert "attention_native_unavailable" in done.stdout  # the one log line naming why
    assert done.stdout.splitlines()[-2:] == ["turned off by KVSTRATA_NATIVE_KERNELS=0", "same"]
