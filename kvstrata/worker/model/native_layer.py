"""A decoder layer's forward on a CPU as direct calls of our native kernels,
for the layers of a packed GGUF (every linear layer one native packed
weight: ``model.quantized_weights`` "packed", or "auto" on a CPU where the
native kernels run) with the fused kernels on.

    NativeLayer.bind(layer) -> NativeLayer | str       the layer's calls, or why it does not qualify
    native_layer(x, residual, cos, sin, kv_cache, meta) -> (x, residual)   LlamaDecoderLayer's fused forward

What it saves: the fused forward is ~10 kernel calls a layer, each behind
its module call and a dispatch (device, Triton or C, argument checks,
buffers): 3-6 Python frames and a few allocations a call, ~4 ms of a ~15 ms
SmolLM2 decode forward at batch 1 on one core (measured; ~120 us a layer).
Here the kernels are called straight: each packed weight's matmul bound
once (``NativeKernels.bind``), the norms' and the rotary's C calls
(``FusedKernels``), attention through ``paged_attention`` without checks,
SiLU-and-mul as the two torch ops the fused path runs; the step's
intermediate tensors are one set shared by every layer (``meta.plans``).

The same kernels in the same order on the same values: **bit-equal** to the
fused forward (tested). ``LlamaDecoderLayer.forward`` runs the step's first
layer the fused way (every kernel argument checked there, the slots too) and
the later ones here, as the fused path's later layers skip the checks.
"""

from __future__ import annotations

import torch

from kvstrata.kernels import PackedWeight, paged_attention
from kvstrata.kernels.fused_native import fused_kernels, fused_status
from kvstrata.kernels.quant_native import native_kernels, native_status
from kvstrata.worker.model.packed import PackedLinear

DTYPES = (torch.float32, torch.bfloat16)  # the activations the bound matmuls take as they are

_BUFFERS = "native_layer_buffers"  # a key of AttentionMetadata.plans: the step's _StepBuffers


class _Dims:
    """One layer's widths (every layer of a model has the same)."""

    __slots__ = ("hidden", "heads", "kv_heads", "head_dim", "q_size", "kv_size", "qkv", "inter", "dtype")

    def __init__(self, layer, dtype: torch.dtype) -> None:
        attn = layer.self_attn
        self.hidden = attn.qkv_proj.in_features
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.q_size, self.kv_size = attn.q_size, attn.kv_size
        self.qkv = attn.qkv_proj.out_features
        self.inter = layer.mlp.intermediate_size
        self.dtype = dtype


class _StepBuffers:
    """One step's intermediate tensors for ``rows`` tokens, shared by its layers
    (a layer reads each before it writes it again)."""

    __slots__ = ("h", "res", "out", "qkv", "q", "k", "v", "qrot", "att", "att_rows", "gu", "gate", "up",
                 "silu", "act", "acc", "sums")

    def __init__(self, rows: int, d: _Dims) -> None:
        t, dt = rows, d.dtype
        self.h = torch.empty(t, d.hidden, dtype=dt)  # a norm's output: the next matmul's input
        self.res = torch.empty(t, d.hidden, dtype=dt)  # the residual stream
        self.out = torch.empty(t, d.hidden, dtype=dt)  # o_proj's, then down_proj's output
        self.qkv = torch.empty(t, d.qkv, dtype=dt)
        self.q = self.qkv[:, :d.q_size].view(t, d.heads, d.head_dim)
        self.k = self.qkv[:, d.q_size:d.q_size + d.kv_size].view(t, d.kv_heads, d.head_dim)
        self.v = self.qkv[:, d.q_size + d.kv_size:].view(t, d.kv_heads, d.head_dim)
        self.qrot = torch.empty(t, d.heads, d.head_dim, dtype=dt)
        self.att = torch.empty(t, d.heads, d.head_dim, dtype=dt)
        self.att_rows = self.att.view(t, d.q_size)
        self.gu = torch.empty(t, 2 * d.inter, dtype=dt)
        self.gate, self.up = self.gu[:, :d.inter], self.gu[:, d.inter:]
        self.silu = torch.empty(t, d.inter, dtype=dt)
        self.act = torch.empty(t, d.inter, dtype=dt)
        widest = max(d.qkv, 2 * d.inter, d.hidden)
        # float32 sums for activations of another dtype (rounded to them once, as NativePath does)
        self.acc = None if dt == torch.float32 else torch.empty(t, widest, dtype=torch.float32)
        self.sums = torch.empty(t * (max(d.hidden, d.inter, d.q_size) // 32), dtype=torch.float32)


class NativeLayer:
    """One decoder layer's bound calls. Owns: nothing but the bindings (the
    weights stay the layer's; the bound matmuls hold their planes)."""

    __slots__ = ("_fk", "_dims", "_w1", "_eps1", "_w2", "_eps2", "_qkv", "_o", "_gu", "_down", "_scale", "_window")

    def __init__(self, layer, fk, matmuls: dict, dims: _Dims) -> None:
        attn = layer.self_attn
        self._fk, self._dims = fk, dims
        self._w1, self._eps1 = layer.input_layernorm.weight, layer.input_layernorm.eps
        self._w2, self._eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps
        self._qkv, self._o = matmuls["self_attn.qkv_proj"], matmuls["self_attn.o_proj"]
        self._gu, self._down = matmuls["mlp.gate_up_proj"], matmuls["mlp.down_proj"]
        self._scale, self._window = attn.scale, attn.sliding_window

    @classmethod
    def bind(cls, layer) -> NativeLayer | str:
        """The layer's calls, or why it has none: the C kernels missing, a
        weight that is not one native packed part without bias, q/k norms
        (Qwen3), activations other than float32 / bf16, not on the CPU."""
        fk, nk = fused_kernels(), native_kernels()
        if fk is None:
            return f"no fused C kernels ({fused_status()})"
        if nk is None:
            return f"no native matmul kernels ({native_status()})"
        dtype = layer.input_layernorm.weight.dtype
        if dtype not in DTYPES or layer.input_layernorm.weight.device.type != "cpu":
            return f"activations {dtype} on {layer.input_layernorm.weight.device}: float32 or bfloat16 on the CPU only"
        if layer.self_attn.qk_norm:
            return "q/k norms (Qwen3) run in the fused forward"
        matmuls = {}
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            lin = layer.get_submodule(name)
            if not (isinstance(lin, PackedLinear) and lin.bias is None and len(lin.parts) == 1
                    and isinstance(lin.parts[0], PackedWeight) and lin.parts[0].cpu_path == "native"):
                return f"{name} is not one native packed weight without bias"
            part = lin.parts[0]
            matmuls[name] = (nk.bind(part.qtype.name, part.planes[0]), part.out_features)
        return cls(layer, fk, matmuls, _Dims(layer, dtype))

    def _buffers(self, rows: int, plans: dict) -> _StepBuffers:
        """The step's buffers, made by its first native layer (``plans`` is one step's)."""
        bufs = plans.get(_BUFFERS)
        if bufs is None:
            bufs = plans[_BUFFERS] = _StepBuffers(rows, self._dims)
        return bufs

    def _matmul(self, bound, x: torch.Tensor, out: torch.Tensor, b: _StepBuffers) -> None:
        """``NativePath.matmul`` without bias: straight into a float32 ``out``, else
        into the float32 sums and rounded once."""
        call, n = bound
        if b.acc is None:
            call(x, out, b.sums)
        else:
            acc = b.acc[:, :n]
            call(x, acc, b.sums)
            out.copy_(acc)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_cache: tuple[torch.Tensor, torch.Tensor], meta) -> tuple[torch.Tensor, torch.Tensor]:
        """``LlamaDecoderLayer.forward`` (fused) for a step whose first layer
        checked the kernel arguments; returns (this layer's MLP output, the
        residual stream): the step's buffers, valid until its next layer."""
        b = self._buffers(x.shape[0], meta.plans)
        fk = self._fk
        key_cache, value_cache = kv_cache
        fk.add_rms_norm(x, residual, self._w1, self._eps1, b.h, b.res)
        self._matmul(self._qkv, b.h, b.qkv, b)
        fk.rotary_and_cache(b.q, b.k, b.v, cos, sin, key_cache, value_cache, meta.slot_mapping, b.qrot)
        paged_attention(b.qrot, key_cache, value_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                        self._scale, self._window, b.att, plans=meta.plans, check=False)
        self._matmul(self._o, b.att_rows, b.out, b)
        fk.add_rms_norm(b.out, b.res, self._w2, self._eps2, b.h, b.res)
        self._matmul(self._gu, b.h, b.gu, b)
        torch.ops.aten.silu.out(b.gate, out=b.silu)  # silu_and_mul_ref's two ops: F.silu(gate) * up
        torch.mul(b.silu, b.up, out=b.act)
        self._matmul(self._down, b.act, b.out, b)
        return b.out, b.res
