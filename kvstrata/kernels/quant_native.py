"""The native CPU kernels of the "native" path (``csrc/lowbit_bf16.c``):
built once per machine with the system C compiler, cached, loaded with ctypes.

    native_kernels() -> NativeKernels | None     loaded (built first if needed); None: see native_status()
    native_status() -> str                        "ok", or why there are no native kernels here
    NativeKernels.matmul(qtype, x, planes, acc)   acc = x @ W.T (x bf16 or float32), W in LAYOUTS[qtype]
    NativeKernels.bind(qtype, planes)            the unchecked matmul of one weight, set up once
    check_planes(qtype, planes, n, k)             what matmul checks of the planes (once per weight suffices)

One kernel design for every packed type (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
Q6_K, Q8_0): the file's integers and scales, re-laid (``quant_relayout``;
the file's bytes, 3 % more for the K-quants' unpacked 6-bit scales); per
(block of 64 output rows, group of 32 columns) the integers become bf16
(exact: small integers), once into a tile every row of x reuses or, where
that costs less, for each few rows straight into registers (see the C
source), for AVX512_BF16 dot products (a float32 x: the integers as float32,
float32 FMAs, x as it is), and each group's scale and offset apply in float32, formed as gguf
forms them, so nothing is rounded but the float32 sums (|err| 3e-8 - 7e-8 of
S against ``dequantize`` in float64, as F.linear on the dequantized float32
weight; a float32 x costs about what a bf16 one does at 1 token for the Q4
kinds and Q8_0, 1.1-1.5x for the others, 1.2-1.6x at 16).
Against torch's int4 kernel on its
planes (the "int4" path, which splits Q5/Q8_0 in two planes, 1.2-1.8x the
bytes, rounds scale and zero to bf16, and unpacks the weights again for
every 4 rows of x): 1.3-1.5x at 1-4 tokens, ~1.7x at 16, 2x at 64 and more
(SmolLM2's shapes, 1 thread). Q6_K has no int4 form at all (16-weight
scales): before this, its only path dequantized per call (an 8B-shape
[14336, 4096] weight: 176 ms at 1 token, now ~5).

Needs x86-64 with AVX512F/BW/VL and AVX512_BF16, or else AVX2, FMA and F16C
(the AVX2 kernel: float32 FMAs only, a bf16 x widened; bit-equal to the
AVX512 kernel for a float32 x; as fast at 1 token for the Q4 types, up to
~2x its time for the others, 1.2x at 16; ``isa`` says which runs,
``KVSTRATA_NATIVE_ISA=avx2`` picks it) (checked at run time), a C
compiler (``$CC``, else ``cc``) with OpenMP, and N % 64 == 0. Built by
``native_build.build`` (cached per source, compiler and flags). Anything
missing: None, one log line (``quant_native_unavailable``) naming why, and
the loader keeps the "int4" / "dequant" paths. ``KVSTRATA_NATIVE_KERNELS=0``
turns it off (read at the first load in a process).

Threads: torch's count, except where OpenMP threads sleep between parallel
regions (``OMP_WAIT_POLICY=PASSIVE``, which the ``kvstrata`` command sets):
there a matmul of fewer than ``SERIAL_MACS`` multiply-adds runs on the
calling thread, since waking the others costs more than they save
(SmolLM2's single-stream decode step, 2 threads: 13.9 -> 11.0 ms; a row's
bits do not depend on the thread count).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from kvstrata.kernels._checks import KernelArgumentError
from kvstrata.kernels.native_build import NativeUnavailable, OnceLoader, load_library

SOURCE = Path(__file__).parent / "csrc" / "lowbit_bf16.c"
ABI_VERSION = 6



# The layout of each type's planes (``quant_relayout`` makes them): the C kind
# (csrc/lowbit_bf16.c's enum), the table offset, and the tensors in order, each
# (name, shape as a function of (N, K), dtype). lo: the low nibbles [N/64, K, 32];
# hi: the bits above [N/64, K, 8 per bit]; the scales per group of 32 columns
# ([K/32, N]) or per 256 ([K/256, N]); Q6_K's sc per 16, Q8_0's q int8 pairs.
KINDS = ("QD4", "QD5", "QK4", "QK5", "Q6K", "Q8")
_NIB = ("lo", lambda n, k: (n // 64, k, 32), torch.uint8)
_HI1 = ("hi", lambda n, k: (n // 64, k, 8), torch.uint8)
_G32 = lambda n, k: (k // 32, n)  # noqa: E731
_S256 = lambda n, k: (k // 256, n)  # noqa: E731
LAYOUTS: dict[str, tuple[str, int, tuple]] = {
    "Q4_0": ("QD4", 8, (_NIB, ("d", _G32, torch.float16))),
    "Q4_1": ("QD4", 0, (_NIB, ("d", _G32, torch.float16), ("m", _G32, torch.float16))),
    "Q5_0": ("QD5", 16, (_NIB, _HI1, ("d", _G32, torch.float16))),
    "Q5_1": ("QD5", 0, (_NIB, _HI1, ("d", _G32, torch.float16), ("m", _G32, torch.float16))),
    "Q4_K": ("QK4", 0, (_NIB, ("sc", _G32, torch.uint8), ("mn", _G32, torch.uint8), ("d", _S256, torch.float16),
                        ("dmin", _S256, torch.float16))),
    "Q5_K": ("QK5", 0, (_NIB, _HI1, ("sc", _G32, torch.uint8), ("mn", _G32, torch.uint8),
                        ("d", _S256, torch.float16), ("dmin", _S256, torch.float16))),
    "Q6_K": ("Q6K", 32, (_NIB, ("hi", lambda n, k: (n // 64, k, 16), torch.uint8),
                         ("sc", lambda n, k: (k // 16, n), torch.int8), ("d", _S256, torch.float16))),
    "Q8_0": ("Q8", 0, (("q", lambda n, k: (n // 64, k // 2, 64, 2), torch.int8), ("d", _G32, torch.float16))),
}
# the C call's pointer slots (q, hi, s1, s2, d, dmin) per kind, by field name
_SLOTS = {
    "QD4": ("lo", None, "d", "m", None, None), "QD5": ("lo", "hi", "d", "m", None, None),
    "QK4": ("lo", None, "sc", "mn", "d", "dmin"), "QK5": ("lo", "hi", "sc", "mn", "d", "dmin"),
    "Q6K": ("lo", "hi", "sc", None, "d", None), "Q8": ("q", None, "d", None, None, None),
}
_BLOCK = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256}  # K must be a multiple of it (else 32)
_OFFSET_KINDS = (KINDS.index("QD4"), KINDS.index("QD5"), KINDS.index("QK4"), KINDS.index("QK5"))  # need x's group sums
# per type: (kind number, table offset, the planes' index for each pointer slot or None)
_CALLS = {qtype: (KINDS.index(kind), off, tuple(next((i for i, fl in enumerate(fields) if fl[0] == f), None)
                                                for f in _SLOTS[kind]))  # Q4_0/Q5_0 have no m: None
          for qtype, (kind, off, fields) in LAYOUTS.items()}


# the kernel sets (kvq_isa's numbers): AVX512F/BW/VL + AVX512_BF16 (bf16 dot products, and
# float32 FMAs for a float32 x), or AVX2 + FMA + F16C (float32 FMAs only: a bf16 x is widened)
ISAS = {"avx512_bf16": 2, "avx2": 1}


class NativeKernels:
    """The loaded library, running the kernels of ``isa`` (ISAS).
    ``matmul`` checks its arguments; one per process."""

    def __init__(self, lib: ctypes.CDLL, path: Path, isa: str) -> None:
        if isa not in ISAS:
            raise KernelArgumentError(f"isa must be one of {', '.join(ISAS)}, got {isa!r}")
        self.path, self.isa, self._isa = path, isa, ISAS[isa]
        p, i = ctypes.c_void_p, ctypes.c_int
        self._fn = lib.kvq_matmul
        self._fn.argtypes = [i, i, i, p, i, p, p, p, p, p, p, p, i, i, i, ctypes.c_long, i, p]
        self._fn.restype = ctypes.c_int

    def matmul(self, qtype: str, x: torch.Tensor, planes: tuple, acc: torch.Tensor) -> None:
        """``acc`` [M, N] float32 (rows may be strided, columns contiguous) =
        ``x`` [M, K] (contiguous) @ W.T, W the ``qtype`` weight as ``planes`` =
        (the tensors LAYOUTS[qtype] names, in order). x bf16: bf16 dot
        products (AVX2: x widened to float32); x float32: the weights as
        float32, float32 FMAs (bit-equal on either isa)."""
        _, k, n = _check_x_acc(x, acc, _BLOCK.get(qtype, 32))
        check_planes(qtype, planes, n, k)
        self.matmul_unchecked(qtype, x, planes, acc)

    def bind(self, qtype: str, planes: tuple) -> BoundMatmul:
        """``matmul_unchecked`` for one weight, its planes' pointers and the
        call's constants worked out once (a third of the per-call Python
        cost, which is most of a small layer's decode matmul). The planes
        must be checked (``check_planes``) and must outlive the result."""
        kind, off, slots = _CALLS[qtype]
        ptrs = tuple(None if i is None else planes[i].data_ptr() for i in slots)
        return BoundMatmul(self._fn, self._isa, kind, off, ptrs, kind in _OFFSET_KINDS, planes)

    def matmul_unchecked(self, qtype: str, x: torch.Tensor, planes: tuple, acc: torch.Tensor,
                         sums: torch.Tensor | None = None) -> None:
        """``matmul`` for planes already checked (``check_planes``, as
        ``quant_cpu.NativePath`` does once when it makes them) and x, acc
        as the caller makes them: the per-call checks cost more than a
        small layer's matmul (~10 us). ``sums``: float32 of at least
        M * K / 32 elements for x's group sums (else allocated)."""
        self.bind(qtype, planes)(x, acc, sums)


# below this many multiply-adds (M x N x K) a matmul runs on the calling thread when OpenMP
# threads sleep between regions (read once: libgomp reads the variable once, at its start)
SERIAL_MACS = 1 << 22
_THREADS_SLEEP = os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


def matmul_threads(macs: int) -> int:
    """The threads a native matmul of ``macs`` multiply-adds runs on (see the module docstring)."""
    threads = torch.get_num_threads()
    return 1 if threads > 1 and _THREADS_SLEEP and macs < SERIAL_MACS else threads


class BoundMatmul:
    """One weight's ``NativeKernels.matmul_unchecked`` (``NativeKernels.bind``):
    ``call(x, acc, sums=None)``, the same arguments and contract. Holds the
    planes it points into."""

    __slots__ = ("_fn", "_isa", "_kind", "_off", "_ptrs", "_offset", "_planes")

    def __init__(self, fn, isa: int, kind: int, off: int, ptrs: tuple, offset: bool, planes: tuple) -> None:
        self._fn, self._isa, self._kind, self._off, self._ptrs = fn, isa, kind, off, ptrs
        self._offset, self._planes = offset, planes

    def __call__(self, x: torch.Tensor, acc: torch.Tensor, sums: torch.Tensor | None = None) -> None:
        f32 = x.dtype == torch.float32
        if self._isa == 1 and not f32:
            x, f32 = x.float(), True  # exact
        m, k = x.shape
        if self._offset and sums is None:
            sums = torch.empty(m * (k // 32), dtype=torch.float32)  # held here until the call returns
        n = acc.shape[1]
        self._fn(self._isa, self._kind, self._off, x.data_ptr(), f32, *self._ptrs, acc.data_ptr(), m, n, k,
                 acc.stride(0), matmul_threads(m * n * k), sums.data_ptr() if self._offset else None)


def check_planes(qtype: str, planes: tuple, n: int, k: int) -> None:
    """``planes`` are the tensors LAYOUTS[qtype] names for an [n, k] weight:
    their count, shapes, dtypes, contiguity and device (KernelArgumentError)."""
    if qtype not in LAYOUTS:
        raise KernelArgumentError(f"the native kernels take {', '.join(LAYOUTS)}, got {qtype!r}")
    fields = LAYOUTS[qtype][2]
    if not isinstance(planes, tuple) or len(planes) != len(fields):
        raise KernelArgumentError(f"planes for {qtype} must be ({', '.join(f[0] for f in fields)})")
    for (name, shape, dtype), t in zip(fields, planes):
        want = shape(n, k)
        if (not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != want or not t.is_contiguous()
                or t.device.type != "cpu"):
            raise KernelArgumentError(
                f"planes {name} must be contiguous {str(dtype).removeprefix('torch.')} {list(want)} on the CPU, "
                f"got {getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', ()))}")


def _check_x_acc(x, acc, k_multiple: int) -> tuple[int, int, int]:
    if not (isinstance(x, torch.Tensor) and x.dtype in (torch.bfloat16, torch.float32) and x.dim() == 2
            and x.is_contiguous()):
        raise KernelArgumentError(f"x must be a contiguous 2-D bfloat16 or float32 CPU tensor, got "
                                  f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    m, k = x.shape
    if not (isinstance(acc, torch.Tensor) and acc.dtype == torch.float32 and acc.dim() == 2
            and acc.shape[0] == m and acc.stride(1) == 1 and acc.stride(0) >= acc.shape[1]):
        raise KernelArgumentError(f"acc must be float32 [{m}, N] with contiguous rows, got "
                                  f"{getattr(acc, 'dtype', None)} {tuple(getattr(acc, 'shape', ()))}")
    n = acc.shape[1]
    if m == 0 or k % k_multiple or n % 64:
        raise KernelArgumentError(f"the native kernels need M >= 1, K % {k_multiple} == 0 and N % 64 == 0, "
                                  f"got M={m}, K={k}, N={n}")
    if x.device.type != "cpu" or acc.device.type != "cpu":
        raise KernelArgumentError("the native kernels run on CPU tensors")
    return m, k, n


def native_kernels() -> NativeKernels | None:
    """The kernel, built and loaded on the first call (seconds at most; call
    it at load, never on the request path); None where it cannot run here."""
    return _once.get()


def native_status() -> str:
    """"ok", why ``native_kernels()`` returned None, or "not tried" before it ran."""
    return _once.status()


def _load() -> NativeKernels:
    lib, path = load_library(SOURCE, "kvq_abi_version", ABI_VERSION)
    level = lib.kvq_isa()
    if level == 0:
        raise NativeUnavailable("this CPU lacks AVX2, FMA or F16C")
    isa = next(name for name, n in ISAS.items() if n == level)
    forced = os.environ.get("KVSTRATA_NATIVE_ISA")
    if forced:
        if forced not in ISAS:
            raise NativeUnavailable(f"KVSTRATA_NATIVE_ISA must be one of {', '.join(ISAS)}, got {forced!r}")
        if ISAS[forced] > level:
            raise NativeUnavailable(f"KVSTRATA_NATIVE_ISA={forced}, but this CPU runs {isa} at most")
        isa = forced
    return NativeKernels(lib, path, isa)


_once: OnceLoader[NativeKernels] = OnceLoader(_load, "quant_native_unavailable", SOURCE)
