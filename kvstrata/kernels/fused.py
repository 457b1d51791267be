"""Fused elementwise work of a Llama decoder layer: one kernel instead of a
chain of torch ops, each reading and writing the whole activation.

    fused_add_rms_norm(x, residual, weight, eps) -> (normed, new_residual)
        new_residual = residual + x      (x itself when residual is None)
        normed       = RMSNorm(new_residual)           layers.RMSNorm's rounding
    silu_and_mul(x [T, 2I]) -> silu(x[:, :I]) * x[:, I:]     LlamaMLP's split
    rotary_and_cache(q, k, v, cos, sin, key_cache, value_cache, slot_mapping) -> q_rot
        q_rot = apply_rotary(q); apply_rotary(k) and v go to the paged caches
        at slot_mapping (reshape_and_cache: negative slot = padding)

CPU (impl "auto", no TRITON_INTERPRET): the add + norm and the rotary +
cache write run in C (``fused_native``, one call each), SiLU-and-mul as
torch's two ops (already one pass each).

Rounding contract: the references below are the unfused model code
(``worker/model/layers.py``, ``rope.py``, ``llama.py``), copied because
kernels sit below the worker layer. The Triton kernels compute in fp32 and
round to the model dtype after every op the torch code rounds after, so
``rotary_and_cache`` and the residual sum are bit-equal to their references;
the norm differs only by its fp32 reduction order (and ``rsqrt``), SiLU only
by the fp32 ``exp``: at most an ulp of the dtype, rarely.

CUDA-graph friendly: no host sync on CUDA (no ``.item()``; the CPU path
range-checks slots, as ``reshape_and_cache`` does), grids from shapes only,
and every output can be a caller's static buffer (``out=``, ``residual_out=``,
``q_out=``), also the input itself (in place): each element is read before
it is written, by the program that writes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvstrata.kernels._checks import (
    KV_DTYPES,
    KernelArgumentError,
    check_cache_pair,
    check_inner_contiguous,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_slot_mapping,
    check_tensor,
)
from kvstrata.kernels.cache_write import check_slots_in_range, reshape_and_cache_ref
from kvstrata.kernels.dispatch import use_triton
from kvstrata.kernels.fused_native import FusedKernels, fused_kernels


def _native(impl: str, x: torch.Tensor) -> FusedKernels | None:
    """The C kernels (``fused_native``) where impl "auto" runs on CPU tensors they take, else None."""
    if impl != "auto" or x.device.type != "cpu":
        return None
    kernels = fused_kernels()
    return kernels if kernels is not None and kernels.supports(x) else None


# ---- add + RMSNorm ---------------------------------------------------------------


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    impl: str = "auto",
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(s), s) for s = residual + x, or s = x when ``residual`` is None.

    x, residual [T, H] (last dim contiguous, any row stride); weight [H].
    ``out`` receives the normed rows, ``residual_out`` the sum (may be
    ``x``/``residual`` themselves). Without ``residual_out`` the sum is a new
    tensor, or ``x`` itself when there is no residual. ``check=False`` skips
    the argument checks: for a caller whose earlier call in the same step
    checked arguments of these very shapes (a model's later layers).
    """
    if check:
        _check_norm_args(x, residual, weight, eps, out, residual_out)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual_out is None and residual is not None:
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] > 0:
        triton = use_triton(impl, x.device)
        native = None if triton else _native(impl, x)
        if triton:
            from kvstrata.kernels._triton_fused import add_rms_norm_triton

            add_rms_norm_triton(x, residual, weight, eps, out, residual_out)
        elif native is not None:
            native.add_rms_norm(x, residual, weight, eps, out, residual_out)
        else:
            normed, summed = fused_add_rms_norm_ref(x, residual, weight, eps)
            out.copy_(normed)
            if residual_out is not None:
                residual_out.copy_(summed)
    return out, (x if residual_out is None else residual_out)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: ``residual + x`` then ``RMSNorm.forward`` (no checks)."""
    summed = x if residual is None else residual + x
    return rms_norm_ref(summed, weight, eps), summed


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``kvstrata.worker.model.layers.RMSNorm.forward``: fp32 normalise, cast, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(x.dtype)


def _check_norm_args(x, residual, weight, eps, out, residual_out) -> None:
    check_tensor("x", x, 2, KV_DTYPES)
    check_inner_contiguous("x", x, 1)
    tensors = {"x": x}
    for name, t in (("residual", residual), ("out", out), ("residual_out", residual_out)):
        if t is not None:
            check_tensor(name, t, 2, KV_DTYPES)
            check_shape(name, t, tuple(x.shape))
            check_same_dtype("x", x, **{name: t})
            check_inner_contiguous(name, t, 1)
            tensors[name] = t
    check_tensor("weight", weight, 1, KV_DTYPES)
    check_shape("weight", weight, (x.shape[1],))
    check_same_dtype("x", x, weight=weight)
    check_inner_contiguous("weight", weight, 1)
    check_same_device(**tensors, weight=weight)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise KernelArgumentError(f"eps must be a number >= 0, got {eps!r}")
    if out is not None and residual_out is not None and out.data_ptr() == residual_out.data_ptr():
        raise KernelArgumentError("out and residual_out must be different buffers")
    if out is not None and residual is None and residual_out is None and out.data_ptr() == x.data_ptr():
        raise KernelArgumentError("out must not be x when residual and residual_out are None (x is the residual)")


# ---- SiLU * up -------------------------------------------------------------------


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None, impl: str = "auto") -> torch.Tensor:
    """``silu(gate) * up`` [T, I] for ``x`` = cat(gate, up) [T, 2I] (last dim contiguous)."""
    check_tensor("x", x, 2, KV_DTYPES)
    check_inner_contiguous("x", x, 1)
    if x.shape[1] % 2:
        raise KernelArgumentError(f"x must have an even last dim (gate then up), got shape {tuple(x.shape)}")
    shape = (x.shape[0], x.shape[1] // 2)
    triton = use_triton(impl, x.device)
    if out is None and not triton:
        return silu_and_mul_ref(x)  # torch's two ops make the result: no copy into a buffer of ours
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, 2, KV_DTYPES)
        check_shape("out", out, shape)
        check_same_dtype("x", x, out=out)
        check_inner_contiguous("out", out, 1)
        check_same_device(x=x, out=out)
    if x.shape[0] == 0 or shape[1] == 0:
        return out
    if triton:
        from kvstrata.kernels._triton_fused import silu_and_mul_triton

        silu_and_mul_triton(x, out)
    else:
        out.copy_(silu_and_mul_ref(x))
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference: ``LlamaMLP``'s ``F.silu(gate) * up`` (no checks)."""
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


# ---- RoPE + cache write ---------------------------------------------------------


def rotary_and_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    q_out: torch.Tensor | None = None,
    impl: str = "auto",
    check: bool = True,
) -> torch.Tensor:
    """Rotate q and k by half-width ``cos``/``sin``, write rotated k and v to the caches.

    q [T, Hq, D], k and v [T, Hkv, D]: heads and head_dim densely packed, the
    token stride free (views into one fused qkv projection output).
    cos, sin [T, 1, D/2] or [T, D/2] in q's dtype (``RotaryEmbedding.cos_sin``).
    Caches and slots as in ``reshape_and_cache`` (either layout of ``layout.py``).
    Returns the rotated q: ``q_out`` if given (may be ``q``), else a new tensor.
    ``check=False``: as in ``fused_add_rms_norm`` (the slots too: one step's
    slot_mapping, range-checked by its first call).
    """
    if check:
        _check_rotary_args(q, k, v, cos, sin, key_cache, value_cache, slot_mapping, q_out)
    if q_out is None:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return q_out
    triton = use_triton(impl, q.device)
    native = None if triton else _native(impl, q)
    if triton:
        from kvstrata.kernels._triton_fused import rotary_and_cache_triton

        rotary_and_cache_triton(q, k, v, cos, sin, key_cache, value_cache, slot_mapping, q_out)
    elif native is not None:
        native.rotary_and_cache(q, k, v, cos, sin, key_cache, value_cache, slot_mapping, q_out)
    else:
        q_out.copy_(rotary_and_cache_ref(q, k, v, cos, sin, key_cache, value_cache, slot_mapping))
    return q_out


def rotary_and_cache_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Torch reference: ``apply_rotary`` on q and k, then ``reshape_and_cache_ref`` (no checks)."""
    if cos.dim() == 2:
        cos, sin = cos[:, None, :], sin[:, None, :]
    k_rot = apply_rotary_ref(k, cos, sin)
    reshape_and_cache_ref(k_rot, v, key_cache, value_cache, slot_mapping)
    return apply_rotary_ref(q, cos, sin)


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``kvstrata.worker.model.rope.apply_rotary``: rotate-half by [T, 1, D/2] cos/sin."""
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _check_rotary_args(q, k, v, cos, sin, key_cache, value_cache, slot_mapping, q_out) -> None:
    check_tensor("q", q, 3, KV_DTYPES)
    check_tensor("k", k, 3, KV_DTYPES)
    check_tensor("v", v, 3, KV_DTYPES)
    num_tokens, _, head_dim = q.shape
    if head_dim % 2:
        raise KernelArgumentError(f"q head_dim must be even, got shape {tuple(q.shape)}")
    num_blocks, block_size, kv_heads, cache_dim = check_cache_pair(key_cache, value_cache)
    if (kv_heads, cache_dim) != (k.shape[1], head_dim):
        raise KernelArgumentError(
            f"key_cache must have Hkv={k.shape[1]}, D={head_dim} like k and q, got shape {tuple(key_cache.shape)}"
        )
    check_shape("k", k, (num_tokens, kv_heads, head_dim))
    check_shape("v", v, (num_tokens, kv_heads, head_dim))
    half = head_dim // 2
    for name, t in (("cos", cos), ("sin", sin)):
        flat = isinstance(t, torch.Tensor) and t.dim() == 2  # [T, D/2]; else [T, 1, D/2]
        check_tensor(name, t, 2 if flat else 3, KV_DTYPES)
        check_shape(name, t, (num_tokens, half) if flat else (num_tokens, 1, half))
        check_inner_contiguous(name, t, 1)
    if cos.stride(0) != sin.stride(0):
        raise KernelArgumentError(f"cos and sin must share the token stride, got {cos.stride(0)} and {sin.stride(0)}")
    tensors = {"q": q, "k": k, "v": v}
    if q_out is not None:
        check_tensor("q_out", q_out, 3, KV_DTYPES)
        check_shape("q_out", q_out, tuple(q.shape))
        tensors["q_out"] = q_out
    for name, t in tensors.items():
        check_inner_contiguous(name, t, 2)
    tensors.update(cos=cos, sin=sin)
    check_same_dtype("q", q, **{n: t for n, t in tensors.items() if n != "q"}, key_cache=key_cache)
    check_slot_mapping(slot_mapping, num_tokens)
    check_same_device(**tensors, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)
    if slot_mapping.device.type == "cpu":
        check_slots_in_range(slot_mapping, num_blocks * block_size)
