"""The native CPU kernels of the "int4", "q6" and "q8" paths (``csrc/lowbit_bf16.c``):
built once per machine with the system C compiler, cached, loaded with ctypes.

    native_kernels() -> NativeKernels | None   loaded (built first if needed); None: see native_status()
    native_status() -> str                      "ok", or why there are no native kernels here
    NativeKernels.int4_matmul(xb, planes, acc)  acc = xb @ W.T, W = the sum of the int4 planes
    NativeKernels.q6k_matmul(xb, planes, acc)   acc = xb @ W.T, W = Q6_K re-laid (quant_cpu.Q6Path)
    NativeKernels.q8_matmul(xb, planes, acc)    acc = xb @ W.T, W = Q8_0 re-laid (quant_cpu.Q8Path)

int4: what it computes is what torch's ``_weight_int4pack_mm_for_cpu`` computes on
the same planes (no repacking, no extra memory), in another order: each
(64-row block, 32-column group) of nibbles becomes bf16 ``q - 8`` once, and
every row of x reuses it with bf16 dot products (vdpbf16ps), scale and
zero applied per group in float32. torch's kernel dequantizes per 4 rows of
x and multiplies in float32 FMAs; at 16 tokens this one is ~1.7x faster
(SmolLM2's shapes, 1 thread), at 1 token ~15 % slower (it pays the unpack
for one row), so ``quant_cpu.choose_cpu_path`` measures both per layer and
sets the token count from which a weight takes this one
(``PackedWeight.int4_native_from``). Its error is smaller too: float32 out,
only x rounded (to bf16, as both do).

q6: Q6_K, which torch has no kernel for (its scales cover 16 weights), the
same design with groups of 16: the file's bytes re-laid (0.82 B a weight),
the 6-bit values as bf16 ``q - 32`` through a 64-entry table, the scale
d * sc in float32. An 8B-shape [4096, 14336] down projection, 1 thread:
4.8 ms at 1 token and 15 ms at 16, against 87 and 130 ms for the "dequant"
path that was Q6_K's only one, and 10 and 41 ms for dense float32.

Needs x86-64 with AVX512F/BW/VL and AVX512_BF16 (checked at run time), a C
compiler (``$CC``, else ``cc``) with OpenMP, and N % 64 == 0 (torch lays a
last block of fewer rows out differently). Built into
``$KVSTRATA_CACHE_DIR/native/`` (default ``~/.cache/kvstrata``) under a
hash of the source, compiler and flags, by an atomic rename, so concurrent
first loads are safe and a changed source rebuilds (old builds stay: a few
tens of KB each, and another checkout may still load one). Anything missing: None,
one log line (``quant_native_unavailable``) naming why, and the int4 path
keeps torch's kernel. ``KVSTRATA_NATIVE_KERNELS=0`` turns it off (read at
the first load in a process).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
import uuid
from pathlib import Path

import structlog
import torch

from kvstrata.kernels._checks import KernelArgumentError
from kvstrata.paths import cache_root

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "lowbit_bf16.c"
ABI_VERSION = 3
_FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-Wall")
_BUILD_TIMEOUT_S = 120

_lock = threading.Lock()
_loaded: NativeKernels | None = None
_status: str | None = None  # None until the first native_kernels()


class NativeKernels:
    """The loaded library. Each matmul checks its arguments; one per process."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        p, i, long = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
        self._int4 = lib.kvq_int4_mm
        self._int4.argtypes = [p, p, p, p, i, i, i, long, i, i, p]
        self._int4.restype = None
        self._q6k = lib.kvq_q6k_mm
        self._q6k.argtypes = [p, p, p, p, p, p, i, i, i, long, i]
        self._q6k.restype = None
        self._q8 = lib.kvq_q8_mm
        self._q8.argtypes = [p, p, p, p, i, i, i, long, i]
        self._q8.restype = None

    def int4_matmul(self, xb: torch.Tensor, planes, acc: torch.Tensor) -> None:
        """``acc`` [M, N] float32 (rows may be strided, columns contiguous) =
        ``xb`` [M, K] bf16 (contiguous) @ W.T, W = sum over ``planes``
        ((nibbles, scales_and_zeros) of ``_convert_weight_to_int4pack_for_cpu``
        with group 32) of (q - 8) * s + z."""
        _check_int4(xb, planes, acc)
        m, k = xb.shape
        n = acc.shape[1]
        xsum = torch.empty(m * (k // 32), dtype=torch.float32)
        threads = torch.get_num_threads()
        for i, (w, sz) in enumerate(planes):
            self._int4(xb.data_ptr(), w.data_ptr(), sz.data_ptr(), acc.data_ptr(), m, n, k, acc.stride(0), int(i > 0),
                       threads, xsum.data_ptr())

    def q6k_matmul(self, xb: torch.Tensor, planes, acc: torch.Tensor) -> None:
        """``acc`` [M, N] float32 (as above) = ``xb`` [M, K] bf16 @ W.T, W
        the Q6_K weight as ``planes`` = ((lo uint8 [N/64, K, 32], hi uint8
        [N/64, K, 16], sc int8 [K/16, N], d float16 [K/256, N]),)."""
        _check_q6k(xb, planes, acc)
        m, k = xb.shape
        (lo, hi, sc, d), = planes
        self._q6k(xb.data_ptr(), lo.data_ptr(), hi.data_ptr(), sc.data_ptr(), d.data_ptr(), acc.data_ptr(), m,
                  acc.shape[1], k, acc.stride(0), torch.get_num_threads())


    def q8_matmul(self, xb: torch.Tensor, planes, acc: torch.Tensor) -> None:
        """``acc`` [M, N] float32 (as above) = ``xb`` [M, K] bf16 @ W.T, W
        the Q8_0 weight as ``planes`` = ((q int8 [N/64, K/2, 64, 2], d
        float16 [K/32, N]),)."""
        _check_planes(xb, planes, acc, 32, lambda n, k: {
            "q": ((n // 64, k // 2, 64, 2), torch.int8), "d": ((k // 32, n), torch.float16)})
        m, k = xb.shape
        (q, d), = planes
        self._q8(xb.data_ptr(), q.data_ptr(), d.data_ptr(), acc.data_ptr(), m, acc.shape[1], k, acc.stride(0),
                 torch.get_num_threads())


def _check_x_acc(xb, acc, k_multiple: int) -> tuple[int, int, int]:
    if not (isinstance(xb, torch.Tensor) and xb.dtype == torch.bfloat16 and xb.dim() == 2 and xb.is_contiguous()):
        raise KernelArgumentError(f"xb must be a contiguous 2-D bfloat16 CPU tensor, got "
                                  f"{getattr(xb, 'dtype', type(xb).__name__)} {tuple(getattr(xb, 'shape', ()))}")
    m, k = xb.shape
    if not (isinstance(acc, torch.Tensor) and acc.dtype == torch.float32 and acc.dim() == 2
            and acc.shape[0] == m and acc.stride(1) == 1 and acc.stride(0) >= acc.shape[1]):
        raise KernelArgumentError(f"acc must be float32 [{m}, N] with contiguous rows, got "
                                  f"{getattr(acc, 'dtype', None)} {tuple(getattr(acc, 'shape', ()))}")
    n = acc.shape[1]
    if m == 0 or k % k_multiple or n % 64:
        raise KernelArgumentError(f"the native kernels need M >= 1, K % {k_multiple} == 0 and N % 64 == 0, "
                                  f"got M={m}, K={k}, N={n}")
    if xb.device.type != "cpu" or acc.device.type != "cpu":
        raise KernelArgumentError("the native kernels run on CPU tensors")
    return m, k, n


def _check_int4(xb, planes, acc) -> None:
    m, k, n = _check_x_acc(xb, acc, 32)
    if not planes:
        raise KernelArgumentError("planes must hold at least one (nibbles, scales_and_zeros) pair")
    for j, (w, sz) in enumerate(planes):
        if w.dtype != torch.uint8 or not w.is_contiguous() or w.numel() != n * k // 2:
            raise KernelArgumentError(f"planes[{j}] nibbles must be contiguous uint8 with {n} * {k} / 2 bytes, "
                                      f"got {w.dtype} {tuple(w.shape)}")
        if sz.dtype != torch.bfloat16 or not sz.is_contiguous() or tuple(sz.shape) != (k // 32, n, 2):
            raise KernelArgumentError(f"planes[{j}] scales_and_zeros must be contiguous bfloat16 "
                                      f"[{k // 32}, {n}, 2], got {sz.dtype} {tuple(sz.shape)}")


def _check_q6k(xb, planes, acc) -> None:
    _check_planes(xb, planes, acc, 256, lambda n, k: {
        "lo": ((n // 64, k, 32), torch.uint8), "hi": ((n // 64, k, 16), torch.uint8),
        "sc": ((k // 16, n), torch.int8), "d": ((k // 256, n), torch.float16)})


def _check_planes(xb, planes, acc, k_multiple: int, layout) -> None:
    """x and acc as the kernels need them, and ``planes`` one tuple of the
    tensors ``layout(n, k)`` names, with those shapes and dtypes, contiguous."""
    _, k, n = _check_x_acc(xb, acc, k_multiple)
    want = layout(n, k)
    if len(planes) != 1 or len(planes[0]) != len(want):
        raise KernelArgumentError(f"planes must be (({', '.join(want)}),)")
    for (name, (shape, dtype)), t in zip(want.items(), planes[0]):
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            raise KernelArgumentError(f"planes {name} must be contiguous {str(dtype).removeprefix('torch.')} "
                                      f"{list(shape)}, got {t.dtype} {list(t.shape)}")


def native_kernels() -> NativeKernels | None:
    """The kernel, built and loaded on the first call (seconds at most; call
    it at load, never on the request path); None where it cannot run here."""
    global _loaded, _status
    with _lock:
        if _status is None:
            try:
                _loaded, _status = _load(), "ok"
            except NativeUnavailable as e:
                _status = str(e)
                log.info("quant_native_unavailable", kernel=SOURCE.name, reason=_status)
        return _loaded


def native_status() -> str:
    """"ok", why ``native_kernels()`` returned None, or "not tried" before it ran."""
    return "not tried" if _status is None else _status


class NativeUnavailable(Exception):
    """The native kernel cannot be built or run here (the message says why)."""


def _load() -> NativeKernels:
    if os.environ.get("KVSTRATA_NATIVE_KERNELS", "1") == "0":
        raise NativeUnavailable("turned off by KVSTRATA_NATIVE_KERNELS=0")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise NativeUnavailable(f"x86-64 only (AVX512_BF16), this is {platform.machine()}")
    path = build(SOURCE)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise NativeUnavailable(f"loading {path} failed: {e}") from e
    if lib.kvq_abi_version() != ABI_VERSION:
        raise NativeUnavailable(f"{path} has ABI {lib.kvq_abi_version()}, expected {ABI_VERSION}")
    if not lib.kvq_supported():
        raise NativeUnavailable("this CPU lacks AVX512F/BW/VL or AVX512_BF16")
    return NativeKernels(lib, path)


def build(source: Path, out_dir: Path | None = None) -> Path:
    """The shared library of ``source``, compiled unless a build of the same
    source, compiler and flags is cached already. Raises NativeUnavailable."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise NativeUnavailable("no C compiler (set CC, or install cc)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"C compiler {cc!r} does not run: {e}") from e
    key = hashlib.sha256(b"\0".join([source.read_bytes(), cc.encode(), version.encode(), " ".join(_FLAGS).encode(),
                                     platform.machine().encode()])).hexdigest()[:16]
    out_dir = (cache_root() / "native") if out_dir is None else out_dir
    final = out_dir / f"{source.stem}-{key}.so"
    if final.is_file():
        return final
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NativeUnavailable(f"cannot create {out_dir}: {e}") from e
    tmp = out_dir / f".{final.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        done = subprocess.run([cc, *_FLAGS, "-o", str(tmp), str(source)], capture_output=True, text=True,
                              timeout=_BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise NativeUnavailable(f"{cc} failed on {source.name} (exit {done.returncode}): {done.stderr.strip()[-400:]}")
        os.replace(tmp, final)
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"building {source.name} with {cc} failed: {e}") from e
    finally:
        tmp.unlink(missing_ok=True)
    log.info("quant_native_built", path=str(final))
    return final
