"""Benchmark packed GGUF weights (kvstrata.kernels.quant); prints one JSON object.

Two layer sets, every packed type (random blocks with sane fp16 scales):

  smollm2   qkv [960, 576], o [576, 576], gate_up [3072, 576], down [576, 1536]
            (hidden 576, intermediate 1536, q 576 / kv 192); a K-quant
            (256-weight blocks) cannot hold a 576-wide row, so only ``down``
            is measured for those, as llama.cpp's files fall back there too
  8b        gate [14336, 4096], down [4096, 14336]   (--quick: gate only, Q4_K, Q6_K and Q8_0)

Per set and type:

  resident_bytes   packed (the GGUF blocks; the native path's planes are
                   these bytes re-laid), int4 (blocks + the int4 path's
                   repacked planes, where the type has them), fp32 / bf16
                   (the weights dequantized at load)
  cpu              per activation dtype, per token count (1 = single-stream
                   decode, 16 = a batch of 16): the set's summed matmul ms for
                   "dense" (F.linear on the dequantized weights) and each packed
                   CPU path that can run the layer (int4: bf16 only), timed as
                   ``choose_cpu_path`` races them (``time_paths``: weights cycled
                   through ~64 MB of copies: a cold cache, as in a forward pass;
                   best of --reps runs), and the path it picks per layer
                   ("native" wherever our kernels build and run)
  gpu              (CUDA, or --gpu-kernels alone) per token count (1, 4, 8, 16, 512):
                   the set's summed ms of quant_matmul (the decode GEMV for up to
                   8 tokens of every packed type; from 128 tokens the
                   weight dequantized in chunks, then torch), of _triton_quant's kernel
                   alone (the previous decode and prefill path: the baseline) and of
                   torch.mm on bf16 weights, the packed reads in GB/s, and the
                   speedups; at 1 token also the multi-token GEMV kernel (gemv_many:
                   what the few-token kernel replaced); at 16 tokens also _triton_quant
                   with 16-row tiles (general_bn16: 4x its default's programs, an A/B
                   for tiles()); for Q8_0, Q4_0, Q4_K and Q6_K also quant_matmul on the
                   weight re-laid for the GPU (layout: model.gpu_quant_layout; its GEMV
                   up to 8 tokens, dequantize-then-mm above), its GB/s, its speedups
                   over dense bf16 and over the blocks' path, and its error;
                   device time from a CUDA graph cycling through
                   >= 256 MB of weight copies (reads from HBM, not L2), median
                   of --reps. --gpu-kernels runs only this, on the 8b set in
                   Q4_0, Q4_K, Q8_0 and Q6_K; without a GPU it is a dry run of
                   the code on tiny shapes in the Triton interpreter (Q4_K)

  engine           (--engine) the real SmolLM2 GGUF end to end on the CPU, one
                   engine per run, in this process, the settings in turn
                   (--engine-repeats rounds; each figure the median of its runs):
                   dequantize/float32 (the baseline: every tensor dequantized at
                   load), packed/float32 (the default: exact, float32 FMAs),
                   packed/bfloat16 (what dtype "auto" takes where bf16 measures
                   10 % faster at load; fixed here, so every run is alike); per
                   setting the resident weight bytes (as loaded, and over the
                   file's tensor bytes), load seconds, greedy decode tok/s
                   single-stream and at batch 16 (tokens after each request's
                   first, over the time from the first first-token to the last
                   token), the seconds to the first token of a 480-token prompt
                   alone on the single-stream engine (its prefill), and each
                   over the baseline

  engine_gpu       (--engine-gpu) decode of a Q4 model on the GPU (issue 26's GPU goal:
                   packed >= 1.5x its bf16-dequantized run at batch 1): a random
                   Llama GGUF of --gpu-shape (8b default: 16 GB of bf16 weights,
                   decode bound by reading them) in --gpu-qtype blocks, written
                   here; one engine per mode (dequantize: bf16 weights; packed:
                   the Triton kernel on the blocks), CUDA graphs on (the
                   default), modes in turn --engine-repeats times; greedy decode
                   tok/s single-stream and at batch 16 (as "engine"), the seconds
                   to the first token of a 480-token prompt alone (its prefill:
                   packed dequantizes then multiplies from 128 tokens), resident
                   weight bytes, and packed over dequantize. --gpu-layout adds a
                   third mode, packed_gpu_layout (model.gpu_quant_layout on; its
                   "relaid" says whether the engine's weights were re-laid), and its
                   figures over dequantize. On a CPU it runs a
                   tiny shape with float32 activations and says so (a dry run of
                   the code, not a GPU figure).

Usage: python tools/bench_quant.py [--quick] [--threads N] [--reps N] [--engine [--engine-only] [--engine-repeats N]]
       python tools/bench_quant.py --engine-gpu [--gpu-shape 8b|3b|tinyllama] [--gpu-qtype Q4_0] [--engine-repeats N]
                                   [--gpu-layout]
       python tools/bench_quant.py --gpu-kernels [--reps N]
--quick runs one CPU thread unless --threads says otherwise: on a shared
machine a two-thread parallel region waits whenever the other thread is
descheduled, which swamps small matmuls (seen: 0.05 ms -> 10+ ms).
Times depend on the machine's other load; the baseline (dense) is measured in
the same run, interleaved with the packed paths. Never asserts timings. With
--engine-gpu and --gpu-kernels each finished part is also printed at once on
stderr as one line, ``bench_quant {"part": {...}}``, so a run stopped by a
time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from kvstrata.kernels import PackedWeight, choose_cpu_path, dequantize, pack_weight, quant_matmul, with_cpu_path
from kvstrata.kernels.quant import QUANT_TYPES
from kvstrata.kernels.quant_cpu import CPU_PATHS, Int4Path, time_paths
from kvstrata.kernels.quant_gpu_layout import GPU_LAYOUT_TYPES, with_gpu_layout
from kvstrata.kernels.quant_native import native_kernels, native_status

from bench_timing import cpu_time, cuda_graph_time  # tools/

SETS = {
    "smollm2": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)},
    "8b": {"gate": (14336, 4096), "down": (4096, 14336)},
    "tiny": {"gate": (24, 256), "down": (8, 512)},  # --gpu-kernels' dry run on a CPU
}
GPU_KERNEL_TYPES = ("Q4_0", "Q4_K", "Q8_0", "Q6_K")  # --gpu-kernels: the goal's Q4_0, a Q4_K_M file's two, Q8_0
QUICK_8B = {"types": ("Q4_K", "Q6_K", "Q8_0"), "layers": ("gate",)}  # a Q4_K_M file: Q4_K and Q6_K
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
TOKENS = (1, 16)


def random_packed(qtype: str, rows: int, cols: int, seed: int, device: str = "cpu") -> PackedWeight:
    qt = QUANT_TYPES[qtype]
    rng = np.random.default_rng(seed)
    nblocks = rows * cols // qt.block
    blocks = rng.integers(0, 256, (nblocks, qt.type_size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        d = (rng.uniform(1e-3, 1e-2, nblocks) * rng.choice([-1.0, 1.0], nblocks)).astype(np.float16)
        blocks[:, at:at + 2] = d.view(np.uint8).reshape(nblocks, 2)
    return pack_weight(torch.from_numpy(blocks), qtype, (rows, cols), device)


def native_isa() -> str:
    """Which native kernel set runs here (KVSTRATA_NATIVE_ISA picks), or why none."""
    kernels = native_kernels()
    return kernels.isa if kernels is not None else f"none: {native_status()}"


def bench_cpu(layers: dict[str, PackedWeight], reps: int) -> dict:
    out: dict = {}
    for dtype in (torch.float32, torch.bfloat16):
        totals: dict[str, dict[int, float]] = {}
        picked = {}
        for name, packed in layers.items():
            choice = choose_cpu_path(packed, TOKENS, dtype=dtype, measure=False)
            picked[name] = choice.path
            # every path that can run it (torch's int4 for bf16 x only: its float32 form is a slow reference)
            weights = {path: with_cpu_path(packed, path) for path, impl in CPU_PATHS.items()
                       if impl.available(packed) and (impl.exact or dtype == torch.bfloat16)}
            for path, times in time_paths(packed, weights, TOKENS, dtype, reps).items():
                for tokens, ms in times.items():
                    totals.setdefault(path, {}).setdefault(tokens, 0.0)
                    totals[path][tokens] += ms
        key = str(dtype).removeprefix("torch.")
        out[key] = {
            "ms": {path: {f"tokens_{t}": round(ms, 3) for t, ms in times.items()} for path, times in totals.items()},
            "picked": picked,
        }
        best = {t: min(totals[p][t] for p in totals if p != "dense") for t in TOKENS}
        out[key]["best_packed_ms"] = {f"tokens_{t}": round(ms, 3) for t, ms in best.items()}
    dense32 = out["float32"]["ms"]["dense"]
    for key in out:
        out[key]["speedup_vs_dense_fp32"] = {
            k: round(dense32[k] / v, 2) for k, v in out[key]["best_packed_ms"].items()
        }
    return out


GPU_TOKENS = (1, 4, 8, 16, 512)
RING_BYTES = 256 << 20  # weight copies cycled per timed call: > 2x an H200's 50 MB L2, so reads come from HBM


def ring_copies(nbytes: int, device: str) -> int:
    """How many copies of a weight of ``nbytes`` one timed call cycles
    through: together over RING_BYTES on CUDA, so reads come from HBM, not
    L2; two on a CPU (a dry run)."""
    return max(2, -(-RING_BYTES // max(1, nbytes))) if device == "cuda" else 2


def cold_ms(calls, reps: int, device: str = "cuda") -> float:
    """ms per call of ``calls`` (one per weight copy), replayed from one
    CUDA graph: the device's time, as in the engine's captured decode steps.
    On a CPU (a dry run): wall time."""
    run = lambda: [c() for c in calls]  # noqa: E731
    if device != "cuda":
        return cpu_time(run, reps) * 1e3 / len(calls)
    return cuda_graph_time(run, 1, reps) * 1e3 / len(calls)


def bench_gpu(layers: dict[str, PackedWeight], reps: int, device: str = "cuda") -> dict:
    """Per token count: the set's summed ms for ``quant_matmul`` (what the
    engine runs: the decode GEMV for up to 8 tokens of its formats, the
    dequantize-then-mm path from 128), for
    ``_triton_quant``'s kernel alone (the previous decode path: the baseline
    of the GEMV), and for F.linear on bf16 weights; the packed reads in GB/s.
    At one token also the multi-token GEMV kernel ("gemv_many": the few-token
    kernel's baseline). From 9 to 127 tokens also ``_triton_quant`` with 16 weight rows a program
    ("general_bn16": its tl.dot tiles take 64, so a 4096-row weight is 64
    programs on a 132-SM GPU). ``device`` "cpu": a dry run of this code under
    the Triton interpreter. Q8_0, Q4_0, Q4_K, Q6_K: also ``quant_matmul`` on the weight
    re-laid for the GPU ("layout": its GEMV up to 8 tokens, dequantize-then-mm above)."""
    from kvstrata.kernels._triton_quant import GEMV_MAX_TOKENS, quant_matmul_triton, tiles
    from kvstrata.kernels._triton_quant_gemv import quant_gemv_triton
    from kvstrata.kernels.quant_linear import PREFILL_DEQUANT_TOKENS

    res: dict = {}
    gen = torch.Generator(device=device).manual_seed(0)
    for tokens in GPU_TOKENS:
        ms = {"packed": 0.0, "general": 0.0, "dense_bf16": 0.0}
        packed_bytes, layout_bytes, worst, layout_worst = 0, 0, 0.0, 0.0
        for packed in layers.values():
            w = packed.to(device)
            qt, n, nbytes = w.qtype, w.out_features, w.nbytes
            ring = [w] + [PackedWeight(qt, w.shape, w.data.clone()) for _ in range(ring_copies(nbytes, device) - 1)]
            x = torch.randn(tokens, w.in_features, generator=gen, device=device).to(torch.bfloat16)
            out = torch.empty(tokens, n, device=device, dtype=torch.bfloat16)

            def general(tiles_=None):  # _triton_quant's kernel on every copy
                return [functools.partial(quant_matmul_triton, x, c.data, qt.name, qt.block, qt.type_size, n, None,
                                          out, tiles_) for c in ring]

            ms["packed"] += cold_ms([functools.partial(quant_matmul, x, c, out=out) for c in ring], reps, device)
            if qt.name in GPU_LAYOUT_TYPES:  # the same copies re-laid (one at a time: the blocks go)
                relaid = [with_gpu_layout(c) for c in ring]
                ms["layout"] = ms.get("layout", 0.0) + cold_ms(
                    [functools.partial(quant_matmul, x, c, out=out) for c in relaid], reps, device)
                layout_bytes += relaid[0].nbytes
                layout_worst = max(layout_worst, _err_over_s(quant_matmul(x, relaid[0]), x, w))
                relaid = None
            ms["general"] += cold_ms(general(), reps, device)
            if tokens == 1:  # the multi-token GEMV at one token: the few-token kernel's baseline
                many = [functools.partial(quant_gemv_triton, x, c.data, qt.name, qt.type_size, n, None, out, many=True)
                        for c in ring]
                ms["gemv_many"] = ms.get("gemv_many", 0.0) + cold_ms(many, reps, device)
            if GEMV_MAX_TOKENS < tokens < PREFILL_DEQUANT_TOKENS:  # tl.dot tiles of 16 rows: 4x the programs
                narrow = {**tiles(tokens, n, w.in_features, interpreted=False), "BLOCK_N": 16}
                ms["general_bn16"] = ms.get("general_bn16", 0.0) + cold_ms(general(narrow), reps, device)
            dense_bytes = 2 * n * w.in_features
            dense = [dequantize(w, torch.bfloat16) for _ in range(ring_copies(dense_bytes, device))]
            ms["dense_bf16"] += cold_ms([functools.partial(torch.mm, x, d.T, out=out) for d in dense], reps, device)
            worst = max(worst, _err_over_s(quant_matmul(x, w), x, w))
            packed_bytes += nbytes
            ring = dense = None  # freed before the next layer's copies (the graphs have run)
        res[f"tokens_{tokens}"] = {
            **{f"{k}_ms": round(v, 4) for k, v in ms.items()},
            "packed_gb_s": round(packed_bytes / ms["packed"] / 1e6, 1),
            "packed_speedup_vs_dense_bf16": round(ms["dense_bf16"] / ms["packed"], 2),
            "packed_speedup_vs_general": round(ms["general"] / ms["packed"], 2),
            **({"packed_speedup_vs_gemv_many": round(ms["gemv_many"] / ms["packed"], 2)} if "gemv_many" in ms else {}),
            "max_err_over_S": worst,
            **(_layout_row(ms, layout_bytes, layout_worst) if "layout" in ms else {}),
        }
    return res


def _err_over_s(got: torch.Tensor, x: torch.Tensor, w: PackedWeight) -> float:
    """max |got - x @ W.T| / S, S = |x| @ |W|.T, against ``dequantize``'s weights in float64."""
    ref = F.linear(x.float(), dequantize(w)).double()
    scale = x.double().abs() @ dequantize(w).double().abs().T
    return ((got.double() - ref).abs() / scale).max().item()


def _layout_row(ms: dict, layout_bytes: int, worst: float) -> dict:
    """The re-laid weights' figures of one token count (``bench_gpu``)."""
    return {"layout_gb_s": round(layout_bytes / ms["layout"] / 1e6, 1),
            "layout_speedup_vs_dense_bf16": round(ms["dense_bf16"] / ms["layout"], 2),
            "layout_speedup_vs_packed": round(ms["packed"] / ms["layout"], 2),
            "layout_max_err_over_S": worst}


def bench_set(set_name: str, qtype: str, args) -> dict:
    qt = QUANT_TYPES[qtype]
    shapes = SETS[set_name]
    if set_name == "8b" and args.quick:
        shapes = {k: v for k, v in shapes.items() if k in QUICK_8B["layers"]}
    skipped = [name for name, (_, cols) in shapes.items() if cols % qt.block]
    layers = {name: random_packed(qtype, rows, cols, seed=i)
              for i, (name, (rows, cols)) in enumerate(shapes.items()) if name not in skipped}
    weights = sum(p.out_features * p.in_features for p in layers.values())
    packed_bytes = sum(p.nbytes for p in layers.values())
    int4_bytes = sum(with_cpu_path(p, "int4").nbytes for p in layers.values() if Int4Path.available(p))
    res = {
        "layers": {name: list(shape) for name, shape in shapes.items() if name not in skipped},
        "skipped_layers": skipped,
        "resident_bytes": {
            "packed": packed_bytes,
            "packed_plus_int4": int4_bytes or None,
            "fp32": 4 * weights,
            "bf16": 2 * weights,
        },
    }
    if args.gpu_kernels:  # the GPU section alone (on a CPU: its dry run)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        res["gpu"] = bench_gpu(layers, max(args.reps, 20) if device == "cuda" else 1, device)
        return res
    start = time.perf_counter()
    res["cpu"] = bench_cpu(layers, args.reps)
    res["cpu_seconds"] = round(time.perf_counter() - start, 2)
    if torch.cuda.is_available():
        res["gpu"] = bench_gpu(layers, max(args.reps, 20))
    return res


TTFT_PROMPT = 480  # tokens: the prefill --engine times once per round and setting (max_model_len 512)
ENGINE_SETTINGS = (("dequantize", "float32"), ("packed", "float32"), ("packed", "bfloat16"))


async def start_engine(path: str, mode: str, dtype: str, threads: int | None, max_batch: int, *,
                       device: str = "cpu", tokenizer: str | None = None, gpu_layout: bool = False):
    from kvstrata.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from kvstrata.enginecore import AsyncEngine

    # graphs only for the batch sizes measured (fewer captures and kernel compiles at start)
    sizes = [s for s in (1, 2, 4, 8, 16, 32) if s <= max_batch] if device == "cuda" else None
    cfg = EngineConfig(model=ModelConfig(model=path, max_model_len=512, quantized_weights=mode, dtype=dtype,
                                         num_threads=threads, tokenizer=tokenizer, cuda_graph_sizes=sizes,
                                         gpu_quant_layout=gpu_layout),
                       scheduler=SchedulerConfig(max_num_seqs=16) if device == "cuda" else SchedulerConfig(),
                       device=device,
                       cache=CacheConfig(num_blocks=64 + 8 * max_batch), log_level="WARNING")
    return await AsyncEngine.start(cfg)


async def decode_tok_s(engine, batch: int, tokens: int, token_prompts: bool = False) -> float:
    """Greedy decode tok/s of ``batch`` concurrent requests: chats with the
    model's template, or token-id prompts (a model without a tokenizer)."""
    from kvstrata.types import SamplingParams

    firsts: list[float] = []
    lasts: list[float] = []

    def stream(i: int, params):
        if token_prompts:
            return engine.generate([1] + [(37 * i + 11 * j) % 250 + 3 for j in range(31)], params)
        return engine.chat([{"role": "user", "content": f"Tell me a story about the number {i}."}], params)

    async def one(i: int) -> int:
        n, first = 0, None
        async for o in stream(i, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)):
            n += len(o.new_token_ids)
            if first is None:
                first = time.perf_counter()
                firsts.append(first)
        lasts.append(time.perf_counter())
        return n - 1

    decoded = sum(await asyncio.gather(*(one(i) for i in range(batch))))
    return decoded / (max(lasts) - min(firsts))


async def engine_decode(path: str, mode: str, dtype: str, threads: int, batch: int, tokens: int,
                        ttft_prompt: int = 0) -> tuple[float, float | None]:
    """Greedy decode tok/s of ``batch`` concurrent chats on a fresh engine,
    and first (when ``ttft_prompt``) the seconds to the first token of one
    ``ttft_prompt``-token prompt (its prefill, alone on the engine)."""
    engine = await start_engine(path, mode, dtype, threads, batch)
    try:
        ttft = await prompt_ttft(engine, ttft_prompt) if ttft_prompt else None
        return await decode_tok_s(engine, batch, tokens), ttft
    finally:
        await engine.aclose()


async def prompt_ttft(engine, tokens: int) -> float:
    """Seconds to the first token of one ``tokens``-token prompt alone on the engine (its prefill)."""
    from kvstrata.types import SamplingParams

    start = time.perf_counter()
    ids = [1 + (13 * j) % 250 for j in range(tokens)]  # ids every model here has (the dry run's vocab is 512)
    async for _ in engine.generate(ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)):
        break
    return time.perf_counter() - start


def _medians(entries) -> None:
    """Each entry's tok/s: the median of its single-stream and batch-16 runs."""
    for entry in entries:
        entry["single_tok_s"] = float(np.median(entry["single_runs"]))
        entry["batch16_tok_s"] = float(np.median(entry["batch16_runs"]))
        if entry.get("ttft_runs_s"):
            entry["ttft_s"] = float(np.median(entry["ttft_runs_s"]))


def bench_engine(args) -> dict:
    from kvstrata.worker.model import load_checkpoint
    from kvstrata.worker.model.gguf_file import GGUFCheckpoint
    from kvstrata.worker.model.smollm2 import locate_smollm2

    path = str(locate_smollm2(download=True))
    file_bytes = sum(src.nbytes for _, src in GGUFCheckpoint(path).tensor_sources())
    tokens = (24, 16) if args.quick else (64, 32)
    repeats = args.engine_repeats if args.engine_repeats is not None else (1 if args.quick else 3)
    res: dict = {"model": path, "file_tensor_bytes": file_bytes, "tokens_single": tokens[0],
                 "tokens_per_request_batch16": tokens[1], "repeats": repeats,
                 "how": "each setting's decode runs alternate with the others' (settings in turn, "
                        "repeats times); tok/s = the median of its runs", "settings": {}}
    for mode, dtype in ENGINE_SETTINGS:
        start = time.perf_counter()
        ckpt = load_checkpoint(path, dtype, "cpu", mode)
        load_s = time.perf_counter() - start
        res["settings"][f"{mode}/{dtype}"] = {
            "dtype": ckpt.dtype, "weight_bytes": ckpt.weight_bytes,
            "weight_over_file": round(ckpt.weight_bytes / file_bytes, 3), "load_s": round(load_s, 2),
            "single_runs": [], "batch16_runs": [], "ttft_runs_s": []}
        del ckpt
    for _ in range(repeats):  # in turn, so a burst of other load lands on every setting alike
        for mode, dtype in ENGINE_SETTINGS:
            entry = res["settings"][f"{mode}/{dtype}"]
            tok_s, ttft = asyncio.run(engine_decode(path, mode, dtype, args.threads, 1, tokens[0], TTFT_PROMPT))
            entry["single_runs"].append(round(tok_s, 2))
            entry["ttft_runs_s"].append(round(ttft, 3))
            entry["batch16_runs"].append(round(asyncio.run(
                engine_decode(path, mode, dtype, args.threads, 16, tokens[1]))[0], 2))
    _medians(res["settings"].values())
    base = res["settings"]["dequantize/float32"]
    for entry in res["settings"].values():
        entry["speedup_single"] = round(entry["single_tok_s"] / base["single_tok_s"], 2)
        entry["speedup_batch16"] = round(entry["batch16_tok_s"] / base["batch16_tok_s"], 2)
        entry["ttft_over_baseline"] = round(entry["ttft_s"] / base["ttft_s"], 2)
    return res


# Llama shapes for --engine-gpu: hidden, intermediate, layers, heads, kv heads, vocab
GPU_SHAPES = {
    "8b": dict(hidden=4096, inter=14336, layers=32, heads=32, kv_heads=8, vocab=128256),
    "3b": dict(hidden=3072, inter=8192, layers=28, heads=24, kv_heads=8, vocab=128256),
    "tinyllama": dict(hidden=2048, inter=5632, layers=22, heads=32, kv_heads=4, vocab=32000),
}
CPU_DRY_SHAPE = dict(hidden=256, inter=512, layers=2, heads=4, kv_heads=2, vocab=512)


def random_gguf(path: str, qtype, shape: dict[str, int]) -> int:
    """The random GGUF at ``path``, written unless a finished one is there
    (written under a temporary name, then renamed: a file cut short is never
    taken). Returns its tensor bytes."""
    from kvstrata.worker.model.gguf_file import GGUFCheckpoint
    from kvstrata.worker.model.gguf_random import write_random_gguf

    if not os.path.exists(path):
        write_random_gguf(path + ".part", qtype, **shape, tied=False, context_length=4096)
        os.replace(path + ".part", path)
    return sum(src.nbytes for _, src in GGUFCheckpoint(path).tensor_sources())


def bench_engine_gpu(args) -> dict:
    """Packed vs dequantized decode of a random Q4 GGUF on the GPU (a tiny
    dry run on a CPU)."""
    import tempfile

    from gguf import GGMLQuantizationType

    cuda = torch.cuda.is_available()
    shape = GPU_SHAPES[args.gpu_shape] if cuda else CPU_DRY_SHAPE
    dtype = "bfloat16" if cuda else "float32"
    device = "cuda" if cuda else "cpu"
    tokens = (128, 64) if cuda else (16, 8)
    repeats = args.engine_repeats or 2
    res: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu (dry run: tiny shape, not a GPU figure)",
                 "shape": args.gpu_shape if cuda else "cpu-dry", **shape, "qtype": args.gpu_qtype, "dtype": dtype,
                 "tokens_single": tokens[0], "tokens_per_request_batch16": tokens[1], "repeats": repeats,
                 "how": "modes in turn, one engine each per round (single-stream, then batch 16); tok/s = the "
                        "median of its runs; CUDA graphs: the engine's default"}
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-quant-") as tmp:
        path = args.gpu_file or f"{tmp}/random-{args.gpu_shape}-{args.gpu_qtype}.gguf"
        t0 = time.perf_counter()
        res["file_tensor_bytes"] = random_gguf(path, GGMLQuantizationType[args.gpu_qtype], shape)
        res["write_s"] = round(time.perf_counter() - t0, 1)
        if args.write_only:
            return res
        tokenizer = f"{tmp}/bytes"  # the random model has no tokenizer: byte-level, token-id prompts
        os.mkdir(tokenizer)
        modes = ("dequantize", "packed", "packed_gpu_layout") if args.gpu_layout else ("dequantize", "packed")
        res["modes"] = {mode: {"single_runs": [], "batch16_runs": [], "ttft_runs_s": [], "start_s": []}
                        for mode in modes}

        async def one_engine(mode: str, entry: dict) -> None:
            t0 = time.perf_counter()
            layout = mode == "packed_gpu_layout"
            engine = await start_engine(path, "packed" if layout else mode, dtype, args.threads, 16, device=device,
                                        tokenizer=tokenizer, gpu_layout=layout)
            entry["start_s"].append(round(time.perf_counter() - t0, 1))
            try:
                entry["weight_bytes"] = engine.core.runner.weight_bytes
                if layout:  # whether the runner carried the switch to the loader
                    entry["relaid"] = any(getattr(p, "gpu_layout", None) is not None
                                          for m in engine.core.runner.model.modules() for p in getattr(m, "parts", ()))
                entry["single_runs"].append(round(await decode_tok_s(engine, 1, tokens[0], True), 2))
                entry["batch16_runs"].append(round(await decode_tok_s(engine, 16, tokens[1], True), 2))
                entry["ttft_runs_s"].append(round(await prompt_ttft(engine, TTFT_PROMPT), 4))
            finally:
                await engine.aclose()

        for _ in range(repeats):  # modes in turn: a burst of other load lands on both
            for mode, entry in res["modes"].items():
                asyncio.run(one_engine(mode, entry))
                progress("engine_gpu", {mode: entry, "write_s": res["write_s"]})
                if cuda:
                    torch.cuda.empty_cache()
    _medians(res["modes"].values())
    base = res["modes"]["dequantize"]
    res["packed_over_dequantize"] = _over(res["modes"]["packed"], base)
    if args.gpu_layout:
        res["packed_gpu_layout_over_dequantize"] = _over(res["modes"]["packed_gpu_layout"], base)
    return res


def _over(entry: dict, base: dict) -> dict:
    """A mode's figures over the dequantized engine's (``bench_engine_gpu``)."""
    return {"single": round(entry["single_tok_s"] / base["single_tok_s"], 2),
            "batch16": round(entry["batch16_tok_s"] / base["batch16_tok_s"], 2),
            "ttft_speed": round(base["ttft_s"] / entry["ttft_s"], 2),
            "weight_bytes": round(entry["weight_bytes"] / base["weight_bytes"], 3)}


def progress(part: str, value: dict) -> None:
    """One finished part of the report, at once, as a JSON line on stderr
    (``bench_quant {...}``): a run stopped by a time limit keeps it."""
    print("bench_quant " + json.dumps({part: value}), file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer runs; 8b: one layer, three types")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's; 1 with --quick)")
    parser.add_argument("--reps", type=int, default=None, help="runs per measurement (default 2 quick, 5)")
    parser.add_argument("--engine", action="store_true", help="also the SmolLM2 GGUF end to end (CPU)")
    parser.add_argument("--engine-only", action="store_true", help="only the end-to-end engine runs")
    parser.add_argument("--engine-repeats", type=int, default=None,
                        help="end-to-end runs per setting, taken in turn (default 3; 1 with --quick; "
                             "2 with --engine-gpu)")
    parser.add_argument("--engine-gpu", action="store_true",
                        help="only the GPU decode goal: a random Q4 GGUF, packed vs dequantized (CPU: a tiny dry run)")
    parser.add_argument("--gpu-kernels", action="store_true",
                        help="only the GPU matmul timings, 8b set (CPU: a dry run in the interpreter)")
    parser.add_argument("--gpu-shape", default="8b", choices=sorted(GPU_SHAPES), help="--engine-gpu's Llama shape")
    parser.add_argument("--gpu-qtype", default="Q4_0", choices=sorted(QUANT_TYPES), help="--engine-gpu's blocks")
    parser.add_argument("--gpu-file", default=None,
                        help="--engine-gpu's GGUF: written there if absent (and kept), else taken as it is "
                             "(default: a temporary file)")
    parser.add_argument("--write-only", action="store_true", help="--engine-gpu: write --gpu-file, run nothing")
    parser.add_argument("--gpu-layout", action="store_true",
                        help="--engine-gpu: also the packed engine with model.gpu_quant_layout on (a third mode)")
    args = parser.parse_args()
    if args.write_only and not (args.engine_gpu and args.gpu_file):
        parser.error("--write-only writes --gpu-file for --engine-gpu: give both")
    from kvstrata.logs import configure_logging

    configure_logging("WARNING", json=False)  # logs on stderr; stdout is the JSON report
    if args.threads or args.quick:
        torch.set_num_threads(args.threads or 1)
    args.reps = args.reps or (2 if args.quick else 5)
    start = time.perf_counter()
    result: dict = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "native_kernels": native_isa(),
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
        "quick": args.quick,
        "sets": {},
    }
    result["load"] = os.getloadavg()  # other work on the host, at the start
    if args.engine_gpu:
        result["engine_gpu"] = bench_engine_gpu(args)
    if args.gpu_kernels:
        if not torch.cuda.is_available():  # a dry run of the code: tiny shapes in the interpreter
            os.environ["TRITON_INTERPRET"] = "1"
            result["note"] = "no CUDA device: a dry run on the CPU (Triton interpreter, tiny shapes), not a GPU figure"
        on_gpu = torch.cuda.is_available()
        types = GPU_KERNEL_TYPES if on_gpu else ("Q4_K",)
        sets = result["sets"]["8b" if on_gpu else "tiny"] = {}
        for qtype in types:
            sets[qtype] = bench_set("8b" if on_gpu else "tiny", qtype, args)
            progress("gpu_kernels", {qtype: sets[qtype]})
    for set_name in () if args.engine_only or args.engine_gpu or args.gpu_kernels else ("smollm2", "8b"):
        types = QUICK_8B["types"] if set_name == "8b" and args.quick else tuple(QUANT_TYPES)
        result["sets"][set_name] = {qtype: bench_set(set_name, qtype, args) for qtype in types}
    if args.engine or args.engine_only:
        result["engine"] = bench_engine(args)
    result["load_at_end"] = os.getloadavg()
    result["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
