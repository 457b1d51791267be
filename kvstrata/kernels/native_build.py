"""Builds kvstrata's C kernels (``kernels/csrc``) with the system C compiler, once per machine.

    build(source, out_dir=None) -> Path     the shared library; raises NativeUnavailable

Built into ``$KVSTRATA_CACHE_DIR/native/`` (default ``~/.cache/kvstrata``)
under a hash of the source, compiler and flags, by an atomic rename, so
concurrent first loads are safe and a changed source rebuilds (old builds
stay: a few tens of KB each, and another checkout may still load one).
Users: ``quant_native`` (the packed-weight matmuls) and ``attention_native``
(decode attention from the paged cache).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import uuid
from pathlib import Path

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
