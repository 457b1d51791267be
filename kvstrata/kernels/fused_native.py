"""The fused decoder-layer ops of ``kernels/fused.py`` in C for the CPU
(``csrc/fused_cpu.c``), built once per machine (``native_build``), loaded
with ctypes.

    fused_kernels() -> FusedKernels | None      loaded (built first if needed); None: see fused_status()
    FusedKernels.add_rms_norm(...)               fused.fused_add_rms_norm's work, one call
    FusedKernels.rotary_and_cache(...)           fused.rotary_and_cache's work, one call

``fused.py`` runs them for impl "auto" on CPU tensors. Where the torch code
is a chain of small ops (a decode step's rows: 2-10 torch calls and their
Python around each, ~5-20 us apiece), each is one call. Rounding as the
torch references round (``fused_cpu.c``): rotary and the residual sum
bit-equal, the norm within an ulp. Portable C: any CPU with a C compiler
(``KVSTRATA_NATIVE_KERNELS=0`` turns it off with the other native kernels).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvstrata.kernels.native_build import OnceLoader, load_library

SOURCE = Path(__file__).parent / "csrc" / "fused_cpu.c"
ABI_VERSION = 1
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the C enum's order
MAX_HIDDEN = 16384  # the norm's row width


class FusedKernels:
    """The loaded library; one per process. Arguments as ``fused.py`` checks them."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        p, i, lg, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
        self._norm = lib.kvf_add_rms_norm
        self._norm.argtypes = [i, p, lg, p, lg, p, f, p, lg, p, lg, i, i]
        self._norm.restype = i
        self._rot = lib.kvf_rotary_and_cache
        self._rot.argtypes = [i, p, lg, p, lg, p, lg, p, p, lg, p, p, lg, i, p, i, p, lg, i, i, i, i]
        self._rot.restype = i

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in DTYPES

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out: torch.Tensor, residual_out: torch.Tensor | None) -> None:
        """out = RMSNorm(residual + x) * weight, residual_out = residual + x (or x)."""
        rc = self._norm(DTYPES.index(x.dtype), x.data_ptr(), x.stride(0),
                        None if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
                        weight.data_ptr(), eps, out.data_ptr(), out.stride(0),
                        None if residual_out is None else residual_out.data_ptr(),
                        0 if residual_out is None else residual_out.stride(0), x.shape[0], x.shape[1])
        if rc != 0:
            raise ValueError(f"kvf_add_rms_norm refused x {tuple(x.shape)} {x.dtype}: at most {MAX_HIDDEN} wide")

    def rotary_and_cache(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, q_out: torch.Tensor) -> None:
        """q_out = rotate(q); rotate(k) and v to the caches at the slots (negative: skipped)."""
        t, hq, d = q.shape
        rc = self._rot(DTYPES.index(q.dtype), q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                       v.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0), key_cache.data_ptr(),
                       value_cache.data_ptr(), key_cache.stride(0), key_cache.shape[1], slot_mapping.data_ptr(),
                       slot_mapping.element_size(), q_out.data_ptr(), q_out.stride(0), t, hq, k.shape[1], d)
        if rc != 0:
            raise ValueError(f"kvf_rotary_and_cache refused q {tuple(q.shape)} {q.dtype}")


def fused_kernels() -> FusedKernels | None:
    """The kernels, built and loaded on the first call (the model runner calls
    it at load); None where they cannot be built here."""
    return _once.get()


def fused_status() -> str:
    """"ok", why ``fused_kernels()`` returned None, or "not tried" before it ran."""
    return _once.status()


def _load() -> FusedKernels:
    lib, path = load_library(SOURCE, "kvf_abi_version", ABI_VERSION, x86_only=False)
    return FusedKernels(lib, path)


_once: OnceLoader[FusedKernels] = OnceLoader(_load, "fused_native_unavailable", SOURCE)
