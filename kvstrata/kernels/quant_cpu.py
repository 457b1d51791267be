"""The CPU paths of ``quant_linear.quant_matmul`` over packed GGUF weights,
and the one-time micro-benchmark that picks one per layer at load.

    with_cpu_path(packed, path, *, keep_blocks=True) -> PackedWeight   (repacked for ``path``)
    choose_cpu_path(packed, sample_tokens=(1, 16), *, dtype, allow_inexact=None, measure=True) -> CpuChoice
    time_paths(packed, {path: prepared}, sample_tokens, dtype) -> {path: {tokens: ms}}   (and "dense")
    int4_rows(packed, ids, dtype) -> [T, in]      rows rebuilt from the int4 planes
    planes_rows(packed, ids, dtype) -> [T, in]    rows of an int4 or native weight whose blocks went

Paths (``quant_matmul`` with impl "auto"/"torch" on CPU runs ``packed.cpu_path``):

    "dequant"  dequantize 2^20-weight row chunks into ``scratch`` (reused,
               one per model) and F.linear each: exact, any type, resident
               memory = the blocks. Slow: ~10 torch ops per chunk, 3-6x
               dense fp32 on the bench machine.
    "int4"     torch's ``_weight_int4pack_mm_for_cpu`` (bf16) on repacked
               planes, w = sum_p (q_p - 8) * s_p + z_p per 32 weights: one plane
               for Q4_0/Q4_1/Q4_K, two (low nibble, high bits) for
               Q5_0/Q5_1/Q5_K/Q8_0. Needs out_features % 16 == 0. Each plane
               adds 0.625 B/weight on top of the blocks. Q6_K has no int4 form
               (its scales cover 16 weights; the kernel's groups are 32..256).
               Its fp32 variant is the op's slow reference (~10x dense): unused.
               ``with_cpu_path(w, "int4", keep_blocks=False)`` drops the blocks:
               resident = planes only (Q4_*: 1.0-1.1x the file's bytes).
               Inexact (bf16 x, scales, zeros): only where "native" cannot run.
    "native"   our kernels (``quant_native``, C, built at the first load) on
               the file's integers and scales re-laid (``quant_relayout``):
               every packed type, Q6_K included; resident = the file's
               bytes (K-quants +3 %); weights exact; a float32 x by float32
               FMAs (as exact as the dense float32 matmul), a bf16 x by bf16
               dot products. Needs the native kernels to load here and
               out_features % 64 == 0; wherever it runs it is the path.

Not candidates: ``_weight_int8pack_mm`` (one scale per output row: Q8_0's
per-32 scales would have to be requantized, off by up to half a step of the
row's largest block), and a torch.compile'd dequantize (75 s to compile one
shape here, and still ~6x slower than the dense matmul it would feed).

``choose_cpu_path`` returns "native" where it runs (timed against "dense"
unless ``measure=False``); elsewhere it times "dequant" (and "int4" for bf16
activations, or any with ``allow_inexact=True``: the loader's packed mode)
against "dense", the dequantize-at-load baseline, and "int4" must beat
"dequant" by 10 %. The table below predates "native" (see docs/quantization.md). Measured with
``tools/bench_quant.py --quick`` (1 thread of a shared, heavily loaded 2-core
AMD EPYC with AVX512-bf16; two runs; ms for the SmolLM2 layer set
qkv+o+gate_up+down in Q4_1, and for one 8B gate [14336, 4096] in Q4_K):

                      int4 (bf16)   dense fp32   dense bf16   dequant fp32
    SmolLM2 Q4_1 T=1     0.30          0.8-1.0      0.9          3.1-4.0
    SmolLM2 Q4_1 T=16    1.5           2.5          1.4          4.5-5.9
    8B Q4_K      T=1     3.7-7.4      16-23        24-30        69-107
    8B Q4_K      T=16     40-57      124-140       36-40       137-190

So without the native kernels: bf16 activations with "int4" where the type
has it (2.7-4.3x dense fp32 at decode; at 16 tokens 1.7-2.5x dense fp32,
0.7-1x dense bf16), dense weights where memory allows otherwise; "dequant"
is the exact low-memory fallback.

``int4_rows`` reads rows back out of torch's int4 layout (an embedding tied
to an lm_head whose blocks were dropped): per 64-row block, byte j of each
column k holds row j (low nibble) and row j + 32 (high); a last block of t <
64 rows pairs rows 2j and 2j + 1 instead. ``int4_layout_ok`` checks that on
this torch build once (a loader keeps the blocks of a tied embedding when
it does not hold), and ``int4_rows`` refuses to run without it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
import weakref

import torch
import torch.nn.functional as F

from kvstrata.kernels._checks import KV_DTYPES, KernelArgumentError
from kvstrata.kernels.quant import (
    CPU_PATH_NAMES,
    PLANE_PATHS,
    PackedWeight,
    _bits,
    _f16,
    _k_nibbles,
    _k_scales,
    _nibbles,
    _q5_high,
    check_packed,
    dequantize,
    dequantize_rows_into,
)
from kvstrata.kernels.quant_native import LAYOUTS, check_planes, native_kernels, native_status
from kvstrata.kernels.quant_relayout import int4_nibbles, native_planes, native_rows

# weights dequantized per chunk of the "dequant" path: 4 MB of float32, still
# in the last-level cache when F.linear reads it, and few enough chunks that
# the ~15 torch ops per chunk (each a parallel region) stay cheap
_CHUNK_WEIGHTS = 1 << 20


class QuantScratch:
    """Reusable buffers of the CPU "dequant" path, grown to the largest chunk.

    Owns: one flat float32 buffer (the dequantized chunk) and one per other
    activation dtype (the chunk rounded to it). One per model: its layers
    run one at a time, so one chunk-sized buffer serves them all.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer of exactly ``numel`` elements (contents undefined)."""
        return self.flat(numel, dtype, device)[:numel]

    def flat(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The whole buffer, at least ``numel`` long, grown when shorter (for a
        kernel that takes a pointer and its own length: no slice to make)."""
        buf = self._buffers.get((dtype, device))
        if buf is None or buf.numel() < numel:
            buf = self._buffers[(dtype, device)] = torch.empty(numel, dtype=dtype, device=device)
        return buf

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class DequantPath:
    """Dequantize row chunks into the scratch buffer, F.linear each chunk.
    Exact: each chunk is ``dequantize``'s rows, in x's dtype."""

    name = "dequant"
    exact = True

    @staticmethod
    def available(packed: PackedWeight) -> bool:
        return True

    @staticmethod
    def prepare(packed: PackedWeight) -> PackedWeight:
        return dataclasses.replace(packed, cpu_path="dequant", planes=None)

    @staticmethod
    def matmul(x, packed, bias, out, scratch) -> None:
        dequantized_linear(x, packed, bias, out, scratch, _CHUNK_WEIGHTS, torch.float32,
                           lambda start, w: dequantize_rows_into(packed, start, start + w.shape[0], w))


def dequantized_linear(x, packed: PackedWeight, bias, out, scratch: QuantScratch | None, chunk_weights: int,
                       w_dtype: torch.dtype, fill) -> None:
    """``out`` = x @ W.T + bias by row chunks of W (up to ``chunk_weights``
    weights each): ``fill(start, w)`` writes rows ``start``.. of W into ``w``
    (``w_dtype``, a view of the scratch buffer), rounded to x's dtype in a
    second scratch buffer where the two differ, then F.linear into ``out``'s
    columns. The CPU "dequant" path and the Triton path's prefill."""
    n, k = packed.shape
    rows = max(1, min(n, chunk_weights // k))
    scratch = scratch if scratch is not None else QuantScratch()
    buf = scratch.get(rows * k, w_dtype, x.device)
    low = scratch.get(rows * k, x.dtype, x.device) if w_dtype != x.dtype else None
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        w = buf[: (stop - start) * k].view(stop - start, k)
        fill(start, w)
        if low is not None:
            w = low[: w.numel()].view(w.shape).copy_(w)
        out[:, start:stop].copy_(F.linear(x, w, None if bias is None else bias[start:stop]))


# Q types as int4 planes: w = sum over planes of (q_p - 8) * s_p + z_p, per 32
# weights. Every z is 0 or a power-of-two multiple of its s where the format
# has no free offset, so rounding s to bf16 scales the group, never shifts it.
def _int4_planes(packed: PackedWeight) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """[(q uint8 [N, K] in 0..15, s float32 [N, K/32], z float32 [N, K/32])]."""
    name, (n, k) = packed.qtype.name, packed.shape
    b = packed.data.view(n, -1, packed.qtype.type_size)
    if name in ("Q4_K", "Q5_K"):
        q = torch.empty(n, b.shape[1], 8, 32, dtype=torch.uint8)
        _k_nibbles(b[..., 16:144] if name == "Q4_K" else b[..., 48:176], q)
        dd, dm = (t.squeeze(-1) for t in _k_scales(b))
        if name == "Q4_K":
            return [(q.view(n, k), dd.view(n, -1), (8 * dd - dm).view(n, -1))]
        high = _bits(b[..., 16:48], 8)
        return [(q.view(n, k), dd.view(n, -1), (8 * dd - dm).view(n, -1)),
                (high.reshape(n, k), (16 * dd).view(n, -1), (128 * dd).view(n, -1))]
    d = _f16(b, 0).squeeze(-1)
    q = torch.empty(n, b.shape[1], 32, dtype=torch.uint8)
    if name == "Q8_0":
        u = b[..., 2:] ^ 128  # int8 q + 128 = lo + 16 * hi
        return [((u & 15).reshape(n, k), d, 8 * d), ((u >> 4).reshape(n, k), 16 * d, torch.zeros_like(d))]
    qs_at = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[name]
    _nibbles(b[..., qs_at:qs_at + 16], q)
    m = _f16(b, 2).squeeze(-1) if name in ("Q4_1", "Q5_1") else None
    if name == "Q4_0":
        return [(q.view(n, k), d, torch.zeros_like(d))]
    if name == "Q4_1":
        return [(q.view(n, k), d, m + 8 * d)]
    high = (_q5_high(b[..., qs_at - 4:qs_at]) >> 4).reshape(n, k)
    low_z = -8 * d if name == "Q5_0" else m + 8 * d
    return [(q.view(n, k), d, low_z), (high, 16 * d, 128 * d)]


_INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q8_0")


class Int4Path:
    """torch's CPU weight-only int4 matmul (bf16) on repacked planes: one for
    the Q4 types, two (low nibble, high bits) for Q5 and Q8_0. Not exact:
    scales and offsets round to bf16, x runs in bf16."""

    name = "int4"
    exact = False

    @staticmethod
    def available(packed: PackedWeight) -> bool:
        return (packed.device.type == "cpu" and packed.qtype.name in _INT4_TYPES
                and packed.out_features % 16 == 0 and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"))

    @staticmethod
    def prepare(packed: PackedWeight) -> PackedWeight:
        if not Int4Path.available(packed):
            raise KernelArgumentError(
                f"packed: the int4 CPU path needs a CPU weight of type {', '.join(_INT4_TYPES)} with "
                f"out_features % 16 == 0, got {packed.qtype.name} {packed.shape} on {packed.device}")
        planes = []
        for q, s, z in _int4_planes(packed):
            w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            sz = torch.stack((s, z), -1).transpose(0, 1).to(torch.bfloat16).contiguous()
            planes.append((w, sz))
        return dataclasses.replace(packed, cpu_path="int4", planes=tuple(planes))

    @staticmethod
    def matmul(x, packed, bias, out, scratch) -> None:
        xb = x.to(torch.bfloat16).contiguous()

        def planes_sum(acc):
            mm, planes = torch.ops.aten._weight_int4pack_mm_for_cpu, packed.planes
            acc.copy_(mm(xb, planes[0][0], 32, planes[0][1]))
            for w, sz in planes[1:]:
                acc.add_(mm(xb, w, 32, sz))

        float32_sum(bias, out, planes_sum)


def float32_sum(bias, out, fill, acc: torch.Tensor | None = None) -> None:
    """``fill(acc)`` into a float32 ``acc``, the bias added there: in place in
    a float32 ``out``, else rounded to ``out`` once (``acc``: a float32 buffer
    of ``out``'s shape to use then, else a new one)."""
    if out.dtype == torch.float32:
        acc = out
    elif acc is None:
        acc = torch.empty(out.shape, dtype=torch.float32, device=out.device)
    fill(acc)
    if bias is not None:
        acc.add_(bias)
    if acc is not out:
        out.copy_(acc)


class NativePath:
    """Our kernels (``quant_native``: AVX512_BF16, or AVX2) on the blocks re-laid
    (``quant_relayout.native_planes``): the file's integers and scales, no
    rounding: a float32 x runs float32 FMAs (as F.linear on the dequantized
    float32 weight, ~1e-7 of S), a bf16 x bf16 dot products (as the dense
    bf16 matmul), a float16 x goes as float32. planes = ((the LAYOUTS
    tensors),)."""

    name = "native"
    exact = True

    @staticmethod
    def available(packed: PackedWeight) -> bool:
        return (packed.device.type == "cpu" and packed.qtype.name in LAYOUTS and packed.out_features % 64 == 0
                and native_kernels() is not None)

    @staticmethod
    def prepare(packed: PackedWeight) -> PackedWeight:
        if not NativePath.available(packed):
            raise KernelArgumentError(
                f"packed: the native CPU path needs a CPU weight of type {', '.join(LAYOUTS)} with out_features "
                f"% 64 == 0 and the native kernels (here: {native_status()}), got {packed.qtype.name} "
                f"{packed.shape} on {packed.device}")
        planes = native_planes(packed)
        check_planes(packed.qtype.name, planes, *packed.shape)  # once: each call skips it
        return dataclasses.replace(packed, cpu_path="native", planes=(planes,))

    @staticmethod
    def matmul(x, packed, bias, out, scratch) -> None:
        # planes checked when made, x and out by quant_matmul / PackedLinear; available() loaded the kernels
        call = _BOUND.get(packed)
        if call is None:
            call = _BOUND[packed] = native_kernels().bind(packed.qtype.name, packed.planes[0])
        if x.dtype is not torch.bfloat16 and x.dtype is not torch.float32:
            x = x.float()
        x = x.contiguous()
        sums = None if scratch is None else scratch.flat(x.shape[0] * (x.shape[1] // 32), torch.float32, x.device)
        if bias is None and out.dtype is torch.float32:
            call(x, out, sums)  # the decode case of a float32 model: straight into out
        else:
            float32_sum(bias, out, lambda acc: call(x, acc, sums))


# each native weight's bound kernel call, made at its first matmul; gone with the weight
_BOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


CPU_PATHS: dict[str, type] = {"dequant": DequantPath, "int4": Int4Path, "native": NativePath}
assert tuple(CPU_PATHS) == CPU_PATH_NAMES


def with_cpu_path(packed: PackedWeight, path: str, *, keep_blocks: bool = True) -> PackedWeight:
    """``packed`` with ``path`` ("dequant", "int4" or "native") as its CPU
    path, repacked for it (KernelArgumentError if the path cannot take it).
    ``keep_blocks=False`` (int4, native) drops the GGUF blocks: resident
    memory is then the planes alone, but ``dequantize``, the Triton
    kernel and ``rows`` / ``to`` / another path no longer work (rows are
    read back with ``planes_rows``)."""
    if path not in CPU_PATHS:
        raise KernelArgumentError(f"path must be one of {', '.join(CPU_PATHS)}, got {path!r}")
    if not keep_blocks and path not in PLANE_PATHS:
        raise KernelArgumentError(f"keep_blocks=False needs path {' or '.join(map(repr, PLANE_PATHS))} "
                                  f"(the {path!r} path reads the blocks)")
    if packed.data is None:
        if path == packed.cpu_path and not keep_blocks:
            return packed
        raise KernelArgumentError(f"packed has no GGUF blocks left (dropped for the {packed.cpu_path} path)")
    weight = packed if path == packed.cpu_path and path in PLANE_PATHS else CPU_PATHS[path].prepare(packed)
    return weight if keep_blocks else dataclasses.replace(weight, data=None)


# ---- choosing a CPU path at load ----------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class CpuChoice:
    """What ``choose_cpu_path`` measured. ``times_ms[path][tokens]``: the best
    of its runs, for every candidate and for "dense" (F.linear on the weight
    dequantized to ``dtype``: what dequantize-at-load would cost, for the
    loader to weigh against memory); empty when nothing was timed
    (``measure=False`` and one candidate). ``weight``: the packed weight
    prepared for ``path`` (repacked when "int4" or "native")."""

    path: str
    dtype: torch.dtype
    times_ms: dict[str, dict[int, float]]
    weight: PackedWeight


def choose_cpu_path(
    packed: PackedWeight,
    sample_tokens: tuple[int, ...] = (1, 16),
    *,
    dtype: torch.dtype = torch.float32,
    reps: int = 5,
    ring_bytes: int = 64 << 20,
    margin: float = 0.1,
    allow_inexact: bool | None = None,
    measure: bool = True,
) -> CpuChoice:
    """The CPU path for ``packed`` with activations of ``dtype``.

    "native" wherever it runs: exact at every dtype and 2-40x "dequant"
    (so the choice, the checkpoint's fingerprint and its numerics never
    hang on a timed near tie). Elsewhere the fastest of "dequant" and, when
    ``allow_inexact`` (default: for bf16 activations only), torch's "int4"
    (x, scales and zeros rounded to bf16), which must beat "dequant" by
    ``margin``: the least sum over token counts of a path's time relative
    to "dense" at that count (so decode's one token weighs as much as a
    batch's sixteen).

    Timing (``measure``; always when there is a race): each candidate and
    "dense" at each token count, cycling through copies of the weight
    totalling ``ring_bytes`` (a cold cache, as in a forward pass whose
    weights exceed the last-level cache), taking turns, so a burst of load
    from other processes lands on all of them; the best of ``reps`` runs
    counts (a candidate 3x behind the leader after two runs gets no more).
    ``measure=False`` with "native": no timing, ``times_ms`` empty. The
    result depends only on (qtype, shape, dtype): a loader asks once per
    distinct one. Loads the native kernels (building them the first time).
    """
    check_packed(packed)
    if packed.device.type != "cpu":
        raise KernelArgumentError(f"packed must be on the CPU to choose a CPU path, got {packed.device}")
    if dtype not in KV_DTYPES:
        raise KernelArgumentError(f"dtype must be one of float32, float16, bfloat16, got {dtype}")
    if not sample_tokens or any(not isinstance(t, int) or t <= 0 for t in sample_tokens):
        raise KernelArgumentError(f"sample_tokens must be positive token counts, got {sample_tokens!r}")
    if NativePath.available(packed):
        offered = ["native"]
    else:
        inexact = dtype == torch.bfloat16 if allow_inexact is None else allow_inexact
        offered = [name for name, path in CPU_PATHS.items() if path.available(packed) and (path.exact or inexact)]
    weights = {name: CPU_PATHS[name].prepare(packed) for name in offered}
    if len(offered) == 1 and not measure:
        return CpuChoice(offered[0], dtype, {}, weights[offered[0]])
    times = time_paths(packed, weights, sample_tokens, dtype, reps, ring_bytes)
    # each token count weighs alike: time relative to dense at that count, summed
    total = {name: sum(times[name][t] / max(times["dense"][t], 1e-6) for t in times[name]) for name in weights}
    path = min(total, key=total.__getitem__)
    if not CPU_PATHS[path].exact and total[path] > (1 - margin) * total["dequant"]:
        path = "dequant"
    return CpuChoice(path, dtype, times, weights[path])


def time_paths(packed: PackedWeight, weights: dict[str, PackedWeight], sample_tokens: tuple[int, ...],
               dtype: torch.dtype, reps: int = 5, ring_bytes: int = 64 << 20) -> dict[str, dict[int, float]]:
    """ms per path of ``weights`` (``packed`` prepared for each) and "dense",
    per token count, as ``choose_cpu_path`` races them: the best of ``reps``
    turns (the first warms up; a path 3x behind after two gets no more)."""
    runners = {name: _ring_runner(w, ring_bytes) for name, w in weights.items()}
    runners["dense"] = _dense_runner(packed, dtype, ring_bytes)
    times: dict[str, dict[int, float]] = {name: {} for name in runners}
    gen = torch.Generator().manual_seed(0)
    for tokens in sample_tokens:
        x = torch.randn(tokens, packed.in_features, generator=gen).to(dtype)
        best = {name: float("inf") for name in runners}
        for rep in range(reps + 1):  # the first turn warms up
            leader = min(best[name] for name in weights)
            for name, run in runners.items():
                # a path 3x behind after two runs is out of the race: no more of its (slow) runs
                if rep < 2 or best[name] <= 3 * leader:
                    best[name] = min(best[name], run(x))
        for name in runners:
            times[name][tokens] = round(best[name] * 1e3, 4)
    return times


def _ring_runner(weight: PackedWeight, ring_bytes: int):
    copies = [weight] + [_clone(weight) for _ in range(max(0, min(64, ring_bytes // weight.nbytes) - 1))]
    scratch = QuantScratch()
    turn = itertools.count()

    def run(x: torch.Tensor) -> float:
        w = copies[next(turn) % len(copies)]
        out = torch.empty(x.shape[0], w.out_features, dtype=x.dtype)
        start = time.perf_counter()
        CPU_PATHS[w.cpu_path].matmul(x, w, None, out, scratch)
        return time.perf_counter() - start

    return run


def _dense_runner(packed: PackedWeight, dtype: torch.dtype, ring_bytes: int):
    first = dequantize(packed, dtype)
    copies = [first] + [first.clone() for _ in range(max(0, min(64, ring_bytes // first.nbytes) - 1))]
    turn = itertools.count()

    def run(x: torch.Tensor) -> float:
        w = copies[next(turn) % len(copies)]
        start = time.perf_counter()
        F.linear(x, w)
        return time.perf_counter() - start

    return run


def _clone(w: PackedWeight) -> PackedWeight:
    planes = None if w.planes is None else tuple(tuple(t.clone() for t in plane) for plane in w.planes)
    return dataclasses.replace(w, data=w.data.clone(), planes=planes)


# ---- rows back out of the planes --------------------------------------------------------------


def planes_rows(packed: PackedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` [T] of a weight whose blocks were dropped, from its path's
    planes (``int4_rows``, or ``quant_relayout.native_rows``: bit-equal to
    ``dequantize``), in ``dtype``."""
    if packed.cpu_path == "native":
        return native_rows(packed, ids, dtype)
    return int4_rows(packed, ids, dtype)


def int4_rows(packed: PackedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` [T] of an int4-path weight as the int4 kernel sees them:
    sum over planes of (q_p - 8) * s_p + z_p (s, z in bf16), in ``dtype``."""
    if packed.planes is None:
        raise KernelArgumentError("packed has no int4 planes (its CPU path is not 'int4')")
    if not int4_layout_ok():
        raise KernelArgumentError("this torch build's int4 layout is not the one int4_rows reads: keep the blocks")
    n, k = packed.shape
    ids = ids.to(torch.int64)
    out = torch.zeros(ids.shape[0], k // 32, 32, dtype=torch.float32)
    for w, sz in packed.planes:
        q = int4_nibbles(w, n, k, ids).view(-1, k // 32, 32).float()
        scale, zero = sz[:, ids].float().unbind(-1)  # [K/32, T] each
        out += (q - 8) * scale.T.unsqueeze(-1) + zero.T.unsqueeze(-1)
    return out.view(-1, k).to(dtype)


@functools.cache
def int4_layout_ok() -> bool:
    """Whether ``quant_relayout.int4_nibbles`` reads this torch build's int4 layout (a
    random [80, 64] round trip: one whole 64-row block and a last one)."""
    if not hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"):
        return False
    q = torch.randint(0, 16, (80, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return torch.equal(int4_nibbles(w, 80, 64, torch.arange(80)).to(torch.int32), q)
