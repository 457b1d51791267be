"""A GGUF's linear layers kept quantized (``model.quantized_weights =
"packed"``, and "auto" on a CPU where the native kernels run): which
tensors pack, the CPU path of each layer, the activation dtype "auto" picks
on a CPU, and the modules put in the model.

    plan = pack_linears(sources, arch, device)          the blocks, read once
    dtype, paths = choose_paths(plan, dtype | None)     CPU only; None: "auto"
    install(model, plan, paths, dtype, device)          PackedLinear / PackedEmbedding in place
    resident_bytes(model)                               weights as held in memory

What packs: every 2-D weight of the linear layers (q, k, v, o, gate, up,
down, an untied lm_head) and the token embedding whose type
``kvstrata.kernels`` packs (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)
and whose rows hold whole blocks. q/k rows are un-permuted by moving whole
rows (``GGUFTensor.pack``); fused q|k|v and gate|up stack runs of one type
(``cat_rows``). Anything else (F32/F16/BF16 weights; another quant type or a
row a K-quant block does not divide, as llama.cpp's own files have: one log
line ``gguf_tensor_dequantized`` names it and its type) is dequantized at
load into a dense part. Norms and biases are dense.

CPU paths: ``choose_cpu_path`` once per distinct (type, shape) at load
(SmolLM2: 5 of 151 weights): the native path (every packed type, weights
exact, x at the activations' own precision) wherever its kernels run, with
no timing for a given dtype; elsewhere, with ``allow_inexact=True``, torch's
int4 path (bf16 matmul, |err| <= 2^-7 S, ``kernels/quant_linear.py``)
races the exact "dequant" path for float32 activations too. A layer keeps
the GGUF blocks only where they are still read: on the int4 and native
paths the blocks are dropped, and a tied embedding then reads its rows from
the lm_head's planes (``planes_rows``: exact from the native planes).
"auto" dtype on a CPU: the chosen paths' summed time (layers weighted by
count, 1 and 16 tokens) at float32 and at bfloat16; bfloat16 when it is
10 % faster, which also runs attention and norms in bf16. On CUDA nothing
is measured: the Triton kernel reads the blocks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import structlog
import torch

from kvstrata.kernels import (
    CpuChoice,
    KernelArgumentError,
    PackedWeight,
    QuantScratch,
    cat_rows,
    choose_cpu_path,
    with_cpu_path,
)
from kvstrata.kernels.quant import PLANE_PATHS
from kvstrata.kernels.quant_cpu import int4_layout_ok
from kvstrata.worker.model.config import CheckpointError, LlamaArchConfig
from kvstrata.worker.model.gguf_file import GGUFTensor
from kvstrata.worker.model.llama import LlamaForCausalLM
from kvstrata.worker.model.packed import Part, PackedEmbedding, PackedLinear, part_bytes

log = structlog.get_logger(__name__)

EMBED, HEAD = "model.embed_tokens", "lm_head"
_AUTO_MARGIN = 0.1  # bf16 activations must be this much faster than fp32 for "auto" to take them


@dataclass
class PackPlan:
    """The packed (or to-be-dequantized) parts of each linear module, by module
    name, and the embedding's blocks; ``consumed``: the HF tensor names
    taken (the loader fills the rest: norms, biases)."""

    linears: dict[str, list[PackedWeight | GGUFTensor]] = field(default_factory=dict)
    embedding: PackedWeight | None = None
    tied: bool = False
    consumed: set[str] = field(default_factory=set)


def _linear_specs(arch: LlamaArchConfig) -> dict[str, tuple[int, list[tuple[str, int]]]]:
    """module name -> (in_features, [(HF weight name, rows)] in row order)."""
    h, inter = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    specs = {}
    for i in range(arch.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        specs[f"{a}.qkv_proj"] = (h, [(f"{a}.q_proj.weight", q), (f"{a}.k_proj.weight", kv),
                                      (f"{a}.v_proj.weight", kv)])
        specs[f"{a}.o_proj"] = (q, [(f"{a}.o_proj.weight", h)])
        specs[f"{m}.gate_up_proj"] = (h, [(f"{m}.gate_proj.weight", inter), (f"{m}.up_proj.weight", inter)])
        specs[f"{m}.down_proj"] = (inter, [(f"{m}.down_proj.weight", h)])
    if not arch.tie_word_embeddings:
        specs[HEAD] = (h, [(f"{HEAD}.weight", arch.vocab_size)])
    return specs


def pack_linears(sources: dict[str, GGUFTensor], arch: LlamaArchConfig, device: torch.device | str,
                 file_name: str) -> PackPlan:
    """Read the linear weights' blocks (and the embedding's) from ``sources``
    (HF name -> tensor); CheckpointError naming a missing or misshapen one."""
    plan = PackPlan(tied=arch.tie_word_embeddings)
    for module, (in_f, pieces) in _linear_specs(arch).items():
        parts: list[PackedWeight | GGUFTensor] = []
        for name, rows in pieces:
            src = _source(sources, name, (rows, in_f), file_name)
            parts.append(_try_pack(src, name, device))
            plan.consumed.add(name)
        plan.linears[module] = _stack_runs(parts)
    emb = _source(sources, f"{EMBED}.weight", (arch.vocab_size, arch.hidden_size), file_name)
    packed = _try_pack(emb, f"{EMBED}.weight", device)
    if isinstance(packed, PackedWeight):
        plan.embedding = packed
        plan.consumed.add(f"{EMBED}.weight")
    return plan


def _source(sources: dict[str, GGUFTensor], name: str, shape: tuple[int, int], file_name: str) -> GGUFTensor:
    src = sources.get(name)
    if src is None:
        raise CheckpointError(f"model: checkpoint {file_name!r} is missing tensor {name!r}")
    if tuple(src.shape) != shape:
        raise CheckpointError(f"model: tensor {name!r} in {file_name!r} has shape {tuple(src.shape)}, "
                              f"expected {shape} from its metadata")
    return src


def _try_pack(src: GGUFTensor, name: str, device: torch.device | str) -> PackedWeight | GGUFTensor:
    """The packed blocks, or ``src`` itself to be dequantized (logged when it is quantized)."""
    try:
        return src.pack(device)
    except KernelArgumentError as e:
        if src.type_name not in ("F32", "F16", "BF16"):
            log.info("gguf_tensor_dequantized", tensor=src.gguf_name, hf_name=name, type=src.type_name,
                     reason=str(e))
        return src


def _stack_runs(parts: list[PackedWeight | GGUFTensor]) -> list[PackedWeight | GGUFTensor]:
    """Adjacent packed parts of one type and width, stacked into one weight."""
    out: list[PackedWeight | GGUFTensor] = []
    for p in parts:
        prev = out[-1] if out else None
        if (isinstance(p, PackedWeight) and isinstance(prev, PackedWeight)
                and (prev.qtype, prev.in_features) == (p.qtype, p.in_features)):
            out[-1] = cat_rows([prev, p])
        else:
            out.append(p)
    return out


def _packed_weights(plan: PackPlan) -> list[PackedWeight]:
    weights = [p for parts in plan.linears.values() for p in parts if isinstance(p, PackedWeight)]
    if plan.tied and plan.embedding is not None:
        weights.append(plan.embedding)  # it is the lm_head too
    return weights


def choose_paths(plan: PackPlan, dtype: torch.dtype | None) -> tuple[torch.dtype, dict[tuple, CpuChoice]]:
    """The activation dtype (``dtype``, or measured when None) and the CPU
    path of each distinct (type, shape) of the packed matmul weights."""
    counts = Counter(_key(w) for w in _packed_weights(plan))
    first = {}
    for w in _packed_weights(plan):
        first.setdefault(_key(w), w)
    candidates = [dtype] if dtype is not None else [torch.float32, torch.bfloat16]
    choices: dict[torch.dtype, dict[tuple, CpuChoice]] = {}
    total: dict[torch.dtype, float] = {}
    for dt in candidates:
        # a given dtype times only where paths race (no native kernels); "auto" compares the dtypes' times
        choices[dt] = {k: choose_cpu_path(w, (1, 16), dtype=dt, reps=3, ring_bytes=32 << 20, allow_inexact=True,
                                          measure=dtype is None) for k, w in first.items()}
        if dtype is None:
            total[dt] = sum(counts[k] * sum(c.times_ms[c.path].values()) for k, c in choices[dt].items())
    picked = candidates[0]
    if dtype is None and total[torch.bfloat16] < (1 - _AUTO_MARGIN) * total[torch.float32]:
        picked = torch.bfloat16
    log.info("quant_cpu_paths_chosen", dtype=str(picked).removeprefix("torch."),
             measured_ms={str(dt).removeprefix("torch."): round(t, 2) for dt, t in total.items()},
             paths={f"{k[0]}{list(k[1])}": c.path for k, c in choices[picked].items()})
    return picked, choices[picked]


def _key(w: PackedWeight) -> tuple:
    return w.qtype.name, w.shape


def install(model: LlamaForCausalLM, plan: PackPlan, paths: dict[tuple, CpuChoice] | None, dtype: torch.dtype,
            device: torch.device | str) -> None:
    """Put the packed modules in ``model`` (built on the meta device); dense
    parts are dequantized here. ``paths``: each weight's CPU path (None on CUDA)."""
    scratch = QuantScratch()

    def prepared(w: PackedWeight, tied: bool = False) -> PackedWeight:
        if paths is None:
            return w
        choice = paths[_key(w)]
        # the blocks go where the planes hold the weight; a tied embedding then reads its rows from the
        # planes, which for int4 needs this torch build's layout to be the one int4_rows knows
        keep = choice.path not in PLANE_PATHS or (tied and choice.path == "int4" and not int4_layout_ok())
        return with_cpu_path(w, choice.path, keep_blocks=keep)

    for name, parts in plan.linears.items():
        dense: list[Part] = [prepared(p) if isinstance(p, PackedWeight) else _dequantized(p, dtype, device)
                             for p in parts]
        old = model.get_submodule(name)
        model.set_submodule(name, PackedLinear(dense, old.bias is not None, dtype, device, scratch))
    if plan.embedding is not None:
        emb = plan.embedding
        if plan.tied:  # one weight for both
            emb = prepared(emb, tied=True)
            model.lm_head = PackedLinear([emb], False, dtype, device, scratch)
        model.model.embed_tokens = PackedEmbedding(emb, dtype)


def _dequantized(src: GGUFTensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    out = torch.empty(src.shape, dtype=dtype, device=device)
    src.read_into(out)
    return out


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's weights hold: parameters, buffers and packed parts,
    each storage counted once (tied weights share one)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    packed_seen: set[int] = set()
    for m in model.modules():
        parts = m.parts if isinstance(m, PackedLinear) else [m.packed] if isinstance(m, PackedEmbedding) else []
        for p in parts:
            if id(p) not in packed_seen:
                packed_seen.add(id(p))
                total += part_bytes(p)
    return total
