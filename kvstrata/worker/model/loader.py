"""Load a Hugging Face Llama-family checkpoint (every architecture in
``config.FAMILIES``) from a local directory or a GGUF file.

One entry point does the building for every format::

    build_model(raw_config: HFConfig,
                tensors: Iterable[tuple[str, torch.Tensor]],
                *, dtype: str = "float32", device: str = "cpu",
                source: str = "<tensors>") -> tuple[LlamaForCausalLM, LlamaArchConfig]

``raw_config`` is a config.json-style dict, ``tensors`` yields tensors under
their Hugging Face names (``model.layers.0.self_attn.q_proj.weight``); the
safetensors path and the GGUF path both feed it. Before any weight is
allocated, a directory's safetensors headers (names and shapes only) are
checked against the model built on the ``meta`` device, so a missing tensor,
a wrong shape or an unknown one is refused with nothing allocated.

A checkpoint is ``config.json`` plus either ``model.safetensors`` or
``model.safetensors.index.json`` and the shards it names (other single
``*.safetensors`` files are accepted when neither exists). Tensors may be
fp32, fp16 or bf16 and are cast to the requested dtype while copied.

Every tensor the model needs must be present with its exact shape, and every
tensor present must be one the model uses: a checkpoint with extra weights
(a bias we would not apply) is a different architecture, refused rather than
run wrongly. Errors name the directory and the file or tensor.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
import structlog
import torch
from safetensors import safe_open

from kvstrata.kernels import PackedWeight
from kvstrata.kernels.dispatch import use_triton
from kvstrata.kernels.quant_gpu_layout import GPU_LAYOUT_TYPES, with_gpu_layout
from kvstrata.kernels.quant_native import native_kernels
from kvstrata.text.gguf_tokenizer import GGUFMetadata
from kvstrata.worker.model.config import (CheckpointError, HFConfig, LlamaArchConfig, parse_arch_config,
                                          with_generation_eos)
from kvstrata.worker.model.fingerprint import checkpoint_fingerprint
from kvstrata.worker.model.gguf_file import GGUFCheckpoint, GGUFTensor, is_gguf_path
from kvstrata.worker.model.gguf_packed import PackPlan, choose_paths, install, pack_linears, resident_bytes
from kvstrata.worker.model.llama import LlamaForCausalLM
from kvstrata.worker.model.rope import RotaryEmbedding

log = structlog.get_logger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# HF tensor name piece -> (our fused parameter, index of the slice it fills)
_PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# A checkpoint tensor: loaded, a GGUF one read on demand, or (``shapes_only``) its shape.
_Source = torch.Tensor | GGUFTensor | tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LoadedCheckpoint:
    model: LlamaForCausalLM
    arch: LlamaArchConfig
    directory: Path
    dtype: str
    fingerprint: str
    gguf_metadata: GGUFMetadata | None = None  # a GGUF's metadata, for its tokenizer
    weight_bytes: int = 0  # resident bytes of the weights as held (packed blocks, dense tensors)
    quantized_weights: str = "dequantize"  # "packed": a GGUF's linear layers kept quantized


def load_checkpoint(path: str, dtype: str = "float32", device: str = "cpu",
                    quantized_weights: str = "auto", gpu_quant_layout: bool = False) -> LoadedCheckpoint:
    """Build the model in ``dtype`` ("float32", "float16", "bfloat16" or "auto":
    a safetensors checkpoint's own; for a GGUF bf16 on a GPU, on a CPU the
    faster measured, ``gguf_packed.py``) on ``device`` and fill it from
    ``path``. ``quantized_weights`` (a GGUF only): "packed", "dequantize",
    or "auto" (``resolve_quantized``: packed on a CPU for dtype "auto" or
    "bfloat16"; dequantize on CUDA, measured faster there). ``gpu_quant_layout`` (``ModelConfig``'s;
    packed GGUF weights only): where the Triton kernels run the matmuls
    (CUDA, or a CPU under TRITON_INTERPRET=1) re-lay the packed weights for
    the GPU GEMV (``kernels/quant_gpu_layout.py``)."""
    if is_gguf_path(path):
        return _load_gguf(path, dtype, device, quantized_weights, gpu_quant_layout)
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise CheckpointError(f"model: {str(directory)!r} is not a directory")
    config_path = directory / "config.json"
    raw = _read_config(config_path)
    arch = parse_arch_config(raw, str(config_path))
    gen_path = directory / "generation_config.json"
    if gen_path.exists():
        arch = with_generation_eos(arch, _read_config(gen_path), str(gen_path))
    files = weight_files(directory)
    dtype_name = resolve_dtype(dtype, arch.checkpoint_dtype)
    # names and shapes from the headers first: a bad checkpoint allocates nothing
    _fill_tensors(LlamaForCausalLM(arch, _DTYPES[dtype_name], "meta"), arch, _header_shapes(files), directory,
                  shapes_only=True)
    model, _ = build_model(raw, _safetensors_tensors(files), dtype=dtype_name, device=device,
                           source=str(directory))
    fingerprint = checkpoint_fingerprint(raw, files, dtype_name)
    weight_bytes = resident_bytes(model)
    log.info(
        "checkpoint_loaded",
        path=str(directory),
        dtype=dtype_name,
        num_files=len(files),
        num_layers=arch.num_hidden_layers,
        weight_mib=round(weight_bytes / 2**20, 1),
        fingerprint=fingerprint[:16],
    )
    return LoadedCheckpoint(model, arch, directory, dtype_name, fingerprint, weight_bytes=weight_bytes)


def resolve_dtype(requested: str, checkpoint_dtype: str | None) -> str:
    if requested == "auto":
        return checkpoint_dtype if checkpoint_dtype in _DTYPES else "float32"
    if requested not in _DTYPES:
        raise ValueError(f"model.dtype must be float32, float16, bfloat16 or auto, got {requested!r}")
    return requested


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of the checkpoint, in a stable order."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"model: {str(index)!r} is not a valid safetensors index: {exc}") from exc
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"model: shard {file.name!r} named in {str(index)!r} is missing")
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(directory.glob("*.safetensors"))
    if files:
        return files
    hint = " (only safetensors are supported, not pytorch .bin)" if any(directory.glob("*.bin")) else ""
    raise CheckpointError(
        f"model: {str(directory)!r} has no model.safetensors or model.safetensors.index.json{hint}"
    )


def _read_config(path: Path) -> HFConfig:
    if not path.is_file():
        raise CheckpointError(f"model: {str(path.parent)!r} is missing {path.name}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"model: cannot parse {str(path)!r}: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"model: {str(path)!r} must hold a JSON object")
    return raw


def _slices(arch: LlamaArchConfig) -> dict[str, list[int]]:
    """Row offsets of the pieces of each fused parameter."""
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_key_value_heads * arch.head_dim
    inter = arch.intermediate_size
    return {"qkv_proj": [0, q, q + kv, q + 2 * kv], "gate_up_proj": [0, inter, 2 * inter]}


def build_model(
    raw_config: HFConfig,
    tensors: Iterable[tuple[str, torch.Tensor | GGUFTensor]],
    *,
    dtype: str = "float32",
    device: str = "cpu",
    source: str = "<tensors>",
) -> tuple[LlamaForCausalLM, LlamaArchConfig]:
    """The model ``raw_config`` (a config.json dict) describes, in ``dtype``
    (or "auto") on ``device``, filled from ``tensors``: (Hugging Face name,
    tensor, or a ``GGUFTensor`` read straight into its parameter) pairs in
    any order, each needed one exactly once, nothing extra, shapes exact.
    Errors are ``CheckpointError`` naming ``source`` and the tensor or
    field; on error no model is returned."""
    arch = parse_arch_config(raw_config, source)
    model = LlamaForCausalLM(arch, _DTYPES[resolve_dtype(dtype, arch.checkpoint_dtype)], device)
    _fill_tensors(model, arch, ((name, t, source) for name, t in tensors), Path(source))
    model.eval()
    return model, arch


def resolve_quantized(requested: str, device: str, dtype: str) -> str:
    """"auto": packed on a CPU where the native kernels run (exact at every
    dtype: float32 activations by float32 FMAs), or where the activations
    may be bf16 anyway (dtype "auto" or "bfloat16"); otherwise the exact
    dequantize-at-load path (torch's int4 kernel, the packed path there,
    rounds to bf16: it flips a 0.08 logit margin on SmolLM2's first chat
    answer); CUDA dequantizes: there the Triton kernels are exact but
    slower than bf16 weights (an H200, 8B Q4_0: 0.91x at batch 1, 0.30x at
    16; docs/quantization.md)."""
    if requested == "auto":
        if torch.device(device).type != "cpu":
            return "dequantize"
        return "packed" if dtype in ("auto", "bfloat16") or native_kernels() is not None else "dequantize"
    if requested not in ("packed", "dequantize"):
        raise ValueError(f"model.quantized_weights must be 'auto', 'packed' or 'dequantize', got {requested!r}")
    return requested


def _load_gguf(path: str, dtype: str, device: str, quantized_weights: str,
               gpu_quant_layout: bool = False) -> LoadedCheckpoint:
    """A GGUF file: its metadata as config.json; its tensors dequantized, or
    its linear layers kept packed (``gguf_packed.py``)."""
    mode = resolve_quantized(quantized_weights, device, dtype)
    ck = GGUFCheckpoint(path)
    raw = ck.hf_config()
    if mode == "packed":
        model, arch, dtype_name, paths = _build_packed(ck, raw, dtype, device, gpu_quant_layout)
    else:  # each tensor is dequantized straight into its parameter (GGUFTensor.read_into)
        dtype_name = resolve_dtype(dtype, "bfloat16" if torch.device(device).type == "cuda" else "float32")
        model, arch = build_model(raw, ck.tensor_sources(), dtype=dtype_name, device=device, source=str(ck.path))
        paths = ""
    weight_bytes = resident_bytes(model)
    fingerprint = checkpoint_fingerprint(raw, [ck.path], dtype_name + paths)
    log.info("checkpoint_loaded", path=str(ck.path), dtype=dtype_name, format="gguf", quantized_weights=mode,
             weight_mib=round(weight_bytes / 2**20, 1), num_layers=arch.num_hidden_layers,
             fingerprint=fingerprint[:16])
    return LoadedCheckpoint(model, arch, ck.path, dtype_name, fingerprint, ck.metadata, weight_bytes, mode)


def _build_packed(ck: GGUFCheckpoint, raw: HFConfig, dtype: str, device: str,
                  gpu_quant_layout: bool = False) -> tuple[LlamaForCausalLM, LlamaArchConfig, str, str]:
    """The model with its linear layers packed: built on the meta device (no
    dense weight is ever allocated for them), the packed modules put in,
    the rest (norms, biases, dense fallbacks) allocated and filled.
    Returns (model, arch, dtype name, the CPU paths as the fingerprint notes them)."""
    arch = parse_arch_config(raw, str(ck.path))
    sources = dict(ck.tensor_sources())
    plan = pack_linears(sources, arch, device, ck.path.name)
    relaid = gpu_quant_layout and use_triton("auto", torch.device(device))
    if relaid:
        _relay_for_gpu(plan)
    if torch.device(device).type == "cpu" and not relaid:
        torch_dtype, choices = choose_paths(plan, None if dtype == "auto" else _DTYPES[resolve_dtype(dtype, None)])
        paths = "/packed:" + ",".join(sorted(f"{q}{list(shape)}={c.path}" for (q, shape), c in choices.items()))
    else:  # the GPU layout's GEMV sums in another order than the blocks' kernels: another fingerprint
        torch_dtype, choices = _DTYPES["bfloat16" if dtype == "auto" else resolve_dtype(dtype, None)], None
        paths = "/packed+gpu_layout" if relaid else "/packed"
    model = LlamaForCausalLM(arch, torch_dtype, "meta")
    install(model, plan, choices, torch_dtype, device)
    model.to_empty(device=device)
    if arch.tie_word_embeddings and plan.embedding is None:  # to_empty made the two copies apart
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rotary = RotaryEmbedding(arch.rope, arch.head_dim, device)
    rest = ((name, src, ck.path.name) for name, src in sources.items() if name not in plan.consumed)
    _fill_tensors(model, arch, rest, ck.path)
    model.eval()
    return model, arch, str(torch_dtype).removeprefix("torch."), paths


def _relay_for_gpu(plan: PackPlan) -> None:
    """The plan's packed matmul weights of a type with a GPU layout (Q8_0, Q4_0, Q4_K, Q6_K)
    re-laid for the GPU GEMV, their blocks dropped; other types keep their blocks (the block
    kernels read them). An untied embedding keeps its blocks: a lookup reads a few rows, and
    the layout would speed nothing up; a tied one is the lm_head's weight and is re-laid."""
    def relaid(w):
        return with_gpu_layout(w) if isinstance(w, PackedWeight) and w.qtype.name in GPU_LAYOUT_TYPES else w

    plan.linears = {name: [relaid(p) for p in parts] for name, parts in plan.linears.items()}
    if plan.tied and plan.embedding is not None:
        plan.embedding = relaid(plan.embedding)


def _header_shapes(files: list[Path]) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(name, shape, file name) of every tensor, read from the safetensors headers only."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for key in reader.keys():
                yield key, tuple(reader.get_slice(key).get_shape()), file.name


def _safetensors_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for key in reader.keys():
                if not key.endswith(_IGNORED_SUFFIXES):
                    yield key, reader.get_tensor(key)


def _fill_tensors(model: LlamaForCausalLM, arch: LlamaArchConfig,
                  tensors: Iterable[tuple[str, _Source, str]], source: Path, *, shapes_only: bool = False) -> None:
    """Copy (HF name, tensor, file name) items into ``model``: each needed
    once, nothing extra, shapes exact; errors name the tensor and the file.
    With ``shapes_only`` the items carry shapes instead of tensors and only
    the checks run (``model`` may live on the meta device)."""
    params = dict(model.named_parameters(remove_duplicate=True))
    if arch.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    needed: set[tuple[str, int]] = set()
    offsets = _slices(arch)
    for name in params:
        fused = name.split(".")[-2]
        count = len(offsets[fused]) - 1 if fused in offsets else 1
        needed.update((name, i) for i in range(count))
    for key, tensor, file_name in tensors:
        target = _target(key, arch)
        if target is None:
            continue
        name, piece = target
        if name not in params:
            raise CheckpointError(
                f"model: {file_name!r} has tensor {key!r}, which a {arch.architecture} with this config "
                "does not use (different architecture?)"
            )
        _copy(params[name], piece, offsets, name, tensor, key, file_name, shapes_only)
        needed.discard((name, piece))
    if needed:
        missing = sorted(_hf_name(name, piece) for name, piece in needed)
        raise CheckpointError(
            f"model: checkpoint {str(source)!r} is missing {len(missing)} tensor(s), e.g. {missing[:3]}"
        )


def _target(key: str, arch: LlamaArchConfig) -> tuple[str, int] | None:
    if key.endswith(_IGNORED_SUFFIXES):
        return None
    if key == "lm_head.weight" and arch.tie_word_embeddings:
        return None  # tied: the embedding is the head; HF ignores this copy too
    parts = key.split(".")
    if len(parts) >= 2 and parts[-2] in _PACKED:
        fused, piece = _PACKED[parts[-2]]
        parts[-2] = fused
        return ".".join(parts), piece
    return key, 0


def _hf_name(name: str, piece: int) -> str:
    for hf, (fused, idx) in _PACKED.items():
        if f".{fused}." in name and idx == piece:
            return name.replace(f".{fused}.", f".{hf}.")
    return name


def _copy(
    param: torch.Tensor,
    piece: int,
    offsets: dict[str, list[int]],
    name: str,
    tensor: _Source,
    key: str,
    file_name: str,
    shapes_only: bool = False,
) -> None:
    """Copy checkpoint ``tensor`` (a tensor, or a GGUF one read on demand)
    into ``param`` (or its ``piece`` of a fused one), casting the dtype."""
    fused = name.split(".")[-2]
    dest = param.data
    if fused in offsets:
        lo, hi = offsets[fused][piece], offsets[fused][piece + 1]
        dest = dest[lo:hi]
    shape = tuple(tensor) if shapes_only else tuple(tensor.shape)
    if shape != tuple(dest.shape):
        raise CheckpointError(
            f"model: tensor {key!r} in {file_name!r} has shape {shape}, expected {tuple(dest.shape)} from config.json"
        )
    if shapes_only:
        return
    if isinstance(tensor, GGUFTensor):
        tensor.read_into(dest)
    else:
        dest.copy_(tensor)
