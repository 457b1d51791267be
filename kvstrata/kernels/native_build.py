"""Builds kvstrata's C kernels (``kernels/csrc``) with the system C compiler, once per machine.

    build(source, out_dir=None) -> Path     the shared library; raises NativeUnavailable
    load_library(source, abi_symbol, abi)   (library, path): built, loaded, ABI checked (the switch and machine first)
    OnceLoader(load, event, source)         a kernel set loaded on first use: .get() (None: .status() says why)

Built into ``$KVSTRATA_CACHE_DIR/native/`` (default ``~/.cache/kvstrata``)
under a hash of the source, compiler and flags, by an atomic rename, so
concurrent first loads are safe and a changed source rebuilds (old builds
stay: a few tens of KB each, and another checkout may still load one).
Users: ``quant_native`` (the packed-weight matmuls), ``attention_native``
(decode attention from the paged cache) and ``fused_native`` (the decoder
layer's add + norm and RoPE + cache write).
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
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

import structlog

from kvstrata.paths import cache_root

log = structlog.get_logger(__name__)

_FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-Wall")
_BUILD_TIMEOUT_S = 120


class NativeUnavailable(Exception):
    """The native kernel cannot be built or run here (the message says why)."""


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
    log.info("native_kernel_built", path=str(final))
    return final


def load_library(source: Path, abi_symbol: str, abi: int, *, x86_only: bool = True) -> tuple[ctypes.CDLL, Path]:
    """``source`` built (``build``) and loaded, after the checks every native
    kernel set shares: ``KVSTRATA_NATIVE_KERNELS=0`` turns them all off, and
    they are x86-64 code (unless ``x86_only`` is false: portable C);
    ``abi_symbol()`` must return ``abi``. Returns the
    library and its path; raises NativeUnavailable naming what is missing."""
    if os.environ.get("KVSTRATA_NATIVE_KERNELS", "1") == "0":
        raise NativeUnavailable("turned off by KVSTRATA_NATIVE_KERNELS=0")
    if x86_only and platform.machine().lower() not in ("x86_64", "amd64"):
        raise NativeUnavailable(f"x86-64 only, this is {platform.machine()}")
    path = build(source)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise NativeUnavailable(f"loading {path} failed: {e}") from e
    got = getattr(lib, abi_symbol)()
    if got != abi:
        raise NativeUnavailable(f"{path} has ABI {got}, expected {abi}")
    return lib, path


T = TypeVar("T")


class OnceLoader(Generic[T]):
    """One kernel set, loaded by ``load`` on the first ``get()`` (thread-safe;
    later calls take no lock): the kernels, or None where ``load`` raised
    NativeUnavailable, then logged once as ``event`` with the reason."""

    def __init__(self, load: Callable[[], T], event: str, source: Path) -> None:
        self._load, self._event, self._source = load, event, source
        self._lock = threading.Lock()
        self._loaded: T | None = None
        self._status: str | None = None  # None until the first get()

    def get(self) -> T | None:
        if self._status is not None:  # settled: every call asks, no lock on that path
            return self._loaded
        with self._lock:
            if self._status is None:
                try:
                    self._loaded, self._status = self._load(), "ok"
                except NativeUnavailable as e:
                    self._status = str(e)
                    log.info(self._event, kernel=self._source.name, reason=self._status)
            return self._loaded

    def status(self) -> str:
        """"ok", why ``get()`` returned None, or "not tried" before it ran."""
        return "not tried" if self._status is None else self._status
