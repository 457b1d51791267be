"""A stable digest of a checkpoint, for cache identity.

The root of every KV block hash chain is derived from it, so two processes
serving the same weights agree on every hash, and changed weights invalidate
the cache by themselves. It covers: config.json (minus keys that do not
change the computation), the compute dtype, and per safetensors file its
name, its header (every tensor's name, dtype, shape and offsets) and a sample
of its data bytes (the first 64 KiB, 16 evenly spaced 4 KiB windows and the
last 4 KiB). Reading a few hundred KiB instead of every byte keeps start-up
fast for multi-GiB checkpoints; a retrained checkpoint changes the sampled
bytes with near certainty.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

_VERSION = b"kvstrata-model-fingerprint-v1\0"
_VOLATILE_KEYS = frozenset({"transformers_version", "_name_or_path", "use_cache"})
_HEAD = 64 * 1024
_WINDOW = 4 * 1024
_NUM_WINDOWS = 16


def checkpoint_fingerprint(config: Mapping[str, object], files: list[Path], dtype: str) -> str:
    """Hex sha256 over the config, ``dtype`` and a sample of every weight file."""
    digest = hashlib.sha256(_VERSION)
    stable = {k: v for k, v in config.items() if k not in _VOLATILE_KEYS}
    digest.update(json.dumps(stable, sort_keys=True, separators=(",", ":")).encode())
    digest.update(b"\0dtype=" + dtype.encode() + b"\0")
    for path in sorted(files, key=lambda p: p.name):
        digest.update(path.name.encode() + b"\0")
        if path.suffix.lower() == ".gguf":
            _digest_sampled(path, digest)  # its metadata and tensor index are at the head
        else:
            _digest_safetensors(path, digest)
    return digest.hexdigest()


def _digest_safetensors(path: Path, digest: "hashlib._Hash") -> None:
    size = path.stat().st_size
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        digest.update(f.read(header_len))
        start = 8 + header_len
        data_len = size - start
        digest.update(f.read(min(_HEAD, data_len)))
        if data_len <= _HEAD:
            return
        stride = data_len // (_NUM_WINDOWS + 1)
        for i in range(1, _NUM_WINDOWS + 1):
            f.seek(start + i * stride)
            digest.update(f.read(_WINDOW))
        f.seek(max(start, size - _WINDOW))
        digest.update(f.read(_WINDOW))


def _digest_sampled(path: Path, digest: "hashlib._Hash") -> None:
    """The size, the first 1 MiB (a GGUF's metadata and tensor index), 16
    evenly spaced windows and the last window."""
    size = path.stat().st_size
    digest.update(size.to_bytes(8, "little"))
    with path.open("rb") as f:
        digest.update(f.read(16 * _HEAD))
        for i in range(_NUM_WINDOWS):
            f.seek(size * i // _NUM_WINDOWS)
            digest.update(f.read(_WINDOW))
        f.seek(max(0, size - _WINDOW))
        digest.update(f.read(_WINDOW))
