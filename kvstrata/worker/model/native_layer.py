"""A decoder layer's forward on a CPU as direct kernel calls, with the fused
kernels on (a CPU's default where their C kernels load): for a packed GGUF
(``model.quantized_weights`` "packed", or "auto" where the native kernels
run) each packed weight's native matmul bound once; for dense weights (a
Hugging Face checkpoint, the seeded random model, a dequantized GGUF)
``F.linear``'s own calls (``torch.mm`` / ``torch.addmm``) into the step's
buffers; biases (Qwen2), q/k norms (Qwen3), windows and linear layers of
several parts as the fused forward runs them.

    NativeLayer.bind(layer) -> NativeLayer | str       the layer's calls, or why it does not qualify
    native_layer(x, residual, cos, sin, kv_cache, meta) -> (x, residual)   LlamaDecoderLayer's fused forward

What it saves: the fused forward is ~10 kernel calls a layer, each behind
its module call and a dispatch (device, Triton or C, argument checks,
buffers): 3-6 Python frames and a few allocations a call, ~4 ms of a ~15 ms
SmolLM2 decode forward at batch 1 on one core (measured; ~120 us a layer).
Here the kernels are called straight: the matmuls as above, the norms' and
the rotary's C calls (``FusedKernels``), attention through
``paged_attention`` without checks, SiLU-and-mul as the two torch ops the
fused path runs; the step's intermediate tensors are one set shared by
every layer (``meta.plans``).

The same kernels in the same order on the same values: **bit-equal** to the
fused forward (tested). ``LlamaDecoderLayer.forward`` runs the step's first
layer the fused way (every kernel argument checked there, the slots too) and
the later ones here, as the fused path's later layers skip the checks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvstrata.kernels import PackedWeight, paged_attention
from kvstrata.kernels.fused_native import fused_kernels, fused_status
from kvstrata.kernels.quant_cpu import float32_sum
from kvstrata.kernels.quant_native import native_kernels, native_status
from kvstrata.worker.model.layers import Linear
from kvstrata.worker.model.packed import PackedLinear

DTYPES = (torch.float32, torch.bfloat16)  # the activations the bound matmuls take as they are

_BUFFERS = "native_layer_buffers"  # a key of AttentionMetadata.plans: the step's _StepBuffers


class _Dims:
    """One layer's widths (every layer of a model has the same)."""

    __slots__ = ("hidden", "heads", "kv_heads", "head_dim", "q_size", "kv_size", "qkv", "inter", "dtype")

    def __init__(self, layer, dtype: torch.dtype) -> None:
        attn = layer.self_attn
        self.hidden = layer.input_layernorm.weight.shape[0]
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.q_size, self.kv_size = attn.q_size, attn.kv_size
        self.qkv = attn.q_size + 2 * attn.kv_size
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


class _Linear:
    """A linear layer's parts as ``NativeLayer._matmul`` runs them: per part
    (bound native matmul or None, the dense weight transposed or None, its
    first and end column, its slice of the bias or None). A ``PackedLinear``
    has one part per run of one type; a dense ``Linear`` one dense part.
    ``simple``: one native part, no bias."""

    __slots__ = ("parts", "whole", "simple")

    def __init__(self, lin: PackedLinear | Linear, nk) -> None:
        parts = lin.parts if isinstance(lin, PackedLinear) else [lin.weight]
        self.whole = len(parts) == 1
        self.parts, lo = [], 0
        for part in parts:
            native = isinstance(part, PackedWeight)
            hi = lo + (part.out_features if native else part.shape[0])
            bias = None if lin.bias is None else lin.bias if self.whole else lin.bias[lo:hi]
            call = nk.bind(part.qtype.name, part.planes[0]) if native else None
            self.parts.append((call, None if native else part.t(), lo, hi, bias))
            lo = hi
        self.simple = self.whole and self.parts[0][0] is not None and lin.bias is None


class NativeLayer:
    """One decoder layer's bound calls. Owns: nothing but the bindings (the
    weights stay the layer's; the bound matmuls hold their planes)."""

    __slots__ = ("_fk", "_dims", "_w1", "_eps1", "_w2", "_eps2", "_qkv", "_o", "_gu", "_down", "_qk_norm", "_scale",
                 "_window")

    def __init__(self, layer, fk, linears: dict, dims: _Dims) -> None:
        attn = layer.self_attn
        self._fk, self._dims = fk, dims
        self._w1, self._eps1 = layer.input_layernorm.weight, layer.input_layernorm.eps
        self._w2, self._eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps
        self._qkv, self._o = linears["self_attn.qkv_proj"], linears["self_attn.o_proj"]
        self._gu, self._down = linears["mlp.gate_up_proj"], linears["mlp.down_proj"]
        self._qk_norm = (attn.q_norm, attn.k_norm) if attn.qk_norm else None
        self._scale, self._window = attn.scale, attn.sliding_window

    @classmethod
    def bind(cls, layer) -> NativeLayer | str:
        """The layer's calls, or why it has none: the fused C kernels
        missing, a linear layer that is neither our ``Linear`` nor a
        ``PackedLinear`` whose packed parts run the native kernels,
        activations other than float32 / bf16, not on the CPU."""
        fk = fused_kernels()
        if fk is None:
            return f"no fused C kernels ({fused_status()})"
        dtype = layer.input_layernorm.weight.dtype
        if dtype not in DTYPES or layer.input_layernorm.weight.device.type != "cpu":
            return f"activations {dtype} on {layer.input_layernorm.weight.device}: float32 or bfloat16 on the CPU only"
        linears = {}
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            lin = layer.get_submodule(name)
            if not isinstance(lin, (PackedLinear, Linear)):
                kind = type(lin)
                return f"{name} is a {kind.__module__}.{kind.__qualname__}, not our Linear or PackedLinear"
            nk = None
            if isinstance(lin, PackedLinear):
                nk = native_kernels()
                if nk is None:
                    return f"no native matmul kernels ({native_status()})"
                if any(isinstance(p, PackedWeight) and p.cpu_path != "native" for p in lin.parts):
                    return f"{name} has a packed part off the native kernels"
            linears[name] = _Linear(lin, nk)
        return cls(layer, fk, linears, _Dims(layer, dtype))

    def _buffers(self, rows: int, plans: dict) -> _StepBuffers:
        """The step's buffers, made by its first native layer (``plans`` is one step's)."""
        bufs = plans.get(_BUFFERS)
        if bufs is None:
            bufs = plans[_BUFFERS] = _StepBuffers(rows, self._dims)
        return bufs

    @staticmethod
    def _matmul(lin: _Linear, x: torch.Tensor, out: torch.Tensor, b: _StepBuffers) -> None:
        """The layer's forward into ``out`` (``PackedLinear.forward``, or
        ``Linear.forward``): each part into its columns, as
        ``NativePath.matmul`` (or ``F.linear`` for a dense part) does: a
        native part's float32 sums straight into a float32 ``out``, else into
        float32 and rounded once, its bias added to the float32 sums."""
        if lin.simple and b.acc is None:
            lin.parts[0][0](x, out, b.sums)  # the common case: one native part, no bias, float32
            return
        for call, dense_t, lo, hi, bias in lin.parts:
            if call is None and lin.whole:  # F.linear's own calls, into out: the same bits (tested)
                if bias is None:
                    torch.mm(x, dense_t, out=out)
                else:
                    torch.addmm(bias, x, dense_t, out=out)
                continue
            o = out if lin.whole else out[:, lo:hi]
            if call is None:
                o.copy_(F.linear(x, dense_t.t(), bias))
            else:
                float32_sum(bias, o, lambda acc: call(x, acc, b.sums), None if b.acc is None else b.acc[:, :hi - lo])

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
        q, k = b.q, b.k
        if self._qk_norm is not None:  # Qwen3: each head of q and k normed before RoPE, as LlamaAttention does
            q, k = self._qk_norm[0](q), self._qk_norm[1](k)
        fk.rotary_and_cache(q, k, b.v, cos, sin, key_cache, value_cache, meta.slot_mapping, b.qrot)
        paged_attention(b.qrot, key_cache, value_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                        self._scale, self._window, b.att, plans=meta.plans, check=False)
        self._matmul(self._o, b.att_rows, b.out, b)
        fk.add_rms_norm(b.out, b.res, self._w2, self._eps2, b.h, b.res)
        self._matmul(self._gu, b.h, b.gu, b)
        torch.ops.aten.silu.out(b.gate, out=b.silu)  # silu_and_mul_ref's two ops: F.silu(gate) * up
        torch.mul(b.silu, b.up, out=b.act)
        self._matmul(self._down, b.act, b.out, b)
        return b.out, b.res
