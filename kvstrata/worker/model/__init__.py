"""The Llama-family model: architecture config, layers, RoPE, checkpoint
loading and the default random model.

    load_checkpoint(path, dtype, device) -> LoadedCheckpoint(model, arch, directory, dtype, fingerprint)
    build_model(raw_config, tensors, *, dtype, device, source) -> (model, arch)   (any format's tensors)
    default_model_dir(seed) -> Path     (built once, cached on disk)
"""

from kvstrata.worker.model.attention import AttentionMetadata
from kvstrata.worker.model.config import (
    CheckpointError,
    LlamaArchConfig,
    RopeConfig,
    UnsupportedArchitectureError,
    parse_arch_config,
)
from kvstrata.worker.model.default_model import DEFAULT_MODEL_CONFIG, default_model_dir
from kvstrata.worker.model.llama import LlamaForCausalLM
from kvstrata.worker.model.loader import LoadedCheckpoint, build_model, load_checkpoint

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
