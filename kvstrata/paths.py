"""Where kvstrata keeps what it builds or downloads once per machine."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$KVSTRATA_CACHE_DIR``, else ``~/.cache/kvstrata``: the default
    checkpoint, the SmolLM2 GGUF, the native CPU kernels."""
    env = os.environ.get("KVSTRATA_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvstrata"
