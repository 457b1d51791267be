"""The Llama-family model: architecture config, layers, RoPE, checkpoint
loading and the default random model.

    load_checkpoint(path, dtype, device) -> LoadedCheckpoint(model, arch, directory, dtype, fingerprint)
    build_model(raw_config, tensors, *, dtype, device, source) -> (model, arch)   (any format's tensors)
    default_model_dir(seed) -> Path     (built once, cached on disk)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvstrata.worker.model.config import (
    CheckpointError,
    LlamaArchConfig,
    RopeConfig,
    UnsupportedArchitectureError,
    parse_arch_config,
)

if TYPE_CHECKING:
    from kvstrata.worker.model.attention import AttentionMetadata
    from kvstrata.worker.model.default_model import DEFAULT_MODEL_CONFIG, default_model_dir
    from kvstrata.worker.model.llama import LlamaForCausalLM
    from kvstrata.worker.model.loader import LoadedCheckpoint, build_model, load_checkpoint

# What needs torch is imported on first use (PEP 562), so finding a
# checkpoint (``smollm2.locate_smollm2``, the CLI) does not pay for torch.
_LAZY = {
    "AttentionMetadata": "attention",
    "DEFAULT_MODEL_CONFIG": "default_model",
    "default_model_dir": "default_model",
    "LlamaForCausalLM": "llama",
    "LoadedCheckpoint": "loader",
    "build_model": "loader",
    "load_checkpoint": "loader",
}


def __getattr__(name: str) -> Any:  # Any: a lazily imported export (PEP 562)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)

__all__ = [
    "DEFAULT_MODEL_CONFIG",
    "AttentionMetadata",
    "CheckpointError",
    "LlamaArchConfig",
    "LlamaForCausalLM",
    "LoadedCheckpoint",
    "RopeConfig",
    "UnsupportedArchitectureError",
    "build_model",
    "default_model_dir",
    "load_checkpoint",
    "parse_arch_config",
]
