"""The default model: a Llama with seeded random weights, used when no
checkpoint is given, so the engine runs on a fresh machine with nothing to
download.

It is written once as a real Hugging Face checkpoint directory (config.json +
model.safetensors, no tokenizer.json: byte-level tokenizer) under
``$KVSTRATA_CACHE_DIR`` or ``~/.cache/kvstrata``, then loaded through the
ordinary loader, so the default path exercises the same code as a user's
checkpoint. The directory name carries a digest of the config and the seed;
a build goes to a temporary directory renamed into place, so concurrent
processes never see half a checkpoint.

Size: hidden 512, 8 layers, 8 query / 4 KV heads of 64, SwiGLU 1408, vocab
258 (bytes + BOS + EOS): about 23 M parameters (92 MB in fp32). On a 2-core
CPU a 2,000-token prefill takes seconds while a decode step takes
milliseconds, so prefix reuse is visible end to end.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    import torch

    from kvstrata.worker.model.config import HFConfig

from kvstrata.paths import cache_root
from kvstrata.text.tokenizer import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_VOCAB_SIZE

log = structlog.get_logger(__name__)

_BUILD_VERSION = 1
_INIT_STD = 0.02

DEFAULT_MODEL_CONFIG: HFConfig = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": BYTE_VOCAB_SIZE,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": BYTE_BOS_ID,
    "eos_token_id": BYTE_EOS_ID,
    "torch_dtype": "float32",
}


def default_model_dir(seed: int = 0, root: Path | None = None, config: HFConfig | None = None) -> Path:
    """The default checkpoint's directory, built first if it does not exist yet."""
    config = DEFAULT_MODEL_CONFIG if config is None else config
    key = json.dumps({"v": _BUILD_VERSION, "seed": seed, "config": config}, sort_keys=True)
    name = f"default-llama-{hashlib.sha256(key.encode()).hexdigest()[:12]}-seed{seed}"
    final = (cache_root() if root is None else root) / name
    if (final / "config.json").is_file() and (final / "model.safetensors").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        write_random_checkpoint(tmp, config, seed)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("default_model_built", path=str(final), seed=seed)
    return final


def write_random_checkpoint(directory: Path, config: HFConfig, seed: int) -> None:
    """Write ``config`` and seeded N(0, 0.02) weights (norms at 1) as an HF checkpoint."""
    import torch  # here, not at import: locating a checkpoint (the CLI) needs no torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: _init(shape, name, gen) for name, shape in _tensor_shapes(config)}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")


def _init(shape: tuple[int, ...], name: str, gen: torch.Generator) -> torch.Tensor:
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape)
    return torch.empty(shape).normal_(0.0, _INIT_STD, generator=gen)


def _tensor_shapes(c: HFConfig) -> list[tuple[str, tuple[int, ...]]]:
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q = c["num_attention_heads"] * c["head_dim"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (q, hidden)),
            (p + "self_attn.k_proj.weight", (kv, hidden)),
            (p + "self_attn.v_proj.weight", (kv, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, q)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
        ]
    shapes.append(("model.norm.weight", (hidden,)))
    if not c.get("tie_word_embeddings", False):
        shapes.append(("lm_head.weight", (vocab, hidden)))
    return shapes
