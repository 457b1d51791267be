"""Decode attention on the CPU straight from the paged KV cache (``csrc/attention_cpu.c``),
built once per machine (``native_build``) and loaded with ctypes.

    attention_kernels() -> AttentionKernels | None   loaded (built first if needed); None: see attention_status()
    attention_status() -> str                         "ok", or why there are none here
    AttentionKernels.supports(query, key_cache)      whether ``decode`` takes these shapes and dtypes
    AttentionKernels.decode(...)                     one new token per sequence over its visible positions

``kernels.paged_attention`` uses it on a CPU step (impl "auto") for decode
tokens and for every token of a query of up to ``attention.NATIVE_MAX_QUERY``
(8) tokens (speculative verification, small chunks), each attending from
its own position; longer queries (prefill, extend) stay on SDPA, faster
there (at 12 tokens they break even).
What it replaces: per layer, gathering each sequence's blocks into a padded
buffer (a copy of every visible K and V row), zeroing the padding, one SDPA
call per chunk of sequences and scattering the outputs back. The kernel
reads each visible row once, where it lies, for every query head of its KV
head (GQA), with an online softmax in float32; the table's padding, the null
block and slid-out blocks are never read. A head's result depends only on
its own query and rows (not on the batch or the thread count); against the
SDPA path it differs by float32 rounding (~1e-7 relative).

Needs x86-64 with AVX2, FMA and F16C, a C compiler with OpenMP, a float32,
bf16 or fp16 cache, head_dim % 8 == 0 and at most 16 query heads per KV head
(``supports``); elsewhere the SDPA path runs. ``KVSTRATA_NATIVE_KERNELS=0``
turns it off with the other native kernels (read at the first load in a
process).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvstrata.kernels.native_build import NativeUnavailable, OnceLoader, load_library

SOURCE = Path(__file__).parent / "csrc" / "attention_cpu.c"
ABI_VERSION = 1
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the C enum's order
MAX_GROUP = 16  # query heads per KV head
MAX_GROUP_DIM = 8192  # query heads per KV head x head_dim



class AttentionKernels:
    """The loaded library; one per process."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        p, i, lg = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
        self._fn = lib.kva_decode
        self._fn.argtypes = [i, p, lg, p, p, lg, i, i, i, i, p, lg, p, p, p, p, i, ctypes.c_float, p, lg, i]
        self._fn.restype = ctypes.c_int

    @staticmethod
    def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
        """``decode`` runs for this query ([T, Hq, D]) and cache ([num_blocks,
        block_size, Hkv, D]): CPU tensors of one DTYPES dtype, D % 8 == 0,
        Hq / Hkv <= MAX_GROUP and (Hq / Hkv) * D <= MAX_GROUP_DIM."""
        _, _, hkv, d = key_cache.shape
        group = query.shape[1] // hkv
        return (query.device.type == "cpu" and key_cache.device.type == "cpu" and query.dtype in DTYPES
                and key_cache.dtype == query.dtype and d % 8 == 0 and 0 < group <= MAX_GROUP
                and group * d <= MAX_GROUP_DIM)

    def decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               block_tables: torch.Tensor, seqs: torch.Tensor, rows: torch.Tensor, lo: torch.Tensor,
               hi: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        """For each i: ``out[rows[i]]`` = the attention of ``query[rows[i]]``
        over positions [lo[i], hi[i]) of sequence ``seqs[i]`` (its row of
        ``block_tables``). Unchecked beyond the kernel's own shape limits
        (``kernels.paged_attention`` checks the arguments and ``supports``):
        ``block_tables`` int32 with contiguous rows, the four index tensors
        int32 and contiguous, 0 <= lo[i] < hi[i] within the table's blocks,
        query / out with contiguous [Hq, D] rows and the caches' [block_size,
        Hkv, D] contiguous with V's block stride equal to K's."""
        _, block_size, hkv, d = key_cache.shape
        rc = self._fn(DTYPES.index(query.dtype), query.data_ptr(), query.stride(0), key_cache.data_ptr(),
                      value_cache.data_ptr(), key_cache.stride(0), block_size, hkv, d, query.shape[1] // hkv,
                      block_tables.data_ptr(), block_tables.stride(0), seqs.data_ptr(), rows.data_ptr(),
                      lo.data_ptr(), hi.data_ptr(), seqs.shape[0], scale, out.data_ptr(), out.stride(0),
                      torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"kva_decode refused query {tuple(query.shape)} {query.dtype} over cache "
                             f"{tuple(key_cache.shape)}: outside what supports() allows")


def attention_kernels() -> AttentionKernels | None:
    """The kernels, built and loaded on the first call (seconds at most: the
    model runner calls it at load); None where they cannot run here."""
    return _once.get()


def attention_status() -> str:
    """"ok", why ``attention_kernels()`` returned None, or "not tried" before it ran."""
    return _once.status()


def _load() -> AttentionKernels:
    lib, path = load_library(SOURCE, "kva_abi_version", ABI_VERSION)
    if not lib.kva_isa():
        raise NativeUnavailable("this CPU lacks AVX2, FMA or F16C")
    return AttentionKernels(lib, path)


_once: OnceLoader[AttentionKernels] = OnceLoader(_load, "attention_native_unavailable", SOURCE)
