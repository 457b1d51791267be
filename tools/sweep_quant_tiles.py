"""Tile sweep of the packed-weight Triton kernels on a GPU (prints one JSON
object; never asserts): which tiles the decode GEMV and the prefill
dequantize should take on this device.

On Llama-8B's MLP shapes (gate [14336, 4096], down [4096, 14336]) in
--types blocks (default Q4_0, issue 26's goal type, and Q4_K):

  gemv        the few-token GEMV (``_gemv_few_kernel``) at --tokens (1: decode
              of one stream; 4: the kernel forced on four tokens, against the
              multi-token kernel that runs there today) over BLOCK_N x words
              per K step x warps; each config's device time (a CUDA graph
              cycling through >= 256 MB of weight copies: reads from HBM),
              its worst error over S = |x| @ |W|.T (as bench_quant's
              max_err_over_S), and the default tiles' time beside it
  dequantize  ``dequantize_rows_triton`` (the prefill path's weight into a
              bf16 scratch) over BLOCK_N x BLOCK_K x warps, its GB/s (packed
              read + bf16 written), bit-exactness against the default tiles,
              and a device copy of the same bytes for scale

Per section and layer (tiles are chosen per shape: K differs): every
config, the best five, the default; per section the default's ms and the
best-per-layer ms summed over the layers. --compile-only
compiles every config (in --jobs processes, into Triton's on-disk cache) and
times nothing: tools/gpu_check.sh runs that beside its tests, then the
timed sweep alone. On a CPU it runs tiny shapes in the Triton interpreter
(a dry run of the code, not a GPU figure).

    python tools/sweep_quant_tiles.py [--types Q4_0,Q4_K] [--tokens 1,4] [--compile-only [--jobs N]]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import itertools
import json
import os
import sys
import time

import torch

if not torch.cuda.is_available():  # a dry run: the interpreter (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench_quant import cold_ms, random_packed, ring_copies  # noqa: E402  (tools/)

from kvstrata.kernels import PackedWeight, dequantize  # noqa: E402
from kvstrata.kernels._triton_quant import dequantize_rows_triton  # noqa: E402
from kvstrata.kernels._triton_quant_gemv import FEW_GEOMETRY, gemv_few_tiles, quant_gemv_triton  # noqa: E402
from kvstrata.kernels.quant import QUANT_TYPES  # noqa: E402

SHAPES = {"gate": (14336, 4096), "down": (4096, 14336)}
DRY_SHAPES = {"gate": (32, 512), "down": (16, 1024)}
BLOCK_N = (4, 8, 16, 32)
WORDS = (1024, 2048, 4096)  # quant words x tokens a program loads per K step (the default: 1024)
WARPS = (4, 8)
DEQ_BLOCK_N = (1, 4, 16)
DEQ_BLOCK_K = (256, 1024)
DRY = dict(BLOCK_N=(4, 16), WORDS=(512, 2048), WARPS=(4,), DEQ_BLOCK_N=(4,), DEQ_BLOCK_K=(256,))


def few_configs(tokens: int, k: int, qtype: str, grid: dict) -> list[dict]:
    """The few-token kernel's tiles to try: BLOCK_T the tokens (a power of
    two), BLOCK_K the largest power-of-two multiple of the block dividing K
    with words x tokens per step within WORDS."""
    ch, u = FEW_GEOMETRY[qtype][:2]
    block = QUANT_TYPES[qtype].block
    bt = 1 << (tokens - 1).bit_length()
    out = []
    for bn, words, warps in itertools.product(grid["BLOCK_N"], grid["WORDS"], grid["WARPS"]):
        bk = block
        while k % (2 * bk) == 0 and 2 * bk // ch * u * bn * bt <= words:
            bk *= 2
        cfg = dict(BLOCK_T=bt, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
        if cfg not in out:
            out.append(cfg)
    return out


def dequant_configs(k: int, grid: dict) -> list[dict]:
    return [dict(BLOCK_N=bn, BLOCK_K=min(bk, 1 << (k - 1).bit_length()), num_warps=w)
            for bn, bk, w in itertools.product(grid["DEQ_BLOCK_N"], grid["DEQ_BLOCK_K"], grid["WARPS"])]


def _x(tokens: int, k: int, device: str) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(tokens)
    return torch.randn(tokens, k, generator=gen, device=device).to(torch.bfloat16)


def gemv_call(w: PackedWeight, x: torch.Tensor, out: torch.Tensor, cfg: dict | None):
    qt = w.qtype
    return functools.partial(quant_gemv_triton, x, w.data, qt.name, qt.type_size, w.out_features, None, out,
                             cfg, few=cfg is not None)


def sweep_gemv(qtype: str, tokens: int, shapes: dict, grid: dict, reps: int, device: str,
               compile_only: bool) -> dict:
    layers: dict[str, dict] = {}
    for i, (name, (n, k)) in enumerate(shapes.items()):
        w = random_packed(qtype, n, k, seed=i, device=device)
        x, out = _x(tokens, k, device), torch.empty(tokens, n, device=device, dtype=torch.bfloat16)
        ring = [w] + [PackedWeight(w.qtype, w.shape, w.data.clone())
                      for _ in range(ring_copies(w.nbytes, device) - 1)] if not compile_only else [w]
        ref = torch.nn.functional.linear(x.float(), dequantize(w)).double()
        scale = x.double().abs() @ dequantize(w).double().abs().T
        default = gemv_few_tiles(tokens, n, k, qtype) if tokens <= 2 else "the multi-token kernel (today's path)"
        rows = []
        for cfg in few_configs(tokens, k, qtype, grid):
            entry = {**cfg}
            try:
                gemv_call(w, x, out, cfg)()
                entry["err_over_S"] = float(((out.double() - ref).abs() / scale).max())
                if not compile_only:
                    entry["ms"] = cold_ms([gemv_call(c, x, out, cfg) for c in ring], reps, device)
            except Exception as exc:  # a tile the compiler refuses (registers, shared memory): recorded
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            rows.append(entry)
        default_ms = None if compile_only else cold_ms([gemv_call(c, x, out, None) for c in ring], reps, device)
        layers[name] = _layer(rows, default, default_ms, w.nbytes)
        ring = None
    return _summary(layers, compile_only)


def sweep_dequant(qtype: str, shapes: dict, grid: dict, reps: int, device: str, compile_only: bool) -> dict:
    layers: dict[str, dict] = {}
    qt = QUANT_TYPES[qtype]
    for i, (name, (n, k)) in enumerate(shapes.items()):
        w = random_packed(qtype, n, k, seed=i, device=device)
        out = torch.empty(n, k, device=device, dtype=torch.bfloat16)
        want = torch.empty_like(out)
        dequantize_rows_triton(w.data, qtype, qt.block, qt.type_size, k, 0, want)
        call = lambda cfg, c: functools.partial(dequantize_rows_triton, c.data, qtype, qt.block,  # noqa: E731
                                                qt.type_size, k, 0, out, cfg)
        ring = [w] + [PackedWeight(w.qtype, w.shape, w.data.clone())
                      for _ in range(ring_copies(w.nbytes, device) - 1)] if not compile_only else [w]
        rows = []
        for cfg in dequant_configs(k, grid):
            entry = {**cfg}
            try:
                call(cfg, w)()
                entry["bit_exact"] = bool(torch.equal(out, want))
                if not compile_only:
                    entry["ms"] = cold_ms([call(cfg, c) for c in ring], reps, device)
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            rows.append(entry)
        nbytes = w.nbytes + out.numel() * out.element_size()  # packed read + bf16 written
        default_ms = None if compile_only else cold_ms([call(None, c) for c in ring], reps, device)
        layers[name] = _layer(rows, "BLOCK_N 16, BLOCK_K min(256, K), 4 warps", default_ms, nbytes)
        if not compile_only:
            src = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16)
            dst = torch.empty_like(src)
            # a device copy moving the same bytes (read + written): the bandwidth to compare with
            layers[name]["copy_same_bytes_ms"] = round(cold_ms([functools.partial(dst.copy_, src)], reps, device) / 2, 4)
        ring = None
    return _summary(layers, compile_only)


def _layer(rows: list[dict], default_tiles, default_ms: float | None, nbytes: int) -> dict:
    """One layer's sweep: its configs, and (timed) the best five and the default."""
    res: dict = {"default_tiles": default_tiles, "configs": len(rows),
                 "failed": sum(1 for r in rows if "error" in r)}
    if default_ms is None:
        return res
    timed = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
    for r in timed:
        r["ms"] = round(r["ms"], 4)
        r["gb_s"] = round(nbytes / r["ms"] / 1e6, 1)
    res.update(default_ms=round(default_ms, 4), default_gb_s=round(nbytes / default_ms / 1e6, 1),
               best=[{**r, "speedup_vs_default": round(default_ms / r["ms"], 2)} for r in timed[:5]], all=rows)
    return res


def _summary(layers: dict[str, dict], compile_only: bool) -> dict:
    """The layers, and (timed) the set's default and best-per-layer ms."""
    res: dict = {"layers": layers, "configs": sum(v["configs"] for v in layers.values()),
                 "failed": sum(v["failed"] for v in layers.values())}
    if not compile_only and all(v.get("best") for v in layers.values()):
        res["default_ms"] = round(sum(v["default_ms"] for v in layers.values()), 4)
        res["best_ms"] = round(sum(v["best"][0]["ms"] for v in layers.values()), 4)
        res["speedup_best_vs_default"] = round(res["default_ms"] / res["best_ms"], 2)
    return res


def _brief(r: dict) -> dict:
    """A section without each config's row (the stderr line)."""
    return {**r, "layers": {n: {k: v for k, v in layer.items() if k != "all"} for n, layer in r["layers"].items()}}


def _compile_part(part: tuple[str, str, int, str]) -> str:
    """One (section, qtype, tokens, layer) compiled in this process (a pool worker)."""
    section, qtype, tokens, layer = part
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes, grid = (SHAPES, GRID) if device == "cuda" else (DRY_SHAPES, DRY)
    shapes = {layer: shapes[layer]}
    if section == "gemv":
        r = sweep_gemv(qtype, tokens, shapes, grid, 1, device, compile_only=True)
    else:
        r = sweep_dequant(qtype, shapes, grid, 1, device, compile_only=True)
    return f"{section} {qtype} {tokens} {layer}: {r['configs']} configs, {r['failed']} failed"


GRID = dict(BLOCK_N=BLOCK_N, WORDS=WORDS, WARPS=WARPS, DEQ_BLOCK_N=DEQ_BLOCK_N, DEQ_BLOCK_K=DEQ_BLOCK_K)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", default="Q4_0,Q4_K")
    p.add_argument("--tokens", default="1,4")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--jobs", type=int, default=8, help="--compile-only: processes")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    shapes, grid = (SHAPES, GRID) if cuda else (DRY_SHAPES, DRY)
    types, tokens = args.types.split(","), [int(t) for t in args.tokens.split(",")]
    t0 = time.perf_counter()
    res: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu (dry run: the interpreter, tiny shapes)",
                 "shapes": shapes, "types": types, "tokens": tokens}
    if args.compile_only:
        parts = [("gemv", q, t, layer) for q in types for t in tokens for layer in shapes]
        parts += [("dequantize", q, 0, layer) for q in types for layer in shapes]
        ctx = torch.multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(min(args.jobs, len(parts)), mp_context=ctx) as pool:
            res["compiled"] = list(pool.map(_compile_part, parts))
    else:
        for q in types:
            for t in tokens:
                res[f"gemv_{q}_tokens_{t}"] = r = sweep_gemv(q, t, shapes, grid, args.reps, device, False)
                print("sweep " + json.dumps({f"gemv_{q}_tokens_{t}": _brief(r)}),
                      file=sys.stderr, flush=True)
            res[f"dequantize_{q}"] = r = sweep_dequant(q, shapes, grid, args.reps, device, False)
            print("sweep " + json.dumps({f"dequantize_{q}": _brief(r)}),
                  file=sys.stderr, flush=True)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
