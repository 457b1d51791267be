"""Benchmark the fused decoder-layer kernels (kvstrata.kernels.fused); prints one JSON object.

CUDA: a TinyLlama-like layer (hidden 2048, intermediate 5632, 32 q heads,
4 kv heads, head_dim 64, bf16) at decode (T = 64, 256) and prefill
(T = 4096, 16384) sizes. For each kernel and size:

  fused_us       the fused Triton kernel, per call
  unfused_us     the torch sequence it replaces (the model code: residual add
                 + RMSNorm; silu * up; apply_rotary twice + reshape_and_cache)
  bytes          bytes the fused kernel must move (read + written, once each)
  GBps           bytes / fused_us
  copy_GBps      a device-to-device copy_ of bytes/2 (so the same bytes
                 moved), measured in the same run
  fraction_of_copy   copy time / fused time (goal >= 0.8 at prefill sizes)
  eager_*_us     one call outside a graph (decode: launch overhead shows)

Per-call times come from CUDA graphs of ``--calls`` back-to-back calls
(kernels only, no Python launch cost: how decode runs), timed with CUDA
events, median of the replays after warm-up.

CPU (no CUDA): SmolLM2's shapes at 1 and 16 tokens, float32 and bf16, the C
kernels (``fused_native``, what a CPU runs) vs the unfused model code; no GPU
figures. ``--engine`` adds SmolLM2's engine (the GGUF, packed, ``--dtype``)
at batch 1, 16 and 64 (``--quick``: 1 and 16), 100-token prompts, ms per
decode step three ways, alternating in one process on the same requests:

  unfused         the model's torch ops (``model.fused_kernels = false``)
  fused           the fused kernels through the model's modules
  native_layers   the default: after a step's first layer, each layer's
                  kernels called straight (``worker/model/native_layer.py``)

Usage: python tools/bench_fused_kernels.py [--quick] [--engine [--dtype bfloat16]]
Never asserts timings.
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable

import torch

from bench_timing import alternate_steps, cpu_time, cuda_eager_time, cuda_graph_time, smollm2_decode_core

from kvstrata.kernels import (
    KVCacheShape,
    allocate_kv_caches,
    fused_add_rms_norm,
    reshape_and_cache,
    rotary_and_cache,
    silu_and_mul,
)
from kvstrata.kernels.fused import apply_rotary_ref, fused_add_rms_norm_ref, silu_and_mul_ref
from kvstrata.logs import configure_logging

HIDDEN, INTER, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 2048, 5632, 32, 4, 64, 16
EPS = 1e-5
DECODE, PREFILL = (64, 256), (4096, 16384)






def norm_case(tokens: int, dtype: torch.dtype) -> tuple[int, Callable, Callable]:
    x = torch.randn((tokens, HIDDEN), device="cuda", dtype=dtype)
    res = torch.randn_like(x)
    weight = torch.ones(HIDDEN, device="cuda", dtype=dtype)
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    nbytes = (4 * x.numel() + HIDDEN) * x.element_size()
    return (nbytes,
            lambda: fused_add_rms_norm(x, res, weight, EPS, out=out, residual_out=res_out),
            lambda: fused_add_rms_norm_ref(x, res, weight, EPS))


def silu_case(tokens: int, dtype: torch.dtype) -> tuple[int, Callable, Callable]:
    x = torch.randn((tokens, 2 * INTER), device="cuda", dtype=dtype)
    out = torch.empty((tokens, INTER), device="cuda", dtype=dtype)
    nbytes = 3 * tokens * INTER * x.element_size()
    return nbytes, lambda: silu_and_mul(x, out=out), lambda: silu_and_mul_ref(x)


def rotary_case(tokens: int, dtype: torch.dtype) -> tuple[int, Callable, Callable]:
    qkv = torch.randn((tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM), device="cuda", dtype=dtype)
    q, k, v = qkv.split((Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM), dim=-1)
    q = q.view(tokens, Q_HEADS, HEAD_DIM)
    k = k.view(tokens, KV_HEADS, HEAD_DIM)
    v = v.view(tokens, KV_HEADS, HEAD_DIM)
    cos = torch.randn((tokens, 1, HEAD_DIM // 2), device="cuda", dtype=dtype)
    sin = torch.randn_like(cos)
    blocks = tokens // BLOCK_SIZE + 2
    shape = KVCacheShape(num_layers=2, num_blocks=blocks, block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS,
                         head_size=HEAD_DIM)
    _, caches = allocate_kv_caches(shape, "cross_layer", dtype, "cuda")
    kc, vc = caches[1]
    slots = torch.randperm(blocks * BLOCK_SIZE, device="cuda")[:tokens]
    q_out = torch.empty_like(q)
    elem = qkv.element_size()
    nbytes = (2 * q.numel() + 4 * k.numel() + 2 * cos.numel()) * elem + slots.numel() * slots.element_size()

    def unfused():  # LlamaAttention today
        q_rot = apply_rotary_ref(q, cos, sin)
        reshape_and_cache(apply_rotary_ref(k, cos, sin), v, kc, vc, slots)
        return q_rot

    return nbytes, lambda: rotary_and_cache(q, k, v, cos, sin, kc, vc, slots, q_out=q_out), unfused


CASES = {"fused_add_rms_norm": norm_case, "silu_and_mul": silu_case, "rotary_and_cache": rotary_case}


def gpu_report(quick: bool, calls: int) -> dict:
    repeat = 10 if quick else 50
    dtype = torch.bfloat16
    report: dict = {"device": torch.cuda.get_device_name(), "dtype": "bfloat16",
                    "layer": {"hidden": HIDDEN, "intermediate": INTER, "q_heads": Q_HEADS, "kv_heads": KV_HEADS,
                              "head_dim": HEAD_DIM},
                    "calls_per_graph": calls, "repeat": repeat}
    for name, make in CASES.items():
        entry = {}
        for phase, sizes in (("decode", DECODE), ("prefill", PREFILL)):
            for tokens in sizes:
                nbytes, fused, unfused = make(tokens, dtype)
                src = torch.empty(nbytes // 2, device="cuda", dtype=torch.uint8)
                dst = torch.empty_like(src)
                t_fused = cuda_graph_time(fused, calls, repeat)
                t_unfused = cuda_graph_time(unfused, calls, repeat)
                t_copy = cuda_graph_time(lambda: dst.copy_(src), calls, repeat)
                entry[f"{phase}_T{tokens}"] = {
                    "bytes": nbytes, "fused_us": t_fused * 1e6, "unfused_us": t_unfused * 1e6,
                    "speedup": t_unfused / t_fused, "GBps": nbytes / t_fused / 1e9,
                    "copy_GBps": nbytes / t_copy / 1e9, "fraction_of_copy": t_copy / t_fused,
                    "eager_fused_us": cuda_eager_time(fused, repeat) * 1e6,
                    "eager_unfused_us": cuda_eager_time(unfused, repeat) * 1e6,
                }
                del src, dst, fused, unfused
                torch.cuda.empty_cache()
        report[name] = entry
    return report


def cpu_report(quick: bool) -> dict:
    """SmolLM2's layer shapes (hidden 576, 9 q heads, 3 kv heads, head_dim 64)
    at decode sizes, float32 and bf16: the C kernels (impl "auto",
    ``fused_native``) vs the unfused model code they replace (the torch ops
    and their Python, one call each way), per call, 1 thread; the C call
    with its argument checks (a step's first layer) and without (the
    others, ``check=False``)."""
    from kvstrata.kernels.fused_native import fused_kernels, fused_status

    fused_kernels()
    torch.set_num_threads(1)
    repeat = 200 if quick else 1000
    hidden, q_heads, kv_heads, head_dim = 576, 9, 3, 64
    report: dict = {"device": "cpu", "note": "GPU figures need CUDA", "c_kernels": fused_status(),
                    "shape": {"hidden": hidden, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim},
                    "threads": 1}

    def us(fn):
        fn()
        return cpu_time(lambda: [fn() for _ in range(repeat)], 5) / repeat * 1e6

    for dtype in (torch.float32, torch.bfloat16):
        for tokens in (1, 16):
            x, res = torch.randn(tokens, hidden).to(dtype), torch.randn(tokens, hidden).to(dtype)
            weight = torch.ones(hidden, dtype=dtype)
            qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim).to(dtype)
            q, k, v = qkv.split((q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
            q, k, v = (q.view(tokens, q_heads, head_dim), k.view(tokens, kv_heads, head_dim),
                       v.view(tokens, kv_heads, head_dim))
            cos, sin = torch.randn(tokens, 1, head_dim // 2).to(dtype), torch.randn(tokens, 1, head_dim // 2).to(dtype)
            kc = torch.zeros(64, 16, kv_heads, head_dim, dtype=dtype)
            vc = torch.zeros_like(kc)
            slots = torch.randperm(64 * 16)[:tokens]

            def unfused_rotary():  # LlamaAttention unfused
                q_rot = apply_rotary_ref(q, cos, sin)
                reshape_and_cache(apply_rotary_ref(k, cos, sin), v, kc, vc, slots)
                return q_rot

            rows = {
                "add_rms_norm": (lambda c: fused_add_rms_norm(x, res, weight, EPS, check=c),
                                 lambda: fused_add_rms_norm_ref(x, res, weight, EPS)),
                "rotary_and_cache": (lambda c: rotary_and_cache(q, k, v, cos, sin, kc, vc, slots, check=c),
                                     unfused_rotary),
            }
            for name, (fused, unfused) in rows.items():
                t_c, t_n, t_u = us(lambda: fused(True)), us(lambda: fused(False)), us(unfused)
                report[f"{name}_{str(dtype).removeprefix('torch.')}_T{tokens}"] = {
                    "c_us": t_c, "c_unchecked_us": t_n, "unfused_us": t_u, "speedup": t_u / t_c,
                    "speedup_unchecked": t_u / t_n}
    return report


def engine_report(batches: tuple[int, ...], dtype: str, steps: int, rounds: int) -> dict:
    """SmolLM2 decode steps unfused / fused / native layers (the module docstring)."""
    report: dict = {"dtype": dtype, "prompt_tokens": 100, "threads": torch.get_num_threads(),
                    "steps_per_round": steps, "rounds": rounds}
    for batch in batches:
        try:
            core, runner = smollm2_decode_core(batch, 100, 3 * rounds * steps, dtype)
        except Exception as e:  # noqa: BLE001 - a bench reports what it could not run
            return {"skipped": f"SmolLM2 GGUF not here: {e}"}
        model = runner.model
        if not runner.native_layers:
            return {"skipped": "native layers are off here (see the native_layers_off log line)"}

        def way(fused: bool, native: bool):
            return lambda: (model.use_fused_kernels(fused), model.use_native_layers(native))

        ms = alternate_steps(core, {"unfused": way(False, False), "fused": way(True, False),
                                    "native_layers": way(True, True)}, steps, rounds)
        model.use_fused_kernels(True)
        model.use_native_layers(True)
        row = {f"{k}_ms_per_step": v for k, v in ms.items()}
        row["native_vs_fused"] = ms["fused"] / ms["native_layers"]
        row["native_vs_unfused"] = ms["unfused"] / ms["native_layers"]
        report[f"b{batch}"] = row
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer timed replays")
    parser.add_argument("--calls", type=int, default=20, help="kernel calls captured per CUDA graph")
    parser.add_argument("--engine", action="store_true",
                        help="CPU: also SmolLM2 engine decode steps, unfused vs fused vs native layers")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="--engine's activations (default float32)")
    args = parser.parse_args()
    configure_logging("WARNING", json=False)  # logs (a kernel build's too) on stderr; stdout is the JSON report
    report: dict = {"torch": torch.__version__, "machine": platform.machine()}
    if torch.cuda.is_available():
        import triton

        report["triton"] = triton.__version__
        report.update(gpu_report(args.quick, args.calls))
    else:
        report.update(cpu_report(args.quick))
        if args.engine:
            report["engine"] = engine_report((1, 16) if args.quick else (1, 16, 64), args.dtype,
                                             8 if args.quick else 16, 3 if args.quick else 5)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
