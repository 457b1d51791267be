"""Read a GGUF checkpoint (llama.cpp's format) as a Hugging Face one: a
config dict shaped like config.json and tensors under HF names, dequantized
(Q4_0, Q4_1, Q8_0, the K-quants, F16, BF16, F32: whatever ``gguf.quants``
dequantizes) to the requested dtype one tensor at a time. GGUF architectures
``llama`` (Llama, and Mistral as llama.cpp converts it), ``qwen2`` and
``qwen3`` map to LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM.

llama.cpp stores Llama's q and k projections (weights and biases) permuted
for its RoPE layout (its Qwen files use the NeoX layout, unpermuted); they
are permuted back, so the tensors equal the original checkpoint's
(dequantization aside). The tokenizer, special tokens and chat template come
from the metadata (``kvstrata.text.gguf_tokenizer``).

Errors (``CheckpointError``) name the file and what is wrong: not a GGUF,
truncated, an architecture or tensor type this reader does not map.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstrata.text.gguf_tokenizer import GGUFMetadata
from kvstrata.worker.model.config import CheckpointError

# GGUF architecture -> HF architecture; and which ones llama.cpp stores with q/k permuted
_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_PERMUTED_QK = {"llama"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class GGUFCheckpoint:
    """Owns: the open reader (memory-mapped file) and what its metadata says."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise CheckpointError(f"model: {str(self.path)!r} is not a file")
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # noqa: BLE001 - numpy raises assorted errors on truncated files
            raise CheckpointError(_unreadable(self.path, e)) from None
        self._meta = GGUFMetadata(self._reader)
        self.arch_name = self.string("general.architecture")
        if self.arch_name not in _ARCHS:
            raise CheckpointError(f"model: {self.path.name!r}: GGUF architecture {self.arch_name!r} is not supported "
                                  f"(supported: {sorted(_ARCHS)})")
        self._tensors = {t.name: t for t in self._reader.tensors}

    # -- metadata ---------------------------------------------------------------
    @property
    def metadata(self) -> GGUFMetadata:
        """The file's metadata, read once (the tokenizer is built from it too)."""
        return self._meta

    def field(self, key: str, default: Any = None) -> Any:
        return self._meta.get(key, default)

    def string(self, key: str) -> str:
        v = self.field(key)
        if not isinstance(v, str):
            raise CheckpointError(f"model: {self.path.name!r} has no {key!r} metadata")
        return v

    def _need(self, key: str) -> Any:
        v = self.field(f"{self.arch_name}.{key}")
        if v is None:
            raise CheckpointError(f"model: {self.path.name!r} is missing metadata {self.arch_name}.{key}")
        return v

    def hf_config(self) -> dict[str, Any]:
        """What config.json would say."""
        heads = int(self._need("attention.head_count"))
        hidden = int(self._need("embedding_length"))
        vocab = self.field(f"{self.arch_name}.vocab_size") or len(self.field("tokenizer.ggml.tokens") or [])
        cfg: dict[str, Any] = {
            "architectures": [_ARCHS[self.arch_name]],
            "hidden_size": hidden,
            "intermediate_size": int(self._need("feed_forward_length")),
            "num_hidden_layers": int(self._need("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.field(f"{self.arch_name}.attention.head_count_kv") or heads),
            "head_dim": int(self.field(f"{self.arch_name}.attention.key_length") or hidden // heads),
            "rms_norm_eps": float(self._need("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self.field(f"{self.arch_name}.rope.freq_base") or 10000.0),
            "max_position_embeddings": int(self.field(f"{self.arch_name}.context_length") or 2048),
            "vocab_size": int(vocab),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "torch_dtype": "float32",
        }
        if self.arch_name in ("qwen2", "qwen3"):
            cfg["use_sliding_window"] = False  # llama.cpp records no window for these
        for key, name in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                          ("eos_token_id", "tokenizer.ggml.eos_token_id")):
            value = self.field(name)
            if value is not None:
                cfg[key] = int(value)
        # end of turn / end of message end a reply too
        ends = [cfg.get("eos_token_id"), self.field("tokenizer.ggml.eot_token_id"),
                self.field("tokenizer.ggml.eom_token_id")]
        ends = list(dict.fromkeys(int(e) for e in ends if e is not None))
        if len(ends) > 1:
            cfg["eos_token_id"] = ends
        return cfg

    # -- tensors ------------------------------------------------------------------
    def tensors(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor in ``dtype``) for every tensor, dequantized lazily."""
        from gguf.quants import dequantize

        cfg = self.hf_config()
        for name, t in self._tensors.items():
            hf = _hf_name(name)
            if hf is None:
                raise CheckpointError(f"model: {self.path.name!r} has tensor {name!r}, which a "
                                      f"{_ARCHS[self.arch_name]} does not use")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            try:
                data = dequantize(t.data, t.tensor_type)
            except NotImplementedError:
                raise CheckpointError(f"model: {self.path.name!r}: tensor {name!r} has type "
                                      f"{t.tensor_type.name}, which cannot be dequantized") from None
            arr = np.asarray(data, dtype=np.float32).reshape(shape)
            if self.arch_name in _PERMUTED_QK and hf.endswith(("q_proj.weight", "q_proj.bias")):
                arr = _unpermute(arr, cfg["num_attention_heads"])
            elif self.arch_name in _PERMUTED_QK and hf.endswith(("k_proj.weight", "k_proj.bias")):
                arr = _unpermute(arr, cfg["num_key_value_heads"])
            yield hf, torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True)).to(dtype)


def _unreadable(path: Path, e: Exception) -> str:
    """Why ``gguf.GGUFReader`` failed, in words: not a GGUF at all, or a GGUF cut short."""
    with path.open("rb") as f:
        head = f.read(4)
    if head != b"GGUF":
        return f"model: {str(path)!r} is not a GGUF file (it starts with {head!r}, not b'GGUF')"
    return (f"model: {str(path)!r} is a truncated or corrupt GGUF file ({path.stat().st_size} bytes): "
            f"{type(e).__name__}: {e}")


def _hf_name(name: str) -> str | None:
    stem, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its converter interleaves the
    two halves of each head's rotary dimensions)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def is_gguf_path(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")
