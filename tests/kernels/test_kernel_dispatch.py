"""Which implementation runs, import hygiene, and launch-time argument checks."""

from __future__ import annotations

import subprocess

import pytest
import torch

from kvstrata.kernels import (
    KernelArgumentError,
    gather_kv,
    interpret_requested,
    paged_attention,
    reshape_and_cache,
    scatter_kv_layer,
    use_triton,
)
from kernel_builders import make_paged_batch, run_python

CPU = torch.device("cpu")


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return run_python(code, **{"TRITON_INTERPRET": None, **env})


def test_cpu_auto_uses_torch_unless_interpret_is_set(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not use_triton("auto", CPU)
    assert use_triton("triton", CPU)
    assert not use_triton("torch", torch.device("cuda"))
    assert use_triton("auto", torch.device("cuda"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert interpret_requested() and use_triton("auto", CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not use_triton("auto", CPU)


def test_unknown_impl_is_rejected():
    with pytest.raises(ValueError, match="impl must be one of"):
        use_triton("cuda", CPU)
    kc = torch.zeros((2, 4, 1, 8))
    with pytest.raises(ValueError, match="impl"):
        gather_kv([(kc, kc.clone())], torch.tensor([1]), impl="fast")


def test_import_needs_no_gpu_and_does_not_import_triton():
    proc = _run(
        """
        import sys, torch
        import kvstrata, kvstrata.kernels as k
        assert "triton" not in sys.modules, "importing kvstrata must not import triton"
        assert not torch.cuda.is_available()
        s = k.KVStreams("cpu", 1)
        assert not s.is_cuda
        print("ok")
        """,
        CUDA_VISIBLE_DEVICES="",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "ok"


def test_interpreter_works_when_env_is_set_before_triton_import():
    """With TRITON_INTERPRET=1 at triton's import, triton's own @jit helpers are
    interpreted functions: the kernels must work in that mode too."""
    proc = _run(
        """
        import triton, torch
        from kernel_builders import make_paged_batch
        from kvstrata.kernels import paged_attention, gather_kv, use_triton
        assert use_triton("auto", torch.device("cpu"))
        b = make_paged_batch([13, 1, 6], [5, 1, 1], q_heads=4, kv_heads=2, sliding_window=4)
        args = (b.query, b.key_cache, b.value_cache, b.block_tables, b.query_start_loc, b.seq_lens, 0.3, 4)
        torch.testing.assert_close(paged_attention(*args), paged_attention(*args, impl="torch"), atol=2e-5, rtol=2e-5)
        caches = [(b.key_cache, b.value_cache)]
        slots = torch.tensor([5, 6, -1, 7])
        assert torch.equal(gather_kv(caches, slots), gather_kv(caches, slots, impl="torch"))
        print("ok")
        """,
        TRITON_INTERPRET="1",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "ok"


def test_checks_reject_bad_layouts_before_launch():
    kc = torch.zeros((4, 4, 2, 8))
    # a cache whose token rows are not contiguous
    strided = torch.zeros((4, 4, 2, 16))[..., ::2]
    with pytest.raises(KernelArgumentError, match="key_cache must be contiguous"):
        reshape_and_cache(torch.zeros((1, 2, 8)), torch.zeros((1, 2, 8)), strided, strided.clone(),
                          torch.tensor([0]), impl="triton")
    with pytest.raises(KernelArgumentError, match="slot_mapping dtype"):
        reshape_and_cache(torch.zeros((1, 2, 8)), torch.zeros((1, 2, 8)), kc, kc.clone(), torch.tensor([0.0]))
    with pytest.raises(KernelArgumentError, match="chunk must have shape"):
        scatter_kv_layer(torch.zeros((2, 3, 2, 8)), kc, kc.clone(), torch.tensor([0, 1]))
    with pytest.raises(KernelArgumentError, match="kv_caches\\[1\\]"):
        gather_kv([(kc, kc.clone()), (kc[:2], kc[:2].clone())], torch.tensor([0]))
    with pytest.raises(KernelArgumentError, match="kv_caches must be a non-empty list"):
        gather_kv([], torch.tensor([0]))
    with pytest.raises(TypeError, match="slot_mapping must be a torch.Tensor"):
        gather_kv([(kc, kc.clone())], [0, 1])


def test_attention_checks_name_the_field():
    b = make_paged_batch([6, 3], [2, 1], q_heads=4, kv_heads=2)
    base = dict(query=b.query, key_cache=b.key_cache, value_cache=b.value_cache, block_tables=b.block_tables,
                query_start_loc=b.query_start_loc, seq_lens=b.seq_lens, scale=0.5)
    cases = [
        (dict(query=b.query.half()), "key_cache dtype"),
        (dict(block_tables=b.block_tables.float()), "block_tables dtype"),
        (dict(block_tables=b.block_tables[:1]), "block_tables must have 2 rows"),
        (dict(query_start_loc=torch.tensor([0, 3], dtype=torch.int32)), "query_start_loc must have shape"),
        (dict(query_start_loc=torch.tensor([0, 2, 4], dtype=torch.int32)), "end at 3"),
        (dict(seq_lens=torch.tensor([1, 3], dtype=torch.int32)), "shorter than its 2 new tokens"),
        (dict(block_tables=b.block_tables.t().contiguous().t()), "block_tables rows must be contiguous"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(out=torch.empty((3, 4, 8))), "out must have shape"),
    ]
    for override, message in cases:
        with pytest.raises(KernelArgumentError, match=message):
            paged_attention(**{**base, **override})
